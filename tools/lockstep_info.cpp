// lockstep-info — "is my GPU recognized?": what devices this program can use, and why not when it cannot.
//
// Lists the GPUs (name, compute capability, memory, multiprocessors, whether this binary carries code for
// them, peer access) with the driver and runtime versions and a verdict on their compatibility, the NCCL
// version, the visibility variables in effect, the host virtual devices with the GEMM kernels they run and
// their measured rate, and the devices a program would use by default. Exit code 0 when usable devices exist,
// 1 otherwise (or when the configuration is invalid).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "lockstep/blas/gemm_rate.hpp"
#include "lockstep/blas/host_kernels.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/device/query.hpp"
#include "lockstep/device/visibility.hpp"

#if LOCKSTEP_HAS_CUDA
#include <nccl.h>
namespace {
__global__ void probe_kernel() {}
}  // namespace
#endif

namespace {

using namespace lockstep;

[[maybe_unused]] std::string version_string(int v) {  // 13000 -> "13.0"
  return std::to_string(v / 1000) + '.' + std::to_string(v % 1000 / 10);
}

void print_env(const char* name) {
  const char* v = std::getenv(name);
  if (v) {
    std::printf("  %-28s '%s'\n", name, v);
  } else {
    std::printf("  %-28s unset\n", name);
  }
}

#if LOCKSTEP_HAS_CUDA
// Which of this binary's kernel images the device would run, asked of the runtime itself.
std::string code_for(int index) {
  cudaFuncAttributes attr{};
  if (cudaSetDevice(index) != cudaSuccess) {
    (void)cudaGetLastError();
    return "unknown (cannot select the device)";
  }
  const cudaError_t e = cudaFuncGetAttributes(&attr, probe_kernel);
  (void)cudaGetLastError();
  if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction) {
    return std::string("NO: this binary has no code for it (") + cudaGetErrorName(e) +
           "); rebuild with its architecture in CMAKE_CUDA_ARCHITECTURES";
  }
  if (e != cudaSuccess) return std::string("unknown (") + cudaGetErrorName(e) + ")";
  return "yes (sm_" + std::to_string(attr.binaryVersion) + " code, PTX " + std::to_string(attr.ptxVersion) + ")";
}
#endif

}  // namespace

constexpr const char* usage = R"(usage: lockstep-info [--no-rates]
Prints what devices this program can use and why not when it cannot: the CUDA driver, runtime and GPUs (compute
capability, memory, whether this binary has code for them, peer access), NCCL, the visibility variables, the host
virtual devices with the GEMM kernels they run (and their measured GFLOP/s on one core, unless --no-rates), and
the devices a program uses by default. Exit status 0 when there are usable devices, 1 otherwise.

environment: CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, LOCKSTEP_HOST_DEVICES, LOCKSTEP_HOST_DEVICE_MEMORY,
LOCKSTEP_HOST_GEMM (auto, openblas, onednn), ONEDNN_MAX_CPU_ISA (e.g. AVX2)
)";

// The host GEMM kernels of this process and their rate on host:0 for the sample's largest shape.
void print_host_gemm(bool rates) {
  const host_gemm_plan& plan = host_gemm_plan::process();
  std::printf("  GEMM kernels: %s\n", plan.str().c_str());
  std::printf("  OpenBLAS:     %s kernels (%s)\n", host_gemm_plan::openblas_core().c_str(),
              plan.f32 == host_gemm_kernel::openblas ? "in use for f32" : "not used for GEMMs");
  if (!rates) return;
  std::printf("  rate on one core, C[128, 1024] = A[128, 1024] B^T:");
  try {
    stream s(device{device_kind::host, 0});
    blas_handle h(s);
    const gemm_shape shape{transpose::no, transpose::yes, 128, 1024, 1024};
    for (dtype t : {dtype::f32, dtype::bf16, dtype::f16}) {
      std::printf(" %s %.0f GFLOP/s%s", std::string(name_of(t)).c_str(), gemm_rate(h, t, shape, 0.1),
                  t == dtype::f16 ? "\n" : ",");
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {  // a measurement, not the verdict: say why and go on
    std::printf(" not measured: %s\n", e.what());
  }
}

int main(int argc, char** argv) {
  bool rates = true;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(usage, stdout);
      return 0;
    }
    if (arg == "--no-rates") {
      rates = false;
      continue;
    }
    std::fprintf(stderr, "lockstep-info: unknown option '%s'\n%s", argv[i], usage);
    return 2;
  }
  try {
    std::printf("lockstep-info %d.%d.%d\n\n", LOCKSTEP_VERSION_MAJOR, LOCKSTEP_VERSION_MINOR, LOCKSTEP_VERSION_PATCH);
    const auto& cuda = cuda_status();
#if LOCKSTEP_HAS_CUDA
#if defined(__CUDA_ARCH_LIST__)
#define LOCKSTEP_STR2(...) #__VA_ARGS__
#define LOCKSTEP_STR(...) LOCKSTEP_STR2(__VA_ARGS__)
    std::printf("CUDA backend:   compiled in (nvcc; GPU code for architectures %s)\n",
                LOCKSTEP_STR(__CUDA_ARCH_LIST__));
#else
    std::printf("CUDA backend:   compiled in (nvcc)\n");
#endif
    std::printf("CUDA runtime:   %s\n", version_string(cuda.runtime_version).c_str());
    if (cuda.driver_version == 0) {
      std::printf("CUDA driver:    none installed\n");
    } else {
      std::printf("CUDA driver:    supports CUDA %s\n", version_string(cuda.driver_version).c_str());
    }
    const char* verdict = cuda.driver_version == 0                             ? "no driver: GPUs cannot be used"
                          : cuda.driver_version >= cuda.runtime_version        ? "compatible"
                          : cuda.driver_version / 1000 == cuda.runtime_version / 1000
                              ? "compatible through minor-version compatibility (newer PTX may not JIT)"
                              : "INCOMPATIBLE: the driver is older than the runtime; update the driver";
    std::printf("Verdict:        %s\n", verdict);
    int nccl = 0;
    if (ncclGetVersion(&nccl) == ncclSuccess) {
      std::printf("NCCL:           %d.%d.%d\n", nccl / 10000, nccl / 100 % 100, nccl % 100);
    }
#else
    std::printf("CUDA backend:   not compiled in (this binary was built without nvcc: host devices only)\n");
#endif

    std::printf("\nVisibility (read once, when CUDA / the host platform start):\n");
    print_env("CUDA_VISIBLE_DEVICES");
    print_env("CUDA_DEVICE_ORDER");
    print_env("LOCKSTEP_HOST_DEVICES");
    print_env("LOCKSTEP_HOST_DEVICE_MEMORY");
    print_env("LOCKSTEP_HOST_GEMM");
    print_env("ONEDNN_MAX_CPU_ISA");

    std::printf("\nGPUs: %d\n", cuda.device_count);
    if (cuda.device_count == 0) std::printf("  none: %s\n", cuda.reason().c_str());
    std::vector<device> gpus;
    for (int i = 0; i < cuda.device_count; ++i) {
      const device d{device_kind::cuda, i};
      gpus.push_back(d);
      const auto p = get_device_properties(d);
      std::printf("  %s  %s  compute capability %d.%d  %s  %d SMs  PCI %s\n", d.str().c_str(), p.name.c_str(),
                  p.compute_capability_major, p.compute_capability_minor, format_bytes(p.total_memory).c_str(),
                  p.multiprocessors, p.pci_bus_id.c_str());
#if LOCKSTEP_HAS_CUDA
      std::printf("         code in this binary: %s\n", code_for(i).c_str());
#endif
    }
    if (gpus.size() > 1) {
      std::printf("  peer access (row can read column):\n        ");
      for (const auto& d : gpus) std::printf(" %6s", d.str().c_str());
      std::printf("\n");
      const auto m = peer_access_matrix(gpus);
      for (std::size_t i = 0; i < gpus.size(); ++i) {
        std::printf("  %6s", gpus[i].str().c_str());
        for (std::size_t j = 0; j < gpus.size(); ++j) std::printf(" %6s", i == j ? "-" : (m[i][j] ? "yes" : "no"));
        std::printf("\n");
      }
    }

    const int hosts = host_device_count();
    std::printf("\nHost virtual devices: %d\n", hosts);
    for (int i = 0; i < hosts; ++i) {
      const auto p = get_device_properties(device{device_kind::host, i});
      std::printf("  host:%d  %s  memory limit %s\n", i, p.name.c_str(), format_bytes(p.total_memory).c_str());
    }
    if (hosts > 0) print_host_gemm(rates);

    const auto selection = default_devices();
    std::printf("\nDefault devices: %s\n  %s\n", selection.devices.str().c_str(), selection.reason.c_str());
    return selection.devices.empty() ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-info: %s\n", e.what());
    return 1;
  }
}
