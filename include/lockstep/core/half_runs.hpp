// lockstep/core/half_runs.hpp — fp16/bf16 <-> fp32 conversion of whole runs of elements on the host, fast.
//
// Host loops that convert many elements at once (the fp16/bf16 GEMM's operand blocks, the optimizer's working
// copy, the data loader's input rows) use these instead of converting element by element: on x86 with AVX2 and
// F16C they run 8 lanes at a time with the hardware's own half conversions, chosen at run time; elsewhere
// they are the portable branch-free loops of core/half.hpp. Both give the bits of core/half.hpp's scalar
// conversions (tests/test_blas.cpp compares them over every half and a dense sweep of floats).
#pragma once

#include <cstddef>
#include <cstdint>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"

// Define LOCKSTEP_BLAS_X86_SIMD=0 to use the portable code only.
#if !defined(LOCKSTEP_BLAS_X86_SIMD)
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define LOCKSTEP_BLAS_X86_SIMD 1
#else
#define LOCKSTEP_BLAS_X86_SIMD 0
#endif
#endif
#if LOCKSTEP_BLAS_X86_SIMD
#include <cpuid.h>
#include <immintrin.h>
#endif

LOCKSTEP_DETAIL_BEGIN

// ---- conversions the compiler can vectorize ----------------------------------------------------------------
//
// core/half.hpp's host conversions are written without branches (every case computed, one selected), so the
// fixed-length inner loops below become SIMD code even at -O2.

/// The value of a half or bfloat16 as a float (core/half.hpp's branch-free conversion).
template <class T>
inline float widen_value(T x) noexcept {
  return to_float(x);
}

/// A float rounded to T (core/half.hpp's branch-free conversion).
template <class T>
inline T narrow_value(float f) noexcept {
  return convert<T>(f);
}

// Loops run in chunks of a fixed length: a loop whose trip count is a known multiple of the vector width is
// vectorized by GCC's default cost model at -O2, an open-ended one is not.
inline constexpr std::int64_t conversion_chunk = 16;

/// dst[i] = float(src[i]) for i < n (portable code).
template <class T>
void widen_run_portable(const T* __restrict src, float* __restrict dst, std::int64_t n) noexcept {
  const std::int64_t full = n - n % conversion_chunk;
  for (std::int64_t i = 0; i < full; i += conversion_chunk) {
    for (std::int64_t l = 0; l < conversion_chunk; ++l) dst[i + l] = widen_value(src[i + l]);
  }
  for (std::int64_t i = full; i < n; ++i) dst[i] = widen_value(src[i]);
}

/// c[i] = T(alpha * acc[i] + beta * float(c[i])) for i < n; c is not read when beta == 0 (portable code).
template <class T>
void store_run_portable(const float* __restrict acc, T* __restrict c, std::int64_t n, float alpha,
                        float beta) noexcept {
  const std::int64_t full = n - n % conversion_chunk;
  if (beta == 0.0f) {
    for (std::int64_t i = 0; i < full; i += conversion_chunk) {
      for (std::int64_t l = 0; l < conversion_chunk; ++l) c[i + l] = narrow_value<T>(alpha * acc[i + l]);
    }
    for (std::int64_t i = full; i < n; ++i) c[i] = narrow_value<T>(alpha * acc[i]);
    return;
  }
  for (std::int64_t i = 0; i < full; i += conversion_chunk) {
    for (std::int64_t l = 0; l < conversion_chunk; ++l) {
      c[i + l] = narrow_value<T>(alpha * acc[i + l] + beta * widen_value(c[i + l]));
    }
  }
  for (std::int64_t i = full; i < n; ++i) c[i] = narrow_value<T>(alpha * acc[i] + beta * widen_value(c[i]));
}

#if LOCKSTEP_BLAS_X86_SIMD
// x86 with AVX2 and F16C (every x86 CPU since 2013): the same conversions 8 lanes at a time, the half ones
// by the hardware's own instructions (vcvtph2ps, and vcvtps2ph rounding to nearest even). Built for the
// baseline x86-64 (SSE2), the portable code costs 0.8 ns per half widened and 1.8-3.4 ns per half rounded
// and stored; these cost 0.2-0.4 ns, which is what keeps the fp16 GEMM near the speed of the fp32 one.
// Chosen at run time (see has_avx2_f16c), so a program built for the baseline still uses them. The results
// are the same bits as the portable code, NaNs included.

inline bool has_avx2_f16c() noexcept {
  static const bool yes = [] {
    // F16C from CPUID leaf 1 (ECX bit 29): __builtin_cpu_supports("f16c") is unknown to clang before 15.
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0 || (c & (1u << 29)) == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return yes;
}

/// 8 halves (their bits) as floats.
__attribute__((target("avx2,f16c"))) inline __m256 widen_halves(__m128i h) noexcept {
  const __m256 x = _mm256_cvtph_ps(h);
  // Every NaN becomes 0x7fffffff, as core/half.hpp and CUDA's __half2float make it (vcvtph2ps keeps the payload
  // and sign): fp32 values computed from it, such as master weights, keep the same bits as on a GPU.
  return _mm256_blendv_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
__attribute__((target("avx2,f16c"))) inline __m256 widen8(const half* src) noexcept {
  return widen_halves(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
__attribute__((target("avx2,f16c"))) inline __m256 widen8(const bfloat16* src) noexcept {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}

/// Rounds 8 floats to half (nearest even; NaN -> 0x7fff) and stores them.
__attribute__((target("avx2,f16c"))) inline void narrow8(__m256 x, half* dst) noexcept {
  __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x7c00));
  h = _mm_or_si128(_mm_andnot_si128(nan, h), _mm_and_si128(nan, _mm_set1_epi16(0x7fff)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
}
/// 8 floats rounded to bfloat16 (nearest even; NaN -> 0x7fff), like float_to_bfloat16_bits: each lane's low 16 bits.
__attribute__((target("avx2,f16c"))) inline __m256i bfloat16_lanes(__m256 x) noexcept {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(mag, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32(0x7fff)), lsb), 16);
  r = _mm256_or_si256(r, _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x8000)));
  const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fff), nan);
}
/// Rounds 8 floats to bfloat16 (bfloat16_lanes) and stores them.
__attribute__((target("avx2,f16c"))) inline void narrow8(__m256 x, bfloat16* dst) noexcept {
  const __m256i r = bfloat16_lanes(x);
  // Every lane is <= 0xffff, so the saturating pack is exact; it packs within 128-bit halves, so the
  // 64-bit quarters are put back in order afterwards.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}

template <class T>
__attribute__((target("avx2,f16c"))) void widen_run_avx2(const T* __restrict src, float* __restrict dst,
                                                         std::int64_t n) noexcept {
  // Bounds computed once (not `i + 8 <= n`): GCC cannot prove the tail loop finite otherwise and rejects it
  // under -Werror=aggressive-loop-optimizations.
  const std::int64_t n8 = n - n % 8;
  for (std::int64_t i = 0; i < n8; i += 8) _mm256_storeu_ps(dst + i, widen8(src + i));
  for (std::int64_t i = n8; i < n; ++i) dst[i] = widen_value(src[i]);
}

template <class T>
__attribute__((target("avx2,f16c"))) void store_run_avx2(const float* __restrict acc, T* __restrict c, std::int64_t n,
                                                         float alpha, float beta) noexcept {
  const __m256 a = _mm256_set1_ps(alpha), b = _mm256_set1_ps(beta);
  const std::int64_t n8 = n - n % 8;
  if (beta == 0.0f) {
    for (std::int64_t i = 0; i < n8; i += 8) narrow8(_mm256_mul_ps(a, _mm256_loadu_ps(acc + i)), c + i);
    for (std::int64_t i = n8; i < n; ++i) c[i] = narrow_value<T>(alpha * acc[i]);
    return;
  }
  // alpha * acc + beta * c as two products and a sum, as the portable code computes it (no FMA).
  for (std::int64_t i = 0; i < n8; i += 8) {
    narrow8(_mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(acc + i)), _mm256_mul_ps(b, widen8(c + i))), c + i);
  }
  for (std::int64_t i = n8; i < n; ++i) c[i] = narrow_value<T>(alpha * acc[i] + beta * widen_value(c[i]));
}
/// widen8(narrow8(x)) without the round trip through memory: 8 floats rounded to T and widened back.
__attribute__((target("avx2,f16c"))) inline __m256 round8(__m256 x, const half*) noexcept {
  // (vcvtps2ph keeps a NaN a NaN; narrow8's 0x7fff widens to 0x7fffffff, as widen_halves makes every NaN)
  return widen_halves(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
__attribute__((target("avx2,f16c"))) inline __m256 round8(__m256 x, const bfloat16*) noexcept {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bfloat16_lanes(x), 16));
}

template <class T>
__attribute__((target("avx2,f16c"))) void round_run_avx2(const float* __restrict src, float* __restrict dst,
                                                         std::int64_t n) noexcept {
  const std::int64_t n8 = n - n % 8;
  for (std::int64_t i = 0; i < n8; i += 8) {
    _mm256_storeu_ps(dst + i, round8(_mm256_loadu_ps(src + i), static_cast<const T*>(nullptr)));
  }
  for (std::int64_t i = n8; i < n; ++i) dst[i] = widen_value(narrow_value<T>(src[i]));
}
#endif

/// dst[i] = float(src[i]) for i < n.
template <class T>
void widen_run(const T* src, float* dst, std::int64_t n) noexcept {
#if LOCKSTEP_BLAS_X86_SIMD
  if (has_avx2_f16c()) return widen_run_avx2(src, dst, n);
#endif
  widen_run_portable(src, dst, n);
}

/// c[i] = T(alpha * acc[i] + beta * float(c[i])) for i < n; c is not read when beta == 0.
template <class T>
void store_run(const float* acc, T* c, std::int64_t n, float alpha, float beta) noexcept {
#if LOCKSTEP_BLAS_X86_SIMD
  if (has_avx2_f16c()) return store_run_avx2(acc, c, n, alpha, beta);
#endif
  store_run_portable(acc, c, n, alpha, beta);
}

/// dst[i] = T(src[i]) for i < n, rounded to nearest even.
template <class T>
void narrow_run(const float* src, T* dst, std::int64_t n) noexcept {
  store_run(src, dst, n, 1.0f, 0.0f);  // 1 * x is x, exactly
}

/// dst[i] = float(T(src[i])) for i < n: each float rounded to T (nearest even; NaN as narrow_run makes it) and
/// widened back, the values narrow_run then widen_run give, without a T array in between.
template <class T>
void round_run(const float* src, float* dst, std::int64_t n) noexcept {
#if LOCKSTEP_BLAS_X86_SIMD
  if (has_avx2_f16c()) return round_run_avx2<T>(src, dst, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) dst[i] = widen_value(narrow_value<T>(src[i]));
}

/// Elements per block of the host loops that convert runs through fp32 arrays on the stack (2 KiB each).
inline constexpr std::size_t run_block = 512;

/// f(begin, count) for the blocks [begin, begin + count) of [0, n), in order, each at most run_block long.
template <class F>
void for_each_run_block(std::size_t n, F&& f) {
  for (std::size_t begin = 0; begin < n; begin += run_block) f(begin, n - begin < run_block ? n - begin : run_block);
}

LOCKSTEP_DETAIL_END
