// bench_roofline — the roofline of the sample's training step on one host device: the best single-core rate of
// the step's own GEMM shapes, each measured with every kernel this machine has (whichever lockstep picked), and
// the FLOPs a sample costs. bench/roofline.py runs it next to mlp_train, alternated, and prints the step's
// distance to this limit as one ratio.
//
//   bench_roofline --hidden 1024,1024 --batch 128 --devices 2 --precision bf16 [--seconds 0.2] [--json]
//
// The step of an MLP inputs-h1-...-10 with batch B on D devices multiplies, on each device, rows = B / D:
//   forward         C[rows, out] = X[rows, in] W[out, in]^T        (every layer)
//   weight gradient C[out, in]   = G[rows, out]^T X[rows, in]       (every layer)
//   input gradient  C[rows, in]  = G[rows, out] W[out, in]          (every layer but the first)
// as nn/linear.hpp does. FLOPs per sample count these products only (2 m n k each); the step's other work
// (bias, activations, loss, optimizer) runs at memory speed and is what the ratio to the roofline leaves room for.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/blas/gemm_rate.hpp"
#include "lockstep/blas/host_kernels.hpp"
#include "lockstep/io/json.hpp"
#include "lockstep/runtime/stream.hpp"

using namespace lockstep;

namespace {

struct step_gemm {
  const char* role;
  gemm_shape shape;
};

std::vector<step_gemm> step_gemms(const std::vector<std::int64_t>& widths, std::int64_t rows) {
  std::vector<step_gemm> list;
  for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
    const std::int64_t in = widths[l], out = widths[l + 1];
    list.push_back({"forward", {transpose::no, transpose::yes, rows, out, in}});
    list.push_back({"weight gradient", {transpose::yes, transpose::no, out, in, rows}});
    if (l > 0) list.push_back({"input gradient", {transpose::no, transpose::no, rows, in, out}});
  }
  return list;
}

// The plans whose kernels differ for dtype t on this machine (the process's own first).
std::vector<host_gemm_plan> candidate_plans(dtype t) {
  using k = host_gemm_kernel;
  std::vector<host_gemm_plan> plans{host_gemm_plan::process()};
  auto add = [&](host_gemm_plan p) {
    for (const auto& q : plans)
      if (q.for_dtype(t) == p.for_dtype(t) && q.f32 == p.f32) return;
    plans.push_back(p);
  };
  add(host_gemm_plan{k::openblas, k::via_f32, k::via_f32});
  if (LOCKSTEP_HAS_ONEDNN) {
    const host_isa isa = host_gemm_plan::linked_isa();
    add(host_gemm_plan{k::onednn, k::via_f32, k::via_f32, isa});
    if (isa >= host_isa::avx512_bf16) add(host_gemm_plan{k::onednn, k::onednn, k::via_f32, isa});
  }
  return plans;
}

std::string kernel_name(const host_gemm_plan& p, dtype t) {
  const host_gemm_kernel k = p.for_dtype(t);
  if (k == host_gemm_kernel::via_f32) return "via f32 (" + std::string(name_of(p.f32)) + ")";
  return std::string(name_of(k));
}

std::vector<std::int64_t> parse_widths(std::string_view s) {
  std::vector<std::int64_t> w;
  while (!s.empty()) {
    const auto comma = s.find(',');
    w.push_back(std::stoll(std::string(s.substr(0, comma))));
    s = comma == std::string_view::npos ? std::string_view{} : s.substr(comma + 1);
  }
  return w;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::int64_t> hidden{256, 256};
  std::int64_t batch = 128, devices = 1, inputs = 784, classes = 10;
  dtype precision = dtype::f32;
  double seconds = 0.2;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_roofline: %s needs a value\n", argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--hidden") hidden = parse_widths(value());
    else if (a == "--batch") batch = std::stoll(std::string(value()));
    else if (a == "--devices") devices = std::stoll(std::string(value()));
    else if (a == "--seconds") seconds = std::stod(std::string(value()));
    else if (a == "--json") json = true;
    else if (a == "--precision") {
      const std::string_view p = value();
      if (p != "f32" && p != "f16" && p != "bf16") {
        std::fprintf(stderr, "bench_roofline: --precision must be f32, f16 or bf16, got '%s'\n", argv[i]);
        return 2;
      }
      precision = p == "bf16" ? dtype::bf16 : p == "f16" ? dtype::f16 : dtype::f32;
    } else {
      std::fprintf(stderr, "usage: bench_roofline [--hidden A,B] [--batch N] [--devices D] [--precision f32|f16|bf16] "
                           "[--seconds S] [--json]\n");
      return 2;
    }
  }
  if (batch < 1 || devices < 1 || seconds <= 0 || hidden.empty()) {
    std::fprintf(stderr, "bench_roofline: --batch and --devices must be >= 1, --seconds > 0, --hidden not empty\n");
    return 2;
  }
  try {
    std::vector<std::int64_t> widths{inputs};
    widths.insert(widths.end(), hidden.begin(), hidden.end());
    widths.push_back(classes);
    const std::int64_t rows = (batch + devices - 1) / devices;
    stream s(device{device_kind::host, 0});
    const auto plans = candidate_plans(precision);
    std::vector<blas_handle> handles;
    for (const auto& p : plans) handles.emplace_back(s, p);

    json_value shapes = json_value::array();
    double flops_per_step = 0, best_seconds = 0, chosen_seconds = 0;
    for (const auto& g : step_gemms(widths, rows)) {
      json_value rates = json_value::object();
      double best = 0, chosen = 0;
      for (std::size_t i = 0; i < plans.size(); ++i) {
        const double r = gemm_rate(handles[i], precision, g.shape, seconds);
        rates[kernel_name(plans[i], precision)] = r;
        if (r > best) best = r;
        if (i == 0) chosen = r;
      }
      flops_per_step += g.shape.flops();
      best_seconds += g.shape.flops() / (best * 1e9);
      chosen_seconds += g.shape.flops() / (chosen * 1e9);
      shapes.push_back({{"role", g.role}, {"m", g.shape.m}, {"n", g.shape.n}, {"k", g.shape.k},
                        {"ta", g.shape.ta == transpose::yes}, {"tb", g.shape.tb == transpose::yes},
                        {"gflops", rates}, {"best_gflops", best}});
      if (!json) {
        std::printf("%-16s %5lld x %5lld x %5lld  best %6.1f GFLOP/s  lockstep's %6.1f\n", g.role,
                    static_cast<long long>(g.shape.m), static_cast<long long>(g.shape.n),
                    static_cast<long long>(g.shape.k), best, chosen);
      }
    }
    const double flops_per_sample = flops_per_step / static_cast<double>(rows);
    const double roofline_gflops = flops_per_step / best_seconds / 1e9;
    json_value out{{"hidden", hidden},
                 {"batch", batch},
                 {"devices", devices},
                 {"rows_per_device", rows},
                 {"precision", std::string(name_of(precision))},
                 {"kernels", host_gemm_plan::process().str()},
                 {"gemm_flops_per_sample", flops_per_sample},
                 {"roofline_gflops_per_device", roofline_gflops},
                 {"chosen_gflops_per_device", flops_per_step / chosen_seconds / 1e9},
                 {"roofline_samples_per_second", static_cast<double>(devices) * roofline_gflops * 1e9 /
                                                     flops_per_sample},
                 {"shapes", shapes}};
    if (json) {
      std::printf("%s\n", out.dump().c_str());
    } else {
      std::printf("GEMM FLOPs per sample %.3g; roofline %.1f GFLOP/s per device (lockstep's kernels: %.1f); "
                  "%.0f samples/s on %lld device(s)\n",
                  flops_per_sample, roofline_gflops, out["chosen_gflops_per_device"].get<double>(),
                  out["roofline_samples_per_second"].get<double>(), static_cast<long long>(devices));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_roofline: %s\n", e.what());
    return 1;
  }
}
