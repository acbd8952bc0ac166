// lockstep/kernels/launch_cuda.cuh — the CUDA side of the launchers: a grid-stride kernel, warp-per-row and
// block column reductions, and CUB reductions.
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
  check_launch(s.cuda_stream(), LOCKSTEP_SITE, ::lockstep::detail::message{"launching ", what, " on ", d});
}

template <class F>
void launch_rows_cuda(std::size_t rows, F f, stream_ref s, const char* what) {
  const device d = s.get_device();
  device_guard guard(d);
  rows_kernel<<<elementwise_grid(rows * 32, d), elementwise_block, 0, s.cuda_stream()>>>(rows, f);
  check_launch(s.cuda_stream(), LOCKSTEP_SITE, ::lockstep::detail::message{"launching ", what, " on ", d});
}

// ---- column reductions (launch_columns): f.finish(c, sum over r of f.load(r, c)) ----
//
// Pass 1: block (x, y) takes columns [32x, 32x + 32) and the rows of split y; thread (tx, ty) adds rows
// ty, ty + 8, ... of the split, in order, for column 32x + tx (a warp reads 32 neighbouring columns of one row:
// coalesced), and the 8 lanes' sums of a column are added in order ty = 0..7 from shared memory. With one split
// that is the column's sum (finished there); otherwise each split's sum goes to partial[y * cols + c] and pass 2
// adds a column's splits in order y = 0, 1, ... No atomics: the order is a function of `rows`.
inline constexpr unsigned column_tile = 32;                // columns per block (blockDim.x)
inline constexpr unsigned column_lanes = 8;                // row lanes per block (blockDim.y)
inline constexpr std::size_t column_block_rows = 32;       // fewer rows: one thread per column
inline constexpr std::size_t column_split_rows = 256;      // rows per split, at least
inline constexpr std::size_t column_splits_max = 128;      // splits, at most (partial sums: splits x cols floats)

#pragma nv_diagnostic push
#pragma nv_diag_suppress 1407
template <class F>
__global__ LOCKSTEP_HIDDEN void column_partials_kernel(std::size_t rows, std::size_t cols, std::size_t split_rows, F f,
                                                       float* partial) {
  const auto k = bind_functor(f);
  __shared__ float sums[column_lanes][column_tile + 1];
  const std::size_t c = static_cast<std::size_t>(blockIdx.x) * column_tile + threadIdx.x;
  const std::size_t begin = static_cast<std::size_t>(blockIdx.y) * split_rows;
  const std::size_t end = rows - begin < split_rows ? rows : begin + split_rows;
  float acc = 0.0f;
  if (c < cols) {
    for (std::size_t r = begin + threadIdx.y; r < end; r += column_lanes) acc += k.load(r, c);
  }
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  float total = sums[0][threadIdx.x];
  for (unsigned j = 1; j < column_lanes; ++j) total += sums[j][threadIdx.x];
  if (gridDim.y == 1) {
    k.finish(c, total);
  } else {
    partial[static_cast<std::size_t>(blockIdx.y) * cols + c] = total;
  }
}

template <class F>
__global__ LOCKSTEP_HIDDEN void column_finish_kernel(std::size_t cols, std::size_t splits, F f, const float* partial) {
  const auto k = bind_functor(f);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t c = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += stride) {
    float total = partial[c];
    for (std::size_t y = 1; y < splits; ++y) total += partial[y * cols + c];
    k.finish(c, total);
  }
}
#pragma nv_diagnostic pop

template <class F>
void launch_columns_cuda(std::size_t rows, std::size_t cols, F f, stream_ref s, const char* what) {
  if (rows < column_block_rows) {  // few rows (none included: finish(c, 0)): a thread per column is enough
    launch_elementwise_cuda(cols, f, s, what);
    return;
  }
  const device d = s.get_device();
  device_guard guard(d);
  const std::size_t wanted = (rows + column_splits_max - 1) / column_splits_max;
  const std::size_t split_rows = wanted > column_split_rows ? wanted : column_split_rows;
  const std::size_t splits = (rows + split_rows - 1) / split_rows;  // <= column_splits_max
  const dim3 block(column_tile, column_lanes);
  const dim3 grid(static_cast<unsigned>((cols + column_tile - 1) / column_tile), static_cast<unsigned>(splits));
  if (splits == 1) {
    column_partials_kernel<<<grid, block, 0, s.cuda_stream()>>>(rows, cols, split_rows, f, static_cast<float*>(nullptr));
    check_launch(s.cuda_stream(), LOCKSTEP_SITE, ::lockstep::detail::message{"launching ", what, " on ", d});
    return;
  }
  const std::size_t bytes = splits * cols * sizeof(float);
  auto* partial = static_cast<float*>(allocate(bytes, s));
  try {
    column_partials_kernel<<<grid, block, 0, s.cuda_stream()>>>(rows, cols, split_rows, f, partial);
    check_launch(s.cuda_stream(), LOCKSTEP_SITE,
                               ::lockstep::detail::message{"launching ", what, " (partial column sums) on ", d});
    column_finish_kernel<<<elementwise_grid(cols, d), elementwise_block, 0, s.cuda_stream()>>>(cols, splits, f, partial);
    check_launch(s.cuda_stream(), LOCKSTEP_SITE,
                               ::lockstep::detail::message{"launching ", what, " (column sums) on ", d});
  } catch (...) {
    deallocate(partial, bytes, s);
    throw;
  }
  deallocate(partial, bytes, s);
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
