// lockstep/nn/flatten.hpp — flatten: [rows, d1, d2, ...] to [rows, d1 * d2 * ...] (PyTorch's nn.Flatten with its
// defaults), and unflatten: [rows, ...] to [rows, d1, d2, ...] (nn.Unflatten of the sample); views of the same
// memory both ways.
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

/// Gives each row the shape `sample` (its elements unchanged: [rows, 784] to [rows, 1, 28, 28]); no copy, no
/// parameters.
class unflatten {
 public:
  explicit unflatten(shape sample) : sample_(sample) {
    LOCKSTEP_EXPECTS(sample.rank() >= 1 && sample.rank() < shape::max_rank, "unflatten: a sample shape of rank 1 to ",
                     shape::max_rank - 1, ", got ", sample.str());
  }

  tensor_view forward(const tensor_view& x, context& ctx) {
    LOCKSTEP_EXPECTS(x.dims().rank() >= 1 && x.cols() == sample_.numel(), "unflatten(", sample_.str(), "): input of shape ",
                     x.dims().str(), " does not have ", sample_.numel(), " elements per row");
    LOCKSTEP_EXPECTS(x.type() == ctx.compute_type(), "unflatten: input is ", name_of(x.type()),
                     " but the context computes in ", name_of(ctx.compute_type()),
                     " (cast the input, or load it in that type)");
    in_ = x.dims();
    forwarded_ = true;
    return x.reshaped(batch_of(x.rows()));
  }

  tensor_view backward(const tensor_view& gy, context&, input_grad need) {
    LOCKSTEP_EXPECTS(forwarded_, "unflatten::backward without a forward");
    LOCKSTEP_EXPECTS(gy.numel() == in_.numel(), "unflatten::backward: gradient of shape ", gy.dims().str(),
                     " for an input of shape ", in_.str());
    if (need == input_grad::not_required) return {};
    return gy.reshaped(in_);
  }

  void parameters(parameter_list&) {}
  [[nodiscard]] unflatten clone(context&) const { return unflatten(sample_); }
  [[nodiscard]] shape output_shape(const shape& sample) const {
    LOCKSTEP_EXPECTS(sample.numel() == sample_.numel(), "unflatten(", sample_.str(), ") expects samples of ",
                     sample_.numel(), " elements, got shape ", sample.str());
    return sample_;
  }

 private:
  [[nodiscard]] shape batch_of(std::int64_t rows) const {
    switch (sample_.rank()) {
      case 1: return shape{rows, sample_[0]};
      case 2: return shape{rows, sample_[0], sample_[1]};
      default: return shape{rows, sample_[0], sample_[1], sample_[2]};
    }
  }

  shape sample_;
  shape in_;
  bool forwarded_ = false;
};
static_assert(layer<unflatten>);

LOCKSTEP_ABI_END
