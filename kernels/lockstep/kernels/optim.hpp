// lockstep/kernels/optim.hpp — kernel bodies of the optimizers: fused SGD and AdamW updates over tensor
// groups [fp32 value, gradient (T), state..., working copy (T, may be null)].
//
// The step count and the skip decision (a mixed-precision overflow) live on the device, so an optimizer step
// never waits for the device: a skipped step changes nothing, not even the step count. Gradients are read
// in f32 and multiplied by `grad_multiplier` (the inverse loss scale) as they are read, so low-precision
// gradients are never unscaled in their own precision.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/kernels/multi_tensor.hpp"

LOCKSTEP_ABI_BEGIN
namespace kernels {

/// Per-optimizer values computed once per step, on the device.
struct optimizer_counters {
  std::int64_t step;        // steps applied so far (after prepare: including this one)
  float bias_correction1;   // 1 - beta1^step (AdamW)
  float bias_correction2;   // 1 - beta2^step (AdamW)
};

/// Where a step reads its mixed-precision inputs; both null outside mixed precision.
struct step_inputs {
  const float* grad_multiplier;  // inverse loss scale, or null for 1
  const std::uint64_t* skip;     // non-zero: skip this step (non-finite gradients somewhere), or null
  LOCKSTEP_HD bool skipped() const { return skip != nullptr && *skip != 0; }
  LOCKSTEP_HD float multiplier() const { return grad_multiplier ? *grad_multiplier : 1.0f; }
};

/// Advances the step count (and AdamW's bias corrections) unless the step is skipped. One element.
struct prepare_step_op {
  optimizer_counters* counters;
  step_inputs in;
  float beta1;
  float beta2;
  LOCKSTEP_HD void operator()(std::size_t) const {
    if (in.skipped()) return;
    const std::int64_t t = ++counters->step;
    counters->bias_correction1 = 1.0f - ::powf(beta1, static_cast<float>(t));
    counters->bias_correction2 = 1.0f - ::powf(beta2, static_cast<float>(t));
  }
};

/// PyTorch's SGD: d = g + wd * p; with momentum b = (first step ? d : momentum * b + (1 - dampening) * d),
/// d = nesterov ? d + momentum * b : b; p -= lr * d. Group: [value, grad, momentum (or null), working (or null)].
template <class T>
struct sgd_update_op {
  float lr;
  float momentum;
  float dampening;
  float weight_decay;
  bool nesterov;
  step_inputs in;
  const optimizer_counters* counters;
  LOCKSTEP_HD void operator()(const tensor_group<4>& g, std::size_t i) const {
    if (in.skipped()) return;
    float* p = static_cast<float*>(g.ptr[0]);
    const T* grad = static_cast<const T*>(g.ptr[1]);
    float* buf = static_cast<float*>(g.ptr[2]);
    T* working = static_cast<T*>(g.ptr[3]);
    const float value = p[i];
    float d = to_float(grad[i]) * in.multiplier();
    if (weight_decay != 0.0f) d += weight_decay * value;
    if (momentum != 0.0f) {
      const float b = counters->step == 1 ? d : momentum * buf[i] + (1.0f - dampening) * d;
      buf[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    const float updated = value - lr * d;
    p[i] = updated;
    if (working) working[i] = convert<T>(updated);
  }
};

/// PyTorch's AdamW: p *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
/// p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps). Group: [value, grad, m, v, working (or null)].
template <class T>
struct adamw_update_op {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  step_inputs in;
  const optimizer_counters* counters;
  LOCKSTEP_HD void operator()(const tensor_group<5>& g, std::size_t i) const {
    if (in.skipped()) return;
    float* p = static_cast<float*>(g.ptr[0]);
    const T* grad = static_cast<const T*>(g.ptr[1]);
    float* m = static_cast<float*>(g.ptr[2]);
    float* v = static_cast<float*>(g.ptr[3]);
    T* working = static_cast<T*>(g.ptr[4]);
    const float d = to_float(grad[i]) * in.multiplier();
    float value = p[i] * (1.0f - lr * weight_decay);
    const float mi = beta1 * m[i] + (1.0f - beta1) * d;
    const float vi = beta2 * v[i] + (1.0f - beta2) * d * d;
    m[i] = mi;
    v[i] = vi;
    const float denom = ::sqrtf(vi) / ::sqrtf(counters->bias_correction2) + eps;
    value -= (lr / counters->bias_correction1) * mi / denom;
    p[i] = value;
    if (working) working[i] = convert<T>(value);
  }
};

}  // namespace kernels
LOCKSTEP_ABI_END
