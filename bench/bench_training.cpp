// bench/bench_training.cpp — the training step of the sample's model (examples/mlp_train: an MLP of linear and
// relu layers, softmax cross-entropy, SGD with momentum, a loss scaler under f16/bf16), in steps per second.
//
//   bench_training [--batch=128] [Google Benchmark flags]
//
// Rows (docs/benchmarks.md):
//
//   <backend>/train_step/mlp:M/batch:B/precision:P        one device, P = f32, f16, bf16 (amp: fp32 master
//                                                          weights, P activations and gradients, loss scaling)
//   <backend>/train_step/mlp:M/batch:B/devices:K/mode:X   f32 on K devices, X = single (one device, the whole
//                                                          batch), dp (data_parallel) or ddp
//                                                          (distributed_data_parallel, one thread per rank)
//
// A step is zero_grad, forward, loss, backward and the optimizer step (with the loss scaler's check and update
// under f16/bf16), on a synthetic batch already on the device: the data loader is not measured. Steps are
// queued back to back as in training (no host synchronization between them); the last step of the run is
// waited for. Counters: samples_per_s, peak_MiB (peak device memory in use over the run: parameters,
// gradients, optimizer state, activations; for K devices the largest of them), vs_f32 (samples/s relative to
// the f32 row of the same model measured earlier in the same run) and vs_single (for dp and ddp).
// A summary table follows the run. Exit status 1 when a benchmark failed (a skipped CUDA row is not a failure).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_model.hpp"
#include "lockstep/amp/loss_scaler.hpp"
#include "lockstep/comm/comm.hpp"
#include "lockstep/device/device_guard.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/nn/loss.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/parallel/data_parallel.hpp"
#include "lockstep/parallel/distributed_data_parallel.hpp"
#include "lockstep/parallel/replica_threads.hpp"
#include "lockstep/runtime/memory.hpp"

namespace {

namespace ls = lockstep;
namespace lb = lockstep_bench;
using lb::clock_type;

std::int64_t batch_size = 128;  // global batch (--batch)
constexpr std::uint64_t seed = 7;
const ls::sgd_options optimizer_options{.lr = 0.05f, .momentum = 0.9f};

const std::vector<lb::mlp_spec>& models() {
  // The sample's default (784-256-256-10) and the wider one bench/compare_pytorch.py also uses.
  static const std::vector<lb::mlp_spec> list{{{784, 256, 256, 10}}, {{784, 1024, 1024, 10}}};
  return list;
}

constexpr ls::dtype precisions[] = {ls::dtype::f32, ls::dtype::f16, ls::dtype::bf16};

enum class mode : std::uint8_t { single, dp, ddp };
const char* mode_name(mode m) { return m == mode::single ? "single" : m == mode::dp ? "dp" : "ddp"; }

std::string kind_name(ls::device_kind k) { return std::string(ls::name_of(k)); }

std::string prefix(ls::device_kind kind, const lb::mlp_spec& m) {
  return kind_name(kind) + "/train_step/mlp:" + m.name() + "/batch:" + std::to_string(batch_size);
}
std::string precision_name(ls::device_kind kind, const lb::mlp_spec& m, ls::dtype p) {
  return prefix(kind, m) + "/precision:" + std::string(ls::name_of(p));
}
std::string mode_row_name(ls::device_kind kind, const lb::mlp_spec& m, int k, mode x) {
  return prefix(kind, m) + "/devices:" + std::to_string(k) + "/mode:" + mode_name(x);
}

bool have_devices(benchmark::State& st, ls::device_kind kind, int k) {
  const int n = ls::device_count(kind);
  if (n >= k) return true;
  if (kind == ls::device_kind::cuda) {
    lb::skip(st, "needs " + std::to_string(k) + " GPU" + (k == 1 ? "" : "s") + ", " + std::to_string(n) + " visible" +
                     (n == 0 ? " (" + ls::cuda_status().reason() + ")" : std::string()));
  } else {
    lb::skip(st, "needs " + std::to_string(k) + " host devices, " + std::to_string(n) +
                     " configured (LOCKSTEP_HOST_DEVICES)");
  }
  return false;
}

/// SGD with momentum and, under f16/bf16, the loss scaler — the sample's end of a step.
class optimizer {
 public:
  optimizer(std::span<ls::parameter* const> params, ls::dtype precision, ls::stream_ref s, ls::context& loss_ctx)
      : params_(params.begin(), params.end()), sgd_(params, optimizer_options) {
    if (precision != ls::dtype::f32) {
      scaler_.emplace(s, ls::loss_scaler_options::for_precision(precision));
      loss_ctx.set_loss_scale(scaler_->scale());
    }
  }
  void zero_grad() { sgd_.zero_grad(); }
  void step(ls::stream_ref s, std::optional<ls::communicator_ref> ranks = std::nullopt) {
    ls::step_inputs in{};
    if (scaler_) {
      scaler_->unscale_and_check(params_, s, ranks);
      in = scaler_->optimizer_inputs();
    }
    sgd_.step(s, in);
    if (scaler_) scaler_->update(s);
  }
  /// Steps skipped because of non-finite gradients (f16 loss scaling), -1 without a scaler; synchronizes s.
  std::int64_t skipped_steps(ls::stream_ref s) const { return scaler_ ? scaler_->read(s).skipped_steps : -1; }

 private:
  std::vector<ls::parameter*> params_;
  ls::sgd sgd_;
  std::optional<ls::loss_scaler> scaler_;
};

/// Runs `step` once per benchmark iteration, back to back, and `wait` at the last one (timed: real time); a few
/// untimed steps first. Returns the measured seconds.
double time_steps(benchmark::State& st, const std::function<void()>& step, const std::function<void()>& wait) {
  for (int i = 0; i < 3; ++i) step();
  wait();
  const auto t0 = clock_type::now();
  benchmark::IterationCount i = 0;
  for (auto _ : st) {
    step();
    if (++i == st.max_iterations) wait();
  }
  return lb::seconds_since(t0);
}

void record(benchmark::State& st, const std::string& name, double seconds, std::int64_t rows, double peak_bytes) {
  if (st.iterations() <= 0 || seconds <= 0) return;
  const double per_step = seconds / static_cast<double>(st.iterations());
  st.counters["samples_per_s"] = static_cast<double>(rows) / per_step;
  st.counters["peak_MiB"] = peak_bytes / (1024.0 * 1024.0);
  lb::measurement& m = lb::latest()[name];
  m.seconds_per_iteration = per_step;
  m.samples_per_second = static_cast<double>(rows) / per_step;
  m.peak_bytes = peak_bytes;
}

/// One device, precision p.
void bm_precision(benchmark::State& st, const std::string& name, ls::device_kind kind, const lb::mlp_spec& m,
                  ls::dtype p) {
  lb::guarded(st, name, [&] {
    if (!have_devices(st, kind, 1)) return;
    const ls::device d{kind, 0};
    double seconds = 0, peak = 0;
    std::int64_t skipped = -1;
    {
      ls::stream s(d);
      s.synchronize();
      ls::reset_memory_stats(d);
      ls::context ctx(s, p);
      ctx.set_seed(seed);
      ls::graph model = lb::build_mlp(m, ctx, seed);
      const auto params = ls::parameters_of(model).pointers();
      optimizer opt(params, p, s, ctx);
      ls::softmax_cross_entropy loss(ls::reduction::mean);
      const ls::tensor x =
          lb::device_tensor(lb::batch_inputs(batch_size, m.inputs(), seed), ls::shape{batch_size, m.inputs()}, p, s);
      const ls::tensor y = lb::device_labels(lb::batch_labels(batch_size, m.classes()), s);
      std::uint64_t step_index = 0;
      seconds = time_steps(
          st,
          [&] {
            ctx.set_step(step_index++);
            opt.zero_grad();
            loss.forward(model.forward(x, ctx), y, ctx);
            model.backward(loss.backward(ctx), ctx, ls::input_grad::not_required);
            opt.step(s);
          },
          [&] { s.synchronize(); });
      peak = static_cast<double>(ls::get_memory_stats(d).peak_bytes_in_use);
      skipped = opt.skipped_steps(s);
    }
    record(st, name, seconds, batch_size, peak);
    if (skipped >= 0) st.counters["skipped_steps"] = static_cast<double>(skipped);
    const lb::measurement* f32 = lb::find_result(precision_name(kind, m, ls::dtype::f32));
    const lb::measurement* self = lb::find_latest(name);
    if (p != ls::dtype::f32 && f32 != nullptr && self != nullptr) {
      st.counters["vs_f32"] = self->samples_per_second / f32->samples_per_second;
      st.counters["peak_vs_f32"] = self->peak_bytes / f32->peak_bytes;
    }
  });
}

/// One rank of a DDP run (bench_model.hpp) with its optimizer.
struct ddp_rank : lb::ddp_rank {
  ddp_rank(ls::device d, const lb::mlp_spec& m, ls::communicator_ref c, std::int64_t first, std::int64_t rows)
      : lb::ddp_rank(d, m, c, first, rows, seed) {
    opt.emplace(ls::parameters_of(model).pointers(), ls::dtype::f32, compute, ctx);
  }
  std::optional<optimizer> opt;
};

/// f32 on k devices: single (one device, the whole batch: the reference), dp, ddp.
void bm_mode(benchmark::State& st, const std::string& name, ls::device_kind kind, const lb::mlp_spec& m, int k,
             mode x) {
  lb::guarded(st, name, [&] {
    if (!have_devices(st, kind, x == mode::single ? 1 : k)) return;
    const std::int64_t rows = batch_size / k;  // per rank under DDP
    const std::int64_t batch = x == mode::ddp ? rows * k : batch_size;
    std::vector<ls::device> list;
    for (int r = 0; r < k; ++r) list.push_back(ls::device{kind, r});
    const ls::device_set devices(list);
    for (const ls::device d : devices) {
      ls::synchronize(d);
      ls::reset_memory_stats(d);
    }
    double seconds = 0;
    if (x == mode::single) {
      const ls::device d = devices[0];
      ls::stream s(d);
      ls::context ctx(s);
      ls::graph model = lb::build_mlp(m, ctx, seed);
      optimizer opt(ls::parameters_of(model).pointers(), ls::dtype::f32, s, ctx);
      ls::softmax_cross_entropy loss(ls::reduction::mean);
      const ls::tensor xb =
          lb::device_tensor(lb::batch_inputs(batch, m.inputs(), seed), ls::shape{batch, m.inputs()}, ls::dtype::f32, s);
      const ls::tensor yb = lb::device_labels(lb::batch_labels(batch, m.classes()), s);
      seconds = time_steps(
          st,
          [&] {
            opt.zero_grad();
            loss.forward(model.forward(xb, ctx), yb, ctx);
            model.backward(loss.backward(ctx), ctx, ls::input_grad::not_required);
            opt.step(s);
          },
          [&] { s.synchronize(); });
    } else if (x == mode::dp) {
      ls::stream setup(devices[0]);
      ls::context build(setup);
      ls::graph model = lb::build_mlp(m, build, seed);
      ls::data_parallel<ls::graph> dp(model, ls::data_parallel_options{.device_ids = devices});
      ls::context& out = dp.output_context();
      const ls::stream_ref s0 = dp.replica_context(0).stream();
      optimizer opt(ls::parameters_of(model).pointers(), ls::dtype::f32, s0, out);
      ls::softmax_cross_entropy loss(ls::reduction::mean);
      const ls::tensor xb = lb::device_tensor(lb::batch_inputs(batch, m.inputs(), seed), ls::shape{batch, m.inputs()},
                                              ls::dtype::f32, s0);
      const ls::tensor yb = lb::device_labels(lb::batch_labels(batch, m.classes()), s0);
      seconds = time_steps(
          st,
          [&] {
            opt.zero_grad();
            loss.forward(dp.forward(xb), yb, out);
            dp.backward(loss.backward(out));
            opt.step(s0);
          },
          [&] {
            for (const ls::device d : devices) ls::synchronize(d);
          });
    } else {
      std::vector<ls::communicator> comms = ls::detail::make_clique(devices, ls::comm_options{});
      ls::detail::replica_threads threads(static_cast<std::size_t>(k));
      const auto on_ranks = [&](const std::function<void(ddp_rank&, std::size_t)>& f,
                                std::vector<std::unique_ptr<ddp_rank>>& ranks) {
        threads.run(
            static_cast<std::size_t>(k),
            [&](std::size_t r) {
              ls::device_guard guard(devices[r]);
              f(*ranks[r], r);
            },
            [&](std::size_t r) { return devices[r].str(); });
      };
      std::vector<std::unique_ptr<ddp_rank>> ranks(static_cast<std::size_t>(k));
      threads.run(
          static_cast<std::size_t>(k),
          [&](std::size_t r) {
            ls::device_guard guard(devices[r]);
            ranks[r] = std::make_unique<ddp_rank>(devices[r], m, comms[r], static_cast<std::int64_t>(r) * rows, rows);
          },
          [&](std::size_t r) { return devices[r].str(); });
      seconds = time_steps(
          st,
          [&] {
            on_ranks(
                [&](ddp_rank& d, std::size_t) {
                  d.opt->zero_grad();
                  d.loss.forward(d.ddp->forward(d.shard), d.y, d.ctx, batch);  // mean over the global batch
                  d.ddp->backward(d.loss.backward(d.ctx));
                  d.opt->step(d.ctx.stream(), d.comm);
                },
                ranks);
          },
          [&] { on_ranks([&](ddp_rank& d, std::size_t) { d.comm.synchronize(d.ctx.stream()); }, ranks); });
      ranks.clear();
    }
    double peak = 0;
    for (const ls::device d : devices) {
      if (x == mode::single && d != devices[0]) continue;
      peak = std::max(peak, static_cast<double>(ls::get_memory_stats(d).peak_bytes_in_use));
    }
    record(st, name, seconds, batch, peak);
    const lb::measurement* single = lb::find_result(mode_row_name(kind, m, k, mode::single));
    const lb::measurement* self = lb::find_latest(name);
    if (x != mode::single && single != nullptr && self != nullptr) {
      st.counters["vs_single"] = self->samples_per_second / single->samples_per_second;
    }
  });
}

void register_benchmarks() {
  for (const ls::device_kind kind : lb::backends()) {
    // Without the devices, one skipped row per family says why.
    const bool one = ls::device_count(kind) >= 1, two = ls::device_count(kind) >= 2;
    for (const auto& m : models()) {
      for (const ls::dtype p : precisions) {
        const std::string name = precision_name(kind, m, p);
        benchmark::RegisterBenchmark(name.c_str(),
                                     [name, kind, m, p](benchmark::State& st) { bm_precision(st, name, kind, m, p); })
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
      if (!one) break;
    }
    for (const auto& m : models()) {
      for (const mode x : {mode::single, mode::dp, mode::ddp}) {
        const std::string name = mode_row_name(kind, m, 2, x);
        benchmark::RegisterBenchmark(name.c_str(),
                                     [name, kind, m, x](benchmark::State& st) { bm_mode(st, name, kind, m, 2, x); })
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
      if (!two) break;
    }
  }
}

void print_summary() {
  std::fprintf(lb::summary_out(),
               "\n==== summary (measured in this run; one device unless stated; global batch %lld) ====\n",
               static_cast<long long>(batch_size));
  bool header = false;
  for (const ls::device_kind kind : lb::backends()) {
    for (const auto& m : models()) {
      const lb::measurement* f32 = lb::find_result(precision_name(kind, m, ls::dtype::f32));
      for (const ls::dtype p : precisions) {
        const lb::measurement* r = lb::find_result(precision_name(kind, m, p));
        if (r == nullptr) continue;
        if (!header) {
          std::fprintf(lb::summary_out(), "%-5s %-20s %-5s %10s %12s %10s %12s %10s\n", "", "model", "prec", "step ms",
                       "samples/s", "vs f32", "peak memory", "vs f32");
          header = true;
        }
        std::fprintf(lb::summary_out(), "%-5s %-20s %-5s %10.3f %12.0f", kind_name(kind).c_str(), m.name().c_str(),
                     std::string(ls::name_of(p)).c_str(), r->seconds_per_iteration * 1e3, r->samples_per_second);
        if (f32 != nullptr) {
          std::fprintf(lb::summary_out(), " %10.2f", r->samples_per_second / f32->samples_per_second);
        } else {
          std::fprintf(lb::summary_out(), " %10s", "-");
        }
        std::fprintf(lb::summary_out(), " %12s", ls::format_bytes(static_cast<std::uint64_t>(r->peak_bytes)).c_str());
        if (f32 != nullptr && f32->peak_bytes > 0) {
          std::fprintf(lb::summary_out(), " %10.2f\n", r->peak_bytes / f32->peak_bytes);
        } else {
          std::fprintf(lb::summary_out(), " %10s\n", "-");
        }
      }
    }
  }
  header = false;
  for (const ls::device_kind kind : lb::backends()) {
    for (const auto& m : models()) {
      const lb::measurement* single = lb::find_result(mode_row_name(kind, m, 2, mode::single));
      for (const mode x : {mode::single, mode::dp, mode::ddp}) {
        const lb::measurement* r = lb::find_result(mode_row_name(kind, m, 2, x));
        if (r == nullptr) continue;
        if (!header) {
          std::fprintf(lb::summary_out(), "\n%-5s %-20s %-16s %10s %12s %10s %12s\n", "", "model", "mode (f32)",
                       "step ms", "samples/s", "vs single", "peak memory");
          header = true;
        }
        const std::string label = std::string(mode_name(x)) + (x == mode::single ? " (1 device)" : " (2 devices)");
        std::fprintf(lb::summary_out(), "%-5s %-20s %-16s %10.3f %12.0f", kind_name(kind).c_str(), m.name().c_str(),
                     label.c_str(), r->seconds_per_iteration * 1e3, r->samples_per_second);
        if (single != nullptr) {
          std::fprintf(lb::summary_out(), " %10.2f", r->samples_per_second / single->samples_per_second);
        } else {
          std::fprintf(lb::summary_out(), " %10s", "-");
        }
        std::fprintf(lb::summary_out(), " %12s\n", ls::format_bytes(static_cast<std::uint64_t>(r->peak_bytes)).c_str());
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (auto v = lb::take_flag(argc, argv, "batch")) {
    batch_size = std::atoll(v->c_str());
    if (batch_size < 2) {
      std::fprintf(stderr, "bench_training: --batch must be at least 2\n");
      return 2;
    }
  }
  lb::launch how(argc, argv);
  benchmark::Initialize(&argc, argv);
  int status = 1;
  try {
    benchmark::AddCustomContext("lockstep_host_devices", std::to_string(ls::host_device_count()));
    benchmark::AddCustomContext("lockstep_cuda", ls::cuda_available()
                                                     ? std::to_string(ls::device_count(ls::device_kind::cuda)) + " GPUs"
                                                     : ls::cuda_status().reason());
    register_benchmarks();
    status = lb::run_benchmarks("bench_training", argc, argv, how, print_summary);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_training: %s\n", lb::describe(e).c_str());
    status = 1;
  }
  return status;
}
