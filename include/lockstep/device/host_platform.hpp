// lockstep/device/host_platform.hpp — how many host virtual devices exist and how much memory each has.
//
// Host devices are lockstep's CPU backend: each one has its own memory accounting with a limit, its own
// streams (worker threads) and events, exactly as a GPU would. Their number and memory limits are read once,
// when the host platform starts (the first time anything asks for a host device), from
//
//   LOCKSTEP_HOST_DEVICES        number of devices (default 2)
//   LOCKSTEP_HOST_DEVICE_MEMORY  limit per device: "4G", "512M", bytes; or one value per device "1G,2G"
//                                (default 4 GiB each)
//   LOCKSTEP_HOST_STRICT         1: host devices behave as strictly as GPUs (host_strictness::strict); 0 or
//                                unset: as lenient as the one address space they share (the default)
//
// or from code through `configure_host_platform()` before that first use. Like CUDA_VISIBLE_DEVICES for the
// CUDA runtime, a change after the start has no effect, so it is an error that says so.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#include <unistd.h>
#endif

#include "lockstep/core/error.hpp"
#include "lockstep/core/units.hpp"

namespace lockstep {

/// How closely host devices imitate GPUs where one address space and one kind of thread would forgive a bug.
enum class host_strictness : std::uint8_t {
  /// Host devices share the process's memory: a kernel on host:1 may read host:0's memory, as nothing stops it.
  lenient,
  /// What a GPU would reject fails a CPU test: every kernel, multi-tensor launch, copy and collective checks that
  /// the device memory it uses belongs to the device it runs on (a GPU would stop with cudaErrorIllegalAddress
  /// or read garbage), and host streams start some of their work late, at random (up to 200 us), so that two
  /// streams ordered by no event race visibly, as a GPU's do. Costs an address look-up per pointer and the
  /// delays: meant for tests (lockstep's own run with it).
  strict,
};

/// Configuration of the host virtual devices.
struct host_platform_config {
  /// Number of host devices, 1..64.
  int device_count = 2;
  /// Memory limit of each device in bytes; one entry for all devices or one per device.
  std::vector<std::uint64_t> memory_limits = {std::uint64_t{4} << 30};

  /// The limit of device `index`.
  [[nodiscard]] std::uint64_t memory_limit(int index) const {
    return memory_limits.size() == 1 ? memory_limits.front() : memory_limits.at(static_cast<std::size_t>(index));
  }
  /// See host_strictness; LOCKSTEP_HOST_STRICT=1 sets strict.
  host_strictness strictness = host_strictness::lenient;
};

namespace detail {

struct host_platform_state {
  std::mutex mutex;
  bool started = false;
  bool configured_by_code = false;
  host_platform_config config;
  std::string env_devices;  // LOCKSTEP_HOST_DEVICES as read at start ("" when unset)
  std::string env_memory;   // LOCKSTEP_HOST_DEVICE_MEMORY as read at start
  std::string env_strict;   // LOCKSTEP_HOST_STRICT as read at start
};

inline host_platform_state& host_platform() {
  static host_platform_state state;
  return state;
}

inline std::string getenv_string(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

/// Parses the two environment variables into `config`; throws device_error naming the variable.
inline void apply_host_environment(host_platform_config& config, const std::string& devices,
                                   const std::string& memory, const std::string& strict = {}) {
  if (!strict.empty()) {
    if (strict != "0" && strict != "1") {
      throw device_error(concat("LOCKSTEP_HOST_STRICT='", strict,
                                "' is not a switch: 1 makes host devices as strict as GPUs, 0 (or unset) does not"));
    }
    config.strictness = strict == "1" ? host_strictness::strict : host_strictness::lenient;
  }
  if (!devices.empty()) {
    int n = -1;
    try {
      std::size_t used = 0;
      n = std::stoi(devices, &used);
      if (used != devices.size()) n = -1;
    } catch (const std::exception&) {
      n = -1;
    }
    if (n < 1 || n > 64) {
      throw device_error(concat("LOCKSTEP_HOST_DEVICES='", devices,
                                "' is not a device count: expected an integer from 1 to 64"));
    }
    config.device_count = n;
  }
  if (!memory.empty()) {
    std::vector<std::uint64_t> limits;
    std::string_view rest = memory;
    while (true) {
      auto comma = rest.find(',');
      auto item = rest.substr(0, comma);
      auto bytes = parse_bytes(item);
      if (!bytes || *bytes == 0) {
        throw device_error(concat("LOCKSTEP_HOST_DEVICE_MEMORY='", memory, "': '", item,
                                  "' is not a memory size; write e.g. 4G, 512M or 1073741824, or one size "
                                  "per device separated by commas"));
      }
      limits.push_back(*bytes);
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
    if (limits.size() != 1 && limits.size() != static_cast<std::size_t>(config.device_count)) {
      throw device_error(concat("LOCKSTEP_HOST_DEVICE_MEMORY='", memory, "' lists ", limits.size(),
                                " sizes for ", config.device_count,
                                " host devices: give one size for all or one per device"));
    }
    config.memory_limits = std::move(limits);
  }
}

inline void validate(const host_platform_config& c) {
  LOCKSTEP_EXPECTS(c.device_count >= 1 && c.device_count <= 64, "host device count must be 1..64, got ",
                   c.device_count);
  LOCKSTEP_EXPECTS(c.memory_limits.size() == 1 || c.memory_limits.size() == static_cast<std::size_t>(c.device_count),
                   "host_platform_config has ", c.memory_limits.size(), " memory limits for ", c.device_count,
                   " devices: give one for all or one per device");
  for (auto limit : c.memory_limits) LOCKSTEP_EXPECTS(limit > 0, "a host device memory limit must be > 0");
}

}  // namespace detail

/// Sets the host devices from code. Must be called before the host platform starts (before the first
/// stream, buffer, device count or device_set of kind host); afterwards it throws device_error explaining
/// that the configuration was already read. The environment variables are not consulted once this is called.
inline void configure_host_platform(const host_platform_config& config) {
  detail::validate(config);
  auto& p = detail::host_platform();
  std::lock_guard lock(p.mutex);
  if (p.started) {
    throw device_error(detail::concat(
        "configure_host_platform() was called after the host platform started with ", p.config.device_count,
        " devices: the host device count and memory limits are read once, at the first use of a host device, "
        "so this call would have no effect. Call it at the top of main(), before creating streams, buffers or "
        "device sets, or set LOCKSTEP_HOST_DEVICES / LOCKSTEP_HOST_DEVICE_MEMORY in the environment before "
        "the program starts."));
  }
  p.config = config;
  p.configured_by_code = true;
}

/// Starts the host platform if needed and returns its configuration (constant from then on).
inline const host_platform_config& host_platform_configuration() {
  auto& p = detail::host_platform();
  std::lock_guard lock(p.mutex);
  if (!p.started) {
    p.env_devices = detail::getenv_string("LOCKSTEP_HOST_DEVICES");
    p.env_memory = detail::getenv_string("LOCKSTEP_HOST_DEVICE_MEMORY");
    p.env_strict = detail::getenv_string("LOCKSTEP_HOST_STRICT");
    if (!p.configured_by_code) {
      host_platform_config c;
      detail::apply_host_environment(c, p.env_devices, p.env_memory, p.env_strict);
      p.config = std::move(c);
    }
    p.started = true;
  }
  return p.config;
}

/// True once anything has used a host device.
inline bool host_platform_started() {
  auto& p = detail::host_platform();
  std::lock_guard lock(p.mutex);
  return p.started;
}

/// Number of host virtual devices (starts the platform).
inline int host_device_count() { return host_platform_configuration().device_count; }

namespace detail {
/// std::thread::hardware_concurrency(), at least 1 (it may return 0).
inline int hardware_threads() noexcept {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}
/// The cores this process may run on: the CPUs of its affinity mask (taskset, a cgroup's cpuset) on Linux,
/// else std::thread::hardware_concurrency(); at least 1.
inline int host_cores() noexcept {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
  return hardware_threads();
}
/// The machine's online CPUs (sysconf on Linux, else std::thread::hardware_concurrency()); at least 1.
inline int online_cores() noexcept {
#if defined(__linux__)
  if (const long n = sysconf(_SC_NPROCESSORS_ONLN); n > 0) return static_cast<int>(n);
#endif
  return hardware_threads();
}
}  // namespace detail

/// Throws device_error if LOCKSTEP_HOST_DEVICES or LOCKSTEP_HOST_DEVICE_MEMORY changed since the platform
/// read them: the change has no effect, and silently training on a different device count than the user
/// believes is the mistake this catches.
inline void check_host_environment_unchanged() {
  auto& p = detail::host_platform();
  std::lock_guard lock(p.mutex);
  if (!p.started || p.configured_by_code) return;
  const std::string devices = detail::getenv_string("LOCKSTEP_HOST_DEVICES");
  const std::string memory = detail::getenv_string("LOCKSTEP_HOST_DEVICE_MEMORY");
  const std::string strict = detail::getenv_string("LOCKSTEP_HOST_STRICT");
  if (devices != p.env_devices || memory != p.env_memory || strict != p.env_strict) {
    throw device_error(detail::concat(
        "LOCKSTEP_HOST_DEVICES/LOCKSTEP_HOST_DEVICE_MEMORY/LOCKSTEP_HOST_STRICT changed after the host platform "
        "started (was '", p.env_devices, "'/'", p.env_memory, "'/'", p.env_strict, "', now '", devices, "'/'", memory,
        "'/'", strict,
        "'): they are read once, at the first use of a host device, so ", p.config.device_count,
        " host devices remain. Set them before the program starts, or call configure_host_platform() at the "
        "top of main()."));
  }
}

}  // namespace lockstep
