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

#if LOCKSTEP_HAS_CUDA
#if CUDART_VERSION < 12000
#error "lockstep's CUDA backend needs CUDA 12.0 or newer (cudaSetDevice creating the context, driver entry points)"
#endif
/// True when the calling thread has a CUDA context current (cuCtxGetCurrent, reached through the runtime so that
/// nothing links libcuda). A fresh thread has none, yet cudaGetDevice reports device 0 there: "restoring" it with
/// cudaSetDevice(0) would create a context on GPU 0 (about 0.5 GB in every process of an mpirun job, and fatal
/// in EXCLUSIVE_PROCESS mode). True when it cannot be told (then the device is restored, as before).
inline bool cuda_context_is_current() noexcept {
  using get_current_fn = int (*)(void**);  // CUresult cuCtxGetCurrent(CUcontext*)
  static const get_current_fn get_current = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &p, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuCtxGetCurrent", &p, cudaEnableDefault, &found);
#endif
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return get_current_fn{nullptr};
    }
    return reinterpret_cast<get_current_fn>(p);
  }();
  if (get_current == nullptr) return true;
  void* context = nullptr;
  return get_current(&context) == 0 && context != nullptr;
}

/// Makes GPU `index` current for a scope without throwing (for release paths), skipping cudaSetDevice when it is
/// current already, and restoring the previous device only when the thread had a context (see above).
class cuda_device_scope {
 public:
  explicit cuda_device_scope(int index) noexcept {
    const bool had_context = cuda_context_is_current();
    int previous = index;
    if (cudaGetDevice(&previous) != cudaSuccess) {
      (void)cudaGetLastError();
      previous = index;
    }
    if (previous != index) {
      if (cudaSetDevice(index) != cudaSuccess) (void)cudaGetLastError();
      if (had_context) previous_ = previous;
    }
  }
  cuda_device_scope(const cuda_device_scope&) = delete;
  cuda_device_scope& operator=(const cuda_device_scope&) = delete;
  ~cuda_device_scope() {
    if (previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }

 private:
  int previous_ = -1;  // the device to restore, or -1
};
#endif
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
    const bool had_context = detail::cuda_context_is_current();
    int prev = 0;
    LOCKSTEP_CUDA_CHECK(cudaGetDevice(&prev), "saving the current device before switching to ", d.str());
    // Nothing to restore when the device is current already (no cudaSetDevice at all), or when the thread had no
    // context: restoring "device 0" would create one there (see detail::cuda_context_is_current).
    previous_.index = prev != d.index && had_context ? prev : -1;
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
    if (previous_.index >= 0) LOCKSTEP_CUDA_IGNORE(cudaSetDevice(previous_.index));
#endif
  }

 private:
  device previous_;
};

LOCKSTEP_ABI_END
