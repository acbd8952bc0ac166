// lockstep/core/cuda_check.hpp — LOCKSTEP_CUDA_CHECK, for translation units compiled by nvcc.
//
// The one header of core/ that sees CUDA: the check macros belong with the other check macros, and the
// header is empty unless the translation unit is compiled by nvcc.
#pragma once

#include "lockstep/config.hpp"
#include "lockstep/core/error.hpp"

#if LOCKSTEP_HAS_CUDA
#include <cuda_runtime_api.h>

LOCKSTEP_DETAIL_BEGIN

/// Builds "file:line call: cudaErrorX (text) while <what>", clears CUDA's last error, and throws.
template <class... What>
[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, source_site at, What&&... what) {
  (void)cudaGetLastError();  // do not let a later, unrelated check report this error again
  std::string msg = concat(short_file(at.file), ':', at.line, ' ', call_name(call), ": ", cudaGetErrorName(status),
                           " (", cudaGetErrorString(status), ')');
  if constexpr (sizeof...(What) > 0) msg += concat(" while ", std::forward<What>(what)...);
  if (status == cudaErrorMemoryAllocation) throw out_of_memory_error(msg, status);
  throw cuda_error(msg, status);
}

LOCKSTEP_DETAIL_END

/// Checks a CUDA runtime call: `LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(...), "copying ", n, " B to ", dev)`.
/// The words after the call say what was being done; they are formatted only on failure.
#define LOCKSTEP_CUDA_CHECK(call, ...)                                                                       \
  do {                                                                                                       \
    const cudaError_t lockstep_status_ = (call);                                                             \
    if (lockstep_status_ != cudaSuccess) [[unlikely]] {                                                      \
      ::lockstep::detail::throw_cuda_error(lockstep_status_, #call, LOCKSTEP_SITE __VA_OPT__(, ) __VA_ARGS__); \
    }                                                                                                        \
  } while (false)

/// For destructors: a failed release is ignored (and the error cleared), never thrown.
#define LOCKSTEP_CUDA_IGNORE(call)                                                                           \
  do {                                                                                                       \
    if ((call) != cudaSuccess) (void)cudaGetLastError();                                                     \
  } while (false)

#endif
