// lockstep/kernels/loss.hpp — kernel bodies of the losses and of the accuracy count.
//
// Softmax cross-entropy works one row at a time and is numerically stable (subtract the row maximum before
// exponentiating); the loss and the probabilities are computed in f32 whatever the logits' storage type.
// A label outside [0, classes) gives a NaN loss for its row (so the loss a user reads shows it) and a zero
// gradient.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/kernels/bind.hpp"

LOCKSTEP_ABI_BEGIN
namespace kernels {

/// Maximum and sum of exp(x - max) of one row, from the lanes that share it (launch_rows): each lane takes
/// columns lane, lane + lanes, ...; one lane (a host stream) is the plain serial loop.
template <class T>
struct row_softmax_stats {
  float max;
  float sum;
  template <class Lanes>
  LOCKSTEP_HD static row_softmax_stats of(const T* x, std::size_t n, const Lanes& lanes) {
    float m = to_float(x[0]);  // every lane starts from a real element, so lanes without columns change nothing
    for (std::size_t c = lanes.index; c < n; c += lanes.count) {
      const float v = to_float(x[c]);
      m = v > m ? v : m;
    }
    m = lanes.max(m);
    float s = 0.0f;
    for (std::size_t c = lanes.index; c < n; c += lanes.count) s += ::expf(to_float(x[c]) - m);
    return {m, lanes.sum(s)};
  }
};

/// What a loss multiplies each sample's loss by: 1 for a sum, 1/count for a mean; the count known on the host
/// (`value`), or, for the share of a global batch whose rows were summed over the ranks on the device, the factor
/// computed there (`on_device`, written by mean_factor_op).
struct loss_factor {
  float value = 1.0f;
  const float* on_device = nullptr;
  [[nodiscard]] LOCKSTEP_HD float get() const { return on_device ? *on_device : value; }
};

/// *factor = 1 / (*rows * per_row), rounded as the host's 1.0f / float(count). One call.
struct mean_factor_op {
  const std::int64_t* rows;
  std::int64_t per_row;
  float* factor;
  LOCKSTEP_HD void operator()(std::size_t) const { *factor = 1.0f / static_cast<float>(*rows * per_row); }
};

/// row_loss[r] = factor * (log sum_c exp(x[r, c]) - x[r, label[r]]). Run by launch_rows.
template <class T>
struct softmax_xent_forward_op {
  const T* logits;
  const std::int32_t* labels;
  float* row_loss;
  std::size_t classes;
  loss_factor factor;
  template <class Lanes>
  LOCKSTEP_HD void row(std::size_t r, const Lanes& lanes) const {
    const T* x = logits + r * classes;
    const std::int32_t label = labels[r];
    if (label < 0 || static_cast<std::size_t>(label) >= classes) {
      // a quiet NaN (numeric_limits is host-only constexpr for nvcc)
      if (lanes.index == 0) row_loss[r] = detail::bits_as_float(0x7fc00000u);
      return;
    }
    const auto st = row_softmax_stats<T>::of(x, classes, lanes);
    if (lanes.index == 0) row_loss[r] = factor.get() * (::logf(st.sum) + st.max - to_float(x[label]));
  }
};

/// grad[r, c] = factor * scale * (softmax(x[r])[c] - [c == label[r]]). Run by launch_rows.
template <class T>
struct softmax_xent_backward_op {
  const T* logits;
  const std::int32_t* labels;
  T* grad;
  std::size_t classes;
  loss_factor factor;
  const float* scale;  // device loss scale, or nullptr for 1
  template <class Lanes>
  LOCKSTEP_HD void row(std::size_t r, const Lanes& lanes) const {
    const T* x = logits + r * classes;
    T* g = grad + r * classes;
    const std::int32_t label = labels[r];
    if (label < 0 || static_cast<std::size_t>(label) >= classes) {
      for (std::size_t c = lanes.index; c < classes; c += lanes.count) g[c] = convert<T>(0.0f);
      return;
    }
    const auto st = row_softmax_stats<T>::of(x, classes, lanes);
    const float f = factor.get() * (scale ? *scale : 1.0f);
    const float inv_sum = 1.0f / st.sum;
    for (std::size_t c = lanes.index; c < classes; c += lanes.count) {
      const float p = ::expf(to_float(x[c]) - st.max) * inv_sum;
      g[c] = convert<T>(f * (p - (static_cast<std::size_t>(label) == c ? 1.0f : 0.0f)));
    }
  }
};

/// element_loss[i] = factor * (y[i] - t[i])^2.
template <class T>
struct mse_forward_op {
  const T* y;
  const float* t;
  float* element_loss;
  loss_factor factor;
  LOCKSTEP_HD void operator()(std::size_t i) const {
    const float d = to_float(y[i]) - t[i];
    element_loss[i] = factor.get() * d * d;
  }
};

/// grad[i] = 2 * factor * scale * (y[i] - t[i]).
template <class T>
struct mse_backward_op {
  const T* y;
  const float* t;
  T* grad;
  loss_factor factor;
  const float* scale;
  LOCKSTEP_HD void operator()(std::size_t i) const {
    grad[i] = convert<T>(2.0f * factor.get() * (scale ? *scale : 1.0f) * (to_float(y[i]) - t[i]));
  }
};

/// hit[r] = 1 when the first maximum of row r is at the label, else 0. Run by launch_rows.
template <class T>
struct argmax_hit_op {
  const T* logits;
  const std::int32_t* labels;
  std::uint64_t* hit;
  std::size_t classes;
  template <class Lanes>
  LOCKSTEP_HD void row(std::size_t r, const Lanes& lanes) const {
    const T* x = logits + r * classes;
    detail::first_max_candidate best{to_float(x[0]), 0};  // a real element in every lane (see row_softmax_stats)
    for (std::size_t c = lanes.index; c < classes; c += lanes.count) {
      const float v = to_float(x[c]);
      if (v > best.value) best = detail::first_max_candidate{v, static_cast<std::uint32_t>(c)};
    }
    best = lanes.first_max(best);
    if (lanes.index == 0) hit[r] = (labels[r] >= 0 && static_cast<std::uint32_t>(labels[r]) == best.index) ? 1u : 0u;
  }
};

/// *total += *batch (one element: a running count kept on the device).
struct accumulate_op {
  const std::uint64_t* batch;
  std::uint64_t* total;
  LOCKSTEP_HD void operator()(std::size_t) const { *total += *batch; }
};

}  // namespace kernels
LOCKSTEP_ABI_END
