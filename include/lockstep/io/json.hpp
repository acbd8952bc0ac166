// lockstep/io/json.hpp — the JSON that lockstep's files hold (a checkpoint's manifest, a safetensors header, a
// checkpoint's user entry), read and written by lockstep itself:
//
//   json_value m = json_value::object();
//   m["position"]["step"] = 100;                  // objects and null values grow by name
//   m["lrs"] = std::vector<float>{0.1f, 0.01f};
//   std::string text = m.dump();                  // compact; dump(1) indents by one space
//   json_value back = json_value::parse(text);    // throws json_error (a data_error) with the byte it stopped at
//   float lr = back.at("lrs").at(0).get<float>();
//
// Strict RFC 8259: one value, no comments, no trailing commas, strings of valid UTF-8 (escapes decoded, lone
// surrogates refused), no key twice in one object, nesting at most json_value::max_depth deep. Numbers without a
// fraction or exponent that fit 64 bits stay integers (signed or unsigned, as written); others are doubles.
// Objects keep their keys sorted by bytes (as std::map would), so a dump does not depend on the order in which
// keys were added. Floating-point numbers are written with the fewest digits that read back to the same double,
// always with a '.' or an exponent; NaN and infinities are refused (JSON has no spelling for them).
//
// It is lockstep's own so that including a checkpoint does not cost a JSON library's compile time (nlohmann's
// header alone took 233 MiB and 1.8 s to parse, about a fifth of lockstep.hpp's). It is small on purpose: a
// document model for files of a few kilobytes, not a general-purpose library. Use any JSON library you like for
// your own files: dump() and parse() exchange text with them.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"

namespace lockstep {

/// Malformed JSON text, or a value read as what it is not (a missing member, a string read as a number, an
/// integer out of range). A data_error: the files lockstep reads are data.
class json_error : public data_error {
 public:
  using data_error::data_error;
};

struct json_member;

/// A JSON value: null, a boolean, a number (a signed or unsigned 64-bit integer, or a double), a string, an array
/// or an object. See the file comment.
class json_value {
 public:
  enum class kind : std::uint8_t { null, boolean, integer, unsigned_integer, floating, string, array, object };
  /// The deepest nesting parse() accepts (a file nested deeper is refused rather than read by deep recursion).
  static constexpr int max_depth = 256;

  json_value() noexcept;
  json_value(std::nullptr_t) noexcept;
  json_value(bool b) noexcept;
  template <class I>
    requires(std::is_integral_v<I> && !std::is_same_v<I, bool> && !std::is_same_v<I, char>)
  json_value(I i) noexcept;
  json_value(double d) noexcept;
  json_value(float f) noexcept;
  json_value(std::string s) noexcept;
  json_value(std::string_view s);
  json_value(const char* s);
  template <class T>
  json_value(const std::vector<T>& items);
  template <class T>
  json_value(const std::map<std::string, T>& members);
  /// An object: json_value{{"lr", 0.1f}, {"nesterov", true}}. Throws json_error when a key is given twice.
  json_value(std::initializer_list<json_member> members);

  [[nodiscard]] static json_value object();
  [[nodiscard]] static json_value array();
  /// Parses `text` (one JSON value, optionally surrounded by whitespace). Throws json_error naming the byte.
  [[nodiscard]] static json_value parse(std::string_view text);

  [[nodiscard]] kind type() const noexcept { return kind_; }
  [[nodiscard]] bool is_null() const noexcept { return kind_ == kind::null; }
  [[nodiscard]] bool is_boolean() const noexcept { return kind_ == kind::boolean; }
  [[nodiscard]] bool is_number() const noexcept { return is_number_integer() || kind_ == kind::floating; }
  /// An integer, signed or unsigned.
  [[nodiscard]] bool is_number_integer() const noexcept {
    return kind_ == kind::integer || kind_ == kind::unsigned_integer;
  }
  [[nodiscard]] bool is_string() const noexcept { return kind_ == kind::string; }
  [[nodiscard]] bool is_array() const noexcept { return kind_ == kind::array; }
  [[nodiscard]] bool is_object() const noexcept { return kind_ == kind::object; }
  /// "null", "boolean", "number", "string", "array" or "object".
  [[nodiscard]] const char* type_name() const noexcept;

  /// The members of an object (sorted by key), or the elements of an array; throws json_error for other kinds.
  [[nodiscard]] const std::vector<json_member>& members() const;
  [[nodiscard]] const std::vector<json_value>& elements() const;
  [[nodiscard]] std::vector<json_value>::const_iterator begin() const { return elements().begin(); }
  [[nodiscard]] std::vector<json_value>::const_iterator end() const { return elements().end(); }
  /// An array's elements or an object's members; 0 for null; throws json_error for scalars.
  [[nodiscard]] std::size_t size() const;

  [[nodiscard]] bool contains(std::string_view key) const noexcept { return find(key) != nullptr; }
  /// The member `key` of an object, or nullptr (also when this is not an object).
  [[nodiscard]] const json_value* find(std::string_view key) const noexcept;
  /// The member `key`; throws json_error when this is not an object or has no such member.
  [[nodiscard]] const json_value& at(std::string_view key) const;
  [[nodiscard]] json_value& at(std::string_view key);
  [[nodiscard]] const json_value& at(std::size_t i) const;
  [[nodiscard]] json_value& at(std::size_t i);
  /// The member `key`, added as null when missing; a null value becomes an empty object first.
  json_value& operator[](std::string_view key);
  [[nodiscard]] const json_value& operator[](std::string_view key) const;
  json_value& operator[](const char* key);
  [[nodiscard]] const json_value& operator[](const char* key) const;
  // Any integer type (a literal 0 would otherwise be as good a const char* as a std::size_t).
  template <class I>
    requires std::is_integral_v<I>
  [[nodiscard]] const json_value& operator[](I i) const;
  template <class I>
    requires std::is_integral_v<I>
  json_value& operator[](I i);
  /// Appends to an array (a null value becomes an empty array first).
  void push_back(json_value v);
  /// Removes the member `key` of an object, if any; returns how many were removed.
  std::size_t erase(std::string_view key);
  /// Sets every member of the object `other` on this object (a null value becomes an object first).
  void update(const json_value& other);

  /// The value as T: bool, an arithmetic type (integers must be integers that fit T; a floating-point T takes
  /// any number), std::string, or a std::vector of those. Throws json_error otherwise.
  template <class T>
  [[nodiscard]] T get() const;
  /// get<T>() of the member `key`, or `fallback` when this object has no such member (or is not an object).
  template <class T>
  [[nodiscard]] T value(std::string_view key, const T& fallback) const;
  [[nodiscard]] std::string value(std::string_view key, const char* fallback) const;

  /// The text of this value: compact when `indent` is negative, else one member or element per line, indented by
  /// `indent` spaces a level (with ": " between keys and values). Throws json_error for NaN or an infinity, and
  /// for a string that is not valid UTF-8.
  [[nodiscard]] std::string dump(int indent = -1) const;

  friend bool operator==(const json_value& a, const json_value& b) noexcept;

 private:
  friend class json_parser;
  void dump_to(std::string& out, int indent, int level) const;
  [[noreturn]] void fail_kind(const char* wanted) const;

  kind kind_ = kind::null;
  bool bool_ = false;
  std::int64_t int_ = 0;
  std::uint64_t uint_ = 0;
  double double_ = 0.0;
  std::string string_;
  std::vector<json_value> array_;
  std::vector<json_member> object_;  // sorted by key, no key twice
};

struct json_member {
  std::string key;
  json_value value;
  friend bool operator==(const json_member& a, const json_member& b) noexcept {
    return a.key == b.key && a.value == b.value;
  }
};


inline json_value::json_value() noexcept = default;
inline json_value::json_value(std::nullptr_t) noexcept {}
inline json_value::json_value(bool b) noexcept : kind_(kind::boolean), bool_(b) {}
template <class I>
  requires(std::is_integral_v<I> && !std::is_same_v<I, bool> && !std::is_same_v<I, char>)
json_value::json_value(I i) noexcept {
  if constexpr (std::is_signed_v<I>) {
    kind_ = kind::integer;
    int_ = i;
  } else {
    kind_ = kind::unsigned_integer;
    uint_ = i;
  }
}
inline json_value::json_value(double d) noexcept : kind_(kind::floating), double_(d) {}
inline json_value::json_value(float f) noexcept : kind_(kind::floating), double_(f) {}
inline json_value::json_value(std::string s) noexcept : kind_(kind::string), string_(std::move(s)) {}
inline json_value::json_value(std::string_view s) : kind_(kind::string), string_(s) {}
inline json_value::json_value(const char* s) : kind_(kind::string), string_(s) {}
template <class T>
json_value::json_value(const std::vector<T>& items) : kind_(kind::array) {
  array_.reserve(items.size());
  for (const auto& x : items) array_.emplace_back(x);
}
template <class T>
json_value::json_value(const std::map<std::string, T>& members) : kind_(kind::object) {
  object_.reserve(members.size());
  for (const auto& [k, v] : members) object_.push_back({k, json_value(v)});  // std::map: already sorted
}

inline json_value json_value::object() {
  json_value v;
  v.kind_ = kind::object;
  return v;
}
inline json_value json_value::array() {
  json_value v;
  v.kind_ = kind::array;
  return v;
}
inline json_value& json_value::at(std::string_view key) { return const_cast<json_value&>(std::as_const(*this).at(key)); }
inline json_value& json_value::at(std::size_t i) { return const_cast<json_value&>(std::as_const(*this).at(i)); }
inline const json_value& json_value::operator[](std::string_view key) const { return at(key); }
inline json_value& json_value::operator[](const char* key) { return (*this)[std::string_view(key)]; }
inline const json_value& json_value::operator[](const char* key) const { return at(std::string_view(key)); }
template <class I>
  requires std::is_integral_v<I>
const json_value& json_value::operator[](I i) const {
  if constexpr (std::is_signed_v<I>) {
    if (i < 0) fail_kind("an array (read with a negative index)");
  }
  return at(static_cast<std::size_t>(i));
}
template <class I>
  requires std::is_integral_v<I>
json_value& json_value::operator[](I i) {
  return const_cast<json_value&>(std::as_const(*this)[i]);
}
template <class T>
T json_value::value(std::string_view key, const T& fallback) const {
  const json_value* v = find(key);
  return v ? v->get<T>() : fallback;
}
inline std::string json_value::value(std::string_view key, const char* fallback) const {
  return value(key, std::string(fallback));
}
inline std::string json_value::dump(int indent) const {
  std::string out;
  dump_to(out, indent, 0);
  return out;
}

inline json_value::json_value(std::initializer_list<json_member> members) : kind_(kind::object) {
  for (const auto& m : members) {
    if (contains(m.key)) throw json_error(detail::concat("JSON: the key '", m.key, "' is given twice"));
    (*this)[m.key] = m.value;
  }
}

namespace detail {

inline bool json_key_less(const json_member& m, std::string_view key) noexcept { return m.key < key; }

// The length of the valid UTF-8 sequence at s[i], or 0 when it is not one (overlong forms, surrogates and code
// points past U+10FFFF are not valid).
inline std::size_t utf8_sequence(std::string_view s, std::size_t i) noexcept {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned c = b(i);
  if (c < 0x80) return 1;
  std::size_t n;
  unsigned lo = 0x80, hi = 0xbf;  // the range of the second byte
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;  // no surrogates
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k) {
    if (b(i + k) < 0x80 || b(i + k) > 0xbf) return 0;
  }
  return n;
}

inline void json_append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

inline void json_dump_string(std::string& out, std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  out += '"';
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const std::size_t n = utf8_sequence(s, i);
      if (n == 0) throw json_error(concat("JSON: a string to write is not valid UTF-8 (byte ", i, ")"));
      out.append(s.substr(i, n));
      i += n;
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += static_cast<char>(c);
        }
    }
    ++i;
  }
  out += '"';
}

template <class T>
void json_append_number(std::string& out, T v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, r.ptr);
}

}  // namespace detail

inline const char* json_value::type_name() const noexcept {
  switch (kind_) {
    case kind::null: return "null";
    case kind::boolean: return "boolean";
    case kind::string: return "string";
    case kind::array: return "array";
    case kind::object: return "object";
    default: return "number";
  }
}

inline void json_value::fail_kind(const char* wanted) const {
  throw json_error(detail::concat("JSON: expected ", wanted, ", got ", type_name()));
}

inline const std::vector<json_member>& json_value::members() const {
  if (kind_ != kind::object) fail_kind("an object");
  return object_;
}

inline const std::vector<json_value>& json_value::elements() const {
  if (kind_ != kind::array) fail_kind("an array");
  return array_;
}

inline std::size_t json_value::size() const {
  switch (kind_) {
    case kind::null: return 0;
    case kind::array: return array_.size();
    case kind::object: return object_.size();
    default: fail_kind("an array or an object");
  }
}

inline const json_value* json_value::find(std::string_view key) const noexcept {
  if (kind_ != kind::object) return nullptr;
  const auto it = std::lower_bound(object_.begin(), object_.end(), key, detail::json_key_less);
  return it != object_.end() && it->key == key ? &it->value : nullptr;
}

inline const json_value& json_value::at(std::string_view key) const {
  if (kind_ != kind::object) fail_kind(detail::concat("an object with the member '", key, "'").c_str());
  const json_value* v = find(key);
  if (!v) throw json_error(detail::concat("JSON: no member '", key, "'"));
  return *v;
}

inline const json_value& json_value::at(std::size_t i) const {
  const auto& a = elements();
  if (i >= a.size()) throw json_error(detail::concat("JSON: no element ", i, " in an array of ", a.size()));
  return a[i];
}

inline json_value& json_value::operator[](std::string_view key) {
  if (kind_ == kind::null) kind_ = kind::object;
  if (kind_ != kind::object) fail_kind(detail::concat("an object (to set its member '", key, "')").c_str());
  const auto it = std::lower_bound(object_.begin(), object_.end(), key, detail::json_key_less);
  if (it != object_.end() && it->key == key) return it->value;
  return object_.insert(it, json_member{std::string(key), json_value()})->value;
}

inline void json_value::push_back(json_value v) {
  if (kind_ == kind::null) kind_ = kind::array;
  if (kind_ != kind::array) fail_kind("an array (to append to it)");
  array_.push_back(std::move(v));
}

inline std::size_t json_value::erase(std::string_view key) {
  if (kind_ != kind::object) return 0;
  const auto it = std::lower_bound(object_.begin(), object_.end(), key, detail::json_key_less);
  if (it == object_.end() || it->key != key) return 0;
  object_.erase(it);
  return 1;
}

inline void json_value::update(const json_value& other) {
  for (const auto& m : other.members()) (*this)[m.key] = m.value;
}

template <class T>
T json_value::get() const {
  if constexpr (std::is_same_v<T, json_value>) {
    return *this;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (kind_ != kind::boolean) fail_kind("a boolean");
    return bool_;
  } else if constexpr (std::is_floating_point_v<T>) {
    switch (kind_) {
      case kind::integer: return static_cast<T>(int_);
      case kind::unsigned_integer: return static_cast<T>(uint_);
      case kind::floating: return static_cast<T>(double_);
      default: fail_kind("a number");
    }
  } else if constexpr (std::is_integral_v<T>) {
    bool fits = false;
    T out{};
    if (kind_ == kind::integer) {
      fits = std::in_range<T>(int_);
      out = static_cast<T>(int_);
    } else if (kind_ == kind::unsigned_integer) {
      fits = std::in_range<T>(uint_);
      out = static_cast<T>(uint_);
    } else {
      fail_kind("an integer");
    }
    if (!fits) throw json_error(detail::concat("JSON: the integer ", dump(), " does not fit the type read"));
    return out;
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (kind_ != kind::string) fail_kind("a string");
    return string_;
  } else {
    static_assert(requires { typename T::value_type; }, "json_value::get: no conversion to this type");
    T out;
    for (const auto& e : elements()) out.push_back(e.template get<typename T::value_type>());
    return out;
  }
}

inline bool operator==(const json_value& a, const json_value& b) noexcept {
  using k = json_value::kind;
  // Numbers compare by value across their kinds (1 == 1u == 1.0), as JSON has one number type.
  if (a.is_number() && b.is_number()) {
    if (a.kind_ == k::floating || b.kind_ == k::floating) {
      const auto as_double = [](const json_value& v) {
        return v.kind_ == k::floating ? v.double_
               : v.kind_ == k::integer ? static_cast<double>(v.int_)
                                       : static_cast<double>(v.uint_);
      };
      return as_double(a) == as_double(b);
    }
    if (a.kind_ == b.kind_) return a.kind_ == k::integer ? a.int_ == b.int_ : a.uint_ == b.uint_;
    const auto& s = a.kind_ == k::integer ? a : b;
    const auto& u = a.kind_ == k::integer ? b : a;
    return s.int_ >= 0 && static_cast<std::uint64_t>(s.int_) == u.uint_;
  }
  if (a.kind_ != b.kind_) return false;
  switch (a.kind_) {
    case k::null: return true;
    case k::boolean: return a.bool_ == b.bool_;
    case k::string: return a.string_ == b.string_;
    case k::array: return a.array_ == b.array_;
    case k::object: return a.object_ == b.object_;
    default: return false;
  }
}

inline void json_value::dump_to(std::string& out, int indent, int level) const {
  const auto newline = [&](int at) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<std::size_t>(indent) * static_cast<std::size_t>(at), ' ');
  };
  switch (kind_) {
    case kind::null: out += "null"; return;
    case kind::boolean: out += bool_ ? "true" : "false"; return;
    case kind::integer: detail::json_append_number(out, int_); return;
    case kind::unsigned_integer: detail::json_append_number(out, uint_); return;
    case kind::floating: {
      if (!std::isfinite(double_)) {
        throw json_error(detail::concat("JSON: cannot write ", double_, " (JSON has no NaN or infinity)"));
      }
      const std::size_t at = out.size();
      detail::json_append_number(out, double_);  // the shortest text that reads back to the same double
      if (out.find_first_of(".eE", at) == std::string::npos) out += ".0";  // reads back as a double
      return;
    }
    case kind::string: detail::json_dump_string(out, string_); return;
    case kind::array:
      out += '[';
      for (std::size_t i = 0; i < array_.size(); ++i) {
        if (i) out += ',';
        newline(level + 1);
        array_[i].dump_to(out, indent, level + 1);
      }
      if (!array_.empty()) newline(level);
      out += ']';
      return;
    case kind::object:
      out += '{';
      for (std::size_t i = 0; i < object_.size(); ++i) {
        if (i) out += ',';
        newline(level + 1);
        detail::json_dump_string(out, object_[i].key);
        out += indent < 0 ? ":" : ": ";
        object_[i].value.dump_to(out, indent, level + 1);
      }
      if (!object_.empty()) newline(level);
      out += '}';
      return;
  }
}

/// The recursive-descent reader behind json_value::parse.
class json_parser {
 public:
  explicit json_parser(std::string_view text) : s_(text) {}

  json_value document() {
    skip_space();
    json_value v = value(0);
    skip_space();
    if (i_ != s_.size()) fail("text after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(std::string_view what) const {
    throw json_error(detail::concat("JSON: ", what, " at byte ", i_));
  }
  void skip_space() noexcept {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool take(char c) noexcept {
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c, const char* what) {
    if (!take(c)) fail(i_ < s_.size() ? what : "unexpected end of the text");
  }
  void literal(std::string_view word) {
    if (s_.substr(i_, word.size()) != word) fail("an unknown literal");
    i_ += word.size();
  }

  json_value value(int depth) {
    if (depth >= json_value::max_depth) fail("nesting deeper than 256");
    if (i_ >= s_.size()) fail("unexpected end of the text");
    json_value v;
    switch (s_[i_]) {
      case '{': return object(depth);
      case '[': return array(depth);
      case '"':
        v.kind_ = json_value::kind::string;
        v.string_ = string();
        return v;
      case 't': literal("true"); return json_value(true);
      case 'f': literal("false"); return json_value(false);
      case 'n': literal("null"); return v;
      default: return number();
    }
  }

  json_value object(int depth) {
    ++i_;  // '{'
    json_value v = json_value::object();
    skip_space();
    if (take('}')) return v;
    for (;;) {
      skip_space();
      if (i_ >= s_.size() || s_[i_] != '"') fail(i_ < s_.size() ? "expected a key string" : "unexpected end of the text");
      const std::size_t key_at = i_;
      std::string key = string();
      skip_space();
      expect(':', "expected ':' after a key");
      skip_space();
      json_value member = value(depth + 1);
      auto& m = v.object_;
      const auto it = std::lower_bound(m.begin(), m.end(), key, detail::json_key_less);
      if (it != m.end() && it->key == key) {
        i_ = key_at;
        fail(detail::concat("the key \"", key, "\" appears twice in one object"));
      }
      m.insert(it, json_member{std::move(key), std::move(member)});
      skip_space();
      if (take('}')) return v;
      expect(',', "expected ',' or '}' in an object");
    }
  }

  json_value array(int depth) {
    ++i_;  // '['
    json_value v = json_value::array();
    skip_space();
    if (take(']')) return v;
    for (;;) {
      skip_space();
      v.array_.push_back(value(depth + 1));
      skip_space();
      if (take(']')) return v;
      expect(',', "expected ',' or ']' in an array");
    }
  }

  std::uint32_t hex4() {
    if (s_.size() - i_ < 4) fail("a \\u escape needs four hex digits");
    std::uint32_t cp = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[i_++];
      cp <<= 4;
      if (c >= '0' && c <= '9') cp |= static_cast<std::uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') cp |= static_cast<std::uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') cp |= static_cast<std::uint32_t>(c - 'A' + 10);
      else fail("a \\u escape needs four hex digits");
    }
    return cp;
  }

  std::string string() {
    ++i_;  // '"'
    std::string out;
    for (;;) {
      if (i_ >= s_.size()) fail("a string without its closing quote");
      const auto c = static_cast<unsigned char>(s_[i_]);
      if (c == '"') {
        ++i_;
        return out;
      }
      if (c < 0x20) fail("a control character in a string (it must be escaped)");
      if (c >= 0x80) {
        const std::size_t n = detail::utf8_sequence(s_, i_);
        if (n == 0) fail("a string that is not valid UTF-8");
        out.append(s_.substr(i_, n));
        i_ += n;
        continue;
      }
      ++i_;
      if (c != '\\') {
        out += static_cast<char>(c);
        continue;
      }
      if (i_ >= s_.size()) fail("a string without its closing quote");
      switch (s_[i_++]) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t cp = hex4();
          if (cp >= 0xdc00 && cp <= 0xdfff) fail("a lone low surrogate in a \\u escape");
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (s_.substr(i_, 2) != "\\u") fail("a high surrogate without its low surrogate");
            i_ += 2;
            const std::uint32_t low = hex4();
            if (low < 0xdc00 || low > 0xdfff) fail("a high surrogate without its low surrogate");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
          }
          detail::json_append_utf8(out, cp);
          break;
        }
        default: --i_; fail("an unknown escape in a string");
      }
    }
  }

  json_value number() {
    const std::size_t start = i_;
    const auto digit = [&] { return i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9'; };
    take('-');
    if (!digit()) fail("an unexpected character");
    if (!take('0')) {
      while (digit()) ++i_;
    }
    bool integral = true;
    if (take('.')) {
      integral = false;
      if (!digit()) fail("a number needs digits after its '.'");
      while (digit()) ++i_;
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      integral = false;
      ++i_;
      if (!take('+')) take('-');
      if (!digit()) fail("a number needs digits in its exponent");
      while (digit()) ++i_;
    }
    const char* first = s_.data() + start;
    const char* last = s_.data() + i_;
    json_value v;
    if (integral) {
      if (*first == '-') {
        if (std::from_chars(first, last, v.int_).ec == std::errc()) {
          v.kind_ = json_value::kind::integer;
          return v;
        }
      } else if (std::from_chars(first, last, v.uint_).ec == std::errc()) {
        v.kind_ = json_value::kind::unsigned_integer;
        return v;
      }
      // wider than 64 bits: a double, as the text is a number
    }
    const auto r = std::from_chars(first, last, v.double_);
    if (r.ec != std::errc() || !std::isfinite(v.double_)) {
      i_ = start;
      fail("a number out of the range of a double");
    }
    v.kind_ = json_value::kind::floating;
    return v;
  }

  std::string_view s_;
  std::size_t i_ = 0;
};

inline json_value json_value::parse(std::string_view text) { return json_parser(text).document(); }

}  // namespace lockstep
