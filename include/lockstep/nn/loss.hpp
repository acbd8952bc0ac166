// lockstep/nn/loss.hpp — losses (softmax cross-entropy, mean squared error) and the accuracy count.
//
// A loss is not a layer: it takes targets, and it starts backward. Its value stays on the device (a [1] f32
// tensor) so that a training step never waits for the device; read it with `read_loss()` when you want to
// print it.
//
// Sum versus mean is an explicit choice. A mean over a batch split across ranks divides each rank's partial sum
// by the GLOBAL batch size, so that the ranks' losses and gradients add up to exactly those of one device on the
// whole batch: distributed_data_parallel tells the loss computed on its output the global batch (it sums the
// ranks' rows, uneven or not) and sums the ranks' losses in backward, so a plain `loss.forward(ddp.forward(x), y,
// ctx)` is right. `mean_over` overrides the divisor.
#pragma once

#include <cstdint>

#include "lockstep/config.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/kernels/loss.hpp"
#include "lockstep/kernels/reduce.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN

/// How a loss combines the per-sample losses.
enum class reduction : std::uint8_t { sum, mean };

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN
inline float reduction_factor(reduction r, std::int64_t rows, std::int64_t mean_over) {
  if (r == reduction::sum) return 1.0f;
  const std::int64_t n = mean_over > 0 ? mean_over : rows;
  LOCKSTEP_EXPECTS(n > 0, "a mean over zero samples");
  return 1.0f / static_cast<float>(n);
}

/// What both losses share: the reduction and its divisor, the [1] f32 value on the device, and the share of a global
/// batch (nn/context.hpp's batch_share, set by distributed_data_parallel).
class loss_value {
 public:
  explicit loss_value(reduction r) : reduction_(r) {}

  /// What a mean counts: the rows (cross-entropy) or every value (mse).
  enum class counting : std::uint8_t { rows, values };

  /// The factor of this forward's per-sample losses, for `out` (the tensor the loss reads: the model's output). For
  /// a mean, the divisor is `mean_over` when given; else, when `out` is the output of a distributed_data_parallel
  /// forward in training (or a view of all of it), the global batch's rows (or values); else out's rows (or values).
  kernels::loss_factor begin(const tensor_view& out, counting what, std::int64_t mean_over, context& ctx,
                             const char* name) {
    share_ = nullptr;
    batch_share* b = ctx.share();
    if (b != nullptr && b->output != nullptr && b->output == out.data()) {
      LOCKSTEP_EXPECTS(out.numel() == b->values, name, ": the loss reads ", out.numel(), " of the ", b->values,
                       " values distributed_data_parallel's forward returned; a loss on part of the output cannot know "
                       "the global batch: pass mean_over (the global count the mean divides by)");
      LOCKSTEP_EXPECTS(b->pending, name, ": a second loss on the output of one distributed_data_parallel forward; "
                       "the wrapper sums one loss over the ranks: add the losses into one, or pass mean_over to each "
                       "and sum their values over the ranks yourself");
      b->pending = false;
      share_ = b;
    }
    if (share_ == nullptr && b != nullptr && b->pending && b->rows == 0 && out.numel() == 0) {
      b->pending = false;  // a rank without rows (its output may have no memory at all)
      share_ = b;
    }
    loss_.ensure(shape{1}, dtype::f32, ctx.stream());
    const std::int64_t rows = out.dims().rank() == 0 ? 1 : out.dims()[0];
    const std::int64_t local = what == counting::rows ? rows : out.numel();
    if (reduction_ == reduction::sum || mean_over > 0 || share_ == nullptr) {
      factor_ = {reduction_factor(reduction_, local, mean_over), nullptr};
      return factor_;
    }
    // values per row: of the wrapper's output, whatever view of it the loss reads
    const std::int64_t per_row =
        what == counting::rows ? 1 : (share_->rows > 0 ? share_->values / share_->rows : std::int64_t{1});
    if (share_->global_rows_on_device == nullptr) {
      factor_ = {reduction_factor(reduction_, share_->global_rows * per_row, 0), nullptr};
    } else {
      if (share_->rows_ready != nullptr) ctx.stream().wait(*share_->rows_ready);
      on_device_.ensure(shape{1}, dtype::f32, ctx.stream());
      launch_elementwise(1, kernels::mean_factor_op{share_->global_rows_on_device, per_row, on_device_.as<float>()},
                         ctx.stream(), "loss mean over the global batch");
      factor_ = {1.0f, on_device_.as<float>()};
    }
    return factor_;
  }

  /// Sums the per-sample losses into the value; a share of a global batch registers it, for the wrapper's backward
  /// to sum over the ranks.
  void end(device_span<const float> per_sample, context& ctx) {
    sum<float>(per_sample, loss_.span<float>(), ctx.stream(), &workspace_);
    if (share_ != nullptr) share_->loss = loss_.as<float>();
  }

  [[nodiscard]] kernels::loss_factor factor() const noexcept { return factor_; }
  [[nodiscard]] bool computed() const noexcept { return loss_.numel() == 1; }
  [[nodiscard]] tensor_view view() const noexcept { return loss_.view(); }
  [[nodiscard]] float read(stream_ref s) const {
    LOCKSTEP_EXPECTS(computed(), "read_loss before any forward");
    return to_vector(loss_.span<const float>(), s)[0];
  }

 private:
  reduction reduction_;
  kernels::loss_factor factor_{};
  batch_share* share_ = nullptr;
  tensor loss_;
  tensor on_device_;
  tensor workspace_;
};
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Softmax followed by the negative log-likelihood of integer labels (PyTorch's CrossEntropyLoss).
class softmax_cross_entropy {
 public:
  explicit softmax_cross_entropy(reduction r = reduction::mean) : value_(r) {}

  /// The loss of `logits` [rows, classes] (compute type) against `labels` [rows] (i32) on ctx's device. A mean
  /// divides by `mean_over` when given, else by the rows of the global batch when `logits` is the output of a
  /// distributed_data_parallel forward in training (every rank's rows: nothing to pass), else by the rows.
  /// Returns the [1] f32 loss on the device. A label outside [0, classes) makes the loss NaN.
  tensor_view forward(const tensor_view& logits, const tensor_view& labels, context& ctx, std::int64_t mean_over = 0) {
    LOCKSTEP_EXPECTS(logits.dims().rank() == 2, "softmax_cross_entropy: logits must be [rows, classes], got ",
                     logits.dims().str());
    LOCKSTEP_EXPECTS(labels.type() == dtype::i32 && labels.numel() == logits.rows(),
                     "softmax_cross_entropy: labels must be ", logits.rows(), " i32 values, got ", labels.dims().str(),
                     " of ", name_of(labels.type()));
    LOCKSTEP_EXPECTS(logits.get_device() == ctx.get_device() && labels.get_device() == ctx.get_device(),
                     "softmax_cross_entropy: logits on ", logits.get_device().str(), ", labels on ",
                     labels.get_device().str(), ", context on ", ctx.get_device().str(),
                     ": put the labels on the device the outputs are on");
    logits_ = logits;
    labels_ = labels;
    const kernels::loss_factor factor =
        value_.begin(logits, detail::loss_value::counting::rows, mean_over, ctx, "softmax_cross_entropy");
    const auto rows = static_cast<std::size_t>(logits.rows());
    const auto classes = static_cast<std::size_t>(logits.cols());
    row_loss_.ensure(shape{logits.rows()}, dtype::f32, ctx.stream());
    dispatch_floating(logits.type(), "softmax_cross_entropy", [&]<class T>() {
      launch_rows(rows,
                  kernels::softmax_xent_forward_op<T>{logits.as<T>(), labels.as<std::int32_t>(), row_loss_.as<float>(),
                                                      classes, factor},
                  ctx.stream(), "softmax cross-entropy");
    });
    value_.end(row_loss_.span<const float>(), ctx);
    return value_.view();
  }

  /// dL/dlogits of the last forward, times the context's loss scale, in the logits' dtype. In training, advances the
  /// context's step (context::step: the next forward's dropout masks are new).
  tensor_view backward(context& ctx) {
    LOCKSTEP_EXPECTS(value_.computed(), "softmax_cross_entropy::backward without a forward");
    grad_.ensure(logits_.dims(), logits_.type(), ctx.stream());
    dispatch_floating(logits_.type(), "softmax_cross_entropy", [&]<class T>() {
      launch_rows(static_cast<std::size_t>(logits_.rows()),
                  kernels::softmax_xent_backward_op<T>{logits_.as<T>(), labels_.as<std::int32_t>(), grad_.as<T>(),
                                                       static_cast<std::size_t>(logits_.cols()), value_.factor(),
                                                       ctx.loss_scale()},
                  ctx.stream(), "softmax cross-entropy gradient");
    });
    ctx.advance_step();
    return grad_.view();
  }

  /// The [1] f32 loss of the last forward, on the device. Under distributed_data_parallel (training), this rank's
  /// share of the global batch's loss after forward, and the global batch's loss (the sum of the shares) once the
  /// wrapper's backward has summed it.
  [[nodiscard]] tensor_view loss() const noexcept { return value_.view(); }
  /// Copies loss() to the host; synchronizes `s`. Under distributed_data_parallel, after backward: the loss of the
  /// global batch, the same on every rank, with no collective here (rank 0 alone may read it).
  [[nodiscard]] float read_loss(stream_ref s) const { return value_.read(s); }

 private:
  detail::loss_value value_;
  tensor_view logits_;
  tensor_view labels_;
  tensor row_loss_;
  tensor grad_;
};

/// Mean (or sum) of squared differences against f32 targets of the output's shape.
class mse {
 public:
  explicit mse(reduction r = reduction::mean) : value_(r) {}

  /// For a mean, the divisor is `mean_over` when given, else the number of output elements (of the global batch
  /// when `y` is the output of a distributed_data_parallel forward in training, as softmax_cross_entropy).
  tensor_view forward(const tensor_view& y, const tensor_view& target, context& ctx, std::int64_t mean_over = 0) {
    LOCKSTEP_EXPECTS(target.type() == dtype::f32 && target.numel() == y.numel(), "mse: targets must be ", y.numel(),
                     " f32 values like the output ", y.dims().str(), ", got ", target.dims().str(), " of ",
                     name_of(target.type()));
    LOCKSTEP_EXPECTS(y.get_device() == ctx.get_device() && target.get_device() == ctx.get_device(),
                     "mse: output on ", y.get_device().str(), ", targets on ", target.get_device().str(),
                     ", context on ", ctx.get_device().str());
    y_ = y;
    target_ = target;
    const kernels::loss_factor factor = value_.begin(y, detail::loss_value::counting::values, mean_over, ctx, "mse");
    element_loss_.ensure(shape{y.numel()}, dtype::f32, ctx.stream());
    dispatch_floating(y.type(), "mse", [&]<class T>() {
      launch_elementwise(static_cast<std::size_t>(y.numel()),
                         kernels::mse_forward_op<T>{y.as<T>(), target.as<float>(), element_loss_.as<float>(), factor},
                         ctx.stream(), "mse");
    });
    value_.end(element_loss_.span<const float>(), ctx);
    return value_.view();
  }

  /// dL/dy of the last forward, times the context's loss scale; in training, advances the context's step.
  tensor_view backward(context& ctx) {
    LOCKSTEP_EXPECTS(value_.computed(), "mse::backward without a forward");
    grad_.ensure(y_.dims(), y_.type(), ctx.stream());
    dispatch_floating(y_.type(), "mse", [&]<class T>() {
      launch_elementwise(static_cast<std::size_t>(y_.numel()),
                         kernels::mse_backward_op<T>{y_.as<T>(), target_.as<float>(), grad_.as<T>(), value_.factor(),
                                                     ctx.loss_scale()},
                         ctx.stream(), "mse gradient");
    });
    ctx.advance_step();
    return grad_.view();
  }

  /// As softmax_cross_entropy's.
  [[nodiscard]] tensor_view loss() const noexcept { return value_.view(); }
  [[nodiscard]] float read_loss(stream_ref s) const { return value_.read(s); }

 private:
  detail::loss_value value_;
  tensor_view y_;
  tensor_view target_;
  tensor element_loss_;
  tensor grad_;
};

/// Counts rows whose arg-max equals the label, accumulating on the device across calls until reset().
class accuracy_counter {
 public:
  /// Adds the hits of `logits` [rows, classes] against `labels` [rows] (i32).
  void add(const tensor_view& logits, const tensor_view& labels, context& ctx) {
    LOCKSTEP_EXPECTS(labels.type() == dtype::i32 && labels.numel() == logits.rows(), "accuracy: labels must be ",
                     logits.rows(), " i32 values");
    hits_.ensure(shape{logits.rows()}, dtype::i64, ctx.stream());
    if (total_.empty()) {
      total_.ensure(shape{1}, dtype::i64, ctx.stream());
      batch_.ensure(shape{1}, dtype::i64, ctx.stream());
      fill_zero(total_.span<std::int64_t>(), ctx.stream());
    }
    dispatch_floating(logits.type(), "accuracy", [&]<class T>() {
      launch_rows(static_cast<std::size_t>(logits.rows()),
                         kernels::argmax_hit_op<T>{logits.as<T>(), labels.as<std::int32_t>(),
                                                   reinterpret_cast<std::uint64_t*>(hits_.data()),
                                                   static_cast<std::size_t>(logits.cols())},
                         ctx.stream(), "accuracy");
    });
    auto* hits = reinterpret_cast<std::uint64_t*>(hits_.data());
    auto* total = reinterpret_cast<std::uint64_t*>(total_.data());
    auto* batch = reinterpret_cast<std::uint64_t*>(batch_.data());
    const device d = ctx.get_device();
    count_non_zero(device_span<const std::uint64_t>(hits, static_cast<std::size_t>(logits.rows()), d),
                   device_span<std::uint64_t>(batch, 1, d), ctx.stream());
    launch_elementwise(1, kernels::accumulate_op{batch, total}, ctx.stream(), "accuracy total");
    seen_ += logits.rows();
  }

  /// Rows counted since the last reset.
  [[nodiscard]] std::int64_t rows() const noexcept { return seen_; }
  /// Correct rows since the last reset; synchronizes `s`.
  [[nodiscard]] std::int64_t correct(stream_ref s) const {
    if (total_.empty()) return 0;
    return to_vector(total_.span<const std::int64_t>(), s)[0];
  }
  void reset(stream_ref s) {
    if (!total_.empty()) fill_zero(total_.span<std::int64_t>(), s);
    seen_ = 0;
  }

 private:
  void count_non_zero(device_span<const std::uint64_t> in, device_span<std::uint64_t> out, stream_ref s) {
    detail::transform_reduce(in, out, kernels::plus_op{}, kernels::identity_op{}, std::uint64_t{0}, s,
                             "accuracy count", &workspace_);
  }

  tensor hits_;
  tensor total_;
  tensor batch_;
  tensor workspace_;
  std::int64_t seen_ = 0;
};

LOCKSTEP_ABI_END
