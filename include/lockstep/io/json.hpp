// lockstep/io/json.hpp — the JSON that lockstep's files hold (a checkpoint's manifest, a safetensors header, a
// checkpoint's user entry), read and written by lockstep itself:
//
//   json_value m{{"format", "mine"}};
//   m["position"]["step"] = 100;                  // objects and null values grow by name
//   m["lrs"] = std::vector<float>{0.1f, 0.01f};
//   std::string text = m.dump();                  // compact; dump(1) indents by one space
//   json_value back = json_value::parse(text);    // throws json_error (a data_error) naming the byte
//   float lr = back.at("lrs").at(1).get<float>();
//
// Strict RFC 8259: one value, no comments, no trailing commas, strings of valid UTF-8 (escapes decoded, lone
// surrogates refused), no key twice in one object, arrays and objects nested at most json_value::max_depth deep. Numbers without a
// fraction or exponent that fit 64 bits stay integers (signed or unsigned, as written); others are doubles.
// Objects keep their keys sorted by bytes, so a dump does not depend on the order in which keys were added, and a
// reference to a member stays valid while others are added. Doubles are written with the fewest digits that read
// back to the same value, laid out as nlohmann::json writes them; NaN and infinities are refused (JSON has no
// spelling for them). A value takes 16 bytes (strings, arrays and objects on the heap).
//
// It is lockstep's own so that including a checkpoint does not cost a JSON library's compile time (nlohmann's
// header took 233 MiB and 1.8 s to parse, about a fifth of lockstep.hpp's). It is small on purpose: a document
// model for files of a few kilobytes, not a general-purpose library. Any JSON library exchanges values with it as
// text: dump() and parse().
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/io/detail/json_text.hpp"

namespace lockstep {

namespace detail {
class json_parser;
}

/// Malformed JSON text, or a value read as what it is not (a missing member, a string read as a number, a number
/// out of the range of the type read). A data_error: the files lockstep reads are data. (Changing a value as what
/// it is not, such as appending to a string, is a precondition_error.)
class json_error : public data_error {
 public:
  using data_error::data_error;
};

/// A JSON value: null, a boolean, a number (a signed or unsigned 64-bit integer, or a double), a string, an array
/// or an object. See the file comment. Copies are deep.
class json_value {
 public:
  enum class kind : std::uint8_t { null, boolean, integer, unsigned_integer, floating, string, array, object };
  /// An object's members, sorted by key (std::less<> also finds a std::string_view key).
  using object_map = std::map<std::string, json_value, std::less<>>;
  /// The deepest nesting parse() accepts (a file nested deeper is refused rather than read by deep recursion).
  static constexpr int max_depth = 256;

  /// Null.
  json_value() noexcept : u_{} {}
  json_value(std::nullptr_t) noexcept : u_{} {}
  json_value(bool b) noexcept : kind_(kind::boolean) { u_.b = b; }
  /// A signed integer type makes an integer, an unsigned one an unsigned integer (char is not a number here).
  template <class I>
    requires(std::is_integral_v<I> && !std::is_same_v<I, bool> && !std::is_same_v<I, char>)
  json_value(I i) noexcept;
  json_value(double d) noexcept : kind_(kind::floating) { u_.d = d; }
  json_value(float f) noexcept : kind_(kind::floating) { u_.d = f; }
  json_value(std::string s);
  json_value(std::string_view s) : json_value(std::string(s)) {}
  json_value(const char* s) : json_value(std::string(s)) {}
  /// An array of the elements' values.
  template <class T>
  json_value(const std::vector<T>& items);
  /// An object of the map's members (members() of another value too).
  template <class T, class Less>
  json_value(const std::map<std::string, T, Less>& members);
  /// An object: json_value{{"lr", 0.1f}, {"nesterov", true}}. Throws json_error when a key is given twice.
  json_value(std::initializer_list<std::pair<const std::string, json_value>> members);

  json_value(const json_value& other);
  json_value(json_value&& other) noexcept : kind_(other.kind_), u_(other.u_) { other.kind_ = kind::null; }
  /// By value: `v = v["member"]` copies the member before v lets go of it.
  json_value& operator=(json_value other) noexcept {
    swap(other);
    return *this;
  }
  ~json_value() { release(); }
  void swap(json_value& other) noexcept {
    std::swap(kind_, other.kind_);
    std::swap(u_, other.u_);
  }

  [[nodiscard]] static json_value object();
  [[nodiscard]] static json_value array();
  /// Parses `text`: one JSON value, optionally surrounded by whitespace. Throws json_error naming what is wrong
  /// and the byte of `text` where it is. O(size of text x log of the largest object's member count).
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

  /// An object's members (sorted by key), or an array's elements; throws json_error for other kinds.
  [[nodiscard]] const object_map& members() const;
  [[nodiscard]] const std::vector<json_value>& elements() const;
  /// An array's elements, in order (throws json_error for other kinds).
  [[nodiscard]] std::vector<json_value>::const_iterator begin() const { return elements().begin(); }
  [[nodiscard]] std::vector<json_value>::const_iterator end() const { return elements().end(); }
  /// An array's elements or an object's members; 0 for null; throws json_error for the other kinds.
  [[nodiscard]] std::size_t size() const;

  /// The member `key` of an object, or nullptr (also when this is not an object). O(log members).
  [[nodiscard]] const json_value* find(std::string_view key) const noexcept;
  [[nodiscard]] bool contains(std::string_view key) const noexcept { return find(key) != nullptr; }
  /// The member `key`; throws json_error when this is not an object or has no such member.
  [[nodiscard]] const json_value& at(std::string_view key) const;
  [[nodiscard]] json_value& at(std::string_view key);
  /// The element `i` of an array; throws json_error when this is not an array or `i` is past its end.
  [[nodiscard]] const json_value& at(std::size_t i) const;
  [[nodiscard]] json_value& at(std::size_t i);
  /// The member `key`, added as null when missing; a null value becomes an empty object first. Throws
  /// precondition_error for the other kinds.
  json_value& operator[](std::string_view key);
  json_value& operator[](const char* key) { return (*this)[std::string_view(key)]; }
  [[nodiscard]] const json_value& operator[](std::string_view key) const { return at(key); }
  [[nodiscard]] const json_value& operator[](const char* key) const { return at(std::string_view(key)); }
  /// The element `i` of an array, as at(i). Any integer type (a literal 0 would otherwise be as good a const char*
  /// as a std::size_t).
  template <class I>
    requires std::is_integral_v<I>
  [[nodiscard]] const json_value& operator[](I i) const;
  template <class I>
    requires std::is_integral_v<I>
  json_value& operator[](I i);
  /// Appends to an array (a null value becomes an empty array first); throws precondition_error for other kinds.
  void push_back(json_value v);
  /// Removes the member `key` of an object, if any; returns how many were removed (0 or 1).
  std::size_t erase(std::string_view key);
  /// Sets every member of the object `other` on this object (a null value becomes an object first). Throws
  /// json_error when `other` is not an object, precondition_error when this is neither null nor an object.
  void update(const json_value& other);

  /// The value as T: bool; an arithmetic type (integers must be integers in T's range; a float or double takes any
  /// number in its range, rounded to nearest); std::string; json_value; or a std::vector of those. Throws json_error
  /// otherwise.
  template <class T>
  [[nodiscard]] T get() const;
  /// get<T>() of the member `key`, or `fallback` when this has no such member (or is not an object).
  template <class T>
  [[nodiscard]] T value(std::string_view key, const T& fallback) const;
  [[nodiscard]] std::string value(std::string_view key, const char* fallback) const;

  /// The text of this value: compact when `indent` is negative, else one member or element per line, indented by
  /// `indent` spaces a level (with ": " between keys and values). Throws json_error for NaN or an infinity, and
  /// for a string that is not valid UTF-8. Linear in the size of the text.
  [[nodiscard]] std::string dump(int indent = -1) const;

  /// Deep equality. Numbers compare by value across their kinds (1 == 1u == 1.0), as JSON has one number type.
  friend bool operator==(const json_value& a, const json_value& b) noexcept;

 private:
  friend class detail::json_parser;
  union storage {
    bool b;
    std::int64_t i;
    std::uint64_t u;
    double d;
    std::string* s;
    std::vector<json_value>* a;
    object_map* o;
  };
  void release() noexcept;
  void dump_to(std::string& out, int indent, int level) const;
  [[noreturn]] void fail_read(const char* wanted) const;
  [[noreturn]] void fail_change(const char* change) const;
  [[nodiscard]] double number() const noexcept;  // a number's value as a double

  kind kind_ = kind::null;
  storage u_;
};

}  // namespace lockstep

#include "lockstep/io/detail/json_value.hpp"
