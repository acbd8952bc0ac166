// lockstep/nn/linear.hpp — the fully connected layer y = x W^T + b (PyTorch's nn.Linear).
#pragma once

#include <cmath>
#include <cstdint>

#include "lockstep/blas/gemm.hpp"
#include "lockstep/config.hpp"
#include "lockstep/kernels/activation.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/deterministic.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/layer.hpp"

LOCKSTEP_ABI_BEGIN

/// Whether a linear layer adds a bias.
enum class bias : std::uint8_t { yes, no };

/// y[rows, out] = x[rows, in] W^T + b, with W [out, in] and b [out]; parameters "weight" and "bias".
class linear {
 public:
  /// A layer on ctx's device, initialized as PyTorch does (weight and bias ~ U(-1/sqrt(in), 1/sqrt(in)))
  /// from `init`'s random streams. Throws precondition_error for non-positive feature counts.
  linear(std::int64_t in_features, std::int64_t out_features, context& ctx, initializer& init, bias b = bias::yes)
      : in_(in_features), out_(out_features), has_bias_(b == bias::yes) {
    LOCKSTEP_EXPECTS(in_features > 0 && out_features > 0, "linear(", in_features, ", ", out_features,
                     "): feature counts must be positive");
    weight_ = parameter("weight", shape{out_, in_}, ctx.stream(), ctx.compute_type());
    const float bound = 1.0f / std::sqrt(static_cast<float>(in_));
    init.uniform(weight_, bound, ctx.stream());
    if (has_bias_) {
      bias_ = parameter("bias", shape{out_}, ctx.stream(), ctx.compute_type());
      init.uniform(bias_, bound, ctx.stream());
    }
  }

  [[nodiscard]] std::int64_t in_features() const noexcept { return in_; }
  [[nodiscard]] std::int64_t out_features() const noexcept { return out_; }
  [[nodiscard]] parameter& weight() noexcept { return weight_; }
  [[nodiscard]] parameter& bias_parameter() noexcept { return bias_; }

  tensor_view forward(const tensor_view& x, context& ctx) {
    check_input(x, ctx);
    const std::int64_t rows = x.rows();
    x_ = x;
    forwarded_ = true;
    y_.ensure(shape{rows, out_}, ctx.compute_type(), ctx.stream());
    if (rows == 0) return y_.view();
    dispatch_floating(ctx.compute_type(), "linear", [&]<class T>() {
      const T* w = weight_.compute_value().as<T>();
      T* y = y_.as<T>();
      // y = x W^T: row-major [rows, in] x [in, out] (in deterministic mode each row's bits its own)
      if (ctx.deterministic()) {
        row_products<T>(ctx, "linear", transpose::yes, rows, out_, in_, x.as<T>(), in_, w, in_, y, out_, rows_scratch_);
      } else {
        gemm<T>(ctx.blas(), transpose::no, transpose::yes, rows, out_, in_, 1.0f, x.as<T>(), in_, w, in_, 0.0f, y, out_);
      }
      if (has_bias_) {
        launch_2d(static_cast<std::size_t>(rows), static_cast<std::size_t>(out_),
                  kernels::add_bias_op<T>{y, bias_.compute_value().as<T>(), y, static_cast<std::size_t>(out_)},
                  ctx.stream(), "linear bias");
      }
    });
    return y_.view();
  }

  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    LOCKSTEP_EXPECTS(forwarded_, "linear::backward without a forward");
    LOCKSTEP_EXPECTS(gy.dims() == y_.dims() && gy.type() == ctx.compute_type(), "linear::backward: gradient of shape ",
                     gy.dims().str(), " (", name_of(gy.type()), ") for an output of shape ", y_.dims().str(), " (",
                     name_of(ctx.compute_type()), ")");
    const std::int64_t rows = gy.rows();
    if (need == input_grad::required) gx_.ensure(shape{rows, in_}, ctx.compute_type(), ctx.stream());
    dispatch_floating(ctx.compute_type(), "linear", [&]<class T>() {
      const T* g = gy.as<T>();
      if (ctx.deterministic()) {
        backward_deterministic<T>(g, rows, ctx, need);
        return;
      }
      // dW[out, in] (+)= gy^T x
      const float wbeta = weight_.begin_accumulate();
      gemm<T>(ctx.blas(), transpose::yes, transpose::no, out_, in_, rows, 1.0f, g, out_, x_.as<T>(), in_, wbeta,
              weight_.grad().as<T>(), in_);
      if (has_bias_) {
        const float bbeta = bias_.begin_accumulate();
        launch_columns(static_cast<std::size_t>(rows), static_cast<std::size_t>(out_),
                       kernels::column_sum_op<T>{g, bias_.grad().as<T>(), static_cast<std::size_t>(rows),
                                                 static_cast<std::size_t>(out_), bbeta},
                       ctx.stream(), "linear bias gradient");
      }
      if (need == input_grad::required) {
        // dx[rows, in] = gy W
        gemm<T>(ctx.blas(), transpose::no, transpose::no, rows, in_, out_, 1.0f, g, out_,
                weight_.compute_value().as<T>(), in_, 0.0f, gx_.as<T>(), in_);
      }
    });
    return need == input_grad::required ? gx_.view() : tensor_view();
  }

  void parameters(parameter_list& out) {
    out.add(weight_);
    if (has_bias_) out.add(bias_);
  }

  [[nodiscard]] linear clone(context& ctx) const {
    linear l(in_, out_, has_bias_);
    l.weight_ = weight_.clone(ctx.stream());
    if (has_bias_) l.bias_ = bias_.clone(ctx.stream());
    return l;
  }

  [[nodiscard]] shape output_shape(const shape& sample) const {
    LOCKSTEP_EXPECTS(sample.numel() == in_, "linear(", in_, ", ", out_, ") expects samples of ", in_,
                     " features, got shape ", sample.str());
    return shape{out_};
  }

 private:
  linear(std::int64_t in, std::int64_t out, bool has_bias) : in_(in), out_(out), has_bias_(has_bias) {}

  // nn/deterministic.hpp: per-chunk GEMMs, the chunks' parameter gradients added exactly.
  template <class T>
  void backward_deterministic(const T* g, std::int64_t rows, context& ctx, input_grad need) {
    const T* x = x_.as<T>();
    exact_.accumulate_products<T>(weight_, rows, ctx, g, out_, x, in_);  // dW = G^T X, chunk by chunk
    if (has_bias_) {
      exact_.accumulate<T>(bias_, rows, ctx, [&](std::int64_t b, std::int64_t r, T* db) {
        launch_columns(static_cast<std::size_t>(r), static_cast<std::size_t>(out_),
                       kernels::column_sum_op<T>{g + b * out_, db, static_cast<std::size_t>(r),
                                                 static_cast<std::size_t>(out_), 0.0f},
                       ctx.stream(), "linear bias gradient");
      });
    }
    if (need == input_grad::required) {  // dx = g W, each row's bits its own
      row_products<T>(ctx, "linear", transpose::no, rows, in_, out_, g, out_, weight_.compute_value().as<T>(), in_,
                      gx_.as<T>(), in_, rows_scratch_);
    }
  }

  void check_input(const tensor_view& x, const context& ctx) const {
    LOCKSTEP_EXPECTS(x.cols() == in_, "linear(", in_, ", ", out_, "): input of shape ", x.dims().str(), " has ",
                     x.cols(), " features per row, expected ", in_);
    LOCKSTEP_EXPECTS(x.type() == ctx.compute_type(), "linear: input is ", name_of(x.type()),
                     " but the context computes in ", name_of(ctx.compute_type()),
                     " (cast the input, or load it in that type)");
    LOCKSTEP_EXPECTS(x.get_device() == ctx.get_device(), "linear: input on ", x.get_device().str(),
                     " but the layer runs on ", ctx.get_device().str());
    LOCKSTEP_EXPECTS(weight_.get_device() == ctx.get_device(), "linear: parameters on ", weight_.get_device().str(),
                     " but the context is on ", ctx.get_device().str());
    LOCKSTEP_EXPECTS(weight_.compute_type() == ctx.compute_type(), "linear: parameters are set up for ",
                     name_of(weight_.compute_type()), " but the context computes in ", name_of(ctx.compute_type()));
  }

  std::int64_t in_;
  std::int64_t out_;
  bool has_bias_;
  parameter weight_;
  parameter bias_;
  tensor y_;
  tensor gx_;
  tensor_view x_;
  exact_gradient exact_;
  tensor rows_scratch_;  // deterministic mode on a host device: row_products' packed operands
  bool forwarded_ = false;  // (a forward on no rows leaves y_ empty)
};
static_assert(layer<linear>);

LOCKSTEP_ABI_END
