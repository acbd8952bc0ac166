// lockstep/io/detail/json_text.hpp — the text of JSON's scalars for io/json.hpp: UTF-8 checks, string escapes,
// and numbers read and written. Internal.
#pragma once

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>

namespace lockstep::detail {

/// The length of the valid UTF-8 sequence at s[i], or 0 when it is not one (overlong forms, surrogates and code
/// points past U+10FFFF are not valid).
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
    if (c == 0xe0) lo = 0xa0;  // no overlong forms
    if (c == 0xed) hi = 0x9f;  // no surrogates
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) lo = 0x90;  // no overlong forms
    if (c == 0xf4) hi = 0x8f;  // nothing past U+10FFFF
  } else {
    return 0;
  }
  if (i + n > s.size() || b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k) {
    if (b(i + k) < 0x80 || b(i + k) > 0xbf) return 0;
  }
  return n;
}

/// Appends the code point `cp` (at most U+10FFFF, not a surrogate) in UTF-8.
inline void append_utf8(std::string& out, std::uint32_t cp) {
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

/// Appends `s` as a JSON string: quotes, backslashes and control characters escaped (\b \f \n \r \t, else \u00xx),
/// everything else as is. Returns the index of the first byte that is not valid UTF-8, or npos when all are.
inline std::size_t append_json_string(std::string& out, std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  out += '"';
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const std::size_t n = utf8_sequence(s, i);
      if (n == 0) return i;
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
  return std::string_view::npos;
}

/// Appends the finite double `v` with the fewest significant digits that read back to it (std::to_chars), laid out
/// as nlohmann::json lays numbers out: plainly from 0.0001 to below 10^15 ("0.0001", "12.5", "100.0"), else as
/// "d.ddde+XX" with at least two exponent digits ("1e-05", "1.5e+15"); always with a '.' or an exponent. So a
/// manifest reads the same to this lockstep and to the versions that wrote theirs with nlohmann::json (their digits
/// come from Grisu2, which in rare cases gives one more digit than the shortest).
inline void append_json_double(std::string& out, double v) {
  if (v == 0.0) {
    out += std::signbit(v) ? "-0.0" : "0.0";
    return;
  }
  char sci[40];
  const auto r = std::to_chars(sci, sci + sizeof sci, v, std::chars_format::scientific);  // "-d.ddde-XX"
  std::string_view t(sci, static_cast<std::size_t>(r.ptr - sci));
  if (t.front() == '-') {
    out += '-';
    t.remove_prefix(1);
  }
  const std::size_t e_at = t.find('e');
  std::string digits(t.substr(0, e_at));
  if (digits.size() > 1) digits.erase(1, 1);  // the '.'
  int exponent = 0;
  std::from_chars(t.data() + e_at + 1 + (t[e_at + 1] == '+' ? 1 : 0), t.data() + t.size(), exponent);
  const int k = static_cast<int>(digits.size());
  const int n = exponent + 1;  // the decimal point's place after the first digit
  if (k <= n && n <= 15) {     // 1234e7 -> 12340000000.0
    out += digits;
    out.append(static_cast<std::size_t>(n - k), '0');
    out += ".0";
  } else if (0 < n && n <= 15) {  // 1234e-2 -> 12.34
    out.append(digits, 0, static_cast<std::size_t>(n));
    out += '.';
    out.append(digits, static_cast<std::size_t>(n));
  } else if (-4 < n && n <= 0) {  // 1234e-6 -> 0.001234
    out += "0.";
    out.append(static_cast<std::size_t>(-n), '0');
    out += digits;
  } else {  // d.igitse+XX
    out += digits[0];
    if (k > 1) {
      out += '.';
      out.append(digits, 1);
    }
    const int e = n - 1;
    out += e < 0 ? "e-" : "e+";
    const int a = e < 0 ? -e : e;
    if (a < 10) out += '0';
    out += std::to_string(a);
  }
}

/// The double that the JSON number `text` (valid by JSON's grammar) denotes: false when it is beyond a double's
/// range. A number too small for a double reads as zero of its sign (as strtod and nlohmann::json read it).
inline bool read_json_double(std::string_view text, double& out) noexcept {
  const auto r = std::from_chars(text.data(), text.data() + text.size(), out);
  if (r.ec == std::errc()) return true;
  if (r.ec != std::errc::result_out_of_range) return false;
  // Overflow or underflow: the decimal magnitude is the count of integer digits (or minus the zeros after the point
  // when the integer part is 0) plus the exponent.
  std::size_t i = text.front() == '-' ? 1 : 0;
  long magnitude = 0;
  if (text[i] != '0') {
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') ++magnitude, ++i;
  } else if (++i < text.size() && text[i] == '.') {
    while (++i < text.size() && text[i] == '0') --magnitude;
  }
  const std::size_t e = text.find_first_of("eE");
  if (e != std::string_view::npos) {
    long exponent = 0;
    const char* first = text.data() + e + 1 + (text[e + 1] == '+' ? 1 : 0);
    const bool read = std::from_chars(first, text.data() + text.size(), exponent).ec == std::errc();
    const long limit = static_cast<long>(text.size());  // |magnitude| before the exponent is at most this
    if (!read || exponent > limit || exponent < -limit) {
      magnitude = text[e + 1] == '-' ? -1 : 1;  // an exponent this far out decides alone
    } else {
      magnitude += exponent;
    }
  }
  if (magnitude > 0) return false;
  out = text.front() == '-' ? -0.0 : 0.0;
  return true;
}

}  // namespace lockstep::detail
