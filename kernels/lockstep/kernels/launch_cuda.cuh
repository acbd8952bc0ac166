// lockstep/kernels/launch_cuda.cuh — the CUDA side of the launchers: a grid-stride kernel and CUB reductions.
//
// Thin glue, compiled by nvcc only. Kernels have hidden visibility and live in the ABI namespace, so two
// shared objects built from these headers never share a kernel symbol.
#pragma once

#include <cuda_runtime.h>

#include <cub/device/device_reduce.cuh>
#include <atomic>
#include <cstddef>

#include "lockstep/config.hpp"
#include "lockstep/core/cuda_check.hpp"
#include "lockstep/kernels/bind.hpp"
#include "lockstep/runtime/memory.hpp"
#include "lockstep/runtime/stream.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_DETAIL_BEGIN

// A kernel instantiated with a functor from an anonymous namespace has internal linkage, where nvcc warns that
// the visibility attribute does not apply (#1407); it is right, and harmless, so that one warning is silenced
// for lockstep's kernels (users' -Werror builds included).
#pragma nv_diagnostic push
#pragma nv_diag_suppress 1407
template <class F>
__global__ LOCKSTEP_HIDDEN void elementwise_kernel(std::size_t n, F f) {
  const auto k = bind_functor(f);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) k(i);
}
#pragma nv_diagnostic pop

/// The 32 lanes of a warp sharing one row under launch_rows: butterfly shuffles give every lane the combined value.
/// The whole warp always works on the same row (rows_kernel), so the full mask is right.
struct warp_lanes {
  unsigned index;
  unsigned count;
  __device__ float sum(float v) const {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
  }
  __device__ float max(float v) const {
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, v, offset);
      v = other > v ? other : v;
    }
    return v;
  }
  __device__ first_max_candidate first_max(first_max_candidate v) const {  // larger value; on a tie the first column
    for (int offset = 16; offset > 0; offset /= 2) {
      const float value = __shfl_xor_sync(0xffffffffu, v.value, offset);
      const std::uint32_t index = __shfl_xor_sync(0xffffffffu, v.index, offset);
      if (value > v.value || (value == v.value && index < v.index)) v = first_max_candidate{value, index};
    }
    return v;
  }
};

#pragma nv_diagnostic push
#pragma nv_diag_suppress 1407
/// A warp per row (grid-stride over rows): the 32 lanes split the row's columns and combine with warp_lanes.
template <class F>
__global__ LOCKSTEP_HIDDEN void rows_kernel(std::size_t rows, F f) {
  const auto k = bind_functor(f);
  const std::size_t warp = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const std::size_t warps = static_cast<std::size_t>(gridDim.x) * blockDim.x / 32;
  const warp_lanes lanes{threadIdx.x % 32u, 32u};
  for (std::size_t r = warp; r < rows; r += warps) k.row(r, lanes);
}
#pragma nv_diagnostic pop

inline constexpr unsigned elementwise_block = 256;  // a multiple of 32: rows_kernel's warps are whole

/// A (row, col) functor seen as a flat one: launch_2d on a GPU.
template <class F>
struct flat_2d {
  F f;
  std::size_t cols;
  __device__ auto bind() const { return flat_2d<decltype(bind_functor(f))>{bind_functor(f), cols}; }
  __device__ void operator()(std::size_t i) const {
    const std::size_t r = index_div(i, cols);
    f(r, i - r * cols);
  }
};

/// Enough blocks to fill the device a few times over; the grid-stride loop covers the rest.
inline unsigned elementwise_grid(std::size_t n, device d) {
  static std::atomic<int> sms[64] = {};  // stream creation refuses device indices of 64 and above
  int count = sms[d.index & 63].load(std::memory_order_relaxed);
  if (count == 0) {
    LOCKSTEP_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, d.index),
                        "reading the multiprocessor count of ", d.str());
    sms[d.index & 63].store(count, std::memory_order_relaxed);
  }
  const std::size_t wanted = (n + elementwise_block - 1) / elementwise_block;
  const std::size_t cap = static_cast<std::size_t>(count) * 16;
  return static_cast<unsigned>(wanted < cap ? wanted : cap);
}

template <class F>
void launch_elementwise_cuda(std::size_t n, F f, stream_ref s, const char* what) {
  const device d = s.get_device();
  device_guard guard(d);
  elementwise_kernel<<<elementwise_grid(n, d), elementwise_block, 0, s.cuda_stream()>>>(n, f);
  check_launch(s.cuda_stream(), LOCKSTEP_SITE, "launching ", what, " on ", d.str());
}

template <class F>
void launch_rows_cuda(std::size_t rows, F f, stream_ref s, const char* what) {
  const device d = s.get_device();
  device_guard guard(d);
  rows_kernel<<<elementwise_grid(rows * 32, d), elementwise_block, 0, s.cuda_stream()>>>(rows, f);
  check_launch(s.cuda_stream(), LOCKSTEP_SITE, "launching ", what, " on ", d.str());
}

/// out[0] = reduce(transform(in[i]) for i in [0, n)) with CUB. Temporary storage comes from `workspace` when
/// given (grown in stream order on `s` and kept), else from the device's caching pool for this call.
template <class In, class Out, class Reduce, class Transform>
void transform_reduce_cuda(const In* in, std::size_t n, Out* out, Reduce reduce, Transform transform, Out init,
                           stream_ref s, const char* what, tensor* workspace) {
  const device d = s.get_device();
  device_guard guard(d);
  std::size_t temp_bytes = 0;
  LOCKSTEP_CUDA_CHECK(cub::DeviceReduce::TransformReduce(nullptr, temp_bytes, in, out, n, reduce, transform, init,
                                                         s.cuda_stream()),
                      "sizing the temporary storage of ", what, " on ", d.str());
  if (workspace != nullptr) {
    if (workspace->empty() || workspace->capacity_bytes() < temp_bytes || workspace->get_device() != d) {
      workspace->ensure(shape{static_cast<std::int64_t>(temp_bytes)}, dtype::u8, s);
    }
    LOCKSTEP_CUDA_CHECK(cub::DeviceReduce::TransformReduce(workspace->data(), temp_bytes, in, out, n, reduce, transform,
                                                           init, s.cuda_stream()),
                        "running ", what, " over ", n, " elements on ", d.str());
    return;
  }
  void* temp = allocate(temp_bytes, s);
  try {
    LOCKSTEP_CUDA_CHECK(cub::DeviceReduce::TransformReduce(temp, temp_bytes, in, out, n, reduce, transform, init,
                                                           s.cuda_stream()),
                        "running ", what, " over ", n, " elements on ", d.str());
  } catch (...) {
    deallocate(temp, temp_bytes, s);
    throw;
  }
  deallocate(temp, temp_bytes, s);
}

LOCKSTEP_DETAIL_END
