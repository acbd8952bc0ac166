// bench_checkpoint — how fast a training checkpoint is saved and loaded, and how long an asynchronous save
// stalls training, on host:0 (the files are the same from either backend; GPUs add their copies to pinned memory).
//
// The model is the sample's MLP (default 784-4096-4096-10: 20M parameters) with SGD momentum: a checkpoint of
// about 160 MB (model.safetensors + training.safetensors). Rows:
//   save/page_cache   checkpointer::save with durability::page_cache (what torch.save does: no fsync)
//   save/fsync        the same with the files and directories fsynced (the default)
//   load              load_checkpoint (read, checksum, validate, copy onto the device)
//   step              one training step (batch 128), for scale
//   step_async_save   a step during which save_async was called (the staging copies and the small reads);
//                     the background write is waited for outside the timed region
// Each reports bytes/s of the checkpoint's files. bench/compare_checkpoint_speed.py runs the rows alternated with
// torch.save/torch.load and dd to the same directory. Flags: --dir DIR (default: a temporary directory), --widths
// 784-4096-4096-10; LOCKSTEP_BENCH_MAX_BYTES (smoke tests) shrinks the model to 784-256-256-10.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include "bench_model.hpp"
#include "lockstep/io/checkpoint.hpp"

namespace {

namespace ls = lockstep;
using namespace lockstep_bench;
namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;

fs::path bench_dir;
std::vector<std::int64_t> widths{784, 4096, 4096, 10};
constexpr std::int64_t batch = 128;

// A model, its optimizer (momentum allocated by one step) and a batch, on host:0.
struct fixture {
  fixture()
      : s(ls::device{ls::device_kind::host, 0}),
        ctx(s),
        model(build_mlp(mlp_spec{widths}, ctx, 0)),
        opt(ls::parameters_of(model).pointers(), ls::sgd_options{.lr = 0.01f, .momentum = 0.9f}),
        x(device_tensor(batch_inputs(batch, widths.front(), 1), ls::shape{batch, widths.front()}, ls::dtype::f32, s)),
        y(device_labels(batch_labels(batch, widths.back()), s)),
        state(ls::parameters_of(model)) {
    state.optimizer(opt);
    step();
    s.synchronize();
  }
  void step() {
    opt.zero_grad();
    loss.forward(model.forward(x.view(), ctx), y.view(), ctx);
    model.backward(loss.backward(ctx), ctx, ls::input_grad::not_required);
    opt.step(s);
  }
  [[nodiscard]] std::uint64_t checkpoint_bytes(const fs::path& dir) const {
    return fs::file_size(dir / "model.safetensors") + fs::file_size(dir / "training.safetensors");
  }

  ls::stream s;
  ls::context ctx;
  ls::graph model;
  ls::sgd opt;
  ls::softmax_cross_entropy loss{ls::reduction::mean};
  ls::tensor x, y;
  ls::checkpoint_state state;
};

fixture& shared() {
  static fixture f;
  return f;
}

void report(benchmark::State& state, std::uint64_t bytes) {
  state.counters["bytes_per_second"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["checkpoint_MB"] = static_cast<double>(bytes) / 1e6;
}

void save(benchmark::State& state, ls::durability d) {
  fixture& f = shared();
  // keep_last is 0 and the previous checkpoint is removed outside the timed region: torch.save and dd, which
  // this is compared with, remove nothing either.
  ls::checkpointer saver(bench_dir / "save", ls::checkpoint_options{.durability = d});
  fs::path last;
  std::uint64_t bytes = 0;
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    last = saver.save(f.state, f.s);
    state.SetIterationTime(std::chrono::duration<double>(clock_type::now() - t0).count());
    bytes = f.checkpoint_bytes(last);
    fs::remove_all(last);
    ++f.state.position.step;
  }
  report(state, bytes);
}

void load(benchmark::State& state) {
  fixture& f = shared();
  fs::remove_all(bench_dir / "load");
  ls::checkpointer saver(bench_dir / "load", ls::checkpoint_options{.durability = ls::durability::page_cache});
  const fs::path dir = saver.save(f.state, f.s);
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    ls::load_checkpoint(dir, f.state, f.s);
    state.SetIterationTime(std::chrono::duration<double>(clock_type::now() - t0).count());
  }
  report(state, f.checkpoint_bytes(dir));
}

void step(benchmark::State& state, bool async_save) {
  fixture& f = shared();
  fs::remove_all(bench_dir / "async");
  ls::checkpointer saver(bench_dir / "async", ls::checkpoint_options{.keep_last = 1, .durability = ls::durability::page_cache});
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    if (async_save) saver.save_async(f.state, f.s);
    f.step();
    f.s.synchronize();
    state.SetIterationTime(std::chrono::duration<double>(clock_type::now() - t0).count());
    if (async_save) (void)saver.wait();  // the background write, outside the measured step
    ++f.state.position.step;
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto take = [&](const char* flag) -> std::optional<std::string> {
      const std::string prefix = std::string(flag) + "=";
      if (a.rfind(prefix, 0) != 0) return std::nullopt;
      for (int j = i; j + 1 < argc; ++j) argv[j] = argv[j + 1];
      --argc;
      --i;
      return a.substr(prefix.size());
    };
    if (auto v = take("--dir")) bench_dir = *v;
    if (auto v = take("--widths")) {
      widths.clear();
      std::size_t at = 0;
      while (at < v->size()) {
        const std::size_t dash = v->find('-', at);
        widths.push_back(std::atoll(v->substr(at, dash - at).c_str()));
        if (dash == std::string::npos) break;
        at = dash + 1;
      }
    }
  }
  if (std::getenv("LOCKSTEP_BENCH_MAX_BYTES") != nullptr) widths = {784, 256, 256, 10};
  const bool temporary = bench_dir.empty();
  if (temporary) bench_dir = fs::temp_directory_path() / ("lockstep_bench_checkpoint." + std::to_string(::getpid()));
  fs::create_directories(bench_dir);
  benchmark::Initialize(&argc, argv);
  const std::string model = "mlp:" + mlp_spec{widths}.name();
  benchmark::RegisterBenchmark(("save/page_cache/" + model).c_str(), save, ls::durability::page_cache)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark(("save/fsync/" + model).c_str(), save, ls::durability::fsync)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark(("load/" + model).c_str(), load)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark(("step/" + model).c_str(), step, false)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark(("step_async_save/" + model).c_str(), step, true)->UseManualTime()->Unit(benchmark::kMillisecond);
  int status = 0;
  try {
    if (benchmark::RunSpecifiedBenchmarks() == 0) {
      std::fprintf(stderr, "bench_checkpoint: the filter matched no benchmark\n");
      status = 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_checkpoint: %s\n", e.what());
    status = 1;
  }
  benchmark::Shutdown();
  if (temporary) fs::remove_all(bench_dir);
  return status;
}
