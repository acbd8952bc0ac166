// lockstep/core/dtype.hpp — the element types a tensor or a buffer can hold.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "lockstep/core/error.hpp"

namespace lockstep {

/// Element type of a tensor. `f16` is IEEE binary16, `bf16` is bfloat16 (the upper half of an f32).
enum class dtype : std::uint8_t { f32, f16, bf16, i32, i64, u8 };

/// Size in bytes of one element.
constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return 4;
    case dtype::f16: return 2;
    case dtype::bf16: return 2;
    case dtype::i32: return 4;
    case dtype::i64: return 8;
    case dtype::u8: return 1;
  }
  return 0;
}

/// The name users write: "f32", "f16", "bf16", "i32", "i64", "u8".
constexpr std::string_view name_of(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
    case dtype::i32: return "i32";
    case dtype::i64: return "i64";
    case dtype::u8: return "u8";
  }
  return "?";
}

/// True for f32, f16 and bf16.
constexpr bool is_floating(dtype t) noexcept { return t == dtype::f32 || t == dtype::f16 || t == dtype::bf16; }

/// Parses "f32" / "float32" / "fp32", "f16" / "float16" / "fp16" / "half", "bf16" / "bfloat16", "i32",
/// "i64", "u8". Throws precondition_error naming the accepted spellings otherwise.
inline dtype parse_dtype(std::string_view s) {
  if (s == "f32" || s == "float32" || s == "fp32") return dtype::f32;
  if (s == "f16" || s == "float16" || s == "fp16" || s == "half") return dtype::f16;
  if (s == "bf16" || s == "bfloat16") return dtype::bf16;
  if (s == "i32" || s == "int32") return dtype::i32;
  if (s == "i64" || s == "int64") return dtype::i64;
  if (s == "u8" || s == "uint8") return dtype::u8;
  LOCKSTEP_THROW(precondition_error, "unknown dtype '", s, "': expected one of f32, f16, bf16, i32, i64, u8");
}

}  // namespace lockstep
