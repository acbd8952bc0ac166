// lockstep/config.hpp — compile-time configuration shared by every header.
//
// A translation unit compiled by nvcc carries both backends (`cuda` and `host`); one compiled by a plain
// C++ compiler carries the host backend only. The two configurations differ in what the same header
// declares, so everything that depends on the configuration lives in an inline namespace named after it
// (`lockstep::cuda_v0` or `lockstep::host_v0`, with `_dnnl` appended when host GEMMs may run on oneDNN). Both
// kinds of translation unit can therefore be linked into one program without violating the one-definition rule. The vocabulary types that do not depend on the
// configuration (errors, dtypes, shapes, `device`) and the host platform (virtual devices, their memory and
// stream workers) live directly in `lockstep` and are shared by both.
#pragma once

#define LOCKSTEP_VERSION_MAJOR 0
#define LOCKSTEP_VERSION_MINOR 1
#define LOCKSTEP_VERSION_PATCH 0

// oneDNN (Debian's libdnnl-dev) for host GEMMs: set to 1 by lockstep's CMake package when it found oneDNN (the
// program then links it); without it host GEMMs run on OpenBLAS alone (blas/host_kernels.hpp).
#ifndef LOCKSTEP_HAS_ONEDNN
#define LOCKSTEP_HAS_ONEDNN 0
#endif

#if defined(__CUDACC__)
#define LOCKSTEP_HAS_CUDA 1
#define LOCKSTEP_HD __host__ __device__
#define LOCKSTEP_DEVICE __device__
#if LOCKSTEP_HAS_ONEDNN
#define LOCKSTEP_ABI_NAMESPACE cuda_v0_dnnl
#else
#define LOCKSTEP_ABI_NAMESPACE cuda_v0
#endif
#else
#define LOCKSTEP_HAS_CUDA 0
#define LOCKSTEP_HD
#define LOCKSTEP_DEVICE
#if LOCKSTEP_HAS_ONEDNN
#define LOCKSTEP_ABI_NAMESPACE host_v0_dnnl
#else
#define LOCKSTEP_ABI_NAMESPACE host_v0
#endif
#endif

// Opens/closes the configuration-dependent namespace `lockstep::<abi>`.
#define LOCKSTEP_ABI_BEGIN                                                                                   \
  namespace lockstep {                                                                                       \
  inline namespace LOCKSTEP_ABI_NAMESPACE {
#define LOCKSTEP_ABI_END                                                                                     \
  }                                                                                                          \
  }

// Opens/closes the configuration-dependent internals, `lockstep::detail::<abi>`. Internals of configuration-
// dependent code go here, never into a `detail` namespace nested in `lockstep::<abi>`: that would make every
// `lockstep::detail::x` ambiguous between the shared `lockstep::detail` and the inline one.
#define LOCKSTEP_DETAIL_BEGIN                                                                                \
  namespace lockstep::detail {                                                                               \
  inline namespace LOCKSTEP_ABI_NAMESPACE {
#define LOCKSTEP_DETAIL_END                                                                                  \
  }                                                                                                          \
  }

// Kernels get hidden visibility so that two shared objects built from these headers never share a kernel
// symbol (CUB and CUTLASS do the same).
#if defined(__GNUC__)
#define LOCKSTEP_HIDDEN __attribute__((visibility("hidden")))
#else
#define LOCKSTEP_HIDDEN
#endif
