// lockstep/device/visibility.hpp — CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, as the CUDA runtime reads them.
//
// The CUDA runtime reads both variables once, when it starts (at the first CUDA call of the process), and
// never again. Setting them later silently changes nothing: the classic "I set CUDA_VISIBLE_DEVICES=1,2 but
// device_count() still says 4". lockstep turns that silence into an error:
//
//   - `set_visible_devices("1,2")` works before CUDA starts and throws device_error after, explaining why;
//   - `check_cuda_environment_unchanged()` (called whenever devices are selected) throws when the variables
//     differ from what the runtime read.
//
// "CUDA started" means: lockstep made its first CUDA runtime call, or the CUDA driver library is loaded and
// initialized in this process (somebody else called CUDA). Nothing here calls CUDA itself.
#pragma once

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/device/device.hpp"

namespace lockstep {

/// How the CUDA runtime orders devices (CUDA_DEVICE_ORDER).
enum class cuda_device_order : std::uint8_t {
  fastest_first,  // the runtime's default: fastest device first
  pci_bus_id,     // by PCI bus id, the order nvidia-smi shows
};

namespace detail {

struct cuda_start_state {
  std::mutex mutex;
  bool started = false;
  std::string started_by;     // which lockstep call started the runtime
  bool visible_set = false;   // CUDA_VISIBLE_DEVICES was set when the runtime read it
  std::string visible;        // its value then
  bool order_set = false;
  std::string order;
};

inline cuda_start_state& cuda_start() {
  static cuda_start_state s;
  return s;
}

/// Records that lockstep is about to make its first CUDA runtime call, and what the runtime will read.
inline void mark_cuda_runtime_started(const char* by) {
  auto& s = cuda_start();
  std::lock_guard lock(s.mutex);
  if (s.started) return;
  s.started = true;
  s.started_by = by;
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");
  s.visible_set = v != nullptr;
  s.visible = v ? v : "";
  const char* o = std::getenv("CUDA_DEVICE_ORDER");
  s.order_set = o != nullptr;
  s.order = o ? o : "";
}

/// True when the CUDA driver is loaded in this process and initialized (cuInit was called by anyone).
inline bool cuda_driver_initialized() noexcept {
  void* lib = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (!lib) return false;
  using get_current_fn = int (*)(void**);
  auto fn = reinterpret_cast<get_current_fn>(::dlsym(lib, "cuCtxGetCurrent"));
  void* ctx = nullptr;
  constexpr int cuda_error_not_initialized = 3;
  const bool initialized = fn != nullptr && fn(&ctx) != cuda_error_not_initialized;
  ::dlclose(lib);
  return initialized;
}

inline std::string env_or_unset(const char* name) {
  const char* v = std::getenv(name);
  return v ? detail::concat('\'', v, '\'') : std::string("unset");
}

}  // namespace detail

/// True once the CUDA runtime of this process has started (and read the visibility variables).
inline bool cuda_runtime_started() {
  {
    auto& s = detail::cuda_start();
    std::lock_guard lock(s.mutex);
    if (s.started) return true;
  }
  return detail::cuda_driver_initialized();
}

/// One entry of CUDA_VISIBLE_DEVICES: a physical ordinal, or a GPU/MIG UUID the driver resolves.
struct visible_device_entry {
  int ordinal = -1;    // physical index, or -1 for a UUID entry
  std::string uuid;    // "GPU-..." or "MIG-..." when ordinal == -1
};

/// Parses a CUDA_VISIBLE_DEVICES value as the CUDA runtime does: a comma-separated list of ordinals or
/// UUIDs; devices are enumerated in list order; the list ends at the first invalid entry (a non-number, a
/// negative or out-of-range ordinal, a repeated ordinal), so "1,-1,2" shows device 1 only, "-1" and "" show
/// none. `physical_count` is the number of devices the driver sees (-1 when unknown: no range check).
inline std::vector<visible_device_entry> parse_cuda_visible_devices(std::string_view value, int physical_count) {
  std::vector<visible_device_entry> out;
  std::size_t start = 0;
  while (start <= value.size()) {
    const auto comma = value.find(',', start);
    const auto item = detail::trim(value.substr(start, comma == std::string_view::npos ? value.npos : comma - start));
    if (item.rfind("GPU-", 0) == 0 || item.rfind("MIG-", 0) == 0) {
      out.push_back(visible_device_entry{-1, std::string(item)});
    } else {
      const int ordinal = detail::parse_index(item);
      if (ordinal < 0 || (physical_count >= 0 && ordinal >= physical_count)) break;
      bool repeated = false;
      for (const auto& e : out) repeated = repeated || e.ordinal == ordinal;
      if (repeated) break;
      out.push_back(visible_device_entry{ordinal, {}});
    }
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

/// Restricts the GPUs this process will see to `ids` (e.g. "1,2"), ordered by `order`, by setting
/// CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER. Must run before CUDA starts; afterwards it throws
/// device_error explaining that the runtime reads them once and what to do instead. Throws device_error when
/// `ids` is not a list of non-negative integers (the "cuda:1,2" mistake included).
inline void set_visible_devices(std::string_view ids, cuda_device_order order = cuda_device_order::pci_bus_id) {
  for (const auto& d : parse_device_list(ids, device_kind::cuda)) {
    if (!d.is_cuda()) {
      throw device_error(detail::concat("set_visible_devices(\"", ids, "\"): ", d.str(),
                                        " is not a GPU; CUDA_VISIBLE_DEVICES lists GPU ids such as \"1,2\""));
    }
  }
  std::string plain;
  for (const auto& d : parse_device_list(ids, device_kind::cuda)) {
    if (!plain.empty()) plain += ',';
    plain += std::to_string(d.index);
  }
  if (cuda_runtime_started()) {
    auto& s = detail::cuda_start();
    std::string by;
    {
      std::lock_guard lock(s.mutex);
      by = s.started ? detail::concat(" (lockstep started it in ", s.started_by, ")") : std::string();
    }
    throw device_error(detail::concat(
        "set_visible_devices(\"", ids, "\") was called after the CUDA runtime started", by,
        ": the runtime reads CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER once, when it starts, so changing them "
        "now would have no effect and every device would stay visible. Either call set_visible_devices() "
        "before anything touches CUDA (first thing in main()), or set the variables in the shell "
        "(CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=",
        plain, " ./app), or leave all devices visible and select the ones you want with a device_set (\"",
        plain, "\") passed to data_parallel / run_on_devices."));
  }
  ::setenv("CUDA_VISIBLE_DEVICES", plain.c_str(), 1);
  ::setenv("CUDA_DEVICE_ORDER", order == cuda_device_order::pci_bus_id ? "PCI_BUS_ID" : "FASTEST_FIRST", 1);
}

/// Throws device_error when CUDA_VISIBLE_DEVICES or CUDA_DEVICE_ORDER differ from what the CUDA runtime read
/// when lockstep started it: the change has no effect, and the devices in use are not the ones the user
/// believes. Does nothing before CUDA starts.
inline void check_cuda_environment_unchanged() {
  auto& s = detail::cuda_start();
  std::lock_guard lock(s.mutex);
  if (!s.started) return;
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");
  const char* o = std::getenv("CUDA_DEVICE_ORDER");
  const bool visible_changed = (v != nullptr) != s.visible_set || (v && s.visible != v);
  const bool order_changed = (o != nullptr) != s.order_set || (o && s.order != o);
  if (!visible_changed && !order_changed) return;
  throw device_error(detail::concat(
      "CUDA_VISIBLE_DEVICES/CUDA_DEVICE_ORDER changed after the CUDA runtime started (it read ",
      s.visible_set ? detail::concat('\'', s.visible, '\'') : std::string("unset"), '/',
      s.order_set ? detail::concat('\'', s.order, '\'') : std::string("unset"), ", now ",
      detail::env_or_unset("CUDA_VISIBLE_DEVICES"), '/', detail::env_or_unset("CUDA_DEVICE_ORDER"),
      "): the runtime reads them once, at its start (", s.started_by,
      "), so the change has no effect. Set them before the first CUDA call — in the shell or first thing in "
      "main() via lockstep::set_visible_devices() — or select devices with a device_set instead."));
}

}  // namespace lockstep
