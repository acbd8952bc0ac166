// lockstep/optim/sgd.hpp — stochastic gradient descent with momentum, Nesterov momentum and weight decay
// (PyTorch's torch.optim.SGD), one fused update per parameter group.
#pragma once

#include <cstdint>

#include "lockstep/config.hpp"
#include "lockstep/optim/optimizer.hpp"

LOCKSTEP_ABI_BEGIN

/// Whether momentum is Nesterov's.
enum class nesterov : std::uint8_t { no, yes };

struct sgd_options {
  float lr = 0.01f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  lockstep::nesterov nesterov = lockstep::nesterov::no;

  /// "sgd(lr=..., ...)": what distributed_data_parallel compares across ranks.
  [[nodiscard]] std::string describe() const {
    using detail::shortest;
    return detail::concat("sgd(lr=", shortest(lr), ", momentum=", shortest(momentum), ", dampening=",
                          shortest(dampening), ", weight_decay=", shortest(weight_decay),
                          ", nesterov=", nesterov == lockstep::nesterov::yes ? "yes" : "no", ")");
  }
};

/// Momentum buffers are fp32 on the parameters' device, allocated (zeroed) at the first step, and only for
/// groups with momentum.
class sgd : public detail::optimizer_core<sgd_options, 1> {
 public:
  /// One group of `params` with `options`. Throws precondition_error for invalid options (negative lr,
  /// Nesterov without momentum or with dampening: PyTorch's rules).
  sgd(std::span<parameter* const> params, const sgd_options& options) { add_param_group(params, options); }

  void add_param_group(std::span<parameter* const> params, const sgd_options& o) {
    LOCKSTEP_EXPECTS(o.lr >= 0.0f, "sgd: learning rate must be >= 0, got ", o.lr);
    LOCKSTEP_EXPECTS(o.momentum >= 0.0f, "sgd: momentum must be >= 0, got ", o.momentum);
    LOCKSTEP_EXPECTS(o.weight_decay >= 0.0f, "sgd: weight_decay must be >= 0, got ", o.weight_decay);
    LOCKSTEP_EXPECTS(o.nesterov == nesterov::no || (o.momentum > 0.0f && o.dampening == 0.0f),
                     "sgd: Nesterov momentum requires momentum > 0 and dampening 0");
    optimizer_core::add_param_group(params, o);
  }

  /// Updates every parameter in stream order on `s` (a stream of the parameters' device): one launch per
  /// group and gradient dtype, plus one for the step count. Never waits for the device.
  void step(stream_ref s, step_inputs in = {}) {
    const auto* counters = prepare(s, in, 0.0f, 0.0f);
    for_each_batch<4>(s, [&](dtype t, std::span<const tensor_group<4>> groups, const sgd_options& o, std::size_t g) {
      dispatch_floating(t, "sgd", [&]<class T>() {
        launch_multi_tensor<4>(groups,
                               kernels::sgd_update_op<T>{o.lr, o.momentum, o.dampening, o.weight_decay,
                                                         o.nesterov == nesterov::yes, in, counters + g},
                               s, "sgd update");
      });
    });
  }

  /// The momentum buffer of parameter `index` of `group` (empty before the first step or without momentum).
  [[nodiscard]] tensor_view momentum_buffer(std::size_t group_index, std::size_t index) const {
    return state(group_index, index, 0);
  }

};

LOCKSTEP_ABI_END
