// lockstep/optim/adamw.hpp — Adam with decoupled weight decay (PyTorch's torch.optim.AdamW), one fused
// update per parameter group.
#pragma once

#include "lockstep/config.hpp"
#include "lockstep/optim/optimizer.hpp"

LOCKSTEP_ABI_BEGIN

struct adamw_options {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;

  /// "adamw(lr=..., ...)": what distributed_data_parallel compares across ranks.
  [[nodiscard]] std::string describe() const {
    using detail::shortest;
    return detail::concat("adamw(lr=", shortest(lr), ", beta1=", shortest(beta1), ", beta2=", shortest(beta2),
                          ", eps=", shortest(eps), ", weight_decay=", shortest(weight_decay), ")");
  }
};

/// First and second moments are fp32 on the parameters' device, allocated (zeroed) at the first step. The
/// bias corrections use the device-side step count, so steps skipped by mixed precision do not count.
class adamw : public detail::optimizer_core<adamw_options, 2> {
 public:
  adamw(std::span<parameter* const> params, const adamw_options& options) { add_param_group(params, options); }

  void add_param_group(std::span<parameter* const> params, const adamw_options& o) {
    LOCKSTEP_EXPECTS(o.lr >= 0.0f, "adamw: learning rate must be >= 0, got ", o.lr);
    LOCKSTEP_EXPECTS(o.beta1 >= 0.0f && o.beta1 < 1.0f, "adamw: beta1 must be in [0, 1), got ", o.beta1);
    LOCKSTEP_EXPECTS(o.beta2 >= 0.0f && o.beta2 < 1.0f, "adamw: beta2 must be in [0, 1), got ", o.beta2);
    LOCKSTEP_EXPECTS(o.eps > 0.0f, "adamw: eps must be > 0, got ", o.eps);
    LOCKSTEP_EXPECTS(o.weight_decay >= 0.0f, "adamw: weight_decay must be >= 0, got ", o.weight_decay);
    LOCKSTEP_EXPECTS(groups_.empty() || (o.beta1 == groups_.front().options.beta1 && o.beta2 == groups_.front().options.beta2),
                     "adamw: all parameter groups of one optimizer share beta1 and beta2 (the bias corrections are "
                     "computed once per step)");
    optimizer_core::add_param_group(params, o);
  }

  /// Updates every parameter in stream order on `s`; never waits for the device.
  void step(stream_ref s, step_inputs in = {}) {
    const auto& first = groups_.front().options;
    const auto* counters = prepare(s, in, first.beta1, first.beta2);
    for_each_batch<5>(s, [&](dtype t, std::span<const tensor_group<5>> groups, const adamw_options& o, std::size_t g) {
      dispatch_floating(t, "adamw", [&]<class T>() {
        launch_multi_tensor<5>(groups,
                               kernels::adamw_update_op<T>{o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, in, counters + g},
                               s, "adamw update");
      });
    });
  }

  /// First (which = 0) or second (which = 1) moment of parameter `index` of `group`.
  [[nodiscard]] tensor_view moment(std::size_t group_index, std::size_t index, int which) const {
    return state(group_index, index, which);
  }
};

LOCKSTEP_ABI_END
