// lockstep/device/device_guard.hpp — makes a device current for a scope, and restores the previous one.
//
// For a GPU this is cudaSetDevice (the CUDA runtime's current device is per thread). Host devices have the
// same notion, a per-thread current host device, used by code that asks "which device am I on".
#pragma once

#include "lockstep/config.hpp"
#include "lockstep/core/cuda_check.hpp"
#include "lockstep/device/device.hpp"
#include "lockstep/device/query.hpp"

namespace lockstep::detail {
inline int& current_host_device_index() noexcept {
  thread_local int index = 0;
  return index;
}
}  // namespace lockstep::detail

LOCKSTEP_ABI_BEGIN

/// The calling thread's current device of `kind`.
inline device current_device(device_kind kind) {
  if (kind == device_kind::host) return device{kind, detail::current_host_device_index()};
#if LOCKSTEP_HAS_CUDA
  int index = 0;
  LOCKSTEP_CUDA_CHECK(cudaGetDevice(&index), "asking for the current device");
  return device{kind, index};
#else
  throw device_error("this code was compiled without nvcc: there is no current CUDA device");
#endif
}

/// Makes `d` the calling thread's current device until the end of the scope. Throws device_error when `d`
/// does not exist. Not movable: it restores state on the thread that created it.
class device_guard {
 public:
  explicit device_guard(device d) : previous_(d) {
    if (d.is_host()) {
      check_device_exists(d);
      previous_.index = std::exchange(detail::current_host_device_index(), d.index);
      return;
    }
#if LOCKSTEP_HAS_CUDA
    int prev = 0;
    LOCKSTEP_CUDA_CHECK(cudaGetDevice(&prev), "saving the current device before switching to ", d.str());
    previous_.index = prev;
    if (prev != d.index) LOCKSTEP_CUDA_CHECK(cudaSetDevice(d.index), "making ", d.str(), " current");
#else
    check_device_exists(d);  // throws: no CUDA device in a host-only translation unit
#endif
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    if (previous_.is_host()) {
      detail::current_host_device_index() = previous_.index;
      return;
    }
#if LOCKSTEP_HAS_CUDA
    LOCKSTEP_CUDA_IGNORE(cudaSetDevice(previous_.index));
#endif
  }

 private:
  device previous_;
};

LOCKSTEP_ABI_END
