// lockstep/device/device_set.hpp — an ordered set of devices of one kind, as users select them.
//
//   device_set("0,1,2")          bare ids: GPUs when there are any, host devices otherwise
//   device_set("cuda:0,cuda:2")  explicit kind
//   device_set("all")            every visible device of the default kind
//   device_set{0, 2}             a list of ids of the default kind
//   default_devices()            all GPUs, or the host devices when there is none, with the reason
//
// The first device of a set is the one DataParallel keeps the model on (PyTorch's device_ids[0]).
#pragma once

#include <algorithm>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/device/device.hpp"
#include "lockstep/device/query.hpp"

LOCKSTEP_ABI_BEGIN

class device_set {
 public:
  /// The empty set.
  device_set() = default;

  /// Parses `spec` (see the file comment); bare ids are of kind `default_device_kind()`. Throws
  /// device_error for a malformed spec ("cuda:1,2" included), a mix of kinds, an id that is not visible, or
  /// an id listed twice — each naming the visible count. Also throws when CUDA_VISIBLE_DEVICES or
  /// LOCKSTEP_HOST_DEVICES changed after they were read (the change would silently have no effect).
  explicit device_set(std::string_view spec) : device_set(parse(spec, default_device_kind())) {}

  /// Ids of the default device kind: `device_set{0, 1}`.
  device_set(std::initializer_list<int> ids) {
    const device_kind kind = default_device_kind();
    for (int id : ids) devices_.push_back(device{kind, id});
    validate(detail::concat("device_set{", join_ids(), '}'));
  }

  /// Explicit devices: `device_set{{device_kind::host, 0}, {device_kind::host, 1}}`.
  explicit device_set(std::vector<device> devices) : devices_(std::move(devices)) {
    validate(detail::concat("device_set{", str(), '}'));
  }

  /// Parses `spec` with bare ids of kind `bare_kind`.
  static device_set parse(std::string_view spec, device_kind bare_kind) {
    check_environment();
    const std::string_view s = detail::trim(spec);
    device_set out;
    if (s == "all" || s == "cuda" || s == "host" || s == "cpu") {
      const device_kind kind = s == "all" ? bare_kind : (s == "cuda" ? device_kind::cuda : device_kind::host);
      const int n = device_count(kind);
      if (n == 0) {
        throw device_error(detail::concat("device set '", s, "' is empty: no ", name_of(kind),
                                          " device is visible",
                                          kind == device_kind::cuda ? " — " + cuda_status().reason() : std::string()));
      }
      for (int i = 0; i < n; ++i) out.devices_.push_back(device{kind, i});
      return out;
    }
    out.devices_ = parse_device_list(s, bare_kind);
    out.validate(detail::concat('\'', s, '\''));
    return out;
  }

  /// Every visible device of `kind`.
  static device_set all(device_kind kind) { return parse("all", kind); }

  [[nodiscard]] std::size_t size() const noexcept { return devices_.size(); }
  [[nodiscard]] bool empty() const noexcept { return devices_.empty(); }
  [[nodiscard]] const device& operator[](std::size_t i) const { return devices_.at(i); }
  [[nodiscard]] const device& front() const { return devices_.at(0); }
  [[nodiscard]] auto begin() const noexcept { return devices_.begin(); }
  [[nodiscard]] auto end() const noexcept { return devices_.end(); }
  [[nodiscard]] const std::vector<device>& devices() const noexcept { return devices_; }
  /// The kind of every device of the set; precondition: not empty.
  [[nodiscard]] device_kind kind() const { return front().kind; }

  [[nodiscard]] bool contains(device d) const { return std::find(begin(), end(), d) != end(); }
  /// Position of `d` in the set, or -1.
  [[nodiscard]] int index_of(device d) const {
    auto it = std::find(begin(), end(), d);
    return it == end() ? -1 : static_cast<int>(it - begin());
  }

  /// "cuda:0,cuda:2".
  [[nodiscard]] std::string str() const {
    std::string s;
    for (const auto& d : devices_) {
      if (!s.empty()) s += ',';
      s += d.str();
    }
    return s;
  }

  friend bool operator==(const device_set&, const device_set&) = default;

 private:
  static void check_environment() {
    check_cuda_environment_unchanged();
    check_host_environment_unchanged();
  }

  std::string join_ids() const {
    std::string s;
    for (const auto& d : devices_) {
      if (!s.empty()) s += ", ";
      s += std::to_string(d.index);
    }
    return s;
  }

  void validate(const std::string& what) const {
    check_environment();
    if (devices_.empty()) throw device_error(detail::concat("device set ", what, " names no device"));
    for (std::size_t i = 0; i < devices_.size(); ++i) {
      const device d = devices_[i];
      if (d.kind != devices_[0].kind) {
        throw device_error(detail::concat("device set ", what, " mixes ", devices_[0].str(), " and ", d.str(),
                                          ": all devices of a set must be of one kind"));
      }
      for (std::size_t j = 0; j < i; ++j) {
        if (devices_[j] == d) {
          throw device_error(detail::concat("device set ", what, " lists ", d.str(), " twice (", device_count(d.kind),
                                            ' ', name_of(d.kind), " devices are visible: ids 0..",
                                            device_count(d.kind) - 1, ")"));
        }
      }
      check_device_exists(d);
    }
  }

  std::vector<device> devices_;
};

/// The devices a program uses when the user names none, and why.
struct device_selection {
  device_set devices;
  std::string reason;  // "2 GPUs found" / "no GPU — no CUDA driver (...); using 2 host devices"
};

/// All visible GPUs, or all host devices when there is no GPU — with the reason, so a program can print
/// what it runs on. Never throws for "no GPU".
inline device_selection default_devices() {
  const auto& cuda = cuda_status();
  if (cuda.device_count > 0) {
    return {device_set::all(device_kind::cuda),
            detail::concat(cuda.device_count, " GPU", cuda.device_count == 1 ? "" : "s", " found")};
  }
  const int n = host_device_count();
  return {device_set::all(device_kind::host),
          detail::concat("no GPU: ", cuda.reason(), "; using ", n, " host device", n == 1 ? "" : "s",
                         " (LOCKSTEP_HOST_DEVICES=", detail::env_or_unset("LOCKSTEP_HOST_DEVICES"), ')')};
}

LOCKSTEP_ABI_END
