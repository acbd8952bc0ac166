// lockstep/nn/batch_norm.hpp — batch normalization over the features of [N, F] or the channels of [N, C, ...]
// (PyTorch's nn.BatchNorm1d / BatchNorm2d / BatchNorm3d in one layer).
#pragma once

#include <algorithm>
#include <cstdint>

#include "lockstep/config.hpp"
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/kernels/exact.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/kernels/norm.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/deterministic.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/runtime/copy.hpp"

LOCKSTEP_ABI_BEGIN

/// What a batch_norm is built with (PyTorch's defaults).
struct batch_norm_options {
  float eps = 1e-5f;             ///< added to the variance under the square root
  float momentum = 0.1f;         ///< running = (1 - momentum) running + momentum batch (PyTorch's convention)
  bool affine = true;            ///< a learned scale "weight" (ones) and shift "bias" (zeros) per channel
  bool track_running_stats = true;  ///< buffers running_mean, running_var, num_batches_tracked; used in evaluation
  /// Synchronized batch norm (PyTorch's SyncBatchNorm): training statistics over every replica's rows, the global
  /// batch of data_parallel or distributed_data_parallel (context::replicas()); alone, the replica's own.
  bool sync = false;
  /// A ReLU fused after the normalization: the output is relu(y), the bits of a relu layer after the batch norm, in
  /// one pass over the output each way instead of that layer's two (PyTorch's BatchNorm2d followed by ReLU, which
  /// has no parameters: the state dict's names are the same).
  bool relu = false;
};

/// Normalizes each channel c of x ([N, C] or [N, C, d2, ...]) over its N * d2 * ... values:
///   training (context::training()):  y = (x - mean_B) / sqrt(var_B + eps) * weight[c] + bias[c], with the batch's
///     mean and biased variance (f32, two compensated passes: kernels/norm.hpp), and the running statistics updated
///     with PyTorch's momentum and the unbiased variance var_B * m / (m - 1) (m values per channel);
///   evaluation: the same with running_mean and running_var (the batch's statistics without track_running_stats).
/// Parameters "weight" and "bias" [C]; buffers "running_mean" [C] (zeros), "running_var" [C] (ones), f32, and
/// "num_batches_tracked" (i64 scalar), named as PyTorch's, so checkpoints load into torch.nn.BatchNorm2d. With
/// options.relu the output is relu(y) (batch_norm_options::relu).
///
/// Data parallelism: each replica normalizes with its own rows' statistics (what PyTorch's BatchNorm does under
/// DDP), or with `sync` with those of the whole global batch: the forward adds the replicas' per-channel sums and
/// count, then their sums of squared deviations from the global mean (two small all-reduces), and the backward
/// their sums of gy and gy * xhat (one), through context::replicas(); so the outputs and gradients are those of
/// one device with the whole batch. With sync every replica runs forward and backward each step, on no rows when it
/// has none (distributed_data_parallel then runs backward on no rows for a rank given an empty gradient). The
/// wrappers keep the buffers equal on every replica, rank 0's (see parameter_list).
///
/// Deterministic mode: the statistics' sums are taken per chunk of global rows (f32, compensated), the chunks added
/// exactly (kernels/exact.hpp) and, with sync, the replicas' exact sums added as integers, then rounded once; the
/// parameter gradients are exact sums of per-chunk partials (nn/deterministic.hpp). With sync the results are then
/// the same bits on any number of replicas; without it the statistics depend on how the batch is split (by
/// definition), and a given split gives the same bits every run. (Terms of the exact sums must stay below 2^32: a
/// chunk whose squared deviations sum beyond it makes the statistics NaN, as a diverging gradient would.)
class batch_norm {
 public:
  /// A layer on ctx's device for `channels` channels. Throws precondition_error for a non-positive channel count,
  /// a non-positive eps or a momentum outside [0, 1].
  batch_norm(std::int64_t channels, context& ctx, batch_norm_options o = {}) : channels_(channels), options_(o) {
    LOCKSTEP_EXPECTS(channels > 0, "batch_norm(", channels, "): the channel count must be positive");
    LOCKSTEP_EXPECTS(o.eps > 0.0f, "batch_norm(", channels, "): eps must be positive, got ", o.eps);
    LOCKSTEP_EXPECTS(o.momentum >= 0.0f && o.momentum <= 1.0f, "batch_norm(", channels,
                     "): momentum must be in [0, 1], got ", o.momentum);
    const stream_ref s = ctx.stream();
    if (o.affine) {
      weight_ = parameter("weight", shape{channels}, s, ctx.compute_type());
      bias_ = parameter("bias", shape{channels}, s, ctx.compute_type());
      fill_values(weight_, 1.0f, s);
      fill_values(bias_, 0.0f, s);
    }
    if (o.track_running_stats) {
      running_mean_ = tensor(shape{channels}, dtype::f32, s);
      running_var_ = tensor(shape{channels}, dtype::f32, s);
      tracked_ = tensor(shape{}, dtype::i64, s);
      fill_zero(running_mean_.view().bytes(), s);
      fill_zero(tracked_.view().bytes(), s);
      launch_elementwise(static_cast<std::size_t>(channels), kernels::fill_op<float>{running_var_.as<float>(), 1.0f}, s,
                         "batch_norm running_var");
    }
  }

  [[nodiscard]] std::int64_t channels() const noexcept { return channels_; }
  [[nodiscard]] const batch_norm_options& options() const noexcept { return options_; }
  [[nodiscard]] parameter& weight() noexcept { return weight_; }
  [[nodiscard]] parameter& bias_parameter() noexcept { return bias_; }
  [[nodiscard]] tensor& running_mean() noexcept { return running_mean_; }
  [[nodiscard]] tensor& running_var() noexcept { return running_var_; }
  [[nodiscard]] tensor& num_batches_tracked() noexcept { return tracked_; }

  tensor_view forward(const tensor_view& x, context& ctx) {
    check_input(x, ctx);
    x_ = x;
    forwarded_ = true;
    batch_stats_ = ctx.training() || !options_.track_running_stats;
    // synchronized in training only (PyTorch's SyncBatchNorm: evaluation without running statistics is local), and
    // a group of one is no group
    group_ = options_.sync && ctx.training() ? ctx.replicas() : nullptr;
    if (group_ != nullptr && group_->size() == 1) group_ = nullptr;
    const stream_ref s = ctx.stream();
    const geometry g = geometry_of(x);
    LOCKSTEP_EXPECTS(!batch_stats_ || group_ != nullptr || g.n * g.inner != 1, "batch_norm(", channels_,
                     "): training needs more than 1 value per channel, got an input of shape ", x.dims().str());
    y_.ensure(x.dims(), x.type(), s);
    if (g.n == 0 && group_ == nullptr) return y_.view();  // (a synchronized replica without rows adds zeros)
    const auto c = static_cast<std::size_t>(channels_);
    mean_.ensure(shape{channels_}, dtype::f32, s);
    rstd_.ensure(shape{channels_}, dtype::f32, s);
    if (batch_stats_) {
      sums_.ensure(shape{channels_ + 1}, dtype::f32, s);
      squares_.ensure(shape{channels_}, dtype::f32, s);
    }
    const bool track = options_.track_running_stats && ctx.training();
    dispatch_floating(x.type(), "batch_norm", [&]<class T>() {
      if (batch_stats_) statistics<T>(x, g, ctx);
      launch_rows(c,
                  kernels::batch_norm_normalize_op<T>{
                      x.as<T>(), affine() ? weight_.compute_value().as<T>() : nullptr,
                      affine() ? bias_.compute_value().as<T>() : nullptr, y_.as<T>(),
                      batch_stats_ ? sums_.as<float>() : nullptr, batch_stats_ ? squares_.as<float>() : nullptr,
                      mean_.as<float>(), rstd_.as<float>(),
                      track || !batch_stats_ ? running_mean_.as<float>() : nullptr,
                      track || !batch_stats_ ? running_var_.as<float>() : nullptr,
                      track ? tracked_.as<std::int64_t>() : nullptr, g.n, c, g.inner, options_.eps, options_.momentum,
                      options_.relu},
                  s, "batch_norm normalize");
    });
    return y_.view();
  }

  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    LOCKSTEP_EXPECTS(forwarded_, "batch_norm::backward without a forward");
    LOCKSTEP_EXPECTS(gy.dims() == x_.dims() && gy.type() == x_.type(), "batch_norm::backward: gradient of shape ",
                     gy.dims().str(), " (", name_of(gy.type()), ") for an output of shape ", x_.dims().str(), " (",
                     name_of(x_.type()), ")");
    const stream_ref s = ctx.stream();
    const geometry g = geometry_of(gy);
    const auto c = static_cast<std::size_t>(channels_);
    if (need == input_grad::required) gx_.ensure(gy.dims(), gy.type(), s);
    // The sums over the rows of gy and gy * xhat: the parameters' gradients (this replica's rows; outside
    // deterministic mode, which sums per chunk) and, under batch statistics, the input gradient (every replica's
    // rows when synchronized, which a replica without rows takes part in).
    const bool batch_dx = batch_stats_ && need == input_grad::required && (g.n > 0 || group_ != nullptr);
    const bool local_sums = (affine() && !ctx.deterministic() && g.n > 0) || (batch_dx && !ctx.deterministic());
    if (batch_dx || local_sums) grad_sums_.ensure(shape{2 * channels_}, dtype::f32, s);
    float* sg = batch_dx || local_sums ? grad_sums_.as<float>() : nullptr;
    float* sgx = sg == nullptr ? nullptr : sg + channels_;
    dispatch_floating(gy.type(), "batch_norm", [&]<class T>() {
      auto sums_op = [&](std::size_t first_row, std::size_t rows, float* a, float* b) {
        const std::size_t first = first_row * c * g.inner;
        return kernels::batch_norm_grad_sums_op<T>{gy.as<T>() + first, x_.as<T>() + first, mean_.as<float>(),
                                                   rstd_.as<float>(), a, b, rows, c, g.inner,
                                                   options_.relu ? y_.as<T>() + first : nullptr};
      };
      if (local_sums) launch_rows(c, sums_op(0, g.n, sg, sgx), s, "batch_norm gradient sums");
      if (ctx.deterministic() && (affine() || batch_dx)) {
        // Each chunk's two sums in one pass (f32, side by side in terms_), which both parameters' partials (rounded
        // to T, added exactly) and the input gradient's exact sums read: a pass over gy and x for each of the three
        // gave the same floats three times.
        const std::int64_t cr = ctx.deterministic()->chunk_rows;
        const std::int64_t chunks = chunk_terms(gy.rows(), 2 * c, ctx, [&](std::size_t first_row, std::size_t rows,
                                                                          float* out) {
          launch_rows(c, sums_op(first_row, rows, out, out + c), s, "batch_norm gradient sums");
        });
        if (affine()) {
          auto partial = [&](std::size_t offset) {  // 0: the sums of gy (beta's), c: of gy * xhat (gamma's)
            return [&, offset](std::int64_t b, std::int64_t, T* out) {
              const float* chunk = terms_.as<float>() + (b / cr) * static_cast<std::int64_t>(2 * c);
              launch_elementwise(c, kernels::cast_op<T, float>{chunk + offset, out}, s, "batch_norm parameter gradients");
            };
          };
          exact_.accumulate<T>(weight_, gy.rows(), ctx, partial(c));
          exact_.accumulate<T>(bias_, gy.rows(), ctx, partial(0));
        }
        if (batch_dx) sum_terms(chunks, 2 * c, sg, ctx);
      } else if (affine()) {
        if (g.n == 0) {
          zero_parameter_gradients(s);  // a replica without rows: its share is zero
        } else {
          const float wbeta = weight_.begin_accumulate(), bbeta = bias_.begin_accumulate();
          launch_elementwise(c,
                             kernels::batch_norm_param_grad_op<T>{sg, sgx, weight_.grad().as<T>(), bias_.grad().as<T>(),
                                                                  wbeta, bbeta},
                             s, "batch_norm parameter gradients");
        }
      }
      if (batch_dx && !ctx.deterministic() && group_ != nullptr) group_->sum(sg, 2 * c, s);
      if (need == input_grad::required && g.n > 0) {
        launch_rows(c,
                    kernels::batch_norm_input_grad_op<T>{
                        gy.as<T>(), x_.as<T>(), affine() ? weight_.compute_value().as<T>() : nullptr, mean_.as<float>(),
                        rstd_.as<float>(), batch_stats_ ? sg : nullptr, batch_stats_ ? sgx : nullptr,
                        batch_stats_ ? sums_.as<float>() : nullptr, gx_.as<T>(), g.n, c, g.inner,
                        options_.relu ? y_.as<T>() : nullptr},
                    s, "batch_norm input gradient");
      }
    });
    return need == input_grad::required ? gx_.view() : tensor_view();
  }

  void parameters(parameter_list& out) {
    if (affine()) {
      out.add(weight_);
      out.add(bias_);
    }
    if (options_.track_running_stats) {
      out.add_buffer("running_mean", running_mean_);
      out.add_buffer("running_var", running_var_);
      out.add_buffer("num_batches_tracked", tracked_);
    }
  }

  [[nodiscard]] batch_norm clone(context& ctx) const {
    batch_norm l(channels_, options_);
    const stream_ref s = ctx.stream();
    if (affine()) {
      l.weight_ = weight_.clone(s);
      l.bias_ = bias_.clone(s);
    }
    if (options_.track_running_stats) {
      for (auto [from, to] : {std::pair{&running_mean_, &l.running_mean_}, std::pair{&running_var_, &l.running_var_},
                              std::pair{&tracked_, &l.tracked_}}) {
        *to = tensor(from->dims(), from->type(), s);
        copy(to->view().bytes(), device_span<const std::uint8_t>(from->view().bytes()), s);
      }
    }
    return l;
  }

  [[nodiscard]] shape output_shape(const shape& sample) const {
    LOCKSTEP_EXPECTS(sample.rank() >= 1 && sample[0] == channels_, "batch_norm(", channels_, ") expects samples of ",
                     channels_, " channels ([", channels_, "] or [", channels_, ", ...]), got shape ", sample.str());
    return sample;
  }

 private:
  batch_norm(std::int64_t channels, batch_norm_options o) : channels_(channels), options_(o) {}

  struct geometry {
    std::size_t n;      // rows
    std::size_t inner;  // values per channel per row
  };
  [[nodiscard]] geometry geometry_of(const tensor_view& x) const {
    return {static_cast<std::size_t>(x.rows()), static_cast<std::size_t>(x.rows() == 0 ? 0 : x.cols() / channels_)};
  }

  [[nodiscard]] bool affine() const noexcept { return options_.affine; }

  // The batch's sums: sums_ (per channel, and the count at [C]) and squares_ (of the deviations from the mean they
  // give), over this replica's rows or, synchronized, every replica's.
  template <class T>
  void statistics(const tensor_view& x, const geometry& g, context& ctx) {
    const stream_ref s = ctx.stream();
    const auto c = static_cast<std::size_t>(channels_);
    auto at = [&](std::size_t first_row) { return x.as<T>() + first_row * c * g.inner; };
    if (ctx.deterministic()) {
      exact_sums(x.rows(), c + 1, sums_.as<float>(), ctx, [&](std::size_t first_row, std::size_t rows, float* out) {
        launch_rows(c, kernels::batch_norm_sum_op<T>{at(first_row), out, rows, c, g.inner}, s, "batch_norm mean");
      });
      exact_sums(x.rows(), c, squares_.as<float>(), ctx, [&](std::size_t first_row, std::size_t rows, float* out) {
        launch_rows(c, kernels::batch_norm_square_op<T>{at(first_row), sums_.as<float>(), out, rows, c, g.inner}, s,
                    "batch_norm variance");
      });
      return;
    }
    launch_rows(c, kernels::batch_norm_sum_op<T>{at(0), sums_.as<float>(), g.n, c, g.inner}, s, "batch_norm mean");
    if (group_ != nullptr) group_->sum(sums_.as<float>(), c + 1, s);
    launch_rows(c, kernels::batch_norm_square_op<T>{at(0), sums_.as<float>(), squares_.as<float>(), g.n, c, g.inner}, s,
                "batch_norm variance");
    if (group_ != nullptr) group_->sum(squares_.as<float>(), c, s);
  }

  // Deterministic mode's sums of `width` values over the replica's `rows` rows: partial(first_row, rows, terms)
  // queues a chunk's f32 sums into terms; the chunks are added exactly, the replicas' exact sums (synchronized)
  // added as integers, and the result rounded once into out[width].
  template <class Partial>
  void exact_sums(std::int64_t rows, std::size_t width, float* out, context& ctx, Partial&& partial) {
    sum_terms(chunk_terms(rows, width, ctx, partial), width, out, ctx);
  }

  // The first half of exact_sums: each chunk's terms into terms_ (chunk j's `width` floats at j * width); returns
  // the number of chunks.
  template <class Partial>
  std::int64_t chunk_terms(std::int64_t rows, std::size_t width, context& ctx, Partial&& partial) {
    const std::int64_t cr = ctx.deterministic()->chunk_rows, chunks = (rows + cr - 1) / cr;
    terms_.ensure(shape{std::max<std::int64_t>(chunks, 1) * static_cast<std::int64_t>(width)}, dtype::f32, ctx.stream());
    for_each_row_chunk(rows, ctx, "batch_norm", [&](std::int64_t b, std::int64_t r) {
      partial(static_cast<std::size_t>(b), static_cast<std::size_t>(r), terms_.as<float>() + (b / cr) * static_cast<std::int64_t>(width));
    });
    return chunks;
  }

  // The second half: the chunks' terms added exactly, the replicas' sums (synchronized) as integers, rounded once
  // into out[width].
  void sum_terms(std::int64_t chunks, std::size_t width, float* out, context& ctx) {
    const stream_ref s = ctx.stream();
    const std::size_t words = kernels::exact_words(width);
    limbs_.ensure(shape{static_cast<std::int64_t>(words)}, dtype::i64, s);
    std::int64_t* hi = limbs_.as<std::int64_t>();
    fill_zero(device_span<std::int64_t>(hi, words, limbs_.get_device()), s);
    if (chunks > 0) {
      launch_elementwise(width,
                         kernels::exact_accumulate_op<float>{terms_.as<float>(), static_cast<std::size_t>(chunks), width,
                                                             hi, hi + width, hi + 2 * width, false},
                         s, "batch_norm exact sums");
    }
    if (group_ != nullptr) group_->sum(hi, words, s);
    launch_elementwise(width, kernels::exact_round_op<float>{hi, hi + width, hi + 2 * width, out}, s,
                       "batch_norm exact sums");
  }

  // A replica without rows: its share of the parameters' gradients is zero.
  void zero_parameter_gradients(stream_ref s) {
    for (parameter* p : {&weight_, &bias_}) {
      if (p->begin_accumulate() == 0.0f) fill_zero(p->grad().bytes(), s);
    }
  }

  void check_input(const tensor_view& x, const context& ctx) const {
    const shape& d = x.dims();
    LOCKSTEP_EXPECTS(d.rank() >= 2 && d[1] == channels_, "batch_norm(", channels_, "): input of shape ", d.str(),
                     " does not have ", channels_, " channels in its second dimension (expected [rows, ", channels_,
                     "] or [rows, ", channels_, ", ...])");
    LOCKSTEP_EXPECTS(x.type() == ctx.compute_type(), "batch_norm: input is ", name_of(x.type()),
                     " but the context computes in ", name_of(ctx.compute_type()),
                     " (cast the input, or load it in that type)");
    LOCKSTEP_EXPECTS(x.get_device() == ctx.get_device(), "batch_norm: input on ", x.get_device().str(),
                     " but the layer runs on ", ctx.get_device().str());
    if (affine()) {
      LOCKSTEP_EXPECTS(weight_.get_device() == ctx.get_device(), "batch_norm: parameters on ",
                       weight_.get_device().str(), " but the context is on ", ctx.get_device().str());
      LOCKSTEP_EXPECTS(weight_.compute_type() == ctx.compute_type(), "batch_norm: parameters are set up for ",
                       name_of(weight_.compute_type()), " but the context computes in ", name_of(ctx.compute_type()));
    }
    if (options_.track_running_stats) {
      LOCKSTEP_EXPECTS(running_mean_.get_device() == ctx.get_device(), "batch_norm: buffers on ",
                       running_mean_.get_device().str(), " but the context is on ", ctx.get_device().str());
    }
  }

  std::int64_t channels_;
  batch_norm_options options_;
  parameter weight_;
  parameter bias_;
  tensor running_mean_;  // buffers (f32, f32, i64 scalar)
  tensor running_var_;
  tensor tracked_;
  tensor_view x_;
  tensor y_;
  tensor gx_;
  tensor mean_;       // [C] f32: the statistics this forward normalized with
  tensor rstd_;
  tensor sums_;       // [C + 1] f32: the batch's sums and count
  tensor squares_;    // [C] f32
  tensor grad_sums_;  // [2C] f32: backward's sums of gy and gy * xhat
  tensor terms_;      // deterministic mode: [chunks, width] f32 per-chunk sums
  tensor limbs_;      // deterministic mode: their exact sum (kernels/exact.hpp)
  replica_group* group_ = nullptr;  // this forward's replicas when synchronized
  exact_gradient exact_;
  bool batch_stats_ = false;
  bool forwarded_ = false;
};
static_assert(layer<batch_norm>);

LOCKSTEP_ABI_END
