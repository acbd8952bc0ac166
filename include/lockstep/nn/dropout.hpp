// lockstep/nn/dropout.hpp — dropout with a counter-based mask (Philox): the same seed draws the same mask on
// both backends and however the batch is split across devices, and backward recomputes the mask instead of
// storing it.
#pragma once

#include <cstdint>

#include "lockstep/config.hpp"
#include "lockstep/kernels/activation.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/layer.hpp"

LOCKSTEP_ABI_BEGIN

/// While training, zeroes each element with probability p and scales the others by 1/(1-p); in evaluation
/// it is the identity (and costs nothing). The mask of element (row, col) of step s is a function of
/// (context seed, this layer's random stream, s, global row * cols + col).
class dropout {
 public:
  /// Precondition: 0 <= p < 1. The layer takes its random stream id from `init`.
  dropout(float p, initializer& init) : p_(p), stream_id_(init.next_stream()) {
    LOCKSTEP_EXPECTS(p >= 0.0f && p < 1.0f, "dropout probability must be in [0, 1), got ", p);
  }

  [[nodiscard]] float probability() const noexcept { return p_; }

  tensor_view forward(const tensor_view& x, context& ctx) {
    active_ = ctx.training() && p_ > 0.0f;
    if (!active_) return x;
    mask_ = mask_for(ctx);
    first_index_ = static_cast<std::uint64_t>(ctx.row_offset() * x.cols());
    y_.ensure(x.dims(), x.type(), ctx.stream());
    apply(x, y_.view(), ctx, "dropout forward");
    return y_.view();
  }

  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    if (need == input_grad::not_required) return {};
    if (!active_) return gy;
    gx_.ensure(gy.dims(), gy.type(), ctx.stream());
    apply(gy, gx_.view(), ctx, "dropout backward");
    return gx_.view();
  }

  void parameters(parameter_list&) {}
  [[nodiscard]] dropout clone(context&) const { return dropout(p_, stream_id_); }
  [[nodiscard]] shape output_shape(const shape& sample) const { return sample; }

 private:
  dropout(float p, std::uint64_t stream_id) : p_(p), stream_id_(stream_id) {}

  [[nodiscard]] kernels::dropout_mask mask_for(const context& ctx) const {
    return kernels::dropout_mask{ctx.seed(), stream_id_, ctx.step(), 1.0f - p_};
  }

  void apply(const tensor_view& in, const tensor_view& out, context& ctx, const char* what) const {
    dispatch_floating(in.type(), "dropout", [&]<class T>() {
      const auto n = static_cast<std::uint64_t>(in.numel());
      launch_elementwise(kernels::dropout_op<T>::calls(first_index_, n),
                         kernels::dropout_op<T>{in.as<T>(), out.as<T>(), mask_, first_index_, n}, ctx.stream(), what);
    });
  }

  float p_;
  std::uint64_t stream_id_;
  bool active_ = false;
  kernels::dropout_mask mask_{};
  std::uint64_t first_index_ = 0;
  tensor y_;
  tensor gx_;
};
static_assert(layer<dropout>);

LOCKSTEP_ABI_END
