// lockstep/nn/layer_norm.hpp — layer normalization over the last dimension (PyTorch's nn.LayerNorm with a
// one-dimensional normalized_shape).
#pragma once

#include <cstdint>

#include "lockstep/config.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/kernels/norm.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/deterministic.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/layer.hpp"

LOCKSTEP_ABI_BEGIN

/// What a layer_norm is built with (PyTorch's defaults).
struct layer_norm_options {
  float eps = 1e-5f;           ///< added to the variance under the square root
  bool elementwise_affine = true;  ///< a learned scale "weight" (ones) and shift "bias" (zeros) per feature
};

/// y = (x - mean) / sqrt(var + eps) * weight + bias over the last dimension of x ([rows, ..., features]), with
/// the mean and the biased variance of each row of `features` values computed in f32 whatever the compute type
/// (two passes over the values shifted by the row's first one: kernels/norm.hpp); the same in training and
/// evaluation. Parameters "weight" and "bias" of shape [features].
///
/// Deterministic mode: outputs and input gradients are per row; the parameters' gradients, sums over rows, are
/// summed per chunk of batch rows and the chunks added exactly (nn/deterministic.hpp), so they have the same bits
/// however the batch is split.
class layer_norm {
 public:
  /// A layer on ctx's device for rows of `features` values. Throws precondition_error for a non-positive
  /// feature count or a non-positive eps.
  layer_norm(std::int64_t features, context& ctx, layer_norm_options o = {}) : features_(features), options_(o) {
    LOCKSTEP_EXPECTS(features > 0, "layer_norm(", features, "): the feature count must be positive");
    LOCKSTEP_EXPECTS(o.eps > 0.0f, "layer_norm(", features, "): eps must be positive, got ", o.eps);
    if (!o.elementwise_affine) return;
    weight_ = parameter("weight", shape{features}, ctx.stream(), ctx.compute_type());
    bias_ = parameter("bias", shape{features}, ctx.stream(), ctx.compute_type());
    fill_values(weight_, 1.0f, ctx.stream());
    fill_values(bias_, 0.0f, ctx.stream());
  }

  [[nodiscard]] std::int64_t features() const noexcept { return features_; }
  [[nodiscard]] const layer_norm_options& options() const noexcept { return options_; }
  [[nodiscard]] parameter& weight() noexcept { return weight_; }
  [[nodiscard]] parameter& bias_parameter() noexcept { return bias_; }

  tensor_view forward(const tensor_view& x, context& ctx) {
    check_input(x, ctx);
    x_ = x;
    forwarded_ = true;
    const std::int64_t rows = x.numel() / features_;
    y_.ensure(x.dims(), x.type(), ctx.stream());
    delta_.ensure(shape{rows}, dtype::f32, ctx.stream());
    rstd_.ensure(shape{rows}, dtype::f32, ctx.stream());
    dispatch_floating(x.type(), "layer_norm", [&]<class T>() {
      const T* w = affine() ? weight_.compute_value().as<T>() : nullptr;
      const T* b = affine() ? bias_.compute_value().as<T>() : nullptr;
      launch_rows(static_cast<std::size_t>(rows),
                  kernels::layer_norm_forward_op<T>{x.as<T>(), w, b, y_.as<T>(), delta_.as<float>(), rstd_.as<float>(),
                                                    static_cast<std::size_t>(features_), options_.eps},
                  ctx.stream(), "layer_norm forward");
    });
    return y_.view();
  }

  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    LOCKSTEP_EXPECTS(forwarded_, "layer_norm::backward without a forward");
    LOCKSTEP_EXPECTS(gy.dims() == x_.dims() && gy.type() == x_.type(), "layer_norm::backward: gradient of shape ",
                     gy.dims().str(), " (", name_of(gy.type()), ") for an output of shape ", x_.dims().str(), " (",
                     name_of(x_.type()), ")");
    const std::int64_t rows = gy.numel() / features_;
    const auto cols = static_cast<std::size_t>(features_);
    if (need == input_grad::required) gx_.ensure(gy.dims(), gy.type(), ctx.stream());
    dispatch_floating(gy.type(), "layer_norm", [&]<class T>() {
      const T* g = gy.as<T>();
      const T* x = x_.as<T>();
      if (affine()) {
        if (ctx.deterministic()) {
          // per chunk of batch rows (each `per_sample` rows of features), added exactly
          const std::int64_t batch_rows = gy.rows(), per_sample = batch_rows == 0 ? 0 : rows / batch_rows;
          auto partial = [&](bool gamma) {
            return [&, gamma](std::int64_t b, std::int64_t r, T* out) {
              const std::int64_t r0 = b * per_sample;
              launch_elementwise(cols,
                                 kernels::layer_norm_param_grad_op<T>{
                                     g + r0 * features_, x + r0 * features_, delta_.as<float>() + r0,
                                     rstd_.as<float>() + r0, gamma ? out : nullptr, gamma ? nullptr : out,
                                     static_cast<std::size_t>(r * per_sample), cols, 0.0f, 0.0f},
                                 ctx.stream(), "layer_norm parameter gradients");
            };
          };
          exact_.accumulate<T>(weight_, batch_rows, ctx, partial(true));
          exact_.accumulate<T>(bias_, batch_rows, ctx, partial(false));
        } else {
          const float wbeta = weight_.begin_accumulate(), bbeta = bias_.begin_accumulate();
          launch_elementwise(cols,
                             kernels::layer_norm_param_grad_op<T>{g, x, delta_.as<float>(), rstd_.as<float>(),
                                                                  weight_.grad().as<T>(), bias_.grad().as<T>(),
                                                                  static_cast<std::size_t>(rows), cols, wbeta, bbeta},
                             ctx.stream(), "layer_norm parameter gradients");
        }
      }
      if (need == input_grad::required) {
        launch_rows(static_cast<std::size_t>(rows),
                    kernels::layer_norm_input_grad_op<T>{g, x, affine() ? weight_.compute_value().as<T>() : nullptr,
                                                         delta_.as<float>(), rstd_.as<float>(), gx_.as<T>(), cols},
                    ctx.stream(), "layer_norm input gradient");
      }
    });
    return need == input_grad::required ? gx_.view() : tensor_view();
  }

  void parameters(parameter_list& out) {
    if (!affine()) return;
    out.add(weight_);
    out.add(bias_);
  }

  [[nodiscard]] layer_norm clone(context& ctx) const {
    layer_norm l(features_, options_);
    if (affine()) {
      l.weight_ = weight_.clone(ctx.stream());
      l.bias_ = bias_.clone(ctx.stream());
    }
    return l;
  }

  [[nodiscard]] shape output_shape(const shape& sample) const {
    LOCKSTEP_EXPECTS(sample.rank() >= 1 && sample[sample.rank() - 1] == features_, "layer_norm(", features_,
                     ") normalizes a last dimension of ", features_, " features, got samples of shape ", sample.str());
    return sample;
  }

 private:
  layer_norm(std::int64_t features, layer_norm_options o) : features_(features), options_(o) {}

  [[nodiscard]] bool affine() const noexcept { return options_.elementwise_affine; }

  void check_input(const tensor_view& x, const context& ctx) const {
    const shape& d = x.dims();
    LOCKSTEP_EXPECTS(d.rank() >= 2 && d[d.rank() - 1] == features_, "layer_norm(", features_, "): input of shape ",
                     d.str(), " does not end in a dimension of ", features_, " features (expected [rows, ..., ",
                     features_, "])");
    LOCKSTEP_EXPECTS(x.type() == ctx.compute_type(), "layer_norm: input is ", name_of(x.type()),
                     " but the context computes in ", name_of(ctx.compute_type()),
                     " (cast the input, or load it in that type)");
    LOCKSTEP_EXPECTS(x.get_device() == ctx.get_device(), "layer_norm: input on ", x.get_device().str(),
                     " but the layer runs on ", ctx.get_device().str());
    if (!affine()) return;
    LOCKSTEP_EXPECTS(weight_.get_device() == ctx.get_device(), "layer_norm: parameters on ",
                     weight_.get_device().str(), " but the context is on ", ctx.get_device().str());
    LOCKSTEP_EXPECTS(weight_.compute_type() == ctx.compute_type(), "layer_norm: parameters are set up for ",
                     name_of(weight_.compute_type()), " but the context computes in ", name_of(ctx.compute_type()));
  }

  std::int64_t features_;
  layer_norm_options options_;
  parameter weight_;
  parameter bias_;
  tensor_view x_;
  tensor y_;
  tensor gx_;
  tensor delta_;  // [rows] f32 per row, for backward: the mean minus the row's first value (kernels/norm.hpp)
  tensor rstd_;
  exact_gradient exact_;
  bool forwarded_ = false;
};
static_assert(layer<layer_norm>);

LOCKSTEP_ABI_END
