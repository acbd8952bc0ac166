// lockstep/kernels/multi_tensor.hpp — one launch over many tensors (optimizer updates, gradient checks).
//
// A training step touches every parameter: launching one kernel per tensor costs a launch per tensor on a
// GPU (and a queued task per tensor on a host stream). `launch_multi_tensor` runs a functor over all the
// elements of a list of tensor groups — a group is K pointers to same-sized tensors (say a parameter, its
// gradient and its momentum) — in as few launches as possible:
//   - on a GPU, the groups and a block-to-chunk table travel in the kernel's parameter block (kept under the
//     4 KiB every architecture accepts); a list that does not fit is split into several launches;
//   - on a host device, one queued task loops over every group.
// The functor is called as f(group, i) for element i of the group, after `bind()` (see launch.hpp). On a
// host stream, a bound functor may offer `for_group(group)`: a loop over the group calling the same
// per-element code with the group's pointers loaded once (and restrict-qualified), which vectorizes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/kernels/bind.hpp"
#include "lockstep/kernels/host_loop.hpp"
#include "lockstep/kernels/launch.hpp"

LOCKSTEP_ABI_BEGIN

/// K pointers to tensors of `size` elements each (any pointer may be null when the functor ignores it).
template <int K>
struct tensor_group {
  void* ptr[K];
  std::size_t size;
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

inline constexpr std::size_t multi_tensor_chunk = 16384;  // elements per GPU block
inline constexpr int multi_tensor_threads = 256;

// Kernel parameter tables of two sizes. Every GPU and CUDA version accepts 4 KiB of kernel parameters: 320 blocks of
// 16K elements per launch. CUDA 12.1 and newer accept 32764 bytes on sm_70 and newer (lockstep builds for sm_80 and
// sm_90), but only with a driver of CUDA 12.1 or newer: a 12.1 build on an older driver would fail every launch with
// the large table, so the driver is asked at run time (multi_tensor_large_tables) and the small table used otherwise.
// The large one covers 4096 blocks of 16K elements (64M elements), enough to fill an H100.
template <int K, int Groups, int Blocks>
struct multi_tensor_table {
  static constexpr int max_groups = Groups;
  static constexpr int max_blocks = Blocks;
  tensor_group<K> groups[max_groups];
  std::uint8_t block_group[max_blocks];
  std::uint32_t block_chunk[max_blocks];
};
inline constexpr std::size_t multi_tensor_small_param_bytes = 4096;
template <int K>
using multi_tensor_small_table = multi_tensor_table<K, 24, 320>;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
inline constexpr std::size_t multi_tensor_large_param_bytes = 32764;
template <int K>
using multi_tensor_large_table = multi_tensor_table<K, 96, 4096>;
#endif

#if LOCKSTEP_HAS_CUDA
// A functor from an anonymous namespace makes the kernel internal, where the visibility attribute does not apply
// (#1407): harmless, silenced as for elementwise_kernel (launch_cuda.cuh).
#pragma nv_diagnostic push
#pragma nv_diag_suppress 1407
template <class Table, int K, class F>
__global__ LOCKSTEP_HIDDEN void multi_tensor_kernel(Table table, F f) {
  const tensor_group<K>& g = table.groups[table.block_group[blockIdx.x]];
  const std::size_t begin = static_cast<std::size_t>(table.block_chunk[blockIdx.x]) * multi_tensor_chunk;
  const std::size_t end = begin + multi_tensor_chunk < g.size ? begin + multi_tensor_chunk : g.size;
  const auto k = bind_functor(f);
  for (std::size_t i = begin + threadIdx.x; i < end; i += blockDim.x) k(g, i);
}
#pragma nv_diagnostic pop

/// True when the driver accepts the large parameter tables (CUDA 12.1 or newer), asked once per process.
inline bool multi_tensor_large_tables() {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
  static const bool large = [] {
    int version = 0;
    const bool known = cudaDriverGetVersion(&version) == cudaSuccess;
    (void)cudaGetLastError();
    return known && version >= 12010;
  }();
  return large;
#else
  return false;
#endif
}

template <class table_t, int K, class F>
void launch_multi_tensor_tables(std::span<const tensor_group<K>> groups, F f, stream_ref s, const char* what) {
  const device d = s.get_device();
  device_guard guard(d);
  table_t table{};
  int n_groups = 0, n_blocks = 0;
  auto flush = [&] {
    if (n_blocks == 0) return;
    multi_tensor_kernel<table_t, K, F><<<n_blocks, multi_tensor_threads, 0, s.cuda_stream()>>>(table, f);
    check_launch(s.cuda_stream(), LOCKSTEP_SITE,
                               ::lockstep::detail::message{"launching ", what, " over ", n_groups, " tensors on ", d});
    n_groups = n_blocks = 0;
  };
  for (const auto& g : groups) {
    if (g.size == 0) continue;
    if (n_groups == table_t::max_groups) flush();
    table.groups[n_groups] = g;
    const std::size_t chunks = (g.size + multi_tensor_chunk - 1) / multi_tensor_chunk;
    for (std::size_t c = 0; c < chunks; ++c) {
      if (n_blocks == table_t::max_blocks) {
        const int current = n_groups;
        flush();
        table.groups[0] = table.groups[current];  // the group being split continues in the next launch
      }
      table.block_group[n_blocks] = static_cast<std::uint8_t>(n_groups);
      table.block_chunk[n_blocks] = static_cast<std::uint32_t>(c);
      ++n_blocks;
    }
    ++n_groups;
  }
  flush();
}

template <int K, class F>
void launch_multi_tensor_cuda(std::span<const tensor_group<K>> groups, F f, stream_ref s, const char* what) {
  static_assert(sizeof(multi_tensor_small_table<K>) + sizeof(F) <= multi_tensor_small_param_bytes,
                "kernel parameters must fit the limit every driver accepts");
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
  static_assert(sizeof(multi_tensor_large_table<K>) + sizeof(F) <= multi_tensor_large_param_bytes,
                "kernel parameters must fit the limit of CUDA 12.1");
  if (multi_tensor_large_tables()) {
    launch_multi_tensor_tables<multi_tensor_large_table<K>>(groups, f, s, what);
    return;
  }
#endif
  launch_multi_tensor_tables<multi_tensor_small_table<K>>(groups, f, s, what);
}
#endif

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Runs f(group, i) for every element i of every group, in stream order on `s`, in as few launches as the
/// backend needs. Every pointer must be memory of the stream's device.
template <int K, class F>
void launch_multi_tensor(std::span<const tensor_group<K>> groups, F f, stream_ref s, const char* what) {
  static_assert(std::is_trivially_copyable_v<F>, "a kernel functor is copied to the device: keep it a plain struct");
  if (groups.empty()) return;
  if (s.get_device().is_host()) {
    if (detail::host_strict()) {
      detail::strict_check_functor(f, s.get_device(), what);
      for (const auto& g : groups) {
        for (const void* p : g.ptr) {
          if (g.size != 0) detail::strict_expect_memory_of(s.get_device(), p, 1, what);
        }
      }
    }
    detail::enqueue_host(
        s,
        [list = std::vector<tensor_group<K>>(groups.begin(), groups.end()), f] {
          detail::run_host_groups<tensor_group<K>>(std::span<const tensor_group<K>>(list), f);
        },
        what);
    return;
  }
#if LOCKSTEP_HAS_CUDA
  detail::launch_multi_tensor_cuda<K>(groups, f, s, what);
#endif
}

LOCKSTEP_ABI_END
