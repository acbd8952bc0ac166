// Shared by the data-parallel tests (threads and mpirun): a small MLP like the sample's, a deterministic
// dataset, and single-device training as the reference the parallel runs must reproduce.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <stdexcept>
#include <vector>

#include "lockstep/amp/loss_scaler.hpp"
#include "lockstep/comm/coalesced.hpp"
#include "lockstep/core/random.hpp"
#include "lockstep/nn/activation.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/nn/conv2d.hpp"
#include "lockstep/nn/flatten.hpp"
#include "lockstep/nn/graph.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/layer_norm.hpp"
#include "lockstep/nn/linear.hpp"
#include "lockstep/nn/loss.hpp"
#include "lockstep/nn/pool.hpp"
#include "lockstep/optim/adamw.hpp"
#include "lockstep/optim/clip.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/parallel/distributed_data_parallel.hpp"
#include "lockstep/runtime/copy.hpp"

namespace parallel_test {

using namespace lockstep;

constexpr std::int64_t features = 20;
constexpr std::int64_t classes = 10;
constexpr std::int64_t samples = 520;
constexpr int steps = 20;
constexpr std::uint64_t seed = 7;
const sgd_options optimizer_options{.lr = 0.1f, .momentum = 0.9f, .weight_decay = 1e-4f};

/// make_model's variants: the MLP alone; with a layer_norm, a batch_norm or a synchronized batch_norm ("norm1") between
/// fc1 and its ReLU; or a small CNN in front of fc1 (the rows as 1x4x5 images: conv 3x3 with padding, synchronized
/// batch norm, ReLU, 2x2 max pooling, flatten: 16 features).
enum class model_variant : std::uint8_t { mlp, layer_norm, batch_norm, sync_batch_norm, cnn };

/// The sample's model shape, small: features -> 32 -> 16 -> classes with ReLU, initialized from `init_seed`, in
/// `variant`.
inline graph make_model(context& ctx, std::uint64_t init_seed = seed, model_variant variant = model_variant::mlp) {
  initializer init(init_seed);
  graph g(shape{features});
  if (variant == model_variant::cnn) {
    static_assert(features == 20);
    g.add("image", unflatten(shape{1, 4, 5}), "input")
        .add("conv1", conv2d(1, 4, 3, ctx, init, conv2d_options{.padding = 1}), "image")
        .add("bn1", batch_norm(4, ctx, batch_norm_options{.sync = true}), "conv1")
        .add("act1", relu(), "bn1")
        .add("pool1", max_pool2d(2), "act1")
        .add("flat", flatten(), "pool1")
        .add("fc1", linear(16, 32, ctx, init), "flat");
  } else {
    g.add("fc1", linear(features, 32, ctx, init), "input");
  }
  if (variant == model_variant::layer_norm) g.add("norm1", layer_norm(32, ctx), "fc1");
  if (variant == model_variant::batch_norm || variant == model_variant::sync_batch_norm) {
    g.add("norm1", batch_norm(32, ctx, batch_norm_options{.sync = variant == model_variant::sync_batch_norm}), "fc1");
  }
  const bool normalized = variant != model_variant::mlp && variant != model_variant::cnn;
  g.add("relu1", relu(), normalized ? "norm1" : "fc1");
  g.add("fc2", linear(32, 16, ctx, init), "relu1");
  g.add("relu2", relu(), "fc2");
  g.add("out", linear(16, classes, ctx, init), "relu2");
  return g;
}

/// Inputs in [-1, 1) and labels, the same on every rank and run.
inline std::vector<float> inputs() {
  std::vector<float> x(static_cast<std::size_t>(samples * features));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2.0f * philox_uniform(seed, 99, i) - 1.0f;
  return x;
}
inline std::vector<std::int32_t> labels() {
  std::vector<std::int32_t> y(static_cast<std::size_t>(samples));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>((i * 7 + i / 3) % classes);
  return y;
}

/// Rows [first, first + count) of the dataset for `step` with a global batch of `batch`.
inline std::int64_t first_row(int step, std::int64_t batch) { return (step * batch) % (samples - batch + 1); }

template <class T>
std::vector<T> slice(const std::vector<T>& v, std::int64_t first, std::int64_t rows, std::int64_t width) {
  return std::vector<T>(v.begin() + first * width, v.begin() + (first + rows) * width);
}

inline tensor device_tensor(const std::vector<float>& v, shape dims, stream_ref s) {
  tensor t(dims, dtype::f32, s);
  if (!v.empty()) {
    auto staged = to_device(v, s);
    copy(t.span<float>(), device_span<const float>(staged.span()), s);
  }
  return t;
}
inline tensor device_labels(const std::vector<std::int32_t>& v, stream_ref s) {
  tensor t(shape{static_cast<std::int64_t>(v.size())}, dtype::i32, s);
  if (!v.empty()) {
    auto staged = to_device(v, s);
    copy(t.span<std::int32_t>(), device_span<const std::int32_t>(staged.span()), s);
  }
  return t;
}

/// Every parameter's fp32 values, concatenated in parameter order.
template <class Model>
std::vector<float> parameter_values(Model& m, stream_ref s) {
  std::vector<float> out;
  for (const auto& p : parameters_of(m)) {
    const auto v = to_vector(p.param->value().template span<const float>(), s);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

/// The parameters the runs start from.
inline std::vector<float> initial_parameters(device d) {
  stream s(d);
  context ctx(s);
  graph model = make_model(ctx);
  return parameter_values(model, s);
}

/// `steps` steps of single-device training with global batch `batch` on `d` (in deterministic mode with
/// `deterministic`); the final parameters.
inline std::vector<float> train_single(device d, std::int64_t batch,
                                       std::optional<deterministic_options> deterministic = std::nullopt,
                                       model_variant variant = model_variant::mlp) {
  stream s(d);
  context ctx(s);
  ctx.set_deterministic(deterministic);
  graph model = make_model(ctx, seed, variant);
  auto params = parameters_of(model).pointers();
  sgd opt(params, optimizer_options);
  softmax_cross_entropy loss(reduction::mean);
  const auto x = inputs();
  const auto y = labels();
  for (int step = 0; step < steps; ++step) {
    const std::int64_t first = first_row(step, batch);
    tensor xb = device_tensor(slice(x, first, batch, features), shape{batch, features}, s);
    tensor yb = device_labels(slice(y, first, batch, 1), s);
    opt.zero_grad();
    loss.forward(model.forward(xb, ctx), yb, ctx, batch);
    model.backward(loss.backward(ctx), ctx, input_grad::not_required);
    opt.step(s);
  }
  return parameter_values(model, s);
}

/// One rank of distributed_data_parallel training: `steps` steps on this rank's chunk of the same global batch
/// of `batch` rows (the loss is the mean over the global batch, as the wrapper tells it: no mean_over passed, shards
/// uneven or empty); in deterministic mode (`deterministic`) its
/// deterministic_shard. The rank's final parameters. Threads (run_on_devices) and processes (mpirun) run the same
/// code.
/// In deterministic mode, `global` tells the context the global batch (context::set_global_rows), with which the
/// wrapper may gather partial gradients; `*gathered` (when given) then says whether the last backward did.
enum class global_batch : std::uint8_t { not_told, told };
inline std::vector<float> train_ddp_rank(context& ctx, communicator_ref comm, stream_ref comm_stream,
                                         std::int64_t batch, ddp_options options = {},
                                         std::optional<deterministic_options> deterministic = std::nullopt,
                                         global_batch global = global_batch::not_told, bool* gathered = nullptr,
                                         model_variant variant = model_variant::mlp) {
  const stream_ref s = ctx.stream();
  graph model = make_model(ctx, seed, variant);
  options.deterministic = deterministic;  // the wrapper sets the mode on the context
  distributed_data_parallel ddp(model, ctx, comm, comm_stream, options);
  auto params = parameters_of(model).pointers();
  sgd opt(params, optimizer_options);
  softmax_cross_entropy loss(reduction::mean);
  const auto x = inputs();
  const auto y = labels();
  const auto chunks = chunk_rows(batch, static_cast<std::size_t>(comm.size()));
  for (int step = 0; step < steps; ++step) {
    const std::int64_t first = first_row(step, batch);
    opt.zero_grad();
    if (deterministic) {
      // as the sample does: every rank runs forward and backward, on no rows when its shard is empty (whose first
      // row is then the batch's end, not a chunk boundary)
      const row_range mine = deterministic_shard(batch, deterministic->chunk_rows, comm.rank(), comm.size());
      ctx.set_row_offset(mine.begin);
      if (global == global_batch::told) ctx.set_global_rows(batch);
      tensor xb = device_tensor(slice(x, first + mine.begin, mine.rows, features), shape{mine.rows, features}, s);
      tensor yb = device_labels(slice(y, first + mine.begin, mine.rows, 1), s);
      loss.forward(ddp.forward(xb), yb, ctx);  // the wrapper makes it the mean over the GLOBAL batch
      ddp.backward(loss.backward(ctx));
    } else if (static_cast<std::size_t>(comm.rank()) < chunks.size()) {
      const row_range mine = chunks[static_cast<std::size_t>(comm.rank())];
      tensor xb = device_tensor(slice(x, first + mine.begin, mine.rows, features), shape{mine.rows, features}, s);
      tensor yb = device_labels(slice(y, first + mine.begin, mine.rows, 1), s);
      loss.forward(ddp.forward(xb), yb, ctx);  // the wrapper sums the ranks' rows: the mean over the GLOBAL batch
      ddp.backward(loss.backward(ctx));
    } else {
      ddp.backward(tensor_view());  // no rows for this rank this step
    }
    opt.step(s);
  }
  if (gathered != nullptr) *gathered = ddp.gathered_partials();
  return parameter_values(model, s);
}

/// What a comparison of DDP and ZeRO trains: the precision (f16/bf16 with the loss scaler, reduced over the
/// ranks), the optimizer, the ZeRO stage, micro-batches per step (under no_sync), gradient clipping, and small
/// buckets, so that the small model spans several and its parameters are cut by the ranks' shards.
struct recipe {
  dtype precision = dtype::f32;
  bool adamw = false;
  int zero = 0;
  int micro_batches = 1;
  float clip = 0.0f;  // max norm (0: none)
  std::size_t bucket_bytes = 2048;
  std::size_t first_bucket_bytes = 512;
  float initial_scale = 0.0f;  // f16's loss scale to start from (0: 2^10)
  std::optional<deterministic_options> deterministic = std::nullopt;  // each rank on its deterministic_shard
  global_batch global = global_batch::not_told;  // deterministic mode: told, DDP may gather partial gradients
  model_variant variant = model_variant::mlp;  // make_model's
  host_collective_stream collectives = host_collective_stream::automatic;  // ddp_options::host_collectives
  bool deferred_masters = false;  // the model built inside a deferred_master_values scope
  bool evaluate = false;     // every rank runs an eval-mode forward through the wrapper before each step
  bool consolidate = false;  // every rank with rows consolidates between its forward and its backward
};

/// What a rank ends a recipe with: its parameters (whole: gathered with ddp.consolidated under ZeRO), its
/// optimizer's state, the report and, with clipping, the last total norm.
struct recipe_result {
  std::vector<float> parameters;
  std::vector<float> optimizer_state;
  device_report report;
  float norm = 0.0f;
  std::int64_t skipped_steps = 0;  // by the loss scaler
  bool gathered_partials = false;  // deterministic DDP: the last backward gathered partial gradients
  bool collectives_on_compute_stream = false;  // the wrapper ran its collectives on the compute stream
};

/// One rank of distributed_data_parallel training with recipe `r`: `steps` steps of the same global batch of
/// `batch` rows, each rank on its chunk (split again into r.micro_batches under no_sync).
inline recipe_result train_recipe_rank(communicator_ref comm, stream_ref s, stream_ref comm_stream, std::int64_t batch,
                                       const recipe& r) {
  context ctx(s, r.precision);
  graph model = [&] {
    std::optional<deferred_master_values> defer;
    if (r.deferred_masters) defer.emplace();
    return make_model(ctx, seed, r.variant);
  }();
  if (r.deferred_masters && !parameters_of(model)[0].param->masters_deferred()) {
    throw std::logic_error("recipe.deferred_masters: the model was built with its master values");
  }
  distributed_data_parallel ddp(model, ctx, comm, comm_stream,
                                ddp_options{.bucket_bytes = r.bucket_bytes, .first_bucket_bytes = r.first_bucket_bytes,
                                            .deterministic = r.deterministic, .zero = to_zero_stage(r.zero),
                                            .host_collectives = r.collectives});
  auto params = parameters_of(model).pointers();
  std::optional<sgd> plain;
  std::optional<adamw> adam;
  if (r.adamw) {
    adam.emplace(params, adamw_options{.lr = 0.01f, .weight_decay = 0.01f});
  } else {
    plain.emplace(params, optimizer_options);
  }
  std::optional<loss_scaler> scaler;
  if (r.precision != dtype::f32) {
    // f16: a scale of 2^10 growing every 5 clean steps, so that growth and (at 2^15+) overflows happen
    const float initial = r.initial_scale > 0.0f ? r.initial_scale : 1024.0f;
    scaler.emplace(s, r.precision == dtype::f16 ? loss_scaler_options{.initial_scale = initial, .growth_interval = 5}
                                                : loss_scaler_options::for_precision(r.precision));
    scaler->attach(ctx);
  }
  gradient_clipper clipper(s);
  softmax_cross_entropy loss(reduction::mean);
  const auto x = inputs();
  const auto y = labels();
  const auto chunks = chunk_rows(batch, static_cast<std::size_t>(comm.size()));
  ddp.reset_report();
  for (int step = 0; step < steps; ++step) {
    const std::int64_t first = first_row(step, batch);
    if (r.evaluate) {  // (the same 4 rows on every rank: an evaluation is every rank's call)
      tensor xe = device_tensor(slice(x, 0, 4, features), shape{4, features}, s);
      tensor input(shape{4, features}, r.precision, s);
      detail::convert_floating(xe, input, s);
      ctx.set_mode(run_mode::eval);
      (void)ddp.forward(input);
      ctx.set_mode(run_mode::train);
    }
    plain ? plain->zero_grad() : adam->zero_grad();
    row_range mine = static_cast<std::size_t>(comm.rank()) < chunks.size() ? chunks[static_cast<std::size_t>(comm.rank())]
                                                                            : row_range{batch, 0};
    auto micro = chunk_rows(mine.rows, static_cast<std::size_t>(r.micro_batches));
    if (r.deterministic) {  // whole chunks, for the rank and for its micro-batches
      mine = deterministic_shard(batch, r.deterministic->chunk_rows, comm.rank(), comm.size());
      micro = deterministic_shards(mine.rows, r.deterministic->chunk_rows, static_cast<std::size_t>(r.micro_batches));
    }
    for (int m = 0; m < r.micro_batches; ++m) {
      const bool last = m + 1 == r.micro_batches;
      if (r.global == global_batch::told) ctx.set_global_rows(batch);  // every rank, rows or not: they decide alike
      auto pass = [&] {
        if (static_cast<std::size_t>(m) >= micro.size()) {
          ddp.backward(tensor_view());  // no rows for this rank (or this micro-batch)
          return;
        }
        const std::int64_t at = first + mine.begin + micro[static_cast<std::size_t>(m)].begin;
        const std::int64_t rows = micro[static_cast<std::size_t>(m)].rows;
        if (r.deterministic) ctx.set_row_offset(mine.begin + micro[static_cast<std::size_t>(m)].begin);
        tensor xb = device_tensor(slice(x, at, rows, features), shape{rows, features}, s);
        tensor yb = device_labels(slice(y, at, rows, 1), s);
        tensor input(shape{rows, features}, r.precision, s);
        dispatch_floating(r.precision, "input", [&]<class T>() {
          if constexpr (std::is_same_v<T, float>) {
            copy(input.span<float>(), xb.span<const float>(), s);
          } else {
            cast<T, float>(xb.span<const float>(), input.span<T>(), s);
          }
        });
        loss.forward(ddp.forward(input), yb, ctx, batch);  // the mean over the GLOBAL batch
        if (r.consolidate) {
          if (adam) {
            auto guard = ddp.consolidated(*adam);
          } else {
            auto guard = ddp.consolidated(*plain);
          }
        }
        ddp.backward(loss.backward(ctx));
      };
      if (last) {
        pass();
      } else {
        auto guard = ddp.no_sync();
        pass();
      }
    }
    step_inputs in{};
    if (scaler) {
      scaler->unscale_and_check(params, s, comm);
      in = scaler->optimizer_inputs();
    }
    if (r.clip > 0.0f) {
      std::optional<communicator_ref> shards;
      if (ddp.zero() != zero_stage::none) shards = comm;
      in = clipper.clip_grad_norm(params, {.max_norm = r.clip}, s, in, shards);
    }
    plain ? plain->step(s, in) : adam->step(s, in);
    if (scaler) scaler->update(s);
  }
  recipe_result out;
  out.report = ddp.report();
  out.report.optimizer_bytes = plain ? plain->state_bytes() : adam->state_bytes();  // sharded, as trained
  if (r.clip > 0.0f) out.norm = clipper.total_norm(s);
  if (scaler) out.skipped_steps = scaler->read(s).skipped_steps;
  out.gathered_partials = ddp.gathered_partials();
  out.collectives_on_compute_stream = ddp.collective_stream() == s;
  auto whole = [&](auto& opt) {
    auto full = ddp.consolidated(opt);
    out.parameters = parameter_values(model, s);
    for (std::size_t i = 0; i < opt.params().size(); ++i) {
      for (int k = 0; k < std::remove_reference_t<decltype(opt)>::state_count; ++k) {
        const tensor_view t = opt.state(0, i, k);
        if (t.empty()) continue;
        const auto v = to_vector(t.template span<const float>(), s);
        out.optimizer_state.insert(out.optimizer_state.end(), v.begin(), v.end());
      }
    }
  };
  plain ? whole(*plain) : whole(*adam);
  return out;
}

/// max |a - b| / max |b|: the relative difference of two parameter vectors.
inline double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return a.size() == b.size() ? diff / scale : 1.0;
}

}  // namespace parallel_test
