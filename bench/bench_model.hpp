// bench/bench_model.hpp — the models and batches of the benchmarks: MLPs built like the sample's
// (examples/mlp_train: input -> [linear -> relu] x hidden -> linear), synthetic batches resident on the device
// (the data loader is not part of what is measured), and the parameter shapes of a model for the
// communication-only gradient benchmarks; and one rank of a DDP benchmark.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "lockstep/core/random.hpp"
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/nn/activation.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/graph.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/linear.hpp"
#include "lockstep/nn/loss.hpp"
#include "lockstep/parallel/distributed_data_parallel.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/tensor.hpp"

namespace lockstep_bench {

/// An MLP by its widths: {784, 2048, 2048, 10} is 784 inputs, two hidden layers of 2048 and 10 classes.
struct mlp_spec {
  std::vector<std::int64_t> widths;

  /// "784-2048-2048-10".
  [[nodiscard]] std::string name() const {
    std::string s;
    for (auto w : widths) {
      if (!s.empty()) s += '-';
      s += std::to_string(w);
    }
    return s;
  }
  [[nodiscard]] std::int64_t inputs() const { return widths.front(); }
  [[nodiscard]] std::int64_t classes() const { return widths.back(); }
  /// The parameter shapes in the order of parameters_of(model): fc1.weight [out, in], fc1.bias [out], ...
  [[nodiscard]] std::vector<lockstep::shape> parameter_shapes() const {
    std::vector<lockstep::shape> out;
    for (std::size_t i = 0; i + 1 < widths.size(); ++i) {
      out.push_back(lockstep::shape{widths[i + 1], widths[i]});
      out.push_back(lockstep::shape{widths[i + 1]});
    }
    return out;
  }
  [[nodiscard]] std::int64_t parameter_count() const {
    std::int64_t n = 0;
    for (const auto& s : parameter_shapes()) n += s.numel();
    return n;
  }
  /// Bytes of the f32 gradients.
  [[nodiscard]] std::size_t gradient_bytes() const {
    return static_cast<std::size_t>(parameter_count()) * sizeof(float);
  }
};

/// The sample's model (graph of linear and relu layers named fc1, relu1, ..., out) on ctx's device, in ctx's
/// compute type.
inline lockstep::graph build_mlp(const mlp_spec& m, lockstep::context& ctx, std::uint64_t seed) {
  lockstep::initializer init(seed);
  lockstep::graph g(lockstep::shape{m.inputs()});
  std::string previous = "input";
  const std::size_t layers = m.widths.size() - 1;
  for (std::size_t i = 0; i < layers; ++i) {
    const bool last = i + 1 == layers;
    const std::string fc = last ? std::string("out") : "fc" + std::to_string(i + 1);
    g.add(fc, lockstep::linear(m.widths[i], m.widths[i + 1], ctx, init), previous);
    previous = fc;
    if (!last) {
      const std::string act = "relu" + std::to_string(i + 1);
      g.add(act, lockstep::relu(), fc);
      previous = act;
    }
  }
  return g;
}

/// A synthetic batch: inputs uniform in [0, 1) like scaled pixels, labels i % classes.
inline std::vector<float> batch_inputs(std::int64_t rows, std::int64_t features, std::uint64_t seed) {
  std::vector<float> x(static_cast<std::size_t>(rows * features));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = lockstep::philox_uniform(seed, 17, i);
  return x;
}
inline std::vector<std::int32_t> batch_labels(std::int64_t rows, std::int64_t classes, std::int64_t first = 0) {
  std::vector<std::int32_t> y(static_cast<std::size_t>(rows));
  for (std::size_t i = 0; i < y.size(); ++i)
    y[i] = static_cast<std::int32_t>((first + static_cast<std::int64_t>(i)) % classes);
  return y;
}

/// `values` as a tensor of `dims` in `type` (rounded from f32) on the device of `s`, written in stream order on `s`.
inline lockstep::tensor device_tensor(const std::vector<float>& values, lockstep::shape dims, lockstep::dtype type,
                                      lockstep::stream_ref s) {
  lockstep::tensor t(dims, type, s);
  auto staged = lockstep::to_device(values, s);
  const lockstep::device_span<const float> src(staged.data(), staged.size(), staged.get_device());
  lockstep::dispatch_floating(type, "benchmark input", [&]<class T>() {
    if constexpr (std::is_same_v<T, float>) {
      lockstep::copy(t.span<float>(), src, s);
    } else {
      lockstep::cast<T, float>(src, t.span<T>(), s);
    }
  });
  return t;  // `staged` is freed in stream order on s, after the copy
}

inline lockstep::tensor device_labels(const std::vector<std::int32_t>& labels, lockstep::stream_ref s) {
  lockstep::tensor t(lockstep::shape{static_cast<std::int64_t>(labels.size())}, lockstep::dtype::i32, s);
  auto staged = lockstep::to_device(labels, s);
  lockstep::copy(t.span<std::int32_t>(),
                 lockstep::device_span<const std::int32_t>(staged.data(), staged.size(), staged.get_device()), s);
  return t;
}

/// One rank of a DDP benchmark: its compute and communication streams, context, model (every rank builds the
/// same one from `seed`), the global batch of rows x ranks synthetic inputs on its device, this rank's shard
/// (`rows` rows from `first`) with its labels, a mean loss, and the DDP wrapper.
struct ddp_rank {
  ddp_rank(lockstep::device d, const mlp_spec& m, lockstep::communicator_ref c, std::int64_t first, std::int64_t rows,
           std::uint64_t seed, const lockstep::ddp_options& options = {})
      : comm(c),
        compute(d),
        comm_stream(d),
        ctx(compute),
        model(build_mlp(m, ctx, seed)),
        x(device_tensor(batch_inputs(rows * c.size(), m.inputs(), seed), lockstep::shape{rows * c.size(), m.inputs()},
                        lockstep::dtype::f32, compute)),
        y(device_labels(batch_labels(rows, m.classes(), first), compute)),
        shard(x.view().slice_rows(first, rows)) {
    ctx.set_seed(seed);
    ddp.emplace(model, ctx, comm, comm_stream, options);
  }
  lockstep::communicator_ref comm;
  lockstep::stream compute, comm_stream;
  lockstep::context ctx;
  lockstep::graph model;
  lockstep::tensor x, y;
  lockstep::tensor_view shard;
  lockstep::softmax_cross_entropy loss{lockstep::reduction::mean};
  std::optional<lockstep::distributed_data_parallel<lockstep::graph>> ddp;
};

}  // namespace lockstep_bench
