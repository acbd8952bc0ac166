// lockstep/io/safetensors.hpp — the safetensors format (Hugging Face), read and written exactly:
//
//   [8 bytes: N, little-endian u64][N bytes: JSON header, padded with spaces][data]
//
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data
// section) and may hold "__metadata__", a map of strings to strings. lockstep writes the header padded to a
// multiple of 8 bytes (so the data is aligned), tensors contiguous in the order given, and "format": "pt" in
// the metadata, so that `safetensors.torch.load_file` reads its files. A file is accepted only when it follows
// every rule below; each violation is a data_error naming the file, the tensor and the rule:
//   - the header length fits the file and is at most 100,000,000 bytes; the header is a JSON object that
//     starts with '{', with no key twice;
//   - each tensor has a known dtype, a shape of non-negative integers, and data_offsets [begin, end] with
//     end - begin = product(shape) x dtype size;
//   - the tensors' byte ranges, sorted, start at 0, leave no gap, do not overlap, and end where the file ends.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/io/json.hpp"

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep {

/// The largest header lockstep reads (the format's own limit).
inline constexpr std::uint64_t safetensors_max_header_bytes = 100'000'000;

/// The safetensors name of a dtype: "F32", "F16", "BF16", "I32", "I64", "U8".
constexpr std::string_view safetensors_dtype_name(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "F32";
    case dtype::f16: return "F16";
    case dtype::bf16: return "BF16";
    case dtype::i32: return "I32";
    case dtype::i64: return "I64";
    case dtype::u8: return "U8";
  }
  return "?";
}

/// The dtype of a safetensors name, or nullopt for a name lockstep has no dtype for.
constexpr std::optional<dtype> dtype_of_safetensors_name(std::string_view name) noexcept {
  for (dtype t : {dtype::f32, dtype::f16, dtype::bf16, dtype::i32, dtype::i64, dtype::u8}) {
    if (safetensors_dtype_name(t) == name) return t;
  }
  return std::nullopt;
}

/// One tensor of a safetensors header: its byte range is [begin, end) of the data section.
struct safetensors_tensor {
  std::string name;
  dtype type = dtype::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;

  [[nodiscard]] std::uint64_t size_bytes() const noexcept { return end - begin; }
  [[nodiscard]] std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (const std::int64_t d : shape) n *= d;
    return n;
  }
};

/// "[784, 256]".
inline std::string shape_text(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// A parsed and validated header.
struct safetensors_header {
  std::vector<safetensors_tensor> tensors;  // sorted by offset (the order of the data)
  std::map<std::string, std::string> metadata;
  std::uint64_t data_offset = 0;            // where the data section starts in the file: 8 + header length

  /// The tensor named `name`, or nullptr.
  [[nodiscard]] const safetensors_tensor* find(std::string_view name) const noexcept {
    for (const auto& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
};

namespace detail {

[[noreturn]] inline void safetensors_fail(std::string_view file, const std::string& what) {
  throw data_error(concat(file, ": not a valid safetensors file: ", what));
}

inline std::uint64_t read_le64(const std::byte* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | std::to_integer<std::uint64_t>(p[i]);
  return v;
}

// A value for a message: scalars as written, arrays and objects by their kind (dumping a deeply nested value
// would recurse as deep as the nesting).
inline std::string brief(const json_value& v) {
  return v.is_array() || v.is_object() ? std::string(v.type_name()) : v.dump();
}

// An unsigned integer that fits in 64 bits, or fails naming `what`.
inline std::uint64_t json_u64(const json_value& v, std::string_view file, const std::string& what) {
  if (v.type() == json_value::kind::unsigned_integer) return v.get<std::uint64_t>();
  if (v.type() == json_value::kind::integer && v.get<std::int64_t>() >= 0) return static_cast<std::uint64_t>(v.get<std::int64_t>());
  safetensors_fail(file, concat(what, " must be a non-negative integer, got ", brief(v)));
}

}  // namespace detail

/// Parses and validates the header of a safetensors file of `file_size` bytes whose first bytes are `prefix`
/// (at least 8 + the header length of them, or the whole file). `file` names the file in messages. Throws
/// data_error for any violation of the format (see the file comment). O(header size + tensors log tensors).
inline safetensors_header parse_safetensors_header(std::span<const std::byte> prefix, std::uint64_t file_size,
                                                   std::string_view file) {
  using detail::safetensors_fail;
  if (file_size < 8 || prefix.size() < 8) {
    safetensors_fail(file, detail::concat("the file has ", file_size, " bytes, fewer than the 8 of the header length"));
  }
  const std::uint64_t n = detail::read_le64(prefix.data());
  if (n > safetensors_max_header_bytes) {
    safetensors_fail(file, detail::concat("the header length is ", n, " bytes, over the limit of ",
                                          safetensors_max_header_bytes));
  }
  if (n > file_size - 8) {
    safetensors_fail(file, detail::concat("the header length is ", n, " bytes but only ", file_size - 8,
                                          " bytes follow it (a truncated file?)"));
  }
  if (prefix.size() < 8 + n) {
    safetensors_fail(file, detail::concat("only ", prefix.size(), " bytes were given for a header of ", n));
  }
  const auto* text = reinterpret_cast<const char*>(prefix.data() + 8);
  if (n < 2 || text[0] != '{') safetensors_fail(file, "the header does not start with '{'");

  // A key twice in one object (a tensor named twice, say) is refused by the parser, naming the key.
  json_value header;
  try {
    header = json_value::parse(std::string_view(text, n));
  } catch (const json_error& e) {
    safetensors_fail(file, detail::concat("its JSON header is refused (", e.what(), " of the header)"));
  }
  if (!header.is_object()) safetensors_fail(file, "the header is not a JSON object");

  safetensors_header out;
  out.data_offset = 8 + n;
  const std::uint64_t data_size = file_size - out.data_offset;
  for (const auto& [name, v] : header.members()) {
    if (name == "__metadata__") {
      if (!v.is_object()) safetensors_fail(file, "__metadata__ must be an object of strings");
      for (const auto& [key, entry] : v.members()) {
        if (!entry.is_string()) {
          safetensors_fail(file, detail::concat("__metadata__ entry '", key, "' must be a string, got ",
                                                detail::brief(entry)));
        }
        out.metadata[key] = entry.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (!v.is_object()) safetensors_fail(file, where + " must map to an object");
    for (const auto& [field, ignored] : v.members()) {
      if (field != "dtype" && field != "shape" && field != "data_offsets") {
        safetensors_fail(file, detail::concat(where, " has an unknown field '", field, "'"));
      }
    }
    if (!v.contains("dtype") || !v["dtype"].is_string()) safetensors_fail(file, where + " has no dtype string");
    const std::string dt = v["dtype"].get<std::string>();
    const auto type = dtype_of_safetensors_name(dt);
    if (!type) {
      safetensors_fail(file, detail::concat(where, " has dtype '", dt, "', which lockstep does not read (it reads ",
                                            "F32, F16, BF16, I32, I64, U8)"));
    }
    if (!v.contains("shape") || !v["shape"].is_array()) safetensors_fail(file, where + " has no shape array");
    safetensors_tensor t;
    t.name = name;
    t.type = *type;
    std::uint64_t elements = 1;
    std::uint64_t nonzero = 1;  // the product of the non-zero dimensions: an element count must fit in int64
    bool overflow = false;
    for (const auto& d : v["shape"]) {
      const std::uint64_t e = detail::json_u64(d, file, where + "'s shape entries");
      if (e > static_cast<std::uint64_t>(INT64_MAX)) safetensors_fail(file, where + "'s shape is too large");
      t.shape.push_back(static_cast<std::int64_t>(e));
      if (e != 0 && nonzero > static_cast<std::uint64_t>(INT64_MAX) / e) {
        safetensors_fail(file, detail::concat(where, "'s shape ", shape_text(t.shape), "... has more than 2^63 elements"));
      }
      if (e != 0) nonzero *= e;
      if (e != 0 && elements > UINT64_MAX / e) overflow = true;
      elements *= e;
    }
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2) {
      safetensors_fail(file, where + " needs data_offsets [begin, end]");
    }
    t.begin = detail::json_u64(v["data_offsets"][0], file, where + "'s data_offsets");
    t.end = detail::json_u64(v["data_offsets"][1], file, where + "'s data_offsets");
    if (t.end < t.begin) {
      safetensors_fail(file, detail::concat(where, "'s data_offsets [", t.begin, ", ", t.end, "] end before they begin"));
    }
    const std::uint64_t unit = size_of(*type);
    if (overflow || (elements != 0 && elements > UINT64_MAX / unit) || elements * unit != t.end - t.begin) {
      safetensors_fail(file, detail::concat(where, " of shape ", shape_text(t.shape), " and dtype ", dt, " needs ",
                                            overflow ? std::string("more than 2^64") : std::to_string(elements * unit),
                                            " bytes, but its data_offsets [", t.begin, ", ", t.end, "] hold ",
                                            t.end - t.begin));
    }
    out.tensors.push_back(std::move(t));
  }
  std::sort(out.tensors.begin(), out.tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t at = 0;
  for (const auto& t : out.tensors) {
    if (t.begin < at) {
      safetensors_fail(file, detail::concat("tensor '", t.name, "' [", t.begin, ", ", t.end,
                                            ") overlaps the tensor before it, which ends at ", at));
    }
    if (t.begin > at) {
      safetensors_fail(file, detail::concat("the data has a gap of ", t.begin - at, " bytes before tensor '", t.name,
                                            "' (offsets must be contiguous from 0)"));
    }
    at = t.end;
  }
  if (at != data_size) {
    safetensors_fail(file, at < data_size
                               ? detail::concat(data_size - at, " bytes follow the last tensor's data (trailing bytes)")
                               : detail::concat("the tensors need ", at, " bytes of data but the file holds ", data_size,
                                                " (a truncated file?)"));
  }
  return out;
}

/// A tensor to write: `data` points at size_bytes() bytes of host memory, row-major, little-endian.
struct safetensors_source {
  std::string name;
  dtype type = dtype::f32;
  std::vector<std::int64_t> shape;
  const std::byte* data = nullptr;

  [[nodiscard]] std::size_t size_bytes() const noexcept {
    std::size_t n = size_of(type);
    for (const std::int64_t d : shape) n *= static_cast<std::size_t>(d);
    return n;
  }
};

/// The first bytes of a safetensors file holding `tensors` in this order, contiguous from offset 0: the 8-byte
/// length and the JSON header padded with spaces to a multiple of 8. `metadata` gets "format": "pt" unless it
/// says otherwise. Throws precondition_error for an empty or duplicate name, or "__metadata__" as a name.
inline std::string safetensors_header_bytes(std::span<const safetensors_source> tensors,
                                            std::map<std::string, std::string> metadata = {}) {
  metadata.emplace("format", "pt");
  // Written by hand, in the order given (a json_value object sorts its keys): the data offsets then follow the
  // header order, which is what a reader scanning the file expects.
  std::string json = "{\"__metadata__\":" + json_value(metadata).dump();
  std::set<std::string_view> names;
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    LOCKSTEP_EXPECTS(!t.name.empty() && t.name != "__metadata__", "safetensors: invalid tensor name '", t.name, "'");
    LOCKSTEP_EXPECTS(names.insert(t.name).second, "safetensors: tensor '", t.name, "' given twice");
    const std::uint64_t bytes = t.size_bytes();
    // appended piece by piece: g++ 12 warns (-Wrestrict, a false positive) on `"," + std::string&&` here
    json += ',';
    json += json_value(t.name).dump();
    json += ":{\"dtype\":\"";
    json += safetensors_dtype_name(t.type);
    json += "\",\"shape\":";
    json += json_value(t.shape).dump();
    json += ",\"data_offsets\":[";
    json += std::to_string(offset);
    json += ',';
    json += std::to_string(offset + bytes);
    json += "]}";
    offset += bytes;
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return out + json;
}

}  // namespace lockstep
