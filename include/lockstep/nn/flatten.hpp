// lockstep/nn/flatten.hpp — flatten: [rows, d1, d2, ...] to [rows, d1 * d2 * ...] (PyTorch's nn.Flatten with its
// defaults), a view of the same memory both ways.
#pragma once

#include "lockstep/config.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/layer.hpp"

LOCKSTEP_ABI_BEGIN

/// Keeps the batch dimension and joins all the others; no copy, no parameters. Backward gives the gradient
/// the input's shape again.
class flatten {
 public:
  flatten() = default;

  tensor_view forward(const tensor_view& x, context& ctx) {
    LOCKSTEP_EXPECTS(x.dims().rank() >= 1, "flatten: a scalar input has no batch dimension");
    LOCKSTEP_EXPECTS(x.type() == ctx.compute_type(), "flatten: input is ", name_of(x.type()),
                     " but the context computes in ", name_of(ctx.compute_type()),
                     " (cast the input, or load it in that type)");
    in_ = x.dims();
    forwarded_ = true;
    return x.reshaped(shape{x.rows(), x.cols()});
  }

  tensor_view backward(const tensor_view& gy, context&, input_grad need) {
    LOCKSTEP_EXPECTS(forwarded_, "flatten::backward without a forward");
    LOCKSTEP_EXPECTS(gy.numel() == in_.numel(), "flatten::backward: gradient of shape ", gy.dims().str(),
                     " for an input of shape ", in_.str());
    if (need == input_grad::not_required) return {};
    return gy.reshaped(in_);
  }

  void parameters(parameter_list&) {}
  [[nodiscard]] flatten clone(context&) const { return flatten(); }
  [[nodiscard]] shape output_shape(const shape& sample) const { return shape{sample.numel()}; }

 private:
  shape in_;
  bool forwarded_ = false;
};
static_assert(layer<flatten>);

LOCKSTEP_ABI_END
