// lockstep/core/units.hpp — byte counts as people read and write them.
#pragma once

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

namespace lockstep {

/// "512 B", "4.00 KiB", "1.50 GiB".
inline std::string format_bytes(std::uint64_t bytes) {
  constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

/// Parses "4096", "64K", "512M", "4G", "4GiB", "4GB", "1T" (all binary multiples); nullopt when malformed or
/// overflowing.
inline std::optional<std::uint64_t> parse_bytes(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (s.empty()) return std::nullopt;
  std::uint64_t value = 0;
  std::size_t i = 0;
  for (; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])); ++i) {
    const std::uint64_t digit = static_cast<std::uint64_t>(s[i] - '0');
    if (value > (std::numeric_limits<std::uint64_t>::max() - digit) / 10) return std::nullopt;
    value = value * 10 + digit;
  }
  if (i == 0) return std::nullopt;
  std::string_view suffix = s.substr(i);
  while (!suffix.empty() && suffix.front() == ' ') suffix.remove_prefix(1);
  int shift = 0;
  if (!suffix.empty()) {
    switch (std::toupper(static_cast<unsigned char>(suffix.front()))) {
      case 'B': shift = 0; break;
      case 'K': shift = 10; break;
      case 'M': shift = 20; break;
      case 'G': shift = 30; break;
      case 'T': shift = 40; break;
      default: return std::nullopt;
    }
    std::string_view rest = suffix.substr(1);
    if (shift != 0 && !(rest.empty() || rest == "B" || rest == "iB" || rest == "b" || rest == "ib"))
      return std::nullopt;
    if (shift == 0 && !rest.empty()) return std::nullopt;
  }
  if (shift && value > (std::numeric_limits<std::uint64_t>::max() >> shift)) return std::nullopt;
  return value << shift;
}

}  // namespace lockstep
