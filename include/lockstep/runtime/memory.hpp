// lockstep/runtime/memory.hpp — stream-ordered device allocation through a per-device caching pool, and
// per-device memory statistics.
//
// On a GPU, allocations come from the device's default memory pool through cudaMallocAsync/cudaFreeAsync,
// with the pool's release threshold raised so that freed memory stays cached: a steady-state training step
// never reaches cudaMalloc/cudaFree. On a host device they come from the device's own caching pool with the
// same stream-ordered semantics (runtime/detail/host_memory.hpp). Both keep the same statistics.
#pragma once

#include <array>
#include <atomic>
#include <cstring>
#include <cstdint>
#include <limits>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/cuda_check.hpp"
#include "lockstep/core/units.hpp"
#include "lockstep/runtime/detail/host_memory.hpp"
#include "lockstep/runtime/stream.hpp"

LOCKSTEP_DETAIL_BEGIN

#if LOCKSTEP_HAS_CUDA
/// lockstep's own accounting of one GPU's allocations (the pool reports reserved memory itself).
struct cuda_device_accounting {
  std::mutex mutex;
  bool pool_ready = false;
  cudaMemPool_t pool = nullptr;
  std::uint64_t in_use = 0, peak_in_use = 0, allocations = 0, frees = 0, system_allocations = 0, live = 0;
  std::uint64_t reserved_seen = 0;  // pool's reserved bytes after the last allocation
};

inline cuda_device_accounting& cuda_accounting(int index) {
  static std::array<cuda_device_accounting, 64> all;
  LOCKSTEP_EXPECTS(index >= 0 && index < 64, "GPU index ", index, " is beyond the 64 devices lockstep tracks");
  return all[static_cast<std::size_t>(index)];
}

/// The device's default pool, with its release threshold raised once so freed memory stays cached.
inline cudaMemPool_t cuda_pool(device d, cuda_device_accounting& acc) {
  if (!acc.pool_ready) {
    cudaMemPool_t pool = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, d.index), "getting the memory pool of ", d.str());
    std::uint64_t keep_everything = std::numeric_limits<std::uint64_t>::max();
    LOCKSTEP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything),
                        "making the memory pool of ", d.str(), " cache freed memory");
    acc.pool = pool;
    acc.pool_ready = true;
  }
  return acc.pool;
}

/// enable_peer_access's record of the pairs it enabled in this process (done[from] bit `to`), and its lock.
inline std::mutex& peer_access_mutex() {
  static std::mutex m;
  return m;
}
inline std::array<std::uint64_t, 64>& peer_access_done() {
  static std::array<std::uint64_t, 64> done{};
  return done;
}
/// The pairs whose cudaDeviceEnablePeerAccess lockstep made (not found enabled already): the ones it may disable.
inline std::array<std::uint64_t, 64>& peer_access_ours() {
  static std::array<std::uint64_t, 64> ours{};
  return ours;
}
/// f(from, to, bit) for each ordered pair of distinct GPUs of `devices` (both indices checked), where `bit` is
/// `to`'s bit in the words of peer_access_done / peer_access_ours.
template <class F>
void for_each_gpu_pair(std::span<const device> devices, F&& f) {
  for (const device from : devices) {
    for (const device to : devices) {
      if (!from.is_cuda() || !to.is_cuda() || from == to) continue;
      check_cuda_index(from);
      check_cuda_index(to);
      f(from, to, std::uint64_t{1} << to.index);
    }
  }
}

/// Gives GPU `from` read and write access to the memory pool of GPU `to` (cudaMemPoolSetAccess), or takes it back.
inline void set_pool_access(device from, device to, bool allowed) {
  auto& acc = cuda_accounting(to.index);
  cudaMemPool_t pool = nullptr;
  {
    std::lock_guard pool_lock(acc.mutex);
    device_guard guard(to);
    pool = cuda_pool(to, acc);
  }
  cudaMemAccessDesc access{};
  access.location.type = cudaMemLocationTypeDevice;
  access.location.id = from.index;
  access.flags = allowed ? cudaMemAccessFlagsProtReadWrite : cudaMemAccessFlagsProtNone;
  LOCKSTEP_CUDA_CHECK(cudaMemPoolSetAccess(pool, &access, 1), allowed ? "giving " : "taking back ", from.str(),
                      allowed ? " access to the memory pool of " : "'s access to the memory pool of ", to.str());
}

inline std::uint64_t cuda_pool_attribute(cudaMemPool_t pool, cudaMemPoolAttr attr, device d) {
  std::uint64_t value = 0;
  LOCKSTEP_CUDA_CHECK(cudaMemPoolGetAttribute(pool, attr, &value), "reading memory statistics of ", d.str());
  return value;
}
#endif

/// Host devices keep the peer-access grants of enable_peer_access / disable_peer_access (every pair of `devices`).
inline void set_host_peer_access(std::span<const device> devices, bool allowed) {
  for (const device from : devices) {
    for (const device to : devices) {
      if (!from.is_host() || !to.is_host() || from == to) continue;
      auto& host = host_backend::runtime::instance();
      (void)host.device(from.index), (void)host.device(to.index);  // both exist, or device_error
      host.set_peer_access(from.index, to.index, allowed);
    }
  }
}

/// `bytes` of memory on the stream's device, usable in stream order on `s` (cudaMallocAsync semantics).
/// Zero bytes gives nullptr. Throws out_of_memory_error naming the device, the request and the usage.
inline void* allocate(std::size_t bytes, stream_ref s) {
  if (bytes == 0) return nullptr;
  const device d = s.get_device();
  if (d.is_host()) return host_backend::runtime::instance().device(d.index).memory().allocate(bytes, &s.host_state());
#if LOCKSTEP_HAS_CUDA
  auto& acc = cuda_accounting(d.index);
  std::lock_guard lock(acc.mutex);
  device_guard guard(d);
  cudaMemPool_t pool = cuda_pool(d, acc);
  void* p = nullptr;
  const cudaError_t e = cudaMallocFromPoolAsync(&p, bytes, pool, s.cuda_stream());
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    (void)cudaMemGetInfo(&free_bytes, &total_bytes);
    (void)cudaGetLastError();
    throw out_of_memory_error(concat(d.str(), " is out of memory: tried to allocate ", format_bytes(bytes), "; ",
                                     format_bytes(acc.in_use), " in use by lockstep allocations, ",
                                     format_bytes(free_bytes), " free of ", format_bytes(total_bytes),
                                     " (cudaErrorMemoryAllocation)"),
                              e);
  }
  if (e != cudaSuccess) {
    ::lockstep::detail::throw_cuda_error(e, "cudaMallocFromPoolAsync", LOCKSTEP_SITE,
                                         ::lockstep::detail::message{"allocating ", bytes, " B on ", d.str()});
  }
  acc.in_use += bytes;
  acc.peak_in_use = std::max(acc.peak_in_use, acc.in_use);
  ++acc.allocations;
  ++acc.live;
  const std::uint64_t reserved = cuda_pool_attribute(pool, cudaMemPoolAttrReservedMemCurrent, d);
  if (reserved > acc.reserved_seen) ++acc.system_allocations;  // the pool had to grow
  acc.reserved_seen = reserved;
  return p;
#else
  throw device_error("unreachable: no CUDA device in a host-only translation unit");
#endif
}

/// Frees `p` (of `bytes`, from allocate on the same device) in stream order on `s` (cudaFreeAsync
/// semantics). Never throws.
inline void deallocate(void* p, std::size_t bytes, stream_ref s) noexcept {
  if (p == nullptr) return;
  const device d = s.get_device();
  if (d.is_host()) {
    // runtime::instance() exists: the allocation came from it.
    host_backend::runtime::instance().device(d.index).memory().deallocate(p, &s.host_state());
    return;
  }
#if LOCKSTEP_HAS_CUDA
  auto& acc = cuda_accounting(d.index);
  std::lock_guard lock(acc.mutex);
  {
    detail::cuda_device_scope current(d.index);
    LOCKSTEP_CUDA_IGNORE(cudaFreeAsync(p, s.cuda_stream()));
  }
  acc.in_use -= std::min<std::uint64_t>(acc.in_use, bytes);
  ++acc.frees;
  if (acc.live > 0) --acc.live;
#else
  (void)bytes;
#endif
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_clear_padding)
#define LOCKSTEP_CAN_CLEAR_PADDING 1
#endif
#endif
#ifndef LOCKSTEP_CAN_CLEAR_PADDING
#define LOCKSTEP_CAN_CLEAR_PADDING 0
#endif

// ---- host_strictness::strict: memory used where it lives --------------------------------------------------------

/// True when host devices run in host_strictness::strict (checks below on; streams start work late at random).
inline bool host_strict() { return host_backend::runtime::instance().strict(); }

[[noreturn]] inline void throw_foreign_memory(device used_on, const void* p, const host_backend::block_owner& owner,
                                              const char* what) {
  throw precondition_error(concat(
      what, " on ", used_on.str(), " uses memory of host:", owner.device, " (", p, ", in a block of ",
      format_bytes(owner.size), " allocated there): work on a stream may only touch its own device's memory, as on a "
      "GPU, where this is cudaErrorIllegalAddress and the CUDA context is lost [host_strictness::strict]. Copy the "
      "data to ", used_on.str(), " first, or run the work on a stream of host:", owner.device));
}

/// Strict mode: throws precondition_error when `p` lies in a live allocation of a host device other than `d` (a
/// GPU kernel on `d` would fault on it). Other addresses (pinned or ordinary host memory, GPU memory) pass.
inline void strict_expect_not_foreign(device d, const void* p, const char* what) {
  if (p == nullptr || !d.is_host()) return;
  if (const auto owner = host_backend::address_registry::instance().find(p); owner && owner->device != d.index) {
    throw_foreign_memory(d, p, *owner, what);
  }
}

/// Strict mode: throws precondition_error unless [p, p + bytes) lies in one live allocation of host device `d`:
/// memory that a span says is on `d` must be (another device's, freed, or ordinary host memory is not).
inline void strict_expect_memory_of(device d, const void* p, std::size_t bytes, const char* what) {
  if (p == nullptr || bytes == 0 || !d.is_host() || !host_strict()) return;
  const auto owner = host_backend::address_registry::instance().find(p);
  if (!owner) {
    throw precondition_error(concat(what, ": ", p, " is said to be memory of ", d.str(),
                                    " but is no live allocation of any host device (freed, or ordinary host memory; "
                                    "on a GPU, an illegal address) [host_strictness::strict]"));
  }
  if (owner->device != d.index) throw_foreign_memory(d, p, *owner, what);
  const auto offset = static_cast<std::size_t>(static_cast<const std::byte*>(p) - static_cast<const std::byte*>(owner->base));
  if (offset + bytes > owner->size) {
    throw precondition_error(concat(what, ": ", format_bytes(bytes), " at ", p, " run ",
                                    format_bytes(offset + bytes - owner->size), " past the end of its allocation on ",
                                    d.str(), " (", format_bytes(owner->size), ") [host_strictness::strict]"));
  }
}

/// Strict mode: every pointer-sized word of a kernel functor that points into another host device's live memory
/// fails the launch. Functors are plain structs of pointers and scalars (launch.hpp), so this sees every pointer
/// a kernel will follow without the functor listing them. Padding is cleared first (its bytes are whatever the
/// caller's stack held, old pointers included); a scalar whose bits happen to equal such an address would be
/// refused too, which heap addresses (above 2^44 here) make implausible for sizes, counts and floats. Compilers
/// without __builtin_clear_padding (clang before 16) skip the scan: the spans' checks remain.
template <class F>
void strict_check_functor(const F& f, device d, const char* what) {
#if LOCKSTEP_CAN_CLEAR_PADDING
  if (!d.is_host() || !host_strict()) return;
  F copy = f;
  __builtin_clear_padding(&copy);
  const auto* bytes = reinterpret_cast<const unsigned char*>(&copy);
  for (std::size_t at = 0; at + sizeof(void*) <= sizeof(F); at += alignof(void*)) {
    const void* p = nullptr;
    std::memcpy(&p, bytes + at, sizeof p);
    strict_expect_not_foreign(d, p, what);
  }
#else
  (void)f, (void)d, (void)what;
#endif
}

/// Throws precondition_error when `p` is device memory of another device than `d`: on a GPU, asked of the CUDA
/// runtime (cudaPointerGetAttributes, about a microsecond: for the few scalars a step reads, not per tensor); on a
/// host device, in strict mode. For pointers the caller cannot otherwise tie to a device (a loss scale, a skip flag).
inline void expect_pointer_on_device(device d, const void* p, const char* what) {
  if (p == nullptr) return;
  if (d.is_host()) {
    if (host_strict()) strict_expect_not_foreign(d, p, what);
    return;
  }
#if LOCKSTEP_HAS_CUDA
  cudaPointerAttributes attributes{};
  LOCKSTEP_CUDA_CHECK(cudaPointerGetAttributes(&attributes, p), "asking where ", what, " reads ", p);
  LOCKSTEP_EXPECTS(attributes.type != cudaMemoryTypeDevice || attributes.device == d.index, what, " on ", d.str(),
                   " reads ", p, ", memory of cuda:", attributes.device, ": keep it on ", d.str(),
                   " (without peer access a kernel reading another GPU's memory fails with cudaErrorIllegalAddress and "
                   "loses the context; with it, every step would read across the link)");
#endif
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Memory statistics of `d` (see memory_stats). Throws device_error when `d` does not exist.
inline memory_stats get_memory_stats(device d) {
  if (d.is_host()) return host_backend::runtime::instance().device(d.index).memory().stats();
  check_device_exists(d);
  memory_stats st;
#if LOCKSTEP_HAS_CUDA
  auto& acc = detail::cuda_accounting(d.index);
  std::lock_guard lock(acc.mutex);
  device_guard guard(d);
  cudaMemPool_t pool = detail::cuda_pool(d, acc);
  st.bytes_in_use = acc.in_use;
  st.peak_bytes_in_use = acc.peak_in_use;
  st.bytes_reserved = detail::cuda_pool_attribute(pool, cudaMemPoolAttrReservedMemCurrent, d);
  st.peak_bytes_reserved = detail::cuda_pool_attribute(pool, cudaMemPoolAttrReservedMemHigh, d);
  st.allocations = acc.allocations;
  st.frees = acc.frees;
  st.system_allocations = acc.system_allocations;
  st.live_allocations = acc.live;
  size_t free_bytes = 0, total_bytes = 0;
  LOCKSTEP_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes), "reading the memory size of ", d.str());
  st.limit = total_bytes;
#endif
  return st;
}

/// Lets each GPU of `devices` read and write the memory of every other one where the hardware allows it, so that
/// copies between them (data_parallel's scatter, gather, broadcast and reduce) run peer to peer over NVLink or PCIe
/// instead of staging through host memory: cudaDeviceEnablePeerAccess, and cudaMemPoolSetAccess on each device's
/// pool (memory from a stream-ordered pool is reachable from a peer only through the pool's own access list).
/// NCCL needs it too: within one process it reads and writes peers' buffers directly (make_nccl_clique calls
/// this). Returns the pairs (from, to) where `from` can now reach `to`'s memory; pairs the hardware does not
/// connect are left out (their copies still work, staged by the driver). Host devices share one address space but
/// keep the same grants (every pair is connected), so that strict mode refuses a collective between host devices
/// that were never granted, as a GPU would fault (make_host_clique calls this, like make_nccl_clique). Idempotent;
/// makes each device current in turn and restores the caller's.
inline std::vector<std::pair<device, device>> enable_peer_access(std::span<const device> devices) {
  std::vector<std::pair<device, device>> enabled;
  detail::set_host_peer_access(devices, true);
  for (const device from : devices) {
    for (const device to : devices) {
      if (from.is_host() && to.is_host() && from != to) enabled.emplace_back(from, to);
    }
  }
#if LOCKSTEP_HAS_CUDA
  std::lock_guard lock(detail::peer_access_mutex());
  auto& done = detail::peer_access_done();
  detail::for_each_gpu_pair(devices, [&](device from, device to, std::uint64_t bit) {
    if ((done[static_cast<std::size_t>(from.index)] & bit) != 0) {
      enabled.emplace_back(from, to);
      return;
    }
    int can = 0;
    LOCKSTEP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from.index, to.index), "asking whether ", from.str(),
                        " can reach ", to.str());
    if (can == 0) return;
    {
      device_guard guard(from);
      const cudaError_t e = cudaDeviceEnablePeerAccess(to.index, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // enabled by the user or another library: fine (and theirs to disable)
      } else if (e == cudaErrorTooManyPeers || e == cudaErrorPeerAccessUnsupported) {
        (void)cudaGetLastError();  // beyond the hardware's peer limit, or refused after all: not connected
        return;
      } else {
        LOCKSTEP_CUDA_CHECK(e, "enabling peer access from ", from.str(), " to ", to.str());
        detail::peer_access_ours()[static_cast<std::size_t>(from.index)] |= bit;
      }
    }
    detail::set_pool_access(from, to, true);
    done[static_cast<std::size_t>(from.index)] |= bit;
    enabled.emplace_back(from, to);
  });
#endif
  return enabled;
}

/// Takes back what enable_peer_access gave between the devices of `devices`: the pools' access lists and the peer
/// access lockstep itself enabled (not one the user or NCCL had enabled before) on GPUs, the grants on host devices.
/// Collectives between them then fault on a GPU and are refused in strict host mode (how the tests show that a
/// clique needs the grants); copies still work. Only while nothing uses the access: no clique or data_parallel
/// of these devices alive, their streams synchronized. Idempotent.
inline void disable_peer_access(std::span<const device> devices) {
  detail::set_host_peer_access(devices, false);
#if LOCKSTEP_HAS_CUDA
  std::lock_guard lock(detail::peer_access_mutex());
  auto& done = detail::peer_access_done();
  detail::for_each_gpu_pair(devices, [&](device from, device to, std::uint64_t bit) {
    if ((done[static_cast<std::size_t>(from.index)] & bit) == 0) return;
    detail::set_pool_access(from, to, false);
    auto& ours = detail::peer_access_ours()[static_cast<std::size_t>(from.index)];
    if ((ours & bit) != 0) {
      device_guard guard(from);
      const cudaError_t e = cudaDeviceDisablePeerAccess(to.index);
      if (e == cudaErrorPeerAccessNotEnabled) {
        (void)cudaGetLastError();
      } else {
        LOCKSTEP_CUDA_CHECK(e, "disabling peer access from ", from.str(), " to ", to.str());
      }
      ours &= ~bit;
    }
    done[static_cast<std::size_t>(from.index)] &= ~bit;
  });
#endif
}

/// Resets the peaks of `d` to the current values and its counters to zero (the number of live allocations
/// is not a counter and stays).
inline void reset_memory_stats(device d) {
  if (d.is_host()) return host_backend::runtime::instance().device(d.index).memory().reset_stats();
  check_device_exists(d);
#if LOCKSTEP_HAS_CUDA
  auto& acc = detail::cuda_accounting(d.index);
  std::lock_guard lock(acc.mutex);
  device_guard guard(d);
  cudaMemPool_t pool = detail::cuda_pool(d, acc);
  acc.peak_in_use = acc.in_use;
  acc.allocations = acc.frees = acc.system_allocations = 0;
  std::uint64_t zero = 0;
  LOCKSTEP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero),
                      "resetting the memory peak of ", d.str());
#endif
}

/// Gives the memory cached by the pool of `d` back to the system (torch.cuda.empty_cache). Waits for
/// pending stream-ordered frees first.
inline void release_cached_memory(device d) {
  if (d.is_host()) return host_backend::runtime::instance().device(d.index).memory().release_cached();
  check_device_exists(d);
#if LOCKSTEP_HAS_CUDA
  auto& acc = detail::cuda_accounting(d.index);
  device_guard guard(d);
  LOCKSTEP_CUDA_CHECK(cudaDeviceSynchronize(), "waiting for pending frees on ", d.str());
  std::lock_guard lock(acc.mutex);
  LOCKSTEP_CUDA_CHECK(cudaMemPoolTrimTo(detail::cuda_pool(d, acc), 0), "trimming the memory pool of ", d.str());
  acc.reserved_seen = 0;
#endif
}

LOCKSTEP_ABI_END
