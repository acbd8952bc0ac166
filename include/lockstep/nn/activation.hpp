// lockstep/nn/activation.hpp — element-wise activation layers: relu, gelu (exact erf form), tanh_layer.
#pragma once

#include "lockstep/config.hpp"
#include "lockstep/kernels/activation.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/layer.hpp"

LOCKSTEP_ABI_BEGIN

/// y = f(x) element-wise, for a kernels:: activation Fn with forward(x) and backward(gy, x, y).
template <class Fn>
class activation {
 public:
  activation() = default;

  tensor_view forward(const tensor_view& x, context& ctx) {
    LOCKSTEP_EXPECTS(x.type() == ctx.compute_type(), "activation: input is ", name_of(x.type()),
                     " but the context computes in ", name_of(ctx.compute_type()));
    x_ = x;
    y_.ensure(x.dims(), x.type(), ctx.stream());
    dispatch_floating(x.type(), "activation", [&]<class T>() {
      launch_elementwise(static_cast<std::size_t>(x.numel()), kernels::activation_forward_op<Fn, T>{x.as<T>(), y_.as<T>()},
                         ctx.stream(), "activation forward");
    });
    return y_.view();
  }

  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    LOCKSTEP_EXPECTS(gy.dims() == y_.dims(), "activation::backward: gradient of shape ", gy.dims().str(),
                     " for an output of shape ", y_.dims().str());
    if (need == input_grad::not_required) return {};
    gx_.ensure(gy.dims(), gy.type(), ctx.stream());
    dispatch_floating(gy.type(), "activation", [&]<class T>() {
      launch_elementwise(static_cast<std::size_t>(gy.numel()),
                         kernels::activation_backward_op<Fn, T>{gy.as<T>(), x_.as<T>(), y_.as<T>(), gx_.as<T>()},
                         ctx.stream(), "activation backward");
    });
    return gx_.view();
  }

  void parameters(parameter_list&) {}
  [[nodiscard]] activation clone(context&) const { return activation(); }
  /// "relu", "gelu", "tanh": the function's name, for summaries.
  [[nodiscard]] static std::string summary_name() {
    std::string k = detail::layer_kind<Fn>();
    if (k.ends_with("_fn")) k.resize(k.size() - 3);
    return k;
  }
  [[nodiscard]] shape output_shape(const shape& sample) const { return sample; }

 private:
  tensor_view x_;
  tensor y_;
  tensor gx_;
};

using relu = activation<kernels::relu_fn>;
using gelu = activation<kernels::gelu_fn>;
using tanh_layer = activation<kernels::tanh_fn>;
static_assert(layer<relu> && layer<gelu> && layer<tanh_layer>);

LOCKSTEP_ABI_END
