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
#include <type_traits>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/half_runs.hpp"
#include "lockstep/kernels/multi_tensor.hpp"

LOCKSTEP_ABI_BEGIN
namespace kernels {

/// The host loop of an update whose gradient and working copy are 16-bit (T): a block of the gradient is
/// widened into `g` with core/half_runs.hpp's vector conversion, `update(begin, count, g)` runs the fp32
/// arithmetic of elements [begin, begin + count) reading g[j] for element begin + j, and the updated fp32
/// values `value[begin, begin + count)` are rounded into `working` (when not null) the same way. The same bits
/// as converting element by element (core/half.hpp), several times faster.
template <class T, class Update>
void host_update_blocks(const T* grad, const float* value, T* working, std::size_t n, Update&& update) {
  float g[detail::run_block];
  detail::for_each_run_block(n, [&](std::size_t begin, std::size_t count) {
    detail::widen_run(grad + begin, g, static_cast<std::int64_t>(count));
    update(begin, count, static_cast<const float*>(g));
    if (working != nullptr) detail::narrow_run(value + begin, working + begin, static_cast<std::int64_t>(count));
  });
}

/// Per-parameter-group values computed once per step, on the device (PyTorch counts steps per parameter; a
/// group's parameters all start together, so one count per group is the same).
struct optimizer_counters {
  std::int64_t step;        // steps applied so far (after prepare: including this one)
  float bias_correction1;   // 1 - beta1^step (AdamW)
  float bias_correction2;   // 1 - beta2^step (AdamW)
};

/// Where a step reads its mixed-precision inputs; both null outside mixed precision.
struct step_inputs {
  const float* grad_multiplier;  // inverse loss scale, or null for 1
  const float* skip;             // non-zero: skip this step (non-finite gradients somewhere), or null
  LOCKSTEP_HD bool skipped() const { return skip != nullptr && *skip != 0.0f; }
  LOCKSTEP_HD float multiplier() const { return grad_multiplier ? *grad_multiplier : 1.0f; }
};

/// Advances each parameter group's step count (and AdamW's bias corrections) unless the step is skipped. One
/// element per group.
struct prepare_step_op {
  optimizer_counters* counters;  // one per group
  step_inputs in;
  float beta1;
  float beta2;
  LOCKSTEP_HD void operator()(std::size_t group) const {
    if (in.skipped()) return;
    optimizer_counters& c = counters[group];
    const std::int64_t t = ++c.step;
    c.bias_correction1 = 1.0f - ::powf(beta1, static_cast<float>(t));
    c.bias_correction2 = 1.0f - ::powf(beta2, static_cast<float>(t));
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

  /// The update with the device-resident inputs loaded (see launch.hpp).
  struct bound {
    float lr, momentum, dampening, weight_decay, multiplier;
    float nesterov_weight;  // 1 for Nesterov momentum, else 0
    float first;            // 1 on the first step, else 0
    bool skip;
    /// Element i, with the group's pointers loaded: the arithmetic both backends run. Momentum and the working
    /// copy are compile-time choices (they decide which memory is touched); the uniform choices (first step,
    /// Nesterov) are blends with weights 0 and 1, exact for finite values, so the host loop has no control
    /// flow and vectorizes. A zero weight decay adds weight_decay * value = 0.
    template <bool Momentum, bool Working, class G = T>
    LOCKSTEP_HD void element(float* __restrict__ p, const G* __restrict__ grad, float* __restrict__ buf,
                             T* __restrict__ working, std::size_t i) const {
      const float value = p[i];
      float d = to_float(grad[i]) * multiplier + weight_decay * value;
      if constexpr (Momentum) {
        // first step: b = d (PyTorch's buffer initialization); later: b = momentum * b + (1 - dampening) * d
        const float b = first * d + (1.0f - first) * (momentum * buf[i] + (1.0f - dampening) * d);
        buf[i] = b;
        d = nesterov_weight * (d + momentum * b) + (1.0f - nesterov_weight) * b;
      }
      const float updated = value - lr * d;
      p[i] = updated;
      if constexpr (Working) working[i] = convert<T>(updated);
    }
    /// Calls f.template operator()<Momentum, Working>() for this group's configuration (host code: a lambda's
    /// call operator is a host constexpr function for nvcc, so the device path below branches by hand).
    template <class F>
    void dispatch(const tensor_group<4>& g, F&& f) const {
      const bool has_momentum = momentum != 0.0f, has_working = g.ptr[3] != nullptr;
      if (has_momentum && has_working) return f.template operator()<true, true>();
      if (has_momentum) return f.template operator()<true, false>();
      if (has_working) return f.template operator()<false, true>();
      return f.template operator()<false, false>();
    }
    LOCKSTEP_HD void operator()(const tensor_group<4>& g, std::size_t i) const {
      if (skip) return;
      float* p = static_cast<float*>(g.ptr[0]);
      const T* grad = static_cast<const T*>(g.ptr[1]);
      float* buf = static_cast<float*>(g.ptr[2]);
      T* working = static_cast<T*>(g.ptr[3]);
      const bool has_momentum = momentum != 0.0f, has_working = working != nullptr;
      if (has_momentum && has_working) return element<true, true>(p, grad, buf, working, i);
      if (has_momentum) return element<true, false>(p, grad, buf, working, i);
      if (has_working) return element<false, true>(p, grad, buf, working, i);
      element<false, false>(p, grad, buf, working, i);
    }
    /// A whole group (the host launcher's loop): one configuration, pointers loaded once.
    void for_group(const tensor_group<4>& g) const {
      if (skip) return;
      dispatch(g, [&]<bool M, bool W>() {
        float* __restrict__ p = static_cast<float*>(g.ptr[0]);
        const T* __restrict__ grad = static_cast<const T*>(g.ptr[1]);
        float* __restrict__ buf = static_cast<float*>(g.ptr[2]);
        T* __restrict__ working = static_cast<T*>(g.ptr[3]);
        if constexpr (std::is_same_v<T, float>) {
          for (std::size_t i = 0; i < g.size; ++i) element<M, W>(p, grad, buf, working, i);
        } else {
          host_update_blocks(grad, p, W ? working : nullptr, g.size, [&](std::size_t b, std::size_t n, const float* gb) {
            float* __restrict__ pb = p + b;
            float* __restrict__ bb = M ? buf + b : nullptr;
            for (std::size_t j = 0; j < n; ++j) element<M, false, float>(pb, gb, bb, nullptr, j);
          });
        }
      });
    }
  };
  LOCKSTEP_HD bound bind() const {
    return bound{lr,
                 momentum,
                 dampening,
                 weight_decay,
                 in.multiplier(),
                 nesterov ? 1.0f : 0.0f,
                 counters->step == 1 ? 1.0f : 0.0f,
                 in.skipped()};
  }
  LOCKSTEP_HD void operator()(const tensor_group<4>& g, std::size_t i) const { bind()(g, i); }
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

  /// The update with the device-resident inputs loaded (see launch.hpp).
  struct bound {
    float beta1, beta2, eps, decay, step_size, inv_sqrt_bc2, multiplier;
    bool skip;
    /// Element i, with the group's pointers loaded: the arithmetic both backends run. The working copy is a
    /// compile-time choice, so the host loop has no control flow and vectorizes.
    template <bool Working, class G = T>
    LOCKSTEP_HD void element(float* __restrict__ p, const G* __restrict__ grad, float* __restrict__ m,
                             float* __restrict__ v, T* __restrict__ working, std::size_t i) const {
      const float d = to_float(grad[i]) * multiplier;
      float value = p[i] * decay;
      const float mi = beta1 * m[i] + (1.0f - beta1) * d;
      const float vi = beta2 * v[i] + (1.0f - beta2) * d * d;
      m[i] = mi;
      v[i] = vi;
      value -= step_size * mi / (::sqrtf(vi) * inv_sqrt_bc2 + eps);
      p[i] = value;
      if constexpr (Working) working[i] = convert<T>(value);
    }
    LOCKSTEP_HD void operator()(const tensor_group<5>& g, std::size_t i) const {
      if (skip) return;
      auto* p = static_cast<float*>(g.ptr[0]);
      auto* grad = static_cast<const T*>(g.ptr[1]);
      auto* m = static_cast<float*>(g.ptr[2]);
      auto* v = static_cast<float*>(g.ptr[3]);
      auto* working = static_cast<T*>(g.ptr[4]);
      if (working) {
        element<true>(p, grad, m, v, working, i);
      } else {
        element<false>(p, grad, m, v, working, i);
      }
    }
    /// A whole group (the host launcher's loop): pointers loaded once.
    void for_group(const tensor_group<5>& g) const {
      if (skip) return;
      float* __restrict__ p = static_cast<float*>(g.ptr[0]);
      const T* __restrict__ grad = static_cast<const T*>(g.ptr[1]);
      float* __restrict__ m = static_cast<float*>(g.ptr[2]);
      float* __restrict__ v = static_cast<float*>(g.ptr[3]);
      T* __restrict__ working = static_cast<T*>(g.ptr[4]);
      if constexpr (!std::is_same_v<T, float>) {
        host_update_blocks(grad, p, working, g.size, [&](std::size_t b, std::size_t n, const float* gb) {
          float* __restrict__ pb = p + b;
          float* __restrict__ mb = m + b;
          float* __restrict__ vb = v + b;
          for (std::size_t j = 0; j < n; ++j) element<false, float>(pb, gb, mb, vb, nullptr, j);
        });
      } else if (working) {
        for (std::size_t i = 0; i < g.size; ++i) element<true>(p, grad, m, v, working, i);
      } else {
        for (std::size_t i = 0; i < g.size; ++i) element<false>(p, grad, m, v, working, i);
      }
    }
  };
  LOCKSTEP_HD bound bind() const {
    return bound{beta1,
                 beta2,
                 eps,
                 1.0f - lr * weight_decay,
                 lr / counters->bias_correction1,
                 1.0f / ::sqrtf(counters->bias_correction2),
                 in.multiplier(),
                 in.skipped()};
  }
  LOCKSTEP_HD void operator()(const tensor_group<5>& g, std::size_t i) const { bind()(g, i); }
};

/// Gradient clipping's device state (optim/clip.hpp): the local reduction, the total norm, the step's gradient
/// multiplier with the clip coefficient folded in, and the clipper's own skip flag.
struct clip_state {
  float reduced;     // sum of squares (l2) or maximum |g| (inf) of the raw gradients, over ranks once all-reduced
  float total_norm;  // of the unscaled gradients
  float multiplier;  // the incoming multiplier (inverse loss scale) times min(1, max_norm / (total_norm + 1e-6))
  float skip;        // non-zero when the total norm is not finite and no other skip flag was given
};

/// state.reduced = the sum (l2) or NaN-propagating maximum (inf) of the per-tensor partials, in index order. One
/// element.
struct clip_reduce_partials_op {
  const float* partials;
  std::size_t count;
  bool maximum;
  clip_state* state;
  LOCKSTEP_HD void operator()(std::size_t) const {
    float r = 0.0f;
    for (std::size_t i = 0; i < count; ++i) {
      const float v = partials[i];
      r = maximum ? ((r != r || r > v) ? r : v) : r + v;
    }
    // A NaN maximum is kept as +inf: ranks' maxima are then combined by NCCL's and MPI's max, which may drop a NaN
    // (fmaxf returns the other operand) but never an infinity. Either way the norm is not finite and the step skips.
    state->reduced = (maximum && r != r) ? detail::bits_as_float(0x7f800000u) : r;
  }
};

/// PyTorch's clip_grad_norm_ on the unscaled gradients g * m: total = sqrt(sum g^2) |m| (or max |g| |m|),
/// coefficient = min(1, max_norm / (total + 1e-6)), folded into the step's multiplier. A total that is not finite
/// sets `skip_out` (the loss scaler's flag, which then backs off as for an overflow, or the clipper's own): the
/// step is skipped, as it is for non-finite gradients. One element.
struct clip_finish_op {
  clip_state* state;
  const float* multiplier_in;  // inverse loss scale, or null for 1
  float* skip_out;
  float max_norm;
  bool l2;
  LOCKSTEP_HD void operator()(std::size_t) const {
    const float m = multiplier_in ? *multiplier_in : 1.0f;
    const float am = m < 0.0f ? -m : m;
    const float r = state->reduced;
    const float total = (l2 ? ::sqrtf(r) : r) * am;
    state->total_norm = total;
    const float coef = max_norm / (total + 1e-6f);
    state->multiplier = m * (coef < 1.0f ? coef : 1.0f);
    const bool finite = total == total && total - total == 0.0f;  // not NaN, not +-inf
    if (skip_out == &state->skip) {
      *skip_out = finite ? 0.0f : 1.0f;
    } else if (!finite) {
      *skip_out = 1.0f;
    }
  }
};

}  // namespace kernels
LOCKSTEP_ABI_END
