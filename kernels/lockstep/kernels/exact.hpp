// lockstep/kernels/exact.hpp — exact, order-independent sums of floats: the arithmetic of deterministic mode.
//
// A float term v is turned into the integer X = round(v * 2^60), held as two signed limbs X = hi * 2^46 + lo
// (|hi| <= 2^46, |lo| <= 2^45). X keeps every bit of v when |v| >= 2^-37 (smaller terms are rounded to a
// multiple of 2^-60, about 8.7e-19: each term on its own, so the same way wherever it is added). Accumulators
// add limbs in 64-bit integers, which is exact and associative: any order of additions, any split of the terms
// over devices and any all-reduce (integer sums) give the same words. The sum is rounded to a float once, at
// the end, to nearest even. An accumulator element takes exact_max_terms terms before a word could overflow.
//
// A term that is not finite, or of magnitude 2^32 or more (outside the window), is counted in the accumulator's
// last word, one per tensor: a tensor that received any such term rounds to NaN in every element (a step with
// a non-finite gradient is skipped by the loss scaler, and diverges in f32, either way).
//
// An accumulator of a tensor of n elements is exact_words(n) i64 words: the hi limbs [0, n), the lo limbs
// [n, 2n) (planar, so that neighbouring GPU threads touch neighbouring words), then the count at 2n.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/half_runs.hpp"

// The arithmetic relies on IEEE rounding of every operation: -ffast-math would drop the error terms of the
// two-sums and the rounding of the magic-number steps, and the sums would silently stop being exact.
#if defined(__FAST_MATH__)
#error "lockstep/kernels/exact.hpp (deterministic mode) needs IEEE arithmetic: compile without -ffast-math"
#endif

LOCKSTEP_ABI_BEGIN
namespace kernels {

/// i64 words of the accumulator of a tensor of n elements: two limbs per element and the count of terms
/// outside the window.
LOCKSTEP_HD constexpr std::size_t exact_words(std::size_t n) noexcept { return 2 * n + 1; }
/// Terms an accumulator element takes without a chance of overflow (2^17 - 1: limbs of at most 2^46).
inline constexpr std::int64_t exact_max_terms = 131071;
/// The fixed point: X = v * 2^exact_scale_bits.
inline constexpr int exact_scale_bits = 60;

namespace exact_detail {
inline constexpr int limb_bits = 46;

LOCKSTEP_HD inline int leading_zeros(std::uint64_t v) noexcept {
#if defined(__CUDA_ARCH__)
  return __clzll(static_cast<long long>(v));
#else
  return v == 0 ? 64 : __builtin_clzll(v);
#endif
}

/// 1.5 * 2^52: for |y| < 2^51, y + magic rounds y to an integer (to nearest even) held in the low bits of the
/// sum's representation (no float-to-integer conversion, which x86 cannot vectorize before AVX-512).
inline constexpr double round_magic = 6755399441055744.0;

/// The integer y held by t = y + round_magic. The subtraction is unsigned: for a t outside the trick's range
/// (a term outside the window, masked afterwards) a signed one could overflow.
LOCKSTEP_HD inline std::int64_t magic_integer(double t) noexcept {
  return static_cast<std::int64_t>(static_cast<std::uint64_t>(detail::double_as_bits(t)) -
                                   static_cast<std::uint64_t>(detail::double_as_bits(round_magic)));
}

/// The limbs of s * 2^60 = hi * 2^46 + lo for an s with at most 24 significant bits from 2^-60 up (a term) or an
/// exact double sum (double_sum_is_exact), below 2^36 in magnitude.
LOCKSTEP_HD inline void limbs_of_sum(double s, std::int64_t& hi, std::int64_t& lo) noexcept {
  const double x = s * 0x1p60;                       // exact (a power-of-two scale), below 2^96
  const double th = x * 0x1p-46 + round_magic;       // hi = round(x / 2^46), below 2^50
  const double r = x - (th - round_magic) * 0x1p46;  // exact (x's bits minus its top ones), |r| <= 2^45
  hi = magic_integer(th);
  lo = magic_integer(r + round_magic);  // r, with a term's fraction below 2^-60 rounded to nearest even
}

/// One term: X = round(v * 2^60) = hi * 2^46 + lo, and 1 when the term is outside the window (then the limbs are
/// 0), else 0. Branch-free, so that the host loop vectorizes it.
LOCKSTEP_HD inline void exact_term(float v, std::int64_t& hi, std::int64_t& lo, std::int64_t& outside) noexcept {
  const std::uint32_t magnitude = detail::float_as_bits(v) & 0x7fffffffu;
  const bool out = magnitude >= 0x4f800000u;  // |v| >= 2^32, an infinity or a NaN
  // The arithmetic runs for every term (an infinity or a NaN cannot trap), and the limbs are masked afterwards:
  // with a select before it GCC moves the arithmetic into a branch, which does not vectorize. Below 2^-60 the
  // last step rounds the fraction: ties to even, as hi * 2^46 is even.
  std::int64_t h = 0, l = 0;
  limbs_of_sum(static_cast<double>(v), h, l);
  const std::int64_t keep = static_cast<std::int64_t>(out) - 1;  // all ones inside the window, else 0
  hi = h & keep;
  lo = l & keep;
  outside = static_cast<std::int64_t>(out);
}

/// The common case of rounding hi * 2^46 + lo (times 2^-60), branch-free: when both limbs are below 2^51 and the
/// sum has at most 53 significant bits (an exact double), `out` is the sum rounded once, and the result true;
/// else false (exact_round_limbs' integer path then gives the answer). Both paths give the correctly rounded
/// sum, so they agree bit for bit.
LOCKSTEP_HD inline bool round_limbs_double(std::int64_t hi, std::int64_t lo, float& out) noexcept {
  constexpr std::int64_t limit = std::int64_t{1} << 51;
  const std::int64_t magic_bits = detail::double_as_bits(round_magic);
  // bitwise &, and masks rather than selects: no branches in the loop that vectorizes this
  const bool small = (hi > -limit) & (hi < limit) & (lo > -limit) & (lo < limit);
  const std::int64_t keep = -static_cast<std::int64_t>(small);
  const double h = (detail::bits_as_double(magic_bits + (hi & keep)) - round_magic) * 0x1p46;  // exact
  const double l = detail::bits_as_double(magic_bits + (lo & keep)) - round_magic;             // exact
  const double s = h + l;  // s + e = h + l exactly (an error-free sum)
  const double z = s - h;
  const double e = (h - (s - z)) + (l - z);
  out = static_cast<float>(s * 0x1p-60);
  return small & (e == 0.0);
}

/// hi * 2^46 + lo (any limbs), times 2^-60, rounded once to the nearest float (ties to even): integer arithmetic.
LOCKSTEP_HD inline float round_limbs_integer(std::int64_t hi, std::int64_t lo) noexcept {
  constexpr std::int64_t base = std::int64_t{1} << limb_bits;
  auto normalize = [&] {  // lo into [0, 2^46), the rest into hi (arithmetic shift: floor)
    const std::int64_t carry = lo >> limb_bits;
    lo -= carry * base;
    hi += carry;
  };
  normalize();
  const bool negative = hi < 0;
  if (negative) {
    hi = -hi;
    lo = -lo;
    normalize();  // the magnitude: hi >= 0
  }
  // the magnitude as 128 bits words[1]:words[0]
  const auto uh = static_cast<std::uint64_t>(hi), ul = static_cast<std::uint64_t>(lo);
  const std::uint64_t words[2] = {ul | (uh << limb_bits), uh >> (64 - limb_bits)};
  const int top = words[1] != 0u ? 1 : 0;
  if (words[top] == 0u) return 0.0f;
  const int lead = 63 - leading_zeros(words[top]);
  const int p = top * 64 + lead;  // the leading bit's position
  const int sh = 63 - lead;
  std::uint64_t window = words[top] << sh;  // 64 bits from the leading one down
  bool sticky = false;                      // anything set below them
  if (top == 1) {
    if (sh > 0) window |= words[0] >> (64 - sh);
    sticky = (sh > 0 ? (words[0] << sh) : words[0]) != 0u;
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
  // 2^-60 <= |sum| < 2^49 (at most exact_max_terms terms below 2^32): a normal float
  const std::uint32_t out = (negative ? 0x80000000u : 0u) | (static_cast<std::uint32_t>(exponent + 127) << 23) |
                            (static_cast<std::uint32_t>(mant) & 0x7fffffu);
  return detail::bits_as_float(out);
}
}  // namespace exact_detail

/// Adds the exact value of `v` to an element's limbs, and 1 to `outside` for a term outside the window.
LOCKSTEP_HD inline void exact_add(float v, std::int64_t& hi, std::int64_t& lo, std::int64_t& outside) noexcept {
  std::int64_t h = 0, l = 0, o = 0;
  exact_detail::exact_term(v, h, l, o);
  hi += h;
  lo += l;
  outside += o;
}

/// The sum held by an element's limbs, rounded once to the nearest float (ties to even); NaN when its tensor's
/// count of terms outside the window is not 0.
LOCKSTEP_HD inline float exact_round(std::int64_t hi, std::int64_t lo, std::int64_t outside) noexcept {
  if (outside != 0) return detail::bits_as_float(0x7fc00000u);
  float out = 0.0f;
  return exact_detail::round_limbs_double(hi, lo, out) ? out : exact_detail::round_limbs_integer(hi, lo);
}

namespace exact_detail {
/// Adds `count` to the tensor's count word (rare: only terms outside the window).
LOCKSTEP_HD inline void add_outside(std::int64_t* count, std::int64_t v) noexcept {
#if defined(__CUDA_ARCH__)
  atomicAdd(reinterpret_cast<unsigned long long*>(count), static_cast<unsigned long long>(v));
#else
  __atomic_fetch_add(count, v, __ATOMIC_RELAXED);
#endif
}

/// ceil(log2(c)) for c >= 1.
LOCKSTEP_HD constexpr int ceil_log2(std::size_t c) noexcept {
  int l = 0;
  while ((std::size_t{1} << l) < c) ++l;
  return l;
}

/// The fast path of a sum of 2^log2_terms terms or fewer, whose largest exponent field is emax and smallest
/// among the non-zero terms emin (255 when all are zero): true when their sum in doubles, in any order, is exact
/// (every partial sum is a multiple of the smallest term's last bit below 2^53 of them), a multiple of 2^-60
/// (no term is rounded by the fixed point) and below 2^36 (its limbs come from the round_magic steps). Then the
/// double sum is the exact sum, and its rounding to float is the same as exact_round's.
LOCKSTEP_HD inline bool double_sum_is_exact(std::int32_t emax, std::int32_t emin, int log2_terms) noexcept {
  // every term inside the window (as exact_term: below 2^32, else it is counted, whichever path it takes)
  return (emin >= 90) & (emax <= 158) & (emax - emin <= 29 - log2_terms) & (emax + log2_terms <= 162);
}

/// The exponent field of a term, and that of a non-zero term (255 for zero), for double_sum_is_exact.
LOCKSTEP_HD inline std::int32_t exponent_field(float v) noexcept {
  return static_cast<std::int32_t>((detail::float_as_bits(v) >> 23) & 0xffu);
}
LOCKSTEP_HD inline std::int32_t nonzero_exponent_field(float v) noexcept {
  const std::uint32_t u = detail::float_as_bits(v);
  return (u & 0x7fffffffu) != 0u ? static_cast<std::int32_t>((u >> 23) & 0xffu) : 255;
}

/// The exact sum of element i's `chunks` terms partials[c * n + i], as limbs and a count of terms outside the
/// window: the fast double path when it applies, else term by term.
template <class T>
LOCKSTEP_HD inline void sum_terms(const T* partials, std::size_t chunks, std::size_t n, std::size_t i, std::int64_t& hi,
                                  std::int64_t& lo, std::int64_t& outside, double& fast_sum, bool& fast) noexcept {
  std::int32_t emax = 0, emin = 255;
  double s = 0.0;
  for (std::size_t c = 0; c < chunks; ++c) {
    const float v = to_float(partials[c * n + i]);
    emax = emax > exponent_field(v) ? emax : exponent_field(v);
    emin = emin < nonzero_exponent_field(v) ? emin : nonzero_exponent_field(v);
    s += static_cast<double>(v);
  }
  fast = double_sum_is_exact(emax, emin, ceil_log2(chunks));
  fast_sum = s;
  hi = lo = outside = 0;
  if (fast) {
    limbs_of_sum(s, hi, lo);
  } else {
    for (std::size_t c = 0; c < chunks; ++c) exact_add(to_float(partials[c * n + i]), hi, lo, outside);
  }
}

/// The host loops' block: the double sums of elements [b0, b0 + len) and whether each is exact, vectorized.
/// Float terms are read in place four at a time: each element's running state is stored once per four terms, the
/// first four write it, and a last group of fewer than four is padded with zeros, which change neither a sum (the
/// running sum starts from +0, as the exact sum of zeros is) nor the exponents. f16 and bf16 terms are widened one
/// term at a time (their code is compiled three times as often; four terms at a time made every file that includes
/// lockstep 10% slower to compile). The double sums' order does not matter: where the fast path applies they are
/// exact in any order, and elsewhere they are not used. Term c's element i is term(c)[i].
template <class T, std::size_t Block, class Term>
inline void block_double_sums(Term term, std::size_t terms, std::size_t b0, std::size_t len, double* sums,
                              std::uint8_t* fast, bool& all_fast) noexcept {
  alignas(64) std::int32_t emax[Block], emin[Block];
  if constexpr (std::is_same_v<T, float>) {
    static constexpr float zeros[Block] = {};
    const auto terms_of = [&](std::size_t c) -> const float* { return c < terms ? term(c) + b0 : zeros; };
    const auto add_group = [&]<bool First>(std::size_t c) {
      const float* __restrict x0 = terms_of(c);
      const float* __restrict x1 = terms_of(c + 1);
      const float* __restrict x2 = terms_of(c + 2);
      const float* __restrict x3 = terms_of(c + 3);
      for (std::size_t j = 0; j < len; ++j) {
        const std::int32_t e0 = exponent_field(x0[j]), e1 = exponent_field(x1[j]), e2 = exponent_field(x2[j]),
                           e3 = exponent_field(x3[j]);
        const std::int32_t z0 = nonzero_exponent_field(x0[j]), z1 = nonzero_exponent_field(x1[j]),
                           z2 = nonzero_exponent_field(x2[j]), z3 = nonzero_exponent_field(x3[j]);
        const std::int32_t hi01 = e0 > e1 ? e0 : e1, hi23 = e2 > e3 ? e2 : e3, lo01 = z0 < z1 ? z0 : z1,
                           lo23 = z2 < z3 ? z2 : z3;
        const std::int32_t hi = hi01 > hi23 ? hi01 : hi23, lo = lo01 < lo23 ? lo01 : lo23;
        const double sum = (static_cast<double>(x0[j]) + static_cast<double>(x1[j])) +
                           (static_cast<double>(x2[j]) + static_cast<double>(x3[j]));
        if constexpr (First) {
          emax[j] = hi;
          emin[j] = lo;
          sums[j] = sum + 0.0;  // +0 for a sum of zeros of either sign, as the exact sum (the other groups add)
        } else {
          emax[j] = emax[j] > hi ? emax[j] : hi;
          emin[j] = emin[j] < lo ? emin[j] : lo;
          sums[j] += sum;
        }
      }
    };
    add_group.template operator()<true>(0);
    for (std::size_t c = 4; c < terms; c += 4) add_group.template operator()<false>(c);
  } else {
    alignas(64) float v[Block];
    for (std::size_t j = 0; j < len; ++j) {
      sums[j] = 0.0;
      emax[j] = 0;
      emin[j] = 255;
    }
    for (std::size_t c = 0; c < terms; ++c) {
      detail::widen_run(term(c) + b0, v, static_cast<std::int64_t>(len));
      for (std::size_t j = 0; j < len; ++j) {
        const std::int32_t e = exponent_field(v[j]), ez = nonzero_exponent_field(v[j]);
        emax[j] = emax[j] > e ? emax[j] : e;
        emin[j] = emin[j] < ez ? emin[j] : ez;
        sums[j] += static_cast<double>(v[j]);
      }
    }
  }
  const int log2_terms = ceil_log2(terms);
  std::uint8_t every = 1;  // bytes, not bools: the loops vectorize
  for (std::size_t j = 0; j < len; ++j) {
    fast[j] = static_cast<std::uint8_t>(double_sum_is_exact(emax[j], emin[j], log2_terms));
    every &= fast[j];
  }
  all_fast = every != 0;
}

// The term-by-term paths of the host loops, for the elements the double path left (rare). Out of line, so that
// they are compiled once, for the baseline, and not again in each of the loops' AVX2 and AVX-512 copies.

/// r[j] = the exact sum over c < terms of term(c)[b0 + j], rounded once, for each j < len with fast[j] == 0;
/// returns the number of terms outside the window.
template <class Term>
[[gnu::noinline]] std::int64_t slow_sums(const Term& term, std::size_t terms, std::size_t b0, std::size_t len,
                                         const std::uint8_t* fast, float* r) {
  std::int64_t outside = 0;
  for (std::size_t j = 0; j < len; ++j) {
    if (fast[j]) continue;
    std::int64_t hi = 0, lo = 0;
    for (std::size_t c = 0; c < terms; ++c) exact_add(to_float(term(c)[b0 + j]), hi, lo, outside);
    r[j] = exact_round(hi, lo, 0);
  }
  return outside;
}

/// hp[j] += hi, lp[j] += lo of the exact sum over c < chunks of partials[c * stride + b0 + j], for each j < len
/// with fast[j] == 0; returns the number of terms outside the window.
template <class T>
[[gnu::noinline]] std::int64_t slow_accumulate(const T* partials, std::size_t chunks, std::size_t stride,
                                               std::size_t b0, std::size_t len, const std::uint8_t* fast,
                                               std::int64_t* hp, std::int64_t* lp) {
  std::int64_t outside = 0;
  for (std::size_t j = 0; j < len; ++j) {
    if (fast[j]) continue;
    std::int64_t hs = 0, ls = 0;
    for (std::size_t c = 0; c < chunks; ++c) exact_add(to_float(partials[c * stride + b0 + j]), hs, ls, outside);
    hp[j] += hs;
    lp[j] += ls;
  }
  return outside;
}

/// r[j] = NaN for every j < len when outside_terms is not 0, else the integer rounding of the limbs for each j
/// with done[j] == 0.
[[gnu::noinline]] inline void slow_rounds(const std::int64_t* hp, const std::int64_t* lp, std::int64_t outside_terms,
                                          std::size_t len, const std::uint8_t* done, float* r) {
  for (std::size_t j = 0; j < len; ++j) {
    if (outside_terms != 0) {
      r[j] = detail::bits_as_float(0x7fc00000u);
    } else if (!done[j]) {
      r[j] = round_limbs_integer(hp[j], lp[j]);
    }
  }
}

/// The host loop of exact sums: outs[k][i] = the exact sum over c < terms of term(c)[i] (T values), rounded once
/// to float, then to Out, for i < count and k < outputs (the same values into each output). Returns the number of terms
/// outside the window (the caller makes the tensor NaN when it is not 0). The double path vectorized, the
/// term-by-term path for the elements it left.
template <class T, class Term, class Out = T>
inline std::int64_t host_exact_sums(Term term, std::size_t terms, std::size_t count, Out* const* outs, int outputs) {
  constexpr std::size_t block = 512;
  alignas(64) double sums[block];
  alignas(64) std::uint8_t fast[block];
  alignas(64) float f[block];
  std::int64_t total_outside = 0;
  for (std::size_t b0 = 0; b0 < count; b0 += block) {
    const std::size_t len = count - b0 < block ? count - b0 : block;
    bool all_fast = true;
    block_double_sums<T, block>(term, terms, b0, len, sums, fast, all_fast);
    float* __restrict r = f;
    if constexpr (std::is_same_v<Out, float>) r = outs[0] + b0;  // floats straight out (into the first output)
    for (std::size_t j = 0; j < len; ++j) r[j] = static_cast<float>(sums[j]);
    if (!all_fast) total_outside += slow_sums(term, terms, b0, len, fast, r);  // rare
    for (int k = 0; k < outputs; ++k) {
      if constexpr (std::is_same_v<Out, float>) {
        if (k > 0) std::copy_n(r, len, outs[k] + b0);
      } else {
        detail::narrow_run(r, outs[k] + b0, static_cast<std::int64_t>(len));
      }
    }
  }
  return total_outside;
}
}  // namespace exact_detail

/// The exact sum over c of partials[c * stride + i] added to (or, with `overwrite`, written over) element i of an
/// accumulator, for each i: its limbs hi[i] and lo[i], its tensor's count of terms outside the window *outside
/// (with `overwrite`, zeroed before). For a whole accumulator `acc` of n elements (exact_words(n) words): hi = acc,
/// lo = acc + n, outside = acc + 2n; for elements [a, b) of it, hi = acc + a and lo = acc + n + a.
template <class T>
struct exact_accumulate_op {
  const T* partials;
  std::size_t chunks;
  std::size_t stride;
  std::int64_t* hi;
  std::int64_t* lo;
  std::int64_t* outside;
  bool overwrite;
  LOCKSTEP_HD void operator()(std::size_t i) const {
    std::int64_t h = 0, l = 0, o = 0;
    double sum = 0.0;
    bool fast = false;
    exact_detail::sum_terms(partials, chunks, stride, i, h, l, o, sum, fast);
    hi[i] = overwrite ? h : hi[i] + h;
    lo[i] = overwrite ? l : lo[i] + l;
    if (o != 0) exact_detail::add_outside(outside, o);
  }
  /// The host loop: blocks of elements, the double path vectorized, the term-by-term path for what it left.
  void for_all(std::size_t count) const {
    constexpr std::size_t block = 512;
    alignas(64) double sums[block];
    alignas(64) std::uint8_t fast[block];
    std::int64_t terms_outside = 0;
    for (std::size_t b0 = 0; b0 < count; b0 += block) {
      const std::size_t len = count - b0 < block ? count - b0 : block;
      bool all_fast = true;
      exact_detail::block_double_sums<T, block>([this](std::size_t c) { return partials + c * stride; }, chunks, b0, len,
                                                 sums, fast, all_fast);
      std::int64_t* __restrict hp = hi + b0;  // locals: the functor's fields might alias
      std::int64_t* __restrict lp = lo + b0;
      // the double path's limbs straight into the accumulator (a staging copy costs as much as the work); 0 for
      // the elements it does not apply to (their double sum may be anything), which the scalar loop adds
      for (std::size_t j = 0; j < len; ++j) {
        std::int64_t h = 0, l = 0;
        exact_detail::limbs_of_sum(sums[j], h, l);
        const std::int64_t keep = -static_cast<std::int64_t>(fast[j]);
        hp[j] = (overwrite ? 0 : hp[j]) + (h & keep);
        lp[j] = (overwrite ? 0 : lp[j]) + (l & keep);
      }
      if (!all_fast) terms_outside += exact_detail::slow_accumulate(partials, chunks, stride, b0, len, fast, hp, lp);
    }
    if (terms_outside != 0) exact_detail::add_outside(outside, terms_outside);
  }
};

/// out[i] = element i of an accumulator rounded to float once, then to T: its limbs hi[i] and lo[i], and its
/// tensor's count of terms outside the window *outside. For a whole accumulator `acc` of n elements (exact_words(n)
/// words): hi = acc, lo = acc + n, outside = acc + 2n; for elements [a, b) of it, hi = acc + a and lo = acc + n + a.
template <class T>
struct exact_round_op {
  const std::int64_t* hi;
  const std::int64_t* lo;
  const std::int64_t* outside;
  T* out;
  LOCKSTEP_HD void operator()(std::size_t i) const { out[i] = convert<T>(exact_round(hi[i], lo[i], *outside)); }
  /// The host loop: the double path over a block (vectorized), the integer path for the elements it left.
  void for_all(std::size_t count) const {
    constexpr std::size_t block = 512;
    alignas(64) float f[block];
    alignas(64) std::uint8_t done[block];
    const std::int64_t outside_terms = *outside;
    for (std::size_t b0 = 0; b0 < count; b0 += block) {
      const std::size_t len = count - b0 < block ? count - b0 : block;
      const std::int64_t* __restrict hp = hi + b0;  // locals: the functor's fields might alias
      const std::int64_t* __restrict lp = lo + b0;
      float* __restrict r = f;
      if constexpr (std::is_same_v<T, float>) r = out + b0;  // floats straight out: no staging copy
      std::uint8_t all_done = 1;                              // bytes, not bools: the loop vectorizes
      for (std::size_t j = 0; j < len; ++j) {
        done[j] = static_cast<std::uint8_t>(exact_detail::round_limbs_double(hp[j], lp[j], r[j]));
        all_done &= done[j];
      }
      if (all_done == 0 || outside_terms != 0) exact_detail::slow_rounds(hp, lp, outside_terms, len, done, r);  // rare
      if constexpr (!std::is_same_v<T, float>) detail::narrow_run(f, out + b0, static_cast<std::int64_t>(len));
    }
  }
};

/// out[i] = the exact sum over c of partials[c * n + i], rounded to float once, then to T: exact_accumulate_op and
/// exact_round_op in one pass, for a sum that needs no accumulator (all terms on one device, in one launch).
/// Terms outside the window are counted in *outside (zeroed before); exact_poison_op then makes the tensor NaN.
template <class T>
struct exact_sum_op {
  /// The host loop's AVX-512 copy for floats (host_loop.hpp): every product here is by a power of two, so FMA
  /// contraction cannot change a bit.
  static constexpr bool host_avx512 = std::is_same_v<T, float>;
  const T* partials;
  std::size_t chunks;
  std::size_t n;
  T* out;
  std::int64_t* outside;
  LOCKSTEP_HD void operator()(std::size_t i) const {
    std::int64_t hi = 0, lo = 0, o = 0;
    double sum = 0.0;
    bool fast = false;
    exact_detail::sum_terms(partials, chunks, n, i, hi, lo, o, sum, fast);
    // the exact double sum rounds like exact_round (one correct rounding of the same value)
    out[i] = convert<T>(fast ? static_cast<float>(sum) : exact_round(hi, lo, 0));
    if (o != 0) exact_detail::add_outside(outside, o);
  }
  /// The host loop: the double path vectorized, the term-by-term path for what it left.
  void for_all(std::size_t count) const {
    T* const outs[1] = {out};
    const std::int64_t o = exact_detail::host_exact_sums<T>([this](std::size_t c) { return partials + c * n; }, chunks,
                                                            count, outs, 1);
    if (o != 0) exact_detail::add_outside(outside, o);
  }
};

/// Host only (the communicators' sums; a host device's one-pass f16/bf16 weight gradients): outs[k][i] for
/// k < outputs = the exact sum over t < terms of term(t)[i], rounded once, for i < count (run it with
/// detail::run_host_loop, whose AVX2 copy vectorizes it); the terms outside the window added to *outside. The
/// terms are T, the outputs Out: float terms holding f16 or bf16 values summed into f16 or bf16 outputs give the
/// sums of the T terms, on the floats' faster path.
template <class T, class Term, class Out = T>
struct exact_sums_host_op {
  /// The host loop's AVX-512 copy for floats (host_loop.hpp): every product here is by a power of two, so FMA
  /// contraction cannot change a bit.
  static constexpr bool host_avx512 = std::is_same_v<T, float>;
  Term term;
  std::size_t terms;
  Out* const* outs;
  int outputs;
  std::int64_t* outside;
  void for_all(std::size_t count) const { *outside += exact_detail::host_exact_sums<T>(term, terms, count, outs, outputs); }
};

/// out[i] = NaN when *outside is not 0 (after exact_sum_op: a tensor that received a term outside the window).
template <class T>
struct exact_poison_op {
  const std::int64_t* outside;
  T* out;
  LOCKSTEP_HD void operator()(std::size_t i) const {
    if (*outside != 0) out[i] = convert<T>(detail::bits_as_float(0x7fc00000u));
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
