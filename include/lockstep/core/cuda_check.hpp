// lockstep/core/cuda_check.hpp — LOCKSTEP_CUDA_CHECK, for translation units compiled by nvcc.
//
// The one header of core/ that sees CUDA: the check macros belong with the other check macros, and the
// header is empty unless the translation unit is compiled by nvcc.
#pragma once

#include "lockstep/config.hpp"
#include "lockstep/core/error.hpp"

#if LOCKSTEP_HAS_CUDA
#include <cuda_runtime_api.h>

#include <cstdlib>

LOCKSTEP_DETAIL_BEGIN

/// Builds "file:line call: cudaErrorX (text) while <what>", clears CUDA's last error, and throws.
[[noreturn]] LOCKSTEP_COLD inline void throw_cuda_error(cudaError_t status, const char* call, source_site at,
                                                      message what) {
  (void)cudaGetLastError();  // do not let a later, unrelated check report this error again
  const std::string msg = call_failure_message(
      at, call, concat(cudaGetErrorName(status), " (", cudaGetErrorString(status), ')'), what);
  if (status == cudaErrorMemoryAllocation) throw out_of_memory_error(msg, status);
  throw cuda_error(msg, status);
}

/// True for the errors that leave the CUDA context unusable ("sticky"): every later call of the process on that
/// device reports them, whichever work caused them.
constexpr bool is_sticky(cudaError_t e) noexcept {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

/// LOCKSTEP_CUDA_LAUNCH_BLOCKING=1: synchronize after every kernel launch, so that a failing kernel is reported
/// by its own launch (a debugging mode, like CUDA_LAUNCH_BLOCKING=1; slow). Read once.
inline bool cuda_launch_blocking() noexcept {
  static const bool on = [] {
    const char* v = std::getenv("LOCKSTEP_CUDA_LAUNCH_BLOCKING");
    return v != nullptr && v[0] == '1' && v[1] == '\0';
  }();
  return on;
}

/// After a kernel launch on `s`: reports a launch error, and in LOCKSTEP_CUDA_LAUNCH_BLOCKING mode the kernel's
/// own failure. A sticky error may come from earlier work: the message says so, and how to find it.
inline void check_launch(cudaStream_t s, source_site at, message what) {
  cudaError_t e = cudaGetLastError();
  const bool blocking = cuda_launch_blocking();
  if (e == cudaSuccess && blocking) e = cudaStreamSynchronize(s);
  if (e == cudaSuccess) return;
  if (is_sticky(e) && !blocking) {
    const std::string context = format_message(what);
    throw_cuda_error(e, "kernel launch", at,
                     message{context,
                             ": the device's CUDA context is unusable (a sticky error). An earlier kernel or copy on "
                             "this device may be at fault, not this launch: rerun with LOCKSTEP_CUDA_LAUNCH_BLOCKING=1 "
                             "to have each kernel checked as it runs, and compute-sanitizer to find the access"});
  }
  throw_cuda_error(e, blocking ? "kernel launch (LOCKSTEP_CUDA_LAUNCH_BLOCKING)" : "kernel launch", at, what);
}

LOCKSTEP_DETAIL_END

/// Checks a CUDA runtime call: `LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(...), "copying ", n, " B to ", dev)`.
/// The words after the call say what was being done; they are formatted only on failure.
#define LOCKSTEP_CUDA_CHECK(call, ...)                                                                       \
  do {                                                                                                       \
    const cudaError_t lockstep_status_ = (call);                                                             \
    if (lockstep_status_ != cudaSuccess) [[unlikely]] {                                                      \
      ::lockstep::detail::throw_cuda_error(lockstep_status_, #call, LOCKSTEP_SITE,                           \
                                           ::lockstep::detail::message{__VA_ARGS__});                        \
    }                                                                                                        \
  } while (false)

/// For destructors: a failed release is ignored (and the error cleared), never thrown.
#define LOCKSTEP_CUDA_IGNORE(call)                                                                           \
  do {                                                                                                       \
    if ((call) != cudaSuccess) (void)cudaGetLastError();                                                     \
  } while (false)

#endif
