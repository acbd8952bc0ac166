// Tests of core/half.hpp (half and bfloat16 conversions) and core/random.hpp (Philox4x32-10).
//
// The conversions are checked three ways:
//   - against values decoded from the bit fields with exact double arithmetic (ldexp), and against a
//     round-to-nearest-even reference that searches the sorted list of representable values; this needs
//     nothing but the standard library, so it runs in every build;
//   - against CUDA's own host implementations in cuda_fp16.h / cuda_bf16.h, bit for bit, when the build
//     defines LOCKSTEP_TEST_CUDA_HEADERS (the CUDA toolkit's include directory is on the path);
//   - exhaustively over all 65,536 16-bit patterns, and over sweeps of millions of float patterns.
// Loops count failures and report the first few, then assert once, and they assert how many inputs they
// checked, so that a loop that silently ran zero times cannot pass.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "lockstep/core/half.hpp"
#include "lockstep/core/random.hpp"

#if defined(LOCKSTEP_TEST_CUDA_HEADERS)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

// cuda_fp16.h declares a global `half`, so the tests always spell out the namespace.
namespace ls = lockstep;

namespace {

// Sweep strides over the 2^32 float patterns. Both are odd, so the low bits (where rounding happens) take
// every value over the sweep. An unoptimized sanitizer build still checks millions of patterns.
#if defined(__OPTIMIZE__)
constexpr std::uint64_t dense_stride = 211;       // ~20.4 million patterns, compared with CUDA's functions
constexpr std::uint64_t reference_stride = 1021;  // ~4.2 million patterns, compared with the reference
#else
constexpr std::uint64_t dense_stride = 1531;      // ~2.8 million
constexpr std::uint64_t reference_stride = 6143;  // ~0.7 million, plus ~0.65 million targeted values
#endif

std::uint32_t bits_of(float f) { return std::bit_cast<std::uint32_t>(f); }
float float_of(std::uint32_t u) { return std::bit_cast<float>(u); }

std::string hex(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

std::string hex16(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%04x", v);
  return buf;
}

// Failures of one check over many inputs: counted, the first few described, asserted once at the end.
class sweep_log {
 public:
  template <class Describe>
  void check(bool ok, Describe&& describe) {
    ++checked_;
    if (!ok && failed_++ < 8) examples_ += "  " + describe() + "\n";
  }

  // Success when at least `at_least` inputs were checked and none failed.
  ::testing::AssertionResult clean(std::uint64_t at_least) const {
    if (checked_ < at_least) {
      return ::testing::AssertionFailure()
             << "only " << checked_ << " inputs checked, expected at least " << at_least;
    }
    if (failed_ != 0) {
      return ::testing::AssertionFailure() << failed_ << " of " << checked_ << " inputs wrong, the first:\n"
                                           << examples_;
    }
    return ::testing::AssertionSuccess() << checked_ << " inputs checked";
  }

 private:
  std::uint64_t checked_ = 0;
  std::uint64_t failed_ = 0;
  std::string examples_;
};

// ---- exact values decoded from the bit fields (no lockstep code involved)
// ----------------------------------

bool half_is_nan(std::uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0u; }
bool bfloat16_is_nan(std::uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0u; }

// The exact value of a binary16 pattern: (-1)^s * m * 2^-24 for subnormals, (-1)^s * (1024 + m) * 2^(e-25)
// for normals.
double half_value(std::uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  double magnitude = 0;
  if (e == 0x1f) {
    magnitude = m != 0 ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    magnitude = std::ldexp(m, -24);
  } else {
    magnitude = std::ldexp(1024 + m, e - 25);
  }
  return (h & 0x8000u) != 0u ? -magnitude : magnitude;
}

// The exact value of a bfloat16 pattern: 8 exponent bits (bias 127) and 7 mantissa bits.
double bfloat16_value(std::uint16_t b) {
  const int e = (b >> 7) & 0xff;
  const int m = b & 0x7f;
  double magnitude = 0;
  if (e == 0xff) {
    magnitude = m != 0 ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    magnitude = std::ldexp(m, -133);
  } else {
    magnitude = std::ldexp(128 + m, e - 134);
  }
  return (b & 0x8000u) != 0u ? -magnitude : magnitude;
}

// Round to nearest, ties to even, done the slow and obvious way: binary search for the two representable
// neighbours of |x| and compare |x| with their midpoint in exact double arithmetic. The list of magnitudes is
// codes 0 .. inf_code - 1 (increasing with the code), followed by `beyond`, the next value the format would
// have with an unbounded exponent (2^16 for half, 2^128 for bfloat16). `beyond` has an even significand and
// stands for infinity, so the overflow rule of IEEE 754 (round as if unbounded, then overflow) falls out.
class nearest_even_reference {
 public:
  nearest_even_reference(double (*value_of)(std::uint16_t), std::uint16_t inf_code, double beyond)
      : inf_code_(inf_code) {
    for (std::uint32_t code = 0; code < inf_code; ++code)
      values_.push_back(value_of(static_cast<std::uint16_t>(code)));
    values_.push_back(beyond);
  }

  bool strictly_increasing() const {
    return std::adjacent_find(values_.begin(), values_.end(), std::greater_equal<>()) == values_.end();
  }
  std::size_t size() const { return values_.size(); }
  double magnitude(std::size_t code) const { return values_[code]; }

  // The rounded bits of a non-NaN float.
  std::uint16_t operator()(float x) const {
    const std::uint32_t sign = std::signbit(x) ? 0x8000u : 0u;
    const double a = std::fabs(static_cast<double>(x));
    if (a >= values_.back()) return static_cast<std::uint16_t>(sign | inf_code_);
    // Bisect for values_[lo] <= a < values_[lo + 1] (values_[0] is 0); a plain loop keeps -O0 builds quick.
    const double* v = values_.data();
    std::uint32_t lo = 0;
    auto hi = static_cast<std::uint32_t>(values_.size() - 1);
    while (hi - lo > 1) {
      const std::uint32_t m = lo + (hi - lo) / 2;
      (v[m] <= a ? lo : hi) = m;
    }
    const double midpoint = (v[lo] + v[hi]) / 2;  // exact: few significant bits
    std::uint32_t code = 0;
    if (a < midpoint) {
      code = lo;
    } else if (a > midpoint) {
      code = hi;
    } else {
      code = (lo % 2 == 0) ? lo : hi;  // the even code is the even significand
    }
    return static_cast<std::uint16_t>(sign | code);
  }

 private:
  std::vector<double> values_;
  std::uint16_t inf_code_;
};

const nearest_even_reference& half_reference() {
  static const nearest_even_reference r(half_value, 0x7c00, 65536.0);
  return r;
}

const nearest_even_reference& bfloat16_reference() {
  static const nearest_even_reference r(bfloat16_value, 0x7f80, std::ldexp(1.0, 128));
  return r;
}

// Every midpoint between consecutive non-negative finite values of a format (and between the largest and
// `beyond`), each with the floats one ulp below and above it, for both signs. All midpoints are floats.
std::vector<float> midpoints_and_neighbours(const nearest_even_reference& ref) {
  std::vector<float> out;
  for (std::size_t code = 0; code + 1 < ref.size(); ++code) {
    const double mid = (ref.magnitude(code) + ref.magnitude(code + 1)) / 2;
    const auto f = static_cast<float>(mid);
    if (static_cast<double>(f) != mid) continue;  // cannot happen; the midpoints test asserts it
    for (float s : {f, -f}) {
      out.push_back(s);
      out.push_back(std::nextafter(s, 0.0f));
      out.push_back(std::nextafter(
          s, s > 0 ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity()));
    }
  }
  return out;
}

// Special and boundary inputs that both formats must handle exactly as CUDA does.
std::vector<float> special_inputs() {
  std::vector<float> out;
  const std::uint32_t patterns[] = {
      0x00000000, 0x80000000,                          // +-0
      0x7f800000, 0xff800000,                          // +-inf
      0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001,  // NaNs: quiet, signalling, both signs
      0x7fbfffff, 0x7fffffff, 0xffffffff, 0x7fc01234,  // NaNs with payloads
      0x7f7fffff, 0xff7fffff,                          // +-FLT_MAX
      0x00000001, 0x80000001, 0x007fffff, 0x00800000,  // float subnormals, smallest normal
      0x00008000, 0x00008001, 0x00018000, 0x0000ffff,  // float subnormals at bfloat16 rounding points
      0x33000000, 0x33000001, 0x32ffffff, 0xb3000000,  // 2^-25 (half of the smallest half subnormal)
      0x33800000, 0x33c00000, 0x33c00001, 0x387fc000,  // 2^-24, 1.5 * 2^-24, largest half subnormal
      0x387fe000, 0x387fdfff, 0x387fe001, 0x38800000,  // halfway from there to 2^-14, and 2^-14 itself
  };
  for (std::uint32_t p : patterns) out.push_back(float_of(p));
  // Around the half overflow threshold 65520 (halfway between 65504 and 65536).
  for (float v :
       {65504.0f, 65519.99f, 65520.0f, 65520.01f, 65535.0f, 65536.0f, 1.0e5f, 65503.99f, 65504.01f}) {
    out.push_back(v);
    out.push_back(-v);
  }
  for (float v : {65520.0f, 65504.0f}) {
    out.push_back(std::nextafter(v, 0.0f));
    out.push_back(std::nextafter(v, 1.0e6f));
  }
  return out;
}

// Floats around the half subnormal range, [2^-26, 2^-13], and the float subnormals (which are bfloat16
// subnormals), every `stride`-th pattern, both signs.
std::vector<float> subnormal_range_inputs(std::uint32_t stride) {
  std::vector<float> out;
  for (std::uint32_t p = 0x32800000; p <= 0x39000000; p += stride) {
    out.push_back(float_of(p));
    out.push_back(float_of(p | 0x80000000u));
  }
  for (std::uint32_t p = 1; p <= 0x00800000; p += stride / 4) {
    out.push_back(float_of(p));
    out.push_back(float_of(p | 0x80000000u));
  }
  return out;
}

// ---- the lockstep functions under test, as bits ----------------------------------------------------------

std::uint16_t lockstep_half(float f) { return ls::to_half(f).bits; }
std::uint16_t lockstep_bfloat16(float f) { return ls::to_bfloat16(f).bits; }

// Compares `convert` with the exact nearest-even reference on the special values, every midpoint and its
// neighbours, the subnormal range and a strided sweep of all float patterns (NaN inputs are checked apart).
void expect_nearest_even(std::uint16_t (*convert)(float), const nearest_even_reference& ref) {
  sweep_log log;
  auto check = [&](float x) {
    if (std::isnan(x)) return;
    const std::uint16_t got = convert(x);
    const std::uint16_t want = ref(x);
    log.check(got == want,
              [&] { return hex(bits_of(x)) + " -> " + hex16(got) + ", reference " + hex16(want); });
  };
  for (float x : special_inputs()) check(x);
  for (float x : midpoints_and_neighbours(ref)) check(x);
  for (float x : subnormal_range_inputs(1021)) check(x);
  for (std::uint64_t p = 7; p <= 0xffffffffu; p += reference_stride)
    check(float_of(static_cast<std::uint32_t>(p)));
  EXPECT_TRUE(log.clean((std::uint64_t{1} << 32) / reference_stride + 300'000));
}

}  // namespace

// ---- layout and construction
// --------------------------------------------------------------------------------

TEST(half_types, have_the_layout_of_two_raw_bytes) {
  static_assert(sizeof(ls::half) == 2 && alignof(ls::half) == 2);
  static_assert(sizeof(ls::bfloat16) == 2 && alignof(ls::bfloat16) == 2);
  static_assert(std::is_trivially_copyable_v<ls::half> && std::is_trivially_copyable_v<ls::bfloat16>);
  static_assert(std::is_standard_layout_v<ls::half> && std::is_standard_layout_v<ls::bfloat16>);
  static_assert(!std::is_convertible_v<float, ls::half> && !std::is_convertible_v<ls::half, float>,
                "conversions are explicit");
  static_assert(ls::half::from_bits(0x3c00).bits == 0x3c00 && ls::bfloat16::from_bits(0x3f80).bits == 0x3f80);

  // A half is its bits in memory: an array of them is an array of uint16_t.
  const ls::half h[2] = {ls::half(1.0f), ls::half(-2.0f)};
  std::uint16_t raw[2];
  std::memcpy(raw, h, sizeof raw);
  EXPECT_EQ(raw[0], 0x3c00);
  EXPECT_EQ(raw[1], 0xc000);
  const ls::bfloat16 b[2] = {ls::bfloat16(1.0f), ls::bfloat16(-2.0f)};
  std::memcpy(raw, b, sizeof raw);
  EXPECT_EQ(raw[0], 0x3f80);
  EXPECT_EQ(raw[1], 0xc000);

  // The constructor and the conversion operator are the free functions.
  EXPECT_EQ(ls::half(0.1f).bits, 0x2e66);  // 0.1 -> 0.0999755859375
  EXPECT_EQ(static_cast<float>(ls::half::from_bits(0x2e66)), 0.0999755859375f);
  EXPECT_EQ(ls::bfloat16(0.1f).bits, 0x3dcd);  // 0x3dcccccd rounds up
  EXPECT_EQ(static_cast<float>(ls::bfloat16::from_bits(0x3dcd)), float_of(0x3dcd0000));
}

// ---- all 65,536 patterns
// ------------------------------------------------------------------------------------

TEST(half_conversion, every_half_widens_to_its_exact_value) {
  sweep_log log;
  for (std::uint32_t p = 0; p <= 0xffff; ++p) {
    const auto h = ls::half::from_bits(static_cast<std::uint16_t>(p));
    const float f = ls::to_float(h);
    // NaNs become the one float NaN CUDA's __half2float returns; everything else is exact.
    const std::uint32_t expected =
        half_is_nan(h.bits) ? 0x7fffffffu : bits_of(static_cast<float>(half_value(h.bits)));
    log.check(bits_of(f) == expected && bits_of(static_cast<float>(h)) == expected,
              [&] { return "half " + hex16(p) + " -> " + hex(bits_of(f)) + ", expected " + hex(expected); });
  }
  EXPECT_TRUE(log.clean(65536));
}

TEST(half_conversion, every_half_survives_a_round_trip_through_float) {
  sweep_log log;
  std::uint32_t nans = 0;
  for (std::uint32_t p = 0; p <= 0xffff; ++p) {
    const auto bits = static_cast<std::uint16_t>(p);
    const std::uint16_t back = ls::to_half(ls::to_float(ls::half::from_bits(bits))).bits;
    const std::uint16_t expected = half_is_nan(bits) ? 0x7fff : bits;  // NaNs come back canonical
    nans += half_is_nan(bits) ? 1u : 0u;
    log.check(back == expected, [&] { return "half " + hex16(p) + " -> " + hex16(back); });
  }
  EXPECT_TRUE(log.clean(65536));
  EXPECT_EQ(nans, 2u * 1023u);
}

TEST(bfloat16_conversion, every_bfloat16_widens_to_its_exact_value) {
  sweep_log log;
  for (std::uint32_t p = 0; p <= 0xffff; ++p) {
    const auto b = ls::bfloat16::from_bits(static_cast<std::uint16_t>(p));
    const float f = ls::to_float(b);
    // NaNs keep sign and payload, as CUDA's __bfloat162float does on the host.
    const std::uint32_t expected =
        bfloat16_is_nan(b.bits) ? (p << 16) : bits_of(static_cast<float>(bfloat16_value(b.bits)));
    log.check(bits_of(f) == expected && bits_of(static_cast<float>(b)) == expected, [&] {
      return "bfloat16 " + hex16(p) + " -> " + hex(bits_of(f)) + ", expected " + hex(expected);
    });
  }
  EXPECT_TRUE(log.clean(65536));
}

TEST(bfloat16_conversion, every_bfloat16_survives_a_round_trip_through_float) {
  sweep_log log;
  for (std::uint32_t p = 0; p <= 0xffff; ++p) {
    const auto bits = static_cast<std::uint16_t>(p);
    const std::uint16_t back = ls::to_bfloat16(ls::to_float(ls::bfloat16::from_bits(bits))).bits;
    const std::uint16_t expected = bfloat16_is_nan(bits) ? 0x7fff : bits;
    log.check(back == expected, [&] { return "bfloat16 " + hex16(p) + " -> " + hex16(back); });
  }
  EXPECT_TRUE(log.clean(65536));
}

// ---- rounding: ties to even, neighbours to nearest, overflow, NaN
// ------------------------------------------

TEST(half_conversion, midpoints_round_to_even_and_their_neighbours_to_nearest) {
  const auto& ref = half_reference();
  ASSERT_TRUE(ref.strictly_increasing());
  ASSERT_EQ(ref.size(), 0x7c01u);
  sweep_log log;
  for (std::uint32_t code = 0; code < 0x7c00; ++code) {
    const double lo = ref.magnitude(code);
    const double hi = ref.magnitude(code + 1);  // 65536 for the largest half: the overflow threshold
    const double mid = (lo + hi) / 2;
    const auto f = static_cast<float>(mid);
    const std::uint32_t even = (code % 2 == 0) ? code : code + 1;  // code + 1 == 0x7c00 is infinity
    for (std::uint32_t sign : {0u, 0x8000u}) {
      const float m = sign != 0 ? -f : f;
      const float below = std::nextafter(m, 0.0f);
      const float above = std::nextafter(m, sign != 0 ? -1.0e30f : 1.0e30f);
      log.check(static_cast<double>(f) == mid && lockstep_half(m) == (sign | even) &&
                    lockstep_half(below) == (sign | code) && lockstep_half(above) == (sign | (code + 1)),
                [&] {
                  return "midpoint " + hex(bits_of(m)) + " of " + hex16(sign | code) + " -> " +
                         hex16(lockstep_half(m)) + ", below -> " + hex16(lockstep_half(below)) +
                         ", above -> " + hex16(lockstep_half(above));
                });
    }
  }
  EXPECT_TRUE(log.clean(2 * 0x7c00));
}

TEST(bfloat16_conversion, midpoints_round_to_even_and_their_neighbours_to_nearest) {
  const auto& ref = bfloat16_reference();
  ASSERT_TRUE(ref.strictly_increasing());
  ASSERT_EQ(ref.size(), 0x7f81u);
  sweep_log log;
  for (std::uint32_t code = 0; code < 0x7f80; ++code) {
    const double mid = (ref.magnitude(code) + ref.magnitude(code + 1)) / 2;
    const auto f = static_cast<float>(mid);
    const std::uint32_t even = (code % 2 == 0) ? code : code + 1;
    for (std::uint32_t sign : {0u, 0x8000u}) {
      const float m = sign != 0 ? -f : f;
      const float below = std::nextafter(m, 0.0f);
      const float above = std::nextafter(
          m, sign != 0 ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity());
      log.check(static_cast<double>(f) == mid && lockstep_bfloat16(m) == (sign | even) &&
                    lockstep_bfloat16(below) == (sign | code) &&
                    lockstep_bfloat16(above) == (sign | (code + 1)),
                [&] {
                  return "midpoint " + hex(bits_of(m)) + " of " + hex16(sign | code) + " -> " +
                         hex16(lockstep_bfloat16(m)) + ", below -> " + hex16(lockstep_bfloat16(below)) +
                         ", above -> " + hex16(lockstep_bfloat16(above));
                });
    }
  }
  EXPECT_TRUE(log.clean(2 * 0x7f80));
}

TEST(half_conversion, handles_zero_infinity_nan_and_the_overflow_threshold) {
  EXPECT_EQ(lockstep_half(0.0f), 0x0000);
  EXPECT_EQ(lockstep_half(-0.0f), 0x8000);
  EXPECT_EQ(lockstep_half(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(lockstep_half(-std::numeric_limits<float>::infinity()), 0xfc00);
  // Every NaN, whatever its sign or payload, becomes CUDA's canonical 0x7fff.
  for (std::uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fbfffffu, 0x7fffffffu,
                            0xffffffffu, 0x7fc01234u, 0x7f802000u}) {
    EXPECT_EQ(lockstep_half(float_of(nan)), 0x7fff) << hex(nan);
  }
  // Half NaNs of either sign widen to 0x7fffffff.
  for (std::uint16_t nan : {0x7c01, 0x7e00, 0x7fff, 0xfc01, 0xfe00, 0xffff}) {
    EXPECT_EQ(bits_of(ls::to_float(ls::half::from_bits(nan))), 0x7fffffffu) << hex16(nan);
  }
  // 65504 is the largest half; 65520 is the tie with 65536, which is even and out of range.
  EXPECT_EQ(lockstep_half(65504.0f), 0x7bff);
  EXPECT_EQ(lockstep_half(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(lockstep_half(65519.99f), 0x7bff);
  EXPECT_EQ(lockstep_half(65520.0f), 0x7c00);
  EXPECT_EQ(lockstep_half(65520.01f), 0x7c00);
  EXPECT_EQ(lockstep_half(-65520.0f), 0xfc00);
  EXPECT_EQ(lockstep_half(-65519.99f), 0xfbff);
  EXPECT_EQ(lockstep_half(std::numeric_limits<float>::max()), 0x7c00);
  // Subnormals: 2^-24 is the smallest, 2^-25 ties to 0, anything above it rounds up to 2^-24.
  EXPECT_EQ(lockstep_half(0x1p-24f), 0x0001);
  EXPECT_EQ(lockstep_half(0x1p-25f), 0x0000);
  EXPECT_EQ(lockstep_half(-0x1p-25f), 0x8000);
  EXPECT_EQ(lockstep_half(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(lockstep_half(0x3p-25f), 0x0002);              // 1.5 * 2^-24 ties to the even 2 * 2^-24
  EXPECT_EQ(lockstep_half(0x1p-14f), 0x0400);              // smallest normal
  EXPECT_EQ(lockstep_half(float_of(0x00000001)), 0x0000);  // float subnormals vanish
  EXPECT_EQ(lockstep_half(float_of(0x807fffff)), 0x8000);
  // Some everyday values.
  EXPECT_EQ(lockstep_half(1.0f), 0x3c00);
  EXPECT_EQ(lockstep_half(-2.5f), 0xc100);
  EXPECT_EQ(lockstep_half(1.0f + 0x1p-11f), 0x3c00);  // tie, even stays
  EXPECT_EQ(lockstep_half(1.0f + 0x3p-11f), 0x3c02);  // tie, odd rounds up
}

TEST(bfloat16_conversion, handles_zero_infinity_nan_overflow_and_float_subnormals) {
  EXPECT_EQ(lockstep_bfloat16(0.0f), 0x0000);
  EXPECT_EQ(lockstep_bfloat16(-0.0f), 0x8000);
  EXPECT_EQ(lockstep_bfloat16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(lockstep_bfloat16(-std::numeric_limits<float>::infinity()), 0xff80);
  for (std::uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fbfffffu, 0x7fffffffu,
                            0xffffffffu, 0x7fc01234u, 0x7f810000u}) {
    EXPECT_EQ(lockstep_bfloat16(float_of(nan)), 0x7fff) << hex(nan);  // no truncation to an infinity either
  }
  // FLT_MAX lies above the midpoint between the largest bfloat16 and 2^128: it overflows.
  EXPECT_EQ(lockstep_bfloat16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(lockstep_bfloat16(float_of(0x7f7f7fff)), 0x7f7f);
  EXPECT_EQ(lockstep_bfloat16(float_of(0x7f7f8000)), 0x7f80);  // tie, 0x7f7f is odd
  // Float subnormals are bfloat16 subnormals: rounding works the same there.
  EXPECT_EQ(lockstep_bfloat16(float_of(0x00000001)), 0x0000);
  EXPECT_EQ(lockstep_bfloat16(float_of(0x00008000)), 0x0000);  // tie to even 0
  EXPECT_EQ(lockstep_bfloat16(float_of(0x00008001)), 0x0001);
  EXPECT_EQ(lockstep_bfloat16(float_of(0x00018000)), 0x0002);  // tie to even 2
  EXPECT_EQ(lockstep_bfloat16(float_of(0x807fffff)), 0x8080);  // rounds up into the smallest normal
  EXPECT_EQ(lockstep_bfloat16(1.0f), 0x3f80);
  EXPECT_EQ(lockstep_bfloat16(float_of(0x3f808000)), 0x3f80);  // tie, even stays
  EXPECT_EQ(lockstep_bfloat16(float_of(0x3f818000)), 0x3f82);  // tie, odd rounds up
}

TEST(half_conversion, matches_the_exact_nearest_even_reference) {
  expect_nearest_even(lockstep_half, half_reference());
}

TEST(bfloat16_conversion, matches_the_exact_nearest_even_reference) {
  expect_nearest_even(lockstep_bfloat16, bfloat16_reference());
}

// ---- bit-for-bit agreement with CUDA's cuda_fp16.h / cuda_bf16.h ------------------------------------------

#if defined(LOCKSTEP_TEST_CUDA_HEADERS)

namespace {

std::uint16_t cuda_half(float f) { return static_cast<__half_raw>(__float2half_rn(f)).x; }
float cuda_half_to_float(std::uint16_t h) {
  __half_raw raw;
  raw.x = h;
  return __half2float(__half(raw));
}
std::uint16_t cuda_bfloat16(float f) { return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(f)).x; }
float cuda_bfloat16_to_float(std::uint16_t b) {
  __nv_bfloat16_raw raw;
  raw.x = b;
  return __bfloat162float(__nv_bfloat16(raw));
}

// Compares both narrowing conversions of one float with CUDA's.
void compare_narrowing(sweep_log& log, float x) {
  const std::uint16_t h = lockstep_half(x);
  const std::uint16_t ch = cuda_half(x);
  const std::uint16_t b = lockstep_bfloat16(x);
  const std::uint16_t cb = cuda_bfloat16(x);
  log.check(h == ch && b == cb, [&] {
    return hex(bits_of(x)) + ": half " + hex16(h) + " (CUDA " + hex16(ch) + "), bfloat16 " + hex16(b) +
           " (CUDA " + hex16(cb) + ")";
  });
}

}  // namespace

TEST(cuda_header_agreement, widening_matches_for_all_65536_patterns) {
  sweep_log log;
  for (std::uint32_t p = 0; p <= 0xffff; ++p) {
    const auto bits = static_cast<std::uint16_t>(p);
    const std::uint32_t h = bits_of(ls::to_float(ls::half::from_bits(bits)));
    const std::uint32_t ch = bits_of(cuda_half_to_float(bits));
    const std::uint32_t b = bits_of(ls::to_float(ls::bfloat16::from_bits(bits)));
    const std::uint32_t cb = bits_of(cuda_bfloat16_to_float(bits));
    log.check(h == ch && b == cb, [&] {
      return hex16(p) + ": half -> " + hex(h) + " (CUDA " + hex(ch) + "), bfloat16 -> " + hex(b) + " (CUDA " +
             hex(cb) + ")";
    });
  }
  EXPECT_TRUE(log.clean(65536));
}

TEST(cuda_header_agreement, narrowing_matches_for_all_65536_upper_halves) {
  // Every combination of sign, exponent and upper mantissa bits, each with lower bits that sit on, just
  // below and just above the rounding points of both formats.
  const std::uint32_t lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x2000, 0x2fff,
                                0x3000, 0x3001, 0x7fff, 0x8000, 0x8001, 0xffff};
  sweep_log log;
  for (std::uint32_t high = 0; high <= 0xffff; ++high) {
    for (std::uint32_t low : lows) compare_narrowing(log, float_of((high << 16) | low));
  }
  EXPECT_TRUE(log.clean(65536 * std::size(lows)));
}

TEST(cuda_header_agreement, narrowing_matches_on_targeted_values) {
  sweep_log log;
  for (float x : special_inputs()) compare_narrowing(log, x);
  for (float x : midpoints_and_neighbours(half_reference())) compare_narrowing(log, x);
  for (float x : midpoints_and_neighbours(bfloat16_reference())) compare_narrowing(log, x);
  for (float x : subnormal_range_inputs(307)) compare_narrowing(log, x);
  EXPECT_TRUE(log.clean(1'000'000));
}

TEST(cuda_header_agreement, narrowing_matches_on_a_dense_sweep_of_float_patterns) {
  sweep_log log;
  for (std::uint64_t p = 3; p <= 0xffffffffu; p += dense_stride) {
    compare_narrowing(log, float_of(static_cast<std::uint32_t>(p)));
  }
  EXPECT_TRUE(log.clean((std::uint64_t{1} << 32) / dense_stride));
}

#else

TEST(cuda_header_agreement, needs_the_cuda_headers) {
  GTEST_SKIP() << "built without LOCKSTEP_TEST_CUDA_HEADERS (no cuda_fp16.h): the conversions are checked "
                  "against the exact reference only";
}

#endif

// ---- is_finite, convert, dtype_of_v
// -------------------------------------------------------------------------

TEST(numeric_traits, is_finite_is_false_exactly_for_infinities_and_nans) {
  sweep_log log;
  for (std::uint32_t p = 0; p <= 0xffff; ++p) {
    const auto bits = static_cast<std::uint16_t>(p);
    const bool half_finite = std::isfinite(half_value(bits));
    const bool bfloat16_finite = std::isfinite(bfloat16_value(bits));
    log.check(ls::is_finite(ls::half::from_bits(bits)) == half_finite &&
                  ls::is_finite(ls::bfloat16::from_bits(bits)) == bfloat16_finite,
              [&] { return hex16(p); });
  }
  EXPECT_TRUE(log.clean(65536));
  std::uint32_t finite_halves = 0;
  for (std::uint32_t p = 0; p <= 0xffff; ++p)
    finite_halves += ls::is_finite(ls::half::from_bits(static_cast<std::uint16_t>(p)));
  EXPECT_EQ(finite_halves, 65536u - 2u * 1024u);

  sweep_log floats;
  for (std::uint64_t p = 1; p <= 0xffffffffu; p += 65521) {
    const float x = float_of(static_cast<std::uint32_t>(p));
    floats.check(ls::is_finite(x) == std::isfinite(x), [&] { return hex(bits_of(x)); });
  }
  for (std::uint32_t p : {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffffffffu, 0x7f7fffffu, 0u}) {
    floats.check(ls::is_finite(float_of(p)) == std::isfinite(float_of(p)), [&] { return hex(p); });
  }
  EXPECT_TRUE(floats.clean(65000));
  EXPECT_FALSE(ls::is_finite(std::numeric_limits<float>::infinity()));
  EXPECT_FALSE(ls::is_finite(std::numeric_limits<float>::quiet_NaN()));
  EXPECT_TRUE(ls::is_finite(std::numeric_limits<float>::max()));
}

TEST(numeric_traits, convert_dispatches_on_the_element_type_and_rounds_once) {
  static_assert(std::is_same_v<decltype(ls::convert<ls::half>(1.0f)), ls::half>);
  static_assert(std::is_same_v<decltype(ls::convert<float>(ls::bfloat16{})), float>);
  EXPECT_EQ(ls::convert<ls::half>(1.5f).bits, 0x3e00);
  EXPECT_EQ(ls::convert<ls::bfloat16>(1.5f).bits, 0x3fc0);
  EXPECT_EQ(ls::convert<float>(2.25f), 2.25f);
  EXPECT_EQ(ls::convert<float>(ls::half::from_bits(0xc0a0)), -2.3125f);
  EXPECT_EQ(ls::convert<float>(ls::bfloat16::from_bits(0xc014)), -2.3125f);
  // half -> bfloat16 rounds once: 65504 = 0x1.ffcp15 has 11 significant bits, bfloat16 keeps 8 -> 65536.
  EXPECT_EQ(ls::convert<ls::bfloat16>(ls::half::from_bits(0x7bff)).bits, 0x4780);
  // bfloat16 -> half: 1/3 in bfloat16 is exactly 0x1.56p-2, which a half holds exactly.
  EXPECT_EQ(ls::convert<ls::half>(ls::bfloat16::from_bits(0x3eab)).bits, 0x3558);
  // bfloat16 values beyond the half range overflow.
  EXPECT_EQ(ls::convert<ls::half>(ls::bfloat16::from_bits(0x4780)).bits, 0x7c00);
  // convert<T>(T) is the identity, NaN payloads included.
  EXPECT_EQ(ls::convert<ls::half>(ls::half::from_bits(0x7e01)).bits, 0x7e01);
  EXPECT_EQ(ls::convert<ls::bfloat16>(ls::bfloat16::from_bits(0xffc1)).bits, 0xffc1);
  EXPECT_EQ(bits_of(ls::convert<float>(float_of(0x7fc01234))), 0x7fc01234u);
  // float -> bfloat16 rounds straight to bfloat16 (not through half, which would flush 1e10 to infinity).
  EXPECT_EQ(ls::convert<ls::bfloat16>(1.0e10f).bits, 0x5015);  // 0x501502f9
  EXPECT_EQ(ls::convert<ls::half>(0.1f).bits, 0x2e66);
  // convert agrees with the named functions over all 16-bit patterns, and over floats with every upper half.
  sweep_log log;
  for (std::uint32_t p = 0; p <= 0xffff; ++p) {
    const auto h = ls::half::from_bits(static_cast<std::uint16_t>(p));
    const auto b = ls::bfloat16::from_bits(static_cast<std::uint16_t>(p));
    const float x = float_of((p << 16) | 0x5a5au);
    log.check(ls::convert<ls::bfloat16>(h).bits == ls::to_bfloat16(ls::to_float(h)).bits &&
                  ls::convert<ls::half>(b).bits == ls::to_half(ls::to_float(b)).bits &&
                  bits_of(ls::convert<float>(h)) == bits_of(ls::to_float(h)) &&
                  bits_of(ls::convert<float>(b)) == bits_of(ls::to_float(b)) &&
                  ls::convert<ls::half>(x).bits == ls::to_half(x).bits &&
                  ls::convert<ls::bfloat16>(x).bits == ls::to_bfloat16(x).bits,
              [&] { return hex16(p); });
  }
  EXPECT_TRUE(log.clean(65536));
}

TEST(numeric_traits, dtype_of_maps_each_element_type_to_its_dtype) {
  static_assert(ls::dtype_of_v<float> == ls::dtype::f32);
  static_assert(ls::dtype_of_v<ls::half> == ls::dtype::f16);
  static_assert(ls::dtype_of_v<ls::bfloat16> == ls::dtype::bf16);
  static_assert(ls::dtype_of_v<std::int32_t> == ls::dtype::i32);
  static_assert(ls::dtype_of_v<std::int64_t> == ls::dtype::i64);
  static_assert(ls::dtype_of_v<std::uint8_t> == ls::dtype::u8);
  static_assert(ls::dtype_of_v<const float> == ls::dtype::f32);
  EXPECT_EQ(ls::size_of(ls::dtype_of_v<ls::half>), sizeof(ls::half));
  EXPECT_EQ(ls::size_of(ls::dtype_of_v<ls::bfloat16>), sizeof(ls::bfloat16));
  EXPECT_EQ(ls::size_of(ls::dtype_of_v<float>), sizeof(float));
  EXPECT_EQ(ls::size_of(ls::dtype_of_v<std::int64_t>), sizeof(std::int64_t));
}

// ---- Philox4x32-10
// --------------------------------------------------------------------------------------------

namespace {

struct philox_kat {
  ls::uint4x32 counter;
  ls::philox_key key;
  ls::uint4x32 expected;
};

// Random123's tests/kat_vectors, lines "philox4x32 10 ..." (counter[4] key[2] -> output[4]).
constexpr philox_kat philox10_kats[] = {
    {{{0x00000000, 0x00000000, 0x00000000, 0x00000000}},
     {0x00000000, 0x00000000},
     {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}}},
    {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}},
     {0xffffffff, 0xffffffff},
     {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}}},
    {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}},
     {0xa4093822, 0x299f31d0},
     {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}},
};

// The same file's "philox4x32 7 ..." lines: a different round count pins down the key schedule (a bump
// before or after the wrong round gives other numbers for 7 and for 10 rounds).
constexpr philox_kat philox7_kats[] = {
    {{{0x00000000, 0x00000000, 0x00000000, 0x00000000}},
     {0x00000000, 0x00000000},
     {{0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48}}},
    {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}},
     {0xffffffff, 0xffffffff},
     {{0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662}}},
    {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}},
     {0xa4093822, 0x299f31d0},
     {{0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a}}},
};

constexpr bool same_words(const ls::uint4x32& a, const ls::uint4x32& b) {
  return a.v[0] == b.v[0] && a.v[1] == b.v[1] && a.v[2] == b.v[2] && a.v[3] == b.v[3];
}

std::string words(const ls::uint4x32& a) {
  return hex(a.v[0]) + " " + hex(a.v[1]) + " " + hex(a.v[2]) + " " + hex(a.v[3]);
}

}  // namespace

// philox4x32_10 is constexpr: the known answers hold at compile time too.
static_assert(same_words(ls::philox4x32_10(philox10_kats[0].counter, philox10_kats[0].key),
                         philox10_kats[0].expected));
static_assert(same_words(ls::philox4x32_10(philox10_kats[2].counter, philox10_kats[2].key),
                         philox10_kats[2].expected));

TEST(philox, matches_the_random123_known_answers) {
  for (const philox_kat& kat : philox10_kats) {
    const ls::uint4x32 got = ls::philox4x32_10(kat.counter, kat.key);
    EXPECT_TRUE(same_words(got, kat.expected))
        << "got " << words(got) << ", expected " << words(kat.expected);
  }
  for (const philox_kat& kat : philox7_kats) {
    const ls::uint4x32 got = ls::detail::philox4x32_rounds<7>(kat.counter, kat.key);
    EXPECT_TRUE(same_words(got, kat.expected))
        << "got " << words(got) << ", expected " << words(kat.expected);
  }
}

TEST(philox, uniform_float_is_an_exact_multiple_of_two_to_the_minus_24_in_the_unit_interval) {
  static_assert(ls::uniform_float(0) == 0.0f);
  EXPECT_EQ(ls::uniform_float(0x000000ff), 0.0f);  // the low 8 bits are dropped
  EXPECT_EQ(ls::uniform_float(0x00000100), 0x1p-24f);
  EXPECT_EQ(ls::uniform_float(0x80000000), 0.5f);
  EXPECT_EQ(bits_of(ls::uniform_float(0xffffffff)), bits_of(1.0f - 0x1p-24f));  // 0x3f7fffff, below 1
  EXPECT_LT(ls::uniform_float(0xffffffff), 1.0f);
  sweep_log log;
  float previous = -1.0f;
  for (std::uint64_t p = 0; p <= 0xffffffffu; p += 65519) {
    const auto u = static_cast<std::uint32_t>(p);
    const float f = ls::uniform_float(u);
    // Exact: f * 2^24 is the integer formed by the top 24 bits.
    log.check(static_cast<double>(f) * 16777216.0 == static_cast<double>(u >> 8) && f >= 0.0f && f < 1.0f &&
                  f > previous,
              [&] { return hex(u) + " -> " + std::to_string(f); });
    previous = f;
  }
  EXPECT_TRUE(log.clean(65000));
}

TEST(philox, stateless_helpers_follow_the_documented_counter_layout) {
  // key = {seed lo, seed hi}, counter = {block lo, block hi, offset lo, offset hi}: the third known answer.
  const std::uint64_t seed = 0x299f31d0a4093822;
  const std::uint64_t offset = 0x0370734413198a2e;
  const std::uint64_t block = 0x85a308d3243f6a88;
  const ls::uint4x32 words_of_block = ls::philox_block(seed, offset, block);
  EXPECT_TRUE(same_words(words_of_block, philox10_kats[2].expected)) << words(words_of_block);
  const ls::float4x32 u = ls::philox_uniform4(seed, offset, block);
  for (int j = 0; j < 4; ++j) EXPECT_EQ(u.v[j], ls::uniform_float(philox10_kats[2].expected.v[j])) << j;

  // Element i is word i % 4 of block i / 4, also when the block number needs the counter's high word.
  sweep_log log;
  for (std::uint64_t index : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{6}, std::uint64_t{1} << 34,
                              (std::uint64_t{5} << 34) + 3, ~std::uint64_t{0}}) {
    for (std::uint64_t k = 0; k < 8; ++k) {
      const std::uint64_t i = index + k;  // wraps around for the last start, which is fine
      const ls::uint4x32 counter{{static_cast<std::uint32_t>(i >> 2), static_cast<std::uint32_t>(i >> 34),
                                  static_cast<std::uint32_t>(offset),
                                  static_cast<std::uint32_t>(offset >> 32)}};
      const ls::philox_key key{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
      const float expected = ls::uniform_float(ls::philox4x32_10(counter, key).v[i & 3]);
      const float got = ls::philox_uniform(seed, offset, i);
      const float from_block = ls::philox_uniform4(seed, offset, i >> 2).v[i & 3];
      log.check(got == expected && from_block == expected, [&] { return "index " + std::to_string(i); });
    }
  }
  EXPECT_TRUE(log.clean(40));
}

TEST(philox, streams_look_uniform_and_differ_by_seed_and_offset) {
  constexpr int blocks = 1 << 16;
  double sum = 0;
  int buckets[16] = {};
  int bit_counts[32] = {};
  int same_as_other_offset = 0;
  int same_as_other_seed = 0;
  for (int b = 0; b < blocks; ++b) {
    const ls::uint4x32 r = ls::philox_block(42, 7, static_cast<std::uint64_t>(b));
    const ls::uint4x32 other_offset = ls::philox_block(42, 8, static_cast<std::uint64_t>(b));
    const ls::uint4x32 other_seed = ls::philox_block(43, 7, static_cast<std::uint64_t>(b));
    for (int j = 0; j < 4; ++j) {
      const float u = ls::uniform_float(r.v[j]);
      sum += u;
      ++buckets[static_cast<int>(u * 16.0f)];
      for (int bit = 0; bit < 32; ++bit) bit_counts[bit] += static_cast<int>((r.v[j] >> bit) & 1u);
      same_as_other_offset += r.v[j] == other_offset.v[j] ? 1 : 0;
      same_as_other_seed += r.v[j] == other_seed.v[j] ? 1 : 0;
    }
  }
  constexpr int n = 4 * blocks;
  // The mean of n uniforms has standard deviation 0.2887 / sqrt(n) = 0.00056; allow about 6 of them.
  EXPECT_NEAR(sum / n, 0.5, 0.0035);
  // Chi-square with 15 degrees of freedom: 50 is far in the tail (p < 1e-5).
  double chi2 = 0;
  for (int count : buckets) chi2 += (count - n / 16.0) * (count - n / 16.0) / (n / 16.0);
  EXPECT_LT(chi2, 50.0);
  // Every output bit is set about half the time (standard deviation 256 out of 262144).
  for (int bit = 0; bit < 32; ++bit) EXPECT_NEAR(bit_counts[bit], n / 2, 2000) << "bit " << bit;
  // Independent streams: matching 32-bit words happen with probability 2^-32 each.
  EXPECT_LE(same_as_other_offset, 2);
  EXPECT_LE(same_as_other_seed, 2);
}
