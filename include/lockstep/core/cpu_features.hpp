// lockstep/core/cpu_features.hpp — what the host CPU runs, asked once, for the host loops that pick an instruction
// set at run time (a program built for baseline x86-64 still uses AVX2 where the CPU has it).
#pragma once

#include "lockstep/config.hpp"

LOCKSTEP_DETAIL_BEGIN

/// True when the CPU (and the OS, for the registers) runs AVX2; false off x86 and under other compilers.
inline bool cpu_has_avx2() noexcept {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx2") != 0;
  return yes;
#else
  return false;
#endif
}

/// True when the CPU (and the OS) runs AVX-512 F, BW, DQ and VL (the host loops' AVX-512 copies); false off x86
/// and under other compilers.
inline bool cpu_has_avx512() noexcept {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512bw") != 0 &&
                          __builtin_cpu_supports("avx512dq") != 0 && __builtin_cpu_supports("avx512vl") != 0;
  return yes;
#else
  return false;
#endif
}

LOCKSTEP_DETAIL_END
