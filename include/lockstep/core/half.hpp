// lockstep/core/half.hpp — 16-bit floating-point storage types (`half`, `bfloat16`) and their conversions.
//
// `half` is IEEE 754 binary16 and `bfloat16` is the upper half of an IEEE binary32. Both are storage types:
// kernels load them, convert to float, compute in float and convert back with `convert<T>(x)`. There is
// deliberately no arithmetic on them, so every rounding step in a kernel is visible.
//
// Conversions are the same on the host and on the device. In device code they are CUDA's intrinsics
// (`__float2half_rn`, `__half2float`, `__float2bfloat16_rn`, `__bfloat162float`); on the host they are this
// file's own bit-level implementation, which gives bit-identical results to the host versions of those CUDA
// functions (the tests compare all 2^16 patterns and a sweep of float patterns). In particular:
//   - float -> half / bfloat16 rounds to nearest, ties to even, with gradual underflow (subnormals);
//   - float -> half gives +-inf for |x| >= 65520 (the tie between 65504 and 65536, which rounds to even);
//   - any NaN converts to the positive canonical NaN 0x7fff (sign and payload are dropped), like CUDA;
//   - half -> float is exact, except that every half NaN becomes the float NaN 0x7fffffff, like CUDA;
//   - bfloat16 -> float is exact and keeps a NaN's sign and payload (the 16 bits move up), like CUDA.
// Non-NaN results are fixed by IEEE 754 and agree everywhere. The bits of a NaN result are the one thing a
// GPU could produce differently (sm_90 widens bfloat16 with cvt.f32.bf16, sm_80 with a plain shift), so code
// may rely on a NaN staying a NaN, never on its bits.
//
// Name these types `lockstep::half` / `lockstep::bfloat16`: CUDA's <cuda_fp16.h> also declares `::half`.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

#include "lockstep/config.hpp"
#include "lockstep/core/dtype.hpp"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

LOCKSTEP_DETAIL_BEGIN

/// The bits of a float (a bit cast that also compiles for the device).
LOCKSTEP_HD inline std::uint32_t float_as_bits(float f) noexcept {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}

/// The float with the given bits.
LOCKSTEP_HD inline float bits_as_float(std::uint32_t u) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

/// The bits of a double, and the double with given bits (kernels/exact.hpp's magic-number steps).
LOCKSTEP_HD inline std::int64_t double_as_bits(double d) noexcept {
#if defined(__CUDA_ARCH__)
  return __double_as_longlong(d);
#else
  return std::bit_cast<std::int64_t>(d);
#endif
}
LOCKSTEP_HD inline double bits_as_double(std::int64_t b) noexcept {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(b);
#else
  return std::bit_cast<double>(b);
#endif
}

/// `v >> shift` rounded to nearest, ties to even. 1 <= shift <= 31.
LOCKSTEP_HD constexpr std::uint32_t shift_right_rne(std::uint32_t v, unsigned shift) noexcept {
  const std::uint32_t kept = v >> shift;
  const std::uint32_t dropped = v & ((std::uint32_t{1} << shift) - 1u);
  const std::uint32_t halfway = std::uint32_t{1} << (shift - 1u);
  return kept + ((dropped > halfway || (dropped == halfway && (kept & 1u) != 0u)) ? 1u : 0u);
}

/// `c ? a : b` computed with masks: compilers keep it free of branches, so loops around it vectorize.
LOCKSTEP_HD constexpr std::uint32_t select_bits(bool c, std::uint32_t a, std::uint32_t b) noexcept {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

/// float -> binary16 bits, round to nearest even; see the file comment for the special cases.
///
/// The host code is written without branches (every case computed, then selected) so that loops converting
/// arrays vectorize. Normal results: rebias the exponent and round the 13 dropped mantissa bits by adding
/// 0xfff plus the lowest kept bit, which carries exactly when round-to-nearest-even rounds up. Subnormal
/// results: adding 0.5f (2^-1) to |f| < 2^-14 in float arithmetic rounds |f| to a multiple of 2^-24 (the
/// float's ulp at 0.5 is 2^-24) to nearest even — the half subnormal grid — and the low bits of the sum are
/// then the half's bits.
LOCKSTEP_HD inline std::uint16_t float_to_half_bits(float f) noexcept {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  const std::uint32_t x = float_as_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t mag = x & 0x7fffffffu;
  // Normal half (|f| >= 2^-14): exponent rebiased from 127 to 15 (subtract 112 << 23), 13 bits rounded away.
  const std::uint32_t odd = (mag >> 13) & 1u;
  const std::uint32_t normal = (mag - 0x38000000u + 0xfffu + odd) >> 13;
  // Subnormal half or zero (|f| < 2^-14).
  const std::uint32_t subnormal = float_as_bits(bits_as_float(mag) + 0.5f) - 0x3f000000u;
  // 0x477ff000 is 65520, halfway between the largest half (65504) and 65536, which has an even significand
  // and is out of range: from there on (infinity included) the result is infinity. NaN becomes CUDA's
  // canonical 0x7fff, sign dropped.
  const std::uint32_t finite =
      select_bits(mag >= 0x477ff000u, 0x7c00u, select_bits(mag >= 0x38800000u, normal, subnormal));
  return static_cast<std::uint16_t>(select_bits(mag > 0x7f800000u, 0x7fffu, sign | finite));
#endif
}

/// binary16 bits -> float (exact; every NaN becomes 0x7fffffff). Branch-free on the host (see above): the
/// exponent is rebiased in place; a subnormal half is rebuilt by float arithmetic, which is exact here.
LOCKSTEP_HD inline float half_bits_to_float(std::uint16_t h) noexcept {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const std::uint32_t sign = (std::uint32_t{h} & 0x8000u) << 16;
  const std::uint32_t em = std::uint32_t{h} & 0x7fffu;  // exponent and mantissa
  const std::uint32_t exponent = em >> 10;
  // Normal: the fields shifted into place and the exponent rebiased from 15 to 127.
  const std::uint32_t normal = (em << 13) + 0x38000000u;
  // Subnormal or zero: mantissa * 2^-24 = float(2^-14 with this mantissa) - 2^-14, exactly.
  const std::uint32_t subnormal = float_as_bits(bits_as_float((em << 13) + 0x38800000u) - 6.103515625e-05f);
  const std::uint32_t special = select_bits((em & 0x3ffu) != 0u, 0x7fffffffu, sign | 0x7f800000u);  // NaN, inf
  return bits_as_float(select_bits(exponent == 0x1fu, special, sign | select_bits(exponent == 0u, subnormal, normal)));
#endif
}

/// float -> bfloat16 bits, round to nearest even; any NaN becomes 0x7fff.
LOCKSTEP_HD inline std::uint16_t float_to_bfloat16_bits(float f) noexcept {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  const std::uint32_t x = float_as_bits(f);
  const std::uint32_t mag = x & 0x7fffffffu;
  // Same exponent range as float, so only the mantissa is rounded (add 0x7fff plus the lowest kept bit: a
  // carry exactly when round-to-nearest-even rounds up). Rounding up from the largest finite value carries
  // into the exponent and gives exactly infinity (0x7f80); subnormals need no special case.
  const std::uint32_t rounded = (mag + 0x7fffu + ((mag >> 16) & 1u)) >> 16;
  return static_cast<std::uint16_t>(select_bits(mag > 0x7f800000u, 0x7fffu, ((x >> 16) & 0x8000u) | rounded));
#endif
}

/// bfloat16 bits -> float (exact, NaN payload and sign kept).
LOCKSTEP_HD inline float bfloat16_bits_to_float(std::uint16_t b) noexcept {
#if defined(__CUDA_ARCH__)
  return __bfloat162float(__ushort_as_bfloat16(b));
#else
  return bits_as_float(std::uint32_t{b} << 16);
#endif
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// IEEE 754 binary16, stored as its bits. Trivially copyable, 2 bytes, alignment 2, the same layout as CUDA's
/// `__half`, so a buffer of `half` can be handed to cuBLAS or NCCL as fp16. The default constructor leaves
/// `bits` uninitialized, like a float.
struct half {
  std::uint16_t bits;

  half() = default;
  /// Rounds `f` to the nearest half, ties to even (the same bits as CUDA's `__float2half_rn`).
  LOCKSTEP_HD explicit half(float f) noexcept : bits(detail::float_to_half_bits(f)) {}
  /// The exact value as a float (a NaN becomes the float NaN 0x7fffffff, like CUDA's `__half2float`).
  LOCKSTEP_HD explicit operator float() const noexcept { return detail::half_bits_to_float(bits); }
  /// The half with the given bits: `half::from_bits(0x3c00)` is 1.
  static constexpr LOCKSTEP_HD half from_bits(std::uint16_t b) noexcept {
    half h{};
    h.bits = b;
    return h;
  }
};

/// bfloat16 (the upper 16 bits of an IEEE binary32), stored as its bits. Trivially copyable, 2 bytes,
/// alignment 2, the same layout as CUDA's `__nv_bfloat16`. The default constructor leaves `bits`
/// uninitialized.
struct bfloat16 {
  std::uint16_t bits;

  bfloat16() = default;
  /// Rounds `f` to the nearest bfloat16, ties to even (the same bits as CUDA's `__float2bfloat16_rn`).
  LOCKSTEP_HD explicit bfloat16(float f) noexcept : bits(detail::float_to_bfloat16_bits(f)) {}
  /// The exact value as a float (NaN payloads kept, like CUDA's `__bfloat162float`).
  LOCKSTEP_HD explicit operator float() const noexcept { return detail::bfloat16_bits_to_float(bits); }
  /// The bfloat16 with the given bits: `bfloat16::from_bits(0x3f80)` is 1.
  static constexpr LOCKSTEP_HD bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h{};
    h.bits = b;
    return h;
  }
};

// The layout contract that device buffers, NCCL and checkpoints rely on.
static_assert(sizeof(half) == 2 && alignof(half) == 2, "lockstep::half must be 2 bytes with alignment 2");
static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2,
              "lockstep::bfloat16 must be 2 bytes with alignment 2");
static_assert(std::is_trivially_copyable_v<half> && std::is_trivially_copyable_v<bfloat16>,
              "lockstep::half and lockstep::bfloat16 must be trivially copyable (memcpy, device copies)");
static_assert(std::is_standard_layout_v<half> && std::is_standard_layout_v<bfloat16>,
              "lockstep::half and lockstep::bfloat16 must be standard layout");
static_assert(std::is_trivially_default_constructible_v<half> &&
                  std::is_trivially_default_constructible_v<bfloat16>,
              "allocating a buffer of lockstep::half or lockstep::bfloat16 must not initialize it");
#if defined(__CUDACC__)
static_assert(sizeof(half) == sizeof(__half) && alignof(half) == alignof(__half),
              "lockstep::half must have the layout of CUDA's __half");
static_assert(sizeof(bfloat16) == sizeof(__nv_bfloat16) && alignof(bfloat16) == alignof(__nv_bfloat16),
              "lockstep::bfloat16 must have the layout of CUDA's __nv_bfloat16");
#endif

/// Rounds `f` to the nearest half, ties to even; |f| >= 65520 gives +-inf, any NaN gives 0x7fff.
LOCKSTEP_HD inline half to_half(float f) noexcept { return half::from_bits(detail::float_to_half_bits(f)); }

/// Rounds `f` to the nearest bfloat16, ties to even; any NaN gives 0x7fff.
LOCKSTEP_HD inline bfloat16 to_bfloat16(float f) noexcept {
  return bfloat16::from_bits(detail::float_to_bfloat16_bits(f));
}

/// The exact value of `h` as a float; every NaN gives 0x7fffffff.
LOCKSTEP_HD inline float to_float(half h) noexcept { return detail::half_bits_to_float(h.bits); }

/// The exact value of `b` as a float (NaN payload and sign kept).
LOCKSTEP_HD inline float to_float(bfloat16 b) noexcept { return detail::bfloat16_bits_to_float(b.bits); }

/// Identity, so generic code can write `to_float(x)` for every element type.
LOCKSTEP_HD constexpr float to_float(float f) noexcept { return f; }

/// False for infinities and NaNs. A test of the exponent bits: it compiles for the device and keeps working
/// under -ffast-math, where std::isfinite may be folded to true.
LOCKSTEP_HD constexpr bool is_finite(half h) noexcept { return (h.bits & 0x7c00u) != 0x7c00u; }

/// False for infinities and NaNs (a bit test, see `is_finite(half)`).
LOCKSTEP_HD constexpr bool is_finite(bfloat16 b) noexcept { return (b.bits & 0x7f80u) != 0x7f80u; }

/// False for infinities and NaNs (a bit test, see `is_finite(half)`).
LOCKSTEP_HD inline bool is_finite(float f) noexcept {
  return (detail::float_as_bits(f) & 0x7f800000u) != 0x7f800000u;
}

/// True for the floating-point element types lockstep stores: float, half and bfloat16.
template <class T>
inline constexpr bool is_storage_float_v =
    std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

/// Converts between float, half and bfloat16, so a kernel templated on its element type `T` can write
/// `convert<T>(acc)` and `convert<float>(x[i])`. Widening to float is exact; narrowing rounds to nearest even
/// once (half <-> bfloat16 goes through float, which holds either exactly). `convert<T>(T)` returns its
/// argument unchanged, NaN payload included. Anything else (double, integers) is a compile error: convert
/// those to float first, where the extra rounding step is visible.
template <class To, class From>
LOCKSTEP_HD To convert(From x) noexcept {
  static_assert(is_storage_float_v<To> && is_storage_float_v<From>,
                "lockstep::convert<To>(x): To and the type of x must each be float, lockstep::half or "
                "lockstep::bfloat16 (convert a double or an integer to float first)");
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<To, float>) {
    return to_float(x);
  } else if constexpr (std::is_same_v<To, half>) {
    return to_half(to_float(x));
  } else {
    return to_bfloat16(to_float(x));
  }
}

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

template <class T>
inline constexpr bool dependent_false_v = false;

template <class T>
constexpr dtype dtype_of() noexcept {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) {
    return dtype::f32;
  } else if constexpr (std::is_same_v<U, half>) {
    return dtype::f16;
  } else if constexpr (std::is_same_v<U, bfloat16>) {
    return dtype::bf16;
  } else if constexpr (std::is_same_v<U, std::int32_t>) {
    return dtype::i32;
  } else if constexpr (std::is_same_v<U, std::int64_t>) {
    return dtype::i64;
  } else if constexpr (std::is_same_v<U, std::uint8_t>) {
    return dtype::u8;
  } else {
    static_assert(dependent_false_v<T>,
                  "lockstep::dtype_of_v<T>: T is not an element type; use float, lockstep::half, "
                  "lockstep::bfloat16, std::int32_t, std::int64_t or std::uint8_t");
    return dtype::f32;
  }
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// The `dtype` of a C++ element type (cv-qualifiers ignored): float -> f32, half -> f16, bfloat16 -> bf16,
/// std::int32_t -> i32, std::int64_t -> i64, std::uint8_t -> u8. Any other type fails to compile with a
/// message naming the accepted types.
template <class T>
inline constexpr dtype dtype_of_v = detail::dtype_of<T>();

LOCKSTEP_ABI_END
