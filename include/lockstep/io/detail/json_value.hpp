// lockstep/io/detail/json_value.hpp — the definitions of io/json.hpp's json_value and its parser. Included by
// io/json.hpp after the class; not on its own.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <memory>
#include <string>
#include <system_error>
#include <utility>

#include "lockstep/io/json.hpp"

namespace lockstep {

template <class I>
  requires(std::is_integral_v<I> && !std::is_same_v<I, bool> && !std::is_same_v<I, char>)
json_value::json_value(I i) noexcept {
  if constexpr (std::is_signed_v<I>) {
    kind_ = kind::integer;
    u_.i = i;
  } else {
    kind_ = kind::unsigned_integer;
    u_.u = i;
  }
}

inline json_value::json_value(std::string s) : kind_(kind::string) { u_.s = new std::string(std::move(s)); }

template <class T>
json_value::json_value(const std::vector<T>& items) : kind_(kind::array) {
  u_.a = new std::vector<json_value>(items.begin(), items.end());
}

template <class T, class Less>
json_value::json_value(const std::map<std::string, T, Less>& members) : kind_(kind::object) {
  u_.o = new object_map(members.begin(), members.end());
}

inline json_value::json_value(std::initializer_list<std::pair<const std::string, json_value>> members)
    : kind_(kind::null) {
  auto map = std::make_unique<object_map>();
  for (const auto& m : members) {
    if (!map->insert(m).second) throw json_error(detail::concat("JSON: the key '", m.first, "' is given twice"));
  }
  u_.o = map.release();
  kind_ = kind::object;
}

inline json_value::json_value(const json_value& other) : kind_(other.kind_), u_(other.u_) {
  switch (kind_) {
    case kind::string: u_.s = new std::string(*other.u_.s); break;
    case kind::array: u_.a = new std::vector<json_value>(*other.u_.a); break;
    case kind::object: u_.o = new object_map(*other.u_.o); break;
    default: break;
  }
}

inline void json_value::release() noexcept {
  switch (kind_) {
    case kind::string: delete u_.s; break;
    case kind::array: delete u_.a; break;
    case kind::object: delete u_.o; break;
    default: break;
  }
  kind_ = kind::null;
}

inline json_value json_value::object() {
  json_value v;
  v.u_.o = new object_map();
  v.kind_ = kind::object;
  return v;
}

inline json_value json_value::array() {
  json_value v;
  v.u_.a = new std::vector<json_value>();
  v.kind_ = kind::array;
  return v;
}

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

inline void json_value::fail_read(const char* wanted) const {
  throw json_error(detail::concat("JSON: expected ", wanted, ", got ", type_name()));
}

inline void json_value::fail_change(const char* change) const {
  const char* name = type_name();
  throw precondition_error(detail::concat("json_value: cannot ", change, name[0] == 'a' || name[0] == 'o' ? " an " : " a ",
                                          name));
}

inline const json_value::object_map& json_value::members() const {
  if (kind_ != kind::object) fail_read("an object");
  return *u_.o;
}

inline const std::vector<json_value>& json_value::elements() const {
  if (kind_ != kind::array) fail_read("an array");
  return *u_.a;
}

inline std::size_t json_value::size() const {
  switch (kind_) {
    case kind::null: return 0;
    case kind::array: return u_.a->size();
    case kind::object: return u_.o->size();
    default: fail_read("an array or an object");
  }
}

inline const json_value* json_value::find(std::string_view key) const noexcept {
  if (kind_ != kind::object) return nullptr;
  const auto it = u_.o->find(key);
  return it != u_.o->end() ? &it->second : nullptr;
}

inline const json_value& json_value::at(std::string_view key) const {
  if (kind_ != kind::object) fail_read("an object");
  const json_value* v = find(key);
  if (!v) throw json_error(detail::concat("JSON: no member '", key, "'"));
  return *v;
}

inline json_value& json_value::at(std::string_view key) { return const_cast<json_value&>(std::as_const(*this).at(key)); }

inline const json_value& json_value::at(std::size_t i) const {
  const auto& a = elements();
  if (i >= a.size()) throw json_error(detail::concat("JSON: no element ", i, " in an array of ", a.size()));
  return a[i];
}

inline json_value& json_value::at(std::size_t i) { return const_cast<json_value&>(std::as_const(*this).at(i)); }

template <class I>
  requires std::is_integral_v<I>
const json_value& json_value::operator[](I i) const {
  if constexpr (std::is_signed_v<I>) {
    if (i < 0) throw json_error(detail::concat("JSON: no element ", i, " (a negative index)"));
  }
  return at(static_cast<std::size_t>(i));
}

template <class I>
  requires std::is_integral_v<I>
json_value& json_value::operator[](I i) {
  return const_cast<json_value&>(std::as_const(*this)[i]);
}

inline json_value& json_value::operator[](std::string_view key) {
  if (kind_ == kind::null) *this = object();
  if (kind_ != kind::object) fail_change("set a member of");
  const auto it = u_.o->find(key);
  if (it != u_.o->end()) return it->second;
  return u_.o->emplace(std::string(key), json_value()).first->second;
}

inline void json_value::push_back(json_value v) {
  if (kind_ == kind::null) *this = array();
  if (kind_ != kind::array) fail_change("append to");
  u_.a->push_back(std::move(v));
}

inline std::size_t json_value::erase(std::string_view key) {
  if (kind_ != kind::object) return 0;
  const auto it = u_.o->find(key);
  if (it == u_.o->end()) return 0;
  u_.o->erase(it);
  return 1;
}

inline void json_value::update(const json_value& other) {
  const object_map copy = other.members();  // `other` may be a member of this
  if (kind_ == kind::null) *this = object();
  if (kind_ != kind::object) fail_change("update");
  for (const auto& [key, v] : copy) (*this)[key] = v;
}

inline double json_value::number() const noexcept {
  return kind_ == kind::floating ? u_.d : kind_ == kind::integer ? static_cast<double>(u_.i) : static_cast<double>(u_.u);
}

template <class T>
T json_value::get() const {
  if constexpr (std::is_same_v<T, json_value>) {
    return *this;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (kind_ != kind::boolean) fail_read("a boolean");
    return u_.b;
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!is_number()) fail_read("a number");
    const double d = number();
    if constexpr (std::is_same_v<T, float>) {
      // past FLT_MAX by half an ulp or more: rounding would give infinity (JSON's numbers are finite)
      if (std::isfinite(d) && std::abs(d) >= 0x1.ffffffp+127) {
        throw json_error(detail::concat("JSON: the number ", d, " is beyond the range of a float"));
      }
    }
    return static_cast<T>(d);
  } else if constexpr (std::is_integral_v<T>) {
    if (!is_number_integer()) fail_read("an integer");
    if (kind_ == kind::integer ? !std::in_range<T>(u_.i) : !std::in_range<T>(u_.u)) {
      throw json_error(detail::concat("JSON: the integer ", dump(), " does not fit the type read"));
    }
    return kind_ == kind::integer ? static_cast<T>(u_.i) : static_cast<T>(u_.u);
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (kind_ != kind::string) fail_read("a string");
    return *u_.s;
  } else {
    static_assert(requires { typename T::value_type; }, "json_value::get: no conversion to this type");
    T out;
    for (const auto& e : elements()) out.push_back(e.template get<typename T::value_type>());
    return out;
  }
}

template <class T>
T json_value::value(std::string_view key, const T& fallback) const {
  const json_value* v = find(key);
  return v ? v->get<T>() : fallback;
}

inline std::string json_value::value(std::string_view key, const char* fallback) const {
  return value(key, std::string(fallback));
}

inline bool operator==(const json_value& a, const json_value& b) noexcept {
  using k = json_value::kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind_ == k::floating || b.kind_ == k::floating) return a.number() == b.number();
    if (a.kind_ == b.kind_) return a.kind_ == k::integer ? a.u_.i == b.u_.i : a.u_.u == b.u_.u;
    const auto& s = a.kind_ == k::integer ? a : b;  // one signed, one unsigned
    const auto& u = a.kind_ == k::integer ? b : a;
    return s.u_.i >= 0 && static_cast<std::uint64_t>(s.u_.i) == u.u_.u;
  }
  if (a.kind_ != b.kind_) return false;
  switch (a.kind_) {
    case k::null: return true;
    case k::boolean: return a.u_.b == b.u_.b;
    case k::string: return *a.u_.s == *b.u_.s;
    case k::array: return *a.u_.a == *b.u_.a;
    case k::object: return *a.u_.o == *b.u_.o;
    default: return false;
  }
}

inline std::string json_value::dump(int indent) const {
  std::string out;
  dump_to(out, indent, 0);
  return out;
}

inline void json_value::dump_to(std::string& out, int indent, int level) const {
  const auto newline = [&](int at) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<std::size_t>(indent) * static_cast<std::size_t>(at), ' ');
  };
  const auto string = [&](std::string_view s) {
    const std::size_t bad = detail::append_json_string(out, s);
    if (bad != std::string_view::npos) {
      throw json_error(detail::concat("JSON: a string to write is not valid UTF-8 (its byte ", bad, ")"));
    }
  };
  switch (kind_) {
    case kind::null: out += "null"; return;
    case kind::boolean: out += u_.b ? "true" : "false"; return;
    case kind::integer: out += std::to_string(u_.i); return;
    case kind::unsigned_integer: out += std::to_string(u_.u); return;
    case kind::floating:
      if (!std::isfinite(u_.d)) throw json_error(detail::concat("JSON: cannot write ", u_.d, " (JSON has no NaN or infinity)"));
      detail::append_json_double(out, u_.d);
      return;
    case kind::string: string(*u_.s); return;
    case kind::array: {
      out += '[';
      bool first = true;
      for (const json_value& e : *u_.a) {
        if (!first) out += ',';
        first = false;
        newline(level + 1);
        e.dump_to(out, indent, level + 1);
      }
      if (!first) newline(level);
      out += ']';
      return;
    }
    case kind::object: {
      out += '{';
      bool first = true;
      for (const auto& [key, v] : *u_.o) {
        if (!first) out += ',';
        first = false;
        newline(level + 1);
        string(key);
        out += indent < 0 ? ":" : ": ";
        v.dump_to(out, indent, level + 1);
      }
      if (!first) newline(level);
      out += '}';
      return;
    }
  }
}

namespace detail {

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
  [[noreturn]] void fail(std::string_view what) const { throw json_error(concat("JSON: ", what, " at byte ", i_)); }
  [[noreturn]] void fail_here(std::string_view what) const { fail(i_ < s_.size() ? what : "unexpected end of the text"); }
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
  void expect(char c, std::string_view what) {
    if (!take(c)) fail_here(what);
  }
  json_value literal(std::string_view word, json_value v) {
    if (s_.substr(i_, word.size()) != word) fail("an unknown literal");
    i_ += word.size();
    return v;
  }

  json_value value(int depth) {
    if (i_ >= s_.size()) fail("unexpected end of the text");
    if ((s_[i_] == '{' || s_[i_] == '[') && depth >= json_value::max_depth) {
      fail(concat("nesting deeper than ", json_value::max_depth));
    }
    switch (s_[i_]) {
      case '{': return object(depth);
      case '[': return array(depth);
      case '"': return json_value(string());
      case 't': return literal("true", json_value(true));
      case 'f': return literal("false", json_value(false));
      case 'n': return literal("null", json_value());
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
      if (i_ >= s_.size() || s_[i_] != '"') fail_here("expected a key string");
      const std::size_t key_at = i_;
      std::string key = string();
      const std::string_view spelled = s_.substr(key_at, i_ - key_at);
      skip_space();
      expect(':', "expected ':' after a key");
      skip_space();
      json_value member = value(depth + 1);
      if (!v.u_.o->emplace(std::move(key), std::move(member)).second) {
        i_ = key_at;
        std::size_t shown = spelled.size() <= 80 ? spelled.size() : 80;
        while (shown < spelled.size() && (static_cast<unsigned char>(spelled[shown]) & 0xc0) == 0x80) --shown;
        fail(concat("the key ", spelled.substr(0, shown), shown < spelled.size() ? "..." : "",
                    " appears twice in one object"));
      }
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
      v.u_.a->push_back(value(depth + 1));
      skip_space();
      if (take(']')) return v;
      expect(',', "expected ',' or ']' in an array");
    }
  }

  std::uint32_t hex4() {
    if (s_.size() - i_ < 4) fail("a \\u escape needs four hex digits");
    std::uint32_t cp = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[i_];
      cp <<= 4;
      if (c >= '0' && c <= '9') cp |= static_cast<std::uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') cp |= static_cast<std::uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') cp |= static_cast<std::uint32_t>(c - 'A' + 10);
      else fail("a \\u escape needs four hex digits");
      ++i_;
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
        const std::size_t n = utf8_sequence(s_, i_);
        if (n == 0) fail("a string that is not valid UTF-8");
        out.append(s_.substr(i_, n));
        i_ += n;
        continue;
      }
      if (c != '\\') {
        out += static_cast<char>(c);
        ++i_;
        continue;
      }
      if (++i_ >= s_.size()) fail("a string without its closing quote");
      const char e = s_[i_++];
      switch (e) {
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
          append_utf8(out, cp);
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
    if (!digit()) fail_here("an unexpected character");
    if (!take('0')) {
      while (digit()) ++i_;
    }
    bool integral = true;
    if (take('.')) {
      integral = false;
      if (!digit()) fail("a number needs digits after its '.'");
      while (digit()) ++i_;
    }
    if (take('e') || take('E')) {
      integral = false;
      if (!take('+')) take('-');
      if (!digit()) fail("a number needs digits in its exponent");
      while (digit()) ++i_;
    }
    const std::string_view text = s_.substr(start, i_ - start);
    if (integral) {  // an integer when it fits 64 bits, else a double
      if (text.front() == '-') {
        std::int64_t v;
        if (std::from_chars(text.data(), text.data() + text.size(), v).ec == std::errc()) return json_value(v);
      } else {
        std::uint64_t v;
        if (std::from_chars(text.data(), text.data() + text.size(), v).ec == std::errc()) return json_value(v);
      }
    }
    double d;
    if (!read_json_double(text, d)) {
      i_ = start;
      fail("a number beyond the range of a double");
    }
    return json_value(d);
  }

  std::string_view s_;
  std::size_t i_ = 0;
};

}  // namespace detail

inline json_value json_value::parse(std::string_view text) { return detail::json_parser(text).document(); }

}  // namespace lockstep
