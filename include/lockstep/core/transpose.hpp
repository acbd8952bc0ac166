// lockstep/core/transpose.hpp — float transposes for host loops: 8 x 8 blocks in AVX2 registers where the CPU runs
// AVX2, a scalar loop elsewhere (data movement only: the same floats either way); and 2x2 max pooling's rows of
// windows in AVX2 registers (comparisons and selections only: the scalar loop's values and indices).
#pragma once

#include <cstddef>
#include <cstdint>

#include "lockstep/config.hpp"
#include "lockstep/core/cpu_features.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define LOCKSTEP_TRANSPOSE_X86 1
#include <immintrin.h>
#else
#define LOCKSTEP_TRANSPOSE_X86 0
#endif

LOCKSTEP_DETAIL_BEGIN

#if LOCKSTEP_TRANSPOSE_X86
/// t[j] = column j of the 8 x 8 matrix whose rows are r[0..7].
__attribute__((target("avx2"))) inline void transpose_8x8(const __m256 (&r)[8], __m256 (&t)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
  t[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  t[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  t[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  t[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  t[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  t[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  t[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  t[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/// transpose_floats with AVX2: 8 x 8 blocks through registers, the edges element by element.
__attribute__((target("avx2"))) inline void transpose_floats_avx2(const float* src, std::size_t rows,
                                                                  std::size_t cols, float* dst) {
  const std::size_t r8 = rows / 8 * 8, c8 = cols / 8 * 8;
  for (std::size_t r0 = 0; r0 < r8; r0 += 8) {
    for (std::size_t c0 = 0; c0 < c8; c0 += 8) {
      __m256 r[8], t[8];
      for (std::size_t i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + (r0 + i) * cols + c0);
      transpose_8x8(r, t);
      for (std::size_t j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (c0 + j) * rows + r0, t[j]);
    }
    for (std::size_t r = r0; r < r0 + 8; ++r) {
      for (std::size_t c = c8; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
    }
  }
  for (std::size_t r = r8; r < rows; ++r) {
    for (std::size_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  }
}
#endif

#if LOCKSTEP_TRANSPOSE_X86
/// The even and the odd floats of lo (floats 0..7) and hi (8..15).
__attribute__((target("avx2"))) inline void split_even_odd(__m256 lo, __m256 hi, __m256& even, __m256& odd) {
  even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xd8));
  odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xdd)), 0xd8));
}

/// Where v > best or v is NaN (max pooling's rule): best = v and index = candidate.
__attribute__((target("avx2"))) inline void take_larger_or_nan(__m256 v, __m256i candidate, __m256& best,
                                                               __m256i& index) {
  const __m256 take = _mm256_or_ps(_mm256_cmp_ps(v, best, _CMP_GT_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  best = _mm256_blendv_ps(best, v, take);
  index = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(index), _mm256_castsi256_ps(candidate), take));
}

/// take_larger_or_nan for four windows.
__attribute__((target("avx2"))) inline void take_larger_or_nan(__m128 v, __m128i candidate, __m128& best,
                                                               __m128i& index) {
  const __m128 take = _mm_or_ps(_mm_cmp_ps(v, best, _CMP_GT_OQ), _mm_cmp_ps(v, v, _CMP_UNORD_Q));
  best = _mm_blendv_ps(best, v, take);
  index = _mm_castps_si128(_mm_blendv_ps(_mm_castsi128_ps(index), _mm_castsi128_ps(candidate), take));
}

/// The windows of max_pool_2x2_row_avx2 from ox on, `Lanes` (8 or 4) of them: each row's 2 x Lanes floats loaded
/// whole, the results stored whole.
template <int Lanes>
__attribute__((target("avx2"))) inline void max_pool_2x2_windows(const float* r0, const float* r1, std::size_t ox,
                                                                 std::int32_t top, std::int32_t w, float* y,
                                                                 std::int32_t* at) {
  const float* p0 = r0 + 2 * ox;
  const float* p1 = r1 + 2 * ox;
  const auto first = top + 2 * static_cast<std::int32_t>(ox);  // the plane index of window ox's first value
  if constexpr (Lanes == 8) {
    __m256 a, b, c, d;
    split_even_odd(_mm256_loadu_ps(p0), _mm256_loadu_ps(p0 + 8), a, b);
    split_even_odd(_mm256_loadu_ps(p1), _mm256_loadu_ps(p1 + 8), c, d);
    const __m256i index0 = _mm256_add_epi32(_mm256_set1_epi32(first), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    __m256 best = a;
    __m256i index = index0;
    take_larger_or_nan(b, _mm256_add_epi32(index0, _mm256_set1_epi32(1)), best, index);
    take_larger_or_nan(c, _mm256_add_epi32(index0, _mm256_set1_epi32(w)), best, index);
    take_larger_or_nan(d, _mm256_add_epi32(index0, _mm256_set1_epi32(w + 1)), best, index);
    _mm256_storeu_ps(y + ox, best);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + ox), index);
  } else {
    static_assert(Lanes == 4);
    const __m128 lo0 = _mm_loadu_ps(p0), hi0 = _mm_loadu_ps(p0 + 4), lo1 = _mm_loadu_ps(p1), hi1 = _mm_loadu_ps(p1 + 4);
    const __m128i index0 = _mm_add_epi32(_mm_set1_epi32(first), _mm_setr_epi32(0, 2, 4, 6));
    __m128 best = _mm_shuffle_ps(lo0, hi0, 0x88);
    __m128i index = index0;
    take_larger_or_nan(_mm_shuffle_ps(lo0, hi0, 0xdd), _mm_add_epi32(index0, _mm_set1_epi32(1)), best, index);
    take_larger_or_nan(_mm_shuffle_ps(lo1, hi1, 0x88), _mm_add_epi32(index0, _mm_set1_epi32(w)), best, index);
    take_larger_or_nan(_mm_shuffle_ps(lo1, hi1, 0xdd), _mm_add_epi32(index0, _mm_set1_epi32(w + 1)), best, index);
    _mm_storeu_ps(y + ox, best);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at + ox), index);
  }
}

/// 2x2 max pooling of stride 2 without padding, one output row of ow >= 4 windows: for ox < ow, the window
/// r0[2ox], r0[2ox + 1], r1[2ox], r1[2ox + 1] (in that order; plane indices top + 2ox, + 1, + w, + w + 1) gives
/// y[ox] = its first maximum, or its last NaN, and at[ox] that value's plane index: the comparisons of the scalar
/// loop (kernels::max_pool_forward_op), so the same values and indices. Eight windows a step (four when the row has
/// fewer than eight), with whole loads and stores: the last step ends at the row's end, computing again (the same
/// values) the windows it shares with the one before. (Masked loads and stores, which AMD's Zen runs in microcode,
/// made this loop twice as slow there; rows of fewer than four windows take the scalar loop.)
__attribute__((target("avx2"))) inline void max_pool_2x2_row_avx2(const float* r0, const float* r1, std::size_t ow,
                                                                  std::int32_t top, std::int32_t w, float* y,
                                                                  std::int32_t* at) {
  if (ow >= 8) {
    for (std::size_t ox = 0; ox < ow; ox += 8) max_pool_2x2_windows<8>(r0, r1, ox + 8 <= ow ? ox : ow - 8, top, w, y, at);
    return;
  }
  for (std::size_t ox = 0; ox < ow; ox += 4) max_pool_2x2_windows<4>(r0, r1, ox + 4 <= ow ? ox : ow - 4, top, w, y, at);
}
#endif

/// Whether max_pool_2x2_row_avx2 runs on this CPU, for rows of `ow` windows.
inline bool max_pool_2x2_row_available(std::size_t ow) noexcept {
#if LOCKSTEP_TRANSPOSE_X86
  return ow >= 4 && cpu_has_avx2();
#else
  return false;
#endif
}

/// dst[c * rows + r] = src[r * cols + c]: the [cols, rows] transpose of the row-major [rows, cols] matrix src
/// (which dst does not overlap).
inline void transpose_floats(const float* src, std::size_t rows, std::size_t cols, float* dst) {
#if LOCKSTEP_TRANSPOSE_X86
  if (cpu_has_avx2()) return transpose_floats_avx2(src, rows, cols, dst);
#endif
  constexpr std::size_t block = 8;  // elsewhere element by element, in blocks that keep both sides in the cache
  for (std::size_t r0 = 0; r0 < rows; r0 += block) {
    const std::size_t r1 = r0 + block < rows ? r0 + block : rows;
    for (std::size_t c0 = 0; c0 < cols; c0 += block) {
      const std::size_t c1 = c0 + block < cols ? c0 + block : cols;
      for (std::size_t c = c0; c < c1; ++c) {
        for (std::size_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * cols + c];
      }
    }
  }
}

LOCKSTEP_DETAIL_END
