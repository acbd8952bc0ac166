// lockstep/device/query.hpp — which devices exist, why there are none, and what they are.
//
// `cuda_status()` asks the CUDA runtime once how many GPUs it sees. On a machine without a GPU driver the
// runtime answers cudaErrorInsufficientDriver (or cudaErrorNoDevice without a GPU): that means "no GPU",
// not a failure, and the status keeps the reason so that `default_devices()` and `lockstep-info` can say it.
#pragma once

#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/cuda_check.hpp"
#include "lockstep/device/device.hpp"
#include "lockstep/device/host_platform.hpp"
#include "lockstep/device/visibility.hpp"

namespace lockstep::detail {
inline std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) return std::string(trim(std::string_view(line).substr(colon + 1)));
    }
  }
  return "unknown CPU";
}
}  // namespace detail

LOCKSTEP_ABI_BEGIN

/// What the CUDA runtime said when asked for devices.
struct cuda_runtime_status {
  bool compiled_in = false;   // this translation unit was compiled by nvcc
  int device_count = 0;       // GPUs visible to this process
  int error = 0;              // the cudaError_t of cudaGetDeviceCount (0: success)
  std::string error_name;     // "cudaErrorInsufficientDriver"
  std::string error_text;     // "CUDA driver version is insufficient for CUDA runtime version"
  int driver_version = 0;     // cudaDriverGetVersion: 0 when no driver is installed
  int runtime_version = 0;    // cudaRuntimeGetVersion, e.g. 13000

  /// Why no GPU can be used, in a sentence; empty when GPUs are available.
  [[nodiscard]] std::string reason() const {
    if (!compiled_in) {
      return "this code was compiled without nvcc, so it carries the host backend only (compile the "
             "translation unit as CUDA to use GPUs)";
    }
    if (device_count > 0) return {};
    if (error_name == "cudaErrorInsufficientDriver") {
      if (driver_version == 0) return "no CUDA driver (cudaErrorInsufficientDriver): no NVIDIA driver is installed";
      return detail::concat("the CUDA driver is too old (cudaErrorInsufficientDriver): driver supports CUDA ",
                            driver_version / 1000, '.', driver_version % 1000 / 10, ", this program needs ",
                            runtime_version / 1000, '.', runtime_version % 1000 / 10);
    }
    if (error_name == "cudaErrorNoDevice" || error == 0) {
      const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
      if (visible != nullptr) {
        return detail::concat("no CUDA device is visible (", error_name.empty() ? "0 devices" : error_name,
                              "); CUDA_VISIBLE_DEVICES='", visible, "' may hide them");
      }
      return detail::concat("no CUDA device (", error_name.empty() ? "0 devices" : error_name, ')');
    }
    return detail::concat("the CUDA runtime failed to start (", error_name, ": ", error_text, ')');
  }
};

/// Asks the CUDA runtime for its devices once per process and remembers the answer (the answer cannot
/// change: the runtime reads visibility once). In a translation unit compiled without nvcc, reports that
/// CUDA is not compiled in. Never throws for "no GPU".
inline const cuda_runtime_status& cuda_status() {
  static const cuda_runtime_status status = [] {
    cuda_runtime_status s;
#if LOCKSTEP_HAS_CUDA
    s.compiled_in = true;
    detail::mark_cuda_runtime_started("the first device query (lockstep::cuda_status)");
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    (void)cudaGetLastError();
    s.device_count = e == cudaSuccess ? n : 0;
    s.error = static_cast<int>(e);
    if (e != cudaSuccess) {
      s.error_name = cudaGetErrorName(e);
      s.error_text = cudaGetErrorString(e);
    }
    if (cudaDriverGetVersion(&s.driver_version) != cudaSuccess) s.driver_version = 0;
    if (cudaRuntimeGetVersion(&s.runtime_version) != cudaSuccess) s.runtime_version = 0;
    (void)cudaGetLastError();
#endif
    return s;
  }();
  return status;
}

/// Number of visible devices of a kind: GPUs seen by the CUDA runtime, or configured host devices.
inline int device_count(device_kind kind) {
  return kind == device_kind::cuda ? cuda_status().device_count : host_device_count();
}

/// True when at least one GPU can be used by this translation unit.
inline bool cuda_available() { return cuda_status().device_count > 0; }

/// The kind bare ids ("0,1") refer to: cuda when a GPU is available, host otherwise — PyTorch's
/// `"cuda" if torch.cuda.is_available() else "cpu"`.
inline device_kind default_device_kind() { return cuda_available() ? device_kind::cuda : device_kind::host; }

/// Throws device_error when `d` is not a visible device, naming the visible count.
inline void check_device_exists(device d) {
  const int n = device_count(d.kind);
  if (d.index >= 0 && d.index < n) return;
  if (d.is_cuda()) {
    if (n == 0) {
      throw device_error(detail::concat(d.str(), " does not exist: no GPU can be used — ", cuda_status().reason(),
                                        ". Use host devices (\"host:0\") or default_devices()."));
    }
    throw device_error(detail::concat(d.str(), " does not exist: ", n, " CUDA device", n == 1 ? " is" : "s are",
                                      " visible (valid ids 0..", n - 1,
                                      "; CUDA_VISIBLE_DEVICES=", detail::env_or_unset("CUDA_VISIBLE_DEVICES"),
                                      ", which renumbers the visible GPUs from 0)"));
  }
  throw device_error(detail::concat(d.str(), " does not exist: ", n, " host device", n == 1 ? " is" : "s are",
                                    " configured (valid ids 0..", n - 1,
                                    "; LOCKSTEP_HOST_DEVICES or configure_host_platform sets the count)"));
}

/// What a device is.
struct device_properties {
  lockstep::device device;
  std::string name;                  // "NVIDIA A100-SXM4-80GB", or "host virtual device (CPU model)"
  std::uint64_t total_memory = 0;    // bytes: GPU memory, or the host device's limit
  int compute_capability_major = 0;  // 0 for host devices
  int compute_capability_minor = 0;
  int multiprocessors = 0;           // SMs; 1 for a host device (it computes on one core)
  std::string pci_bus_id;            // "0000:3b:00.0"; empty for host devices
};


/// Properties of `d`; throws device_error when it does not exist.
inline device_properties get_device_properties(device d) {
  check_device_exists(d);
  device_properties p;
  p.device = d;
  if (d.is_host()) {
    p.name = detail::concat("host virtual device (", detail::cpu_model_name(), ')');
    p.total_memory = host_platform_configuration().memory_limit(d.index);
    p.multiprocessors = 1;
    return p;
  }
#if LOCKSTEP_HAS_CUDA
  cudaDeviceProp prop{};
  LOCKSTEP_CUDA_CHECK(cudaGetDeviceProperties(&prop, d.index), "reading the properties of ", d.str());
  p.name = prop.name;
  p.total_memory = prop.totalGlobalMem;
  p.compute_capability_major = prop.major;
  p.compute_capability_minor = prop.minor;
  p.multiprocessors = prop.multiProcessorCount;
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, d.index) == cudaSuccess) p.pci_bus_id = bus;
  (void)cudaGetLastError();
#endif
  return p;
}

/// Whether device i can read device j's memory directly, for every pair of `devices` (the diagonal is true).
/// Host devices share the process's memory, so they always can; CUDA pairs ask cudaDeviceCanAccessPeer.
inline std::vector<std::vector<bool>> peer_access_matrix(const std::vector<device>& devices) {
  std::vector<std::vector<bool>> m(devices.size(), std::vector<bool>(devices.size(), false));
  for (std::size_t i = 0; i < devices.size(); ++i) {
    for (std::size_t j = 0; j < devices.size(); ++j) {
      const device a = devices[i], b = devices[j];
      if (i == j || (a.is_host() && b.is_host())) {
        m[i][j] = true;
        continue;
      }
#if LOCKSTEP_HAS_CUDA
      if (a.is_cuda() && b.is_cuda()) {
        int can = 0;
        LOCKSTEP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, a.index, b.index), "asking whether ", a.str(),
                            " can access ", b.str());
        m[i][j] = can != 0;
      }
#endif
    }
  }
  return m;
}

LOCKSTEP_ABI_END
