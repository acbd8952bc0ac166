// lockstep/device/device.hpp — what a device is, and how users spell one.
//
// A device is a kind (`cuda` for a GPU seen by the CUDA runtime, `host` for a virtual device on the CPU)
// and an index among the visible devices of that kind. The spellings are PyTorch's: "cuda", "cuda:1",
// "cpu", and lockstep's "host" / "host:2" ("cpu:2" is accepted as a synonym).
#pragma once

#include <charconv>
#include <compare>
#include <ostream>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/core/error.hpp"

namespace lockstep {

/// The backend a device belongs to.
enum class device_kind : std::uint8_t { host, cuda };

/// "host" or "cuda".
constexpr std::string_view name_of(device_kind k) noexcept { return k == device_kind::cuda ? "cuda" : "host"; }

/// One device: a kind and an index among the visible devices of that kind. Cheap to copy.
struct device {
  device_kind kind = device_kind::host;
  int index = 0;

  /// "cuda:1", "host:0".
  [[nodiscard]] std::string str() const { return std::string(name_of(kind)) + ':' + std::to_string(index); }
  [[nodiscard]] constexpr bool is_cuda() const noexcept { return kind == device_kind::cuda; }
  [[nodiscard]] constexpr bool is_host() const noexcept { return kind == device_kind::host; }
  friend constexpr bool operator==(const device&, const device&) = default;
  friend constexpr auto operator<=>(const device&, const device&) = default;
};

inline std::ostream& operator<<(std::ostream& os, const device& d) { return os << d.str(); }

namespace detail {

constexpr std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

/// Parses a non-negative decimal index; -1 when `s` is not one.
inline int parse_index(std::string_view s) noexcept {
  if (s.empty() || s.size() > 9) return -1;
  int value = -1;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc{} || end != s.data() + s.size() || value < 0) return -1;
  return value;
}

}  // namespace detail

/// Parses one device: "cuda", "cuda:1", "cpu", "host", "host:2", "cpu:2", or a bare index ("1") that names a
/// device of kind `bare_kind`. "cuda" alone means cuda:0, "cpu"/"host" alone host:0. Does not check that the
/// device exists (see `device_set`). Throws device_error with the reason and the correct spelling; in
/// particular "cuda:1,2" is rejected with the two spellings of a list.
inline device parse_device(std::string_view spec, device_kind bare_kind = device_kind::cuda) {
  const std::string_view s = detail::trim(spec);
  if (s.find(',') != std::string_view::npos) {
    const auto colon = s.find(':');
    std::string hint;
    if (colon != std::string_view::npos) {
      // "cuda:1,2" -> "cuda:1,cuda:2" and "1,2"
      std::string_view kind = s.substr(0, colon), ids = s.substr(colon + 1);
      std::string prefixed;
      std::size_t start = 0;
      while (start <= ids.size()) {
        auto comma = ids.find(',', start);
        auto id = detail::trim(ids.substr(start, comma == std::string_view::npos ? ids.npos : comma - start));
        if (!prefixed.empty()) prefixed += ',';
        prefixed += std::string(kind) + ':' + std::string(id);
        if (comma == std::string_view::npos) break;
        start = comma + 1;
      }
      hint = detail::concat(": write the list as \"", prefixed, "\" or as plain ids \"", ids,
                            "\" (a device_set), and pick one device with \"", kind, ':',
                            detail::trim(ids.substr(0, ids.find(','))), '"');
    }
    throw device_error(detail::concat("invalid device string '", s,
                                      "': a device string names exactly one device, and a list of devices is "
                                      "not a device",
                                      hint));
  }
  if (int idx = detail::parse_index(s); idx >= 0) return device{bare_kind, idx};
  const auto colon = s.find(':');
  const std::string_view kind_name = s.substr(0, colon);
  device_kind kind{};
  if (kind_name == "cuda") {
    kind = device_kind::cuda;
  } else if (kind_name == "host" || kind_name == "cpu") {
    kind = device_kind::host;
  } else {
    std::string hint;
    if (kind_name == "gpu" || kind_name == "GPU" || kind_name == "/gpu")
      hint = " (GPUs are spelled \"cuda\", e.g. \"cuda:0\")";
    throw device_error(detail::concat("invalid device string '", s, "': unknown device kind '", kind_name,
                                      "'; expected \"cuda\", \"cuda:N\", \"cpu\", \"host\" or \"host:N\"",
                                      hint));
  }
  if (colon == std::string_view::npos) return device{kind, 0};
  const std::string_view id = s.substr(colon + 1);
  const int idx = detail::parse_index(id);
  if (idx < 0) {
    throw device_error(detail::concat("invalid device string '", s, "': '", id,
                                      "' is not a device index; expected a non-negative integer as in \"",
                                      kind_name, ":0\""));
  }
  return device{kind, idx};
}

/// Splits a list of devices: "0,1,2", "cuda:0,cuda:2", "host:0, host:1". Bare ids are of kind `bare_kind`.
/// "cuda:1,2" is rejected (see parse_device). Does not resolve "all" and does not check ranges or duplicates:
/// `device_set` does, because it knows how many devices are visible.
inline std::vector<device> parse_device_list(std::string_view spec, device_kind bare_kind) {
  const std::string_view s = detail::trim(spec);
  if (s.empty()) throw device_error("empty device list: expected ids such as \"0,1\", \"cuda:0,cuda:1\" or \"all\"");
  const auto colon = s.find(':');
  const auto comma = s.find(',');
  if (colon != std::string_view::npos && comma != std::string_view::npos) {
    // Every element after the first must carry its own prefix: "cuda:1,2" is the classic mistake.
    std::size_t start = 0;
    while (start <= s.size()) {
      auto next = s.find(',', start);
      auto item = detail::trim(s.substr(start, next == std::string_view::npos ? s.npos : next - start));
      if (item.find(':') == std::string_view::npos && detail::parse_index(item) >= 0) {
        (void)parse_device(s, bare_kind);  // throws the explanatory message for "cuda:1,2"
      }
      if (next == std::string_view::npos) break;
      start = next + 1;
    }
  }
  std::vector<device> out;
  std::size_t start = 0;
  while (start <= s.size()) {
    auto next = s.find(',', start);
    auto item = detail::trim(s.substr(start, next == std::string_view::npos ? s.npos : next - start));
    if (item.empty()) {
      throw device_error(detail::concat("invalid device list '", s, "': empty entry between commas"));
    }
    out.push_back(parse_device(item, bare_kind));
    if (next == std::string_view::npos) break;
    start = next + 1;
  }
  return out;
}

}  // namespace lockstep
