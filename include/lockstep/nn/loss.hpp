// lockstep/nn/loss.hpp — losses (softmax cross-entropy, mean squared error) and the accuracy count.
//
// A loss is not a layer: it takes targets, and it starts backward. Its value stays on the device (a [1] f32
// tensor) so that a training step never waits for the device; read it with `read_loss()` when you want to
// print it.
//
// Sum versus mean is an explicit choice. For a mean, the divisor is explicit too (`mean_over`): when a
// batch is split across devices, each replica divides its partial sum by the GLOBAL batch size, so that the
// replicas' losses and gradients add up to exactly those of one device on the whole batch.
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
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Softmax followed by the negative log-likelihood of integer labels (PyTorch's CrossEntropyLoss).
class softmax_cross_entropy {
 public:
  explicit softmax_cross_entropy(reduction r = reduction::mean) : reduction_(r) {}

  /// The loss of `logits` [rows, classes] (compute type) against `labels` [rows] (i32) on ctx's device,
  /// divided by `mean_over` (default: rows) for a mean. Returns the [1] f32 loss on the device. A label
  /// outside [0, classes) makes the loss NaN.
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
    factor_ = detail::reduction_factor(reduction_, logits.rows(), mean_over);
    const auto rows = static_cast<std::size_t>(logits.rows());
    const auto classes = static_cast<std::size_t>(logits.cols());
    row_loss_.ensure(shape{logits.rows()}, dtype::f32, ctx.stream());
    loss_.ensure(shape{1}, dtype::f32, ctx.stream());
    dispatch_floating(logits.type(), "softmax_cross_entropy", [&]<class T>() {
      launch_rows(rows,
                         kernels::softmax_xent_forward_op<T>{logits.as<T>(), labels.as<std::int32_t>(),
                                                             row_loss_.as<float>(), classes, factor_},
                         ctx.stream(), "softmax cross-entropy");
    });
    sum<float>(row_loss_.span<const float>(), loss_.span<float>(), ctx.stream(), &workspace_);
    return loss_.view();
  }

  /// dL/dlogits of the last forward, times the context's loss scale, in the logits' dtype.
  tensor_view backward(context& ctx) {
    LOCKSTEP_EXPECTS(loss_.numel() == 1, "softmax_cross_entropy::backward without a forward");
    grad_.ensure(logits_.dims(), logits_.type(), ctx.stream());
    dispatch_floating(logits_.type(), "softmax_cross_entropy", [&]<class T>() {
      launch_rows(static_cast<std::size_t>(logits_.rows()),
                         kernels::softmax_xent_backward_op<T>{logits_.as<T>(), labels_.as<std::int32_t>(), grad_.as<T>(),
                                                              static_cast<std::size_t>(logits_.cols()), factor_,
                                                              ctx.loss_scale()},
                         ctx.stream(), "softmax cross-entropy gradient");
    });
    return grad_.view();
  }

  /// The [1] f32 loss of the last forward, on the device.
  [[nodiscard]] tensor_view loss() const noexcept { return loss_.view(); }
  /// Copies the loss to the host; synchronizes `s`.
  [[nodiscard]] float read_loss(stream_ref s) const { return to_vector(loss_.span<const float>(), s)[0]; }

 private:
  reduction reduction_;
  float factor_ = 1.0f;
  tensor_view logits_;
  tensor_view labels_;
  tensor row_loss_;
  tensor loss_;
  tensor grad_;
  tensor workspace_;
};

/// Mean (or sum) of squared differences against f32 targets of the output's shape.
class mse {
 public:
  explicit mse(reduction r = reduction::mean) : reduction_(r) {}

  /// For a mean, the divisor is `mean_over` (default: the number of output elements).
  tensor_view forward(const tensor_view& y, const tensor_view& target, context& ctx, std::int64_t mean_over = 0) {
    LOCKSTEP_EXPECTS(target.type() == dtype::f32 && target.numel() == y.numel(), "mse: targets must be ", y.numel(),
                     " f32 values like the output ", y.dims().str(), ", got ", target.dims().str(), " of ",
                     name_of(target.type()));
    LOCKSTEP_EXPECTS(y.get_device() == ctx.get_device() && target.get_device() == ctx.get_device(),
                     "mse: output on ", y.get_device().str(), ", targets on ", target.get_device().str(),
                     ", context on ", ctx.get_device().str());
    y_ = y;
    target_ = target;
    factor_ = detail::reduction_factor(reduction_, y.numel(), mean_over);
    element_loss_.ensure(shape{y.numel()}, dtype::f32, ctx.stream());
    loss_.ensure(shape{1}, dtype::f32, ctx.stream());
    dispatch_floating(y.type(), "mse", [&]<class T>() {
      launch_elementwise(static_cast<std::size_t>(y.numel()),
                         kernels::mse_forward_op<T>{y.as<T>(), target.as<float>(), element_loss_.as<float>(), factor_},
                         ctx.stream(), "mse");
    });
    sum<float>(element_loss_.span<const float>(), loss_.span<float>(), ctx.stream(), &workspace_);
    return loss_.view();
  }

  tensor_view backward(context& ctx) {
    LOCKSTEP_EXPECTS(loss_.numel() == 1, "mse::backward without a forward");
    grad_.ensure(y_.dims(), y_.type(), ctx.stream());
    dispatch_floating(y_.type(), "mse", [&]<class T>() {
      launch_elementwise(static_cast<std::size_t>(y_.numel()),
                         kernels::mse_backward_op<T>{y_.as<T>(), target_.as<float>(), grad_.as<T>(), factor_, ctx.loss_scale()},
                         ctx.stream(), "mse gradient");
    });
    return grad_.view();
  }

  [[nodiscard]] tensor_view loss() const noexcept { return loss_.view(); }
  [[nodiscard]] float read_loss(stream_ref s) const { return to_vector(loss_.span<const float>(), s)[0]; }

 private:
  reduction reduction_;
  float factor_ = 1.0f;
  tensor_view y_;
  tensor_view target_;
  tensor element_loss_;
  tensor loss_;
  tensor grad_;
  tensor workspace_;
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
