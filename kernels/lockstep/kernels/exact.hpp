// lockstep/kernels/exact.hpp — exact, order-independent sums of floats: the arithmetic of deterministic mode.
//
// A float v is turned into the integer X = round(v * 2^88) (exact for |v| >= 2^-65: every bit of such a float
// is kept), held as three signed 48-bit limbs, X = l2 * 2^96 + l1 * 2^48 + l0. Accumulators add limbs in
// 64-bit integers, which is exact and associative: any order of additions, any split of the terms over
// devices and any all-reduce (integer sums) give the same words. Rounding to a float happens once, at the end,
// to nearest even. A limb of one term is below 2^48 in magnitude, so an accumulator takes at least
// `exact_max_terms` terms before a 64-bit word could overflow.
//
// Non-finite terms are counted in a fourth word (+inf, -inf, NaN in separate bit fields), and so is a finite
// term of magnitude 2^56 or more (the window's top; as the infinity of its sign). The rounded sum is NaN when
// any NaN or infinities of both signs were added, else the infinity that was added: IEEE's sum of those terms.
//
// An accumulator of n elements is exact_words planar arrays of n i64 words: word w of element i at w * n + i
// (so that neighbouring threads touch neighbouring words on a GPU).
#pragma once

#include <cstddef>
#include <cstdint>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"

LOCKSTEP_ABI_BEGIN
namespace kernels {

/// i64 words per accumulated element: three limbs and the non-finite counts.
inline constexpr std::size_t exact_words = 4;
/// Terms an accumulator element takes without a chance of overflow (2^15 - 1: limbs below 2^48 each).
inline constexpr std::int64_t exact_max_terms = 32767;
/// The fixed point: X = v * 2^exact_scale_bits.
inline constexpr int exact_scale_bits = 88;

namespace exact_detail {
inline constexpr int limb_bits = 48;
inline constexpr std::uint64_t limb_mask = (std::uint64_t{1} << limb_bits) - 1u;
// the non-finite counts: +inf in bits 0..20, -inf in 21..41, NaN from 42
inline constexpr std::int64_t positive_infinity = 1;
inline constexpr std::int64_t negative_infinity = std::int64_t{1} << 21;
inline constexpr std::int64_t not_a_number = std::int64_t{1} << 42;
inline constexpr std::int64_t count_mask = (std::int64_t{1} << 21) - 1;

/// The 48-bit piece of m * 2^shift that limb `limb` holds (0 <= m < 2^24).
LOCKSTEP_HD inline std::int64_t limb_of(std::uint64_t m, int shift, int limb) noexcept {
  const int sh = shift - limb * limb_bits;
  std::uint64_t v = 0;
  if (sh >= 0) {
    v = sh < limb_bits ? (m << sh) & limb_mask : 0u;  // bits shifted past 64 belong to higher limbs
  } else {
    v = -sh < 64 ? (m >> -sh) & limb_mask : 0u;
  }
  return static_cast<std::int64_t>(v);
}

LOCKSTEP_HD inline int leading_zeros(std::uint64_t v) noexcept {
#if defined(__CUDA_ARCH__)
  return __clzll(static_cast<long long>(v));
#else
  return v == 0 ? 64 : __builtin_clzll(v);
#endif
}
}  // namespace exact_detail

/// Adds the exact value of `v` to the accumulator words w[0..3] (limbs, non-finite counts).
LOCKSTEP_HD inline void exact_add(float v, std::int64_t* w) noexcept {
  using namespace exact_detail;
  const std::uint32_t bits = detail::float_as_bits(v);
  const bool negative = (bits >> 31) != 0u;
  const std::uint32_t exponent = (bits >> 23) & 0xffu;
  std::uint64_t m = bits & 0x7fffffu;
  if (exponent == 0xffu) {
    w[3] += m != 0u ? not_a_number : (negative ? negative_infinity : positive_infinity);
    return;
  }
  int e = -149;  // v = m * 2^e
  if (exponent != 0u) {
    m |= 0x800000u;
    e = static_cast<int>(exponent) - 150;
  }
  if (m == 0u) return;
  int shift = e + exact_scale_bits;  // X = m * 2^shift
  if (shift > 3 * limb_bits - 24) {  // |v| >= 2^56: above the window
    w[3] += negative ? negative_infinity : positive_infinity;
    return;
  }
  if (shift < 0) {  // below the fixed point's last bit: round to nearest, ties to even
    const int drop = -shift;
    if (drop >= 25) return;  // m * 2^shift < 2^-1: rounds to 0
    const std::uint64_t kept = m >> drop;
    const std::uint64_t dropped = m & ((std::uint64_t{1} << drop) - 1u);
    const std::uint64_t halfway = std::uint64_t{1} << (drop - 1);
    m = kept + ((dropped > halfway || (dropped == halfway && (kept & 1u) != 0u)) ? 1u : 0u);
    shift = 0;
  }
  for (int k = 0; k < 3; ++k) {
    const std::int64_t limb = limb_of(m, shift, k);
    w[k] += negative ? -limb : limb;
  }
}

/// The sum held by accumulator words w[0..3], rounded once to the nearest float (ties to even).
LOCKSTEP_HD inline float exact_round(const std::int64_t* w) noexcept {
  using namespace exact_detail;
  const std::int64_t special = w[3];
  if (special != 0) {
    const std::int64_t pos = special & count_mask, neg = (special >> 21) & count_mask, nan = special >> 42;
    if (nan != 0 || (pos != 0 && neg != 0)) return detail::bits_as_float(0x7fc00000u);
    return detail::bits_as_float(pos != 0 ? 0x7f800000u : 0xff800000u);
  }
  constexpr std::int64_t base = std::int64_t{1} << limb_bits;
  std::int64_t l0 = w[0], l1 = w[1], l2 = w[2];
  auto normalize = [&] {  // l0, l1 into [0, 2^48) (floor division moves the rest up)
    std::int64_t carry = l0 >> limb_bits;  // arithmetic shift: floor
    l0 -= carry * base;
    l1 += carry;
    carry = l1 >> limb_bits;
    l1 -= carry * base;
    l2 += carry;
  };
  normalize();
  const bool negative = l2 < 0;
  if (negative) {
    l0 = -l0;
    l1 = -l1;
    l2 = -l2;
    normalize();  // the magnitude: l2 >= 0 now
  }
  // the magnitude as 192 bits w2:w1:w0
  const auto u0 = static_cast<std::uint64_t>(l0), u1 = static_cast<std::uint64_t>(l1),
             u2 = static_cast<std::uint64_t>(l2);
  const std::uint64_t words[3] = {u0 | (u1 << 48), (u1 >> 16) | (u2 << 32), u2 >> 32};
  int top_word = 2;
  while (top_word >= 0 && words[top_word] == 0u) --top_word;
  if (top_word < 0) return 0.0f;
  const int lead = 63 - leading_zeros(words[top_word]);  // in the top word
  const int p = top_word * 64 + lead;                     // the leading bit's position in X
  // the 64 bits from the leading one down, and whether anything below them is set
  const int sh = 63 - lead;
  std::uint64_t window = words[top_word] << sh;
  bool sticky = false;
  if (top_word > 0) {
    const std::uint64_t below = words[top_word - 1];
    if (sh > 0) window |= below >> (64 - sh);
    sticky = (sh > 0 ? (below << sh) : below) != 0u;
    if (top_word > 1) sticky = sticky || words[0] != 0u;
  }
  std::uint64_t mant = window >> 40;  // 24 bits, the leading one included
  const std::uint64_t rest = window & ((std::uint64_t{1} << 40) - 1u);
  constexpr std::uint64_t halfway = std::uint64_t{1} << 39;
  if (rest > halfway || (rest == halfway && (sticky || (mant & 1u) != 0u))) ++mant;
  int exponent = p - exact_scale_bits;  // of the leading bit
  if (mant == (std::uint64_t{1} << 24)) {
    mant >>= 1;
    ++exponent;
  }
  // X >= 1 and X < 2^160: 2^-88 <= |sum| < 2^72, always a normal float
  const std::uint32_t out = (negative ? 0x80000000u : 0u) | (static_cast<std::uint32_t>(exponent + 127) << 23) |
                            (static_cast<std::uint32_t>(mant) & 0x7fffffu);
  return detail::bits_as_float(out);
}

/// acc (+)= the exact sum over c of partials[c * n + i], for each element i of n: `chunks` arrays of partial
/// sums (T), added to (or, with `overwrite`, written over) the planar accumulator `acc` (exact_words x n).
template <class T>
struct exact_accumulate_op {
  const T* partials;
  std::size_t chunks;
  std::size_t n;
  std::int64_t* acc;
  bool overwrite;
  LOCKSTEP_HD void operator()(std::size_t i) const {
    std::int64_t w[exact_words] = {0, 0, 0, 0};
    if (!overwrite) {
      for (std::size_t k = 0; k < exact_words; ++k) w[k] = acc[k * n + i];
    }
    for (std::size_t c = 0; c < chunks; ++c) exact_add(to_float(partials[c * n + i]), w);
    for (std::size_t k = 0; k < exact_words; ++k) acc[k * n + i] = w[k];
  }
};

/// out[i] = the accumulator's sum for element i, rounded to float once, then to T.
template <class T>
struct exact_round_op {
  const std::int64_t* acc;
  std::size_t n;
  T* out;
  LOCKSTEP_HD void operator()(std::size_t i) const {
    const std::int64_t w[exact_words] = {acc[i], acc[n + i], acc[2 * n + i], acc[3 * n + i]};
    out[i] = convert<T>(exact_round(w));
  }
};

/// y[i] += x[i] on i64 words (accumulators of two devices combined: exact).
struct exact_add_words_op {
  const std::int64_t* x;
  std::int64_t* y;
  LOCKSTEP_HD void operator()(std::size_t i) const { y[i] += x[i]; }
};

}  // namespace kernels
LOCKSTEP_ABI_END
