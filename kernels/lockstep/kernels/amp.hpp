// lockstep/kernels/amp.hpp — kernel bodies of mixed precision: the fused check of every gradient for
// non-finite values, in-place unscaling, and the dynamic loss scale's update, all on the device.
#pragma once

#include <cstddef>
#include <cstdint>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/kernels/multi_tensor.hpp"

LOCKSTEP_ABI_BEGIN
namespace kernels {

/// The loss scaler's state, kept on the device so that no step waits for the host.
struct scaler_state {
  float scale;                       // what the loss gradient is multiplied by
  float inv_scale;                   // 1 / scale: what gradients are multiplied by when read
  float found_inf;                   // 1 when this step's gradients had a non-finite value (on any rank), else 0
  std::int32_t growth_tracker;       // consecutive steps without overflow since the last change of scale
  std::int64_t steps;                // steps taken (skipped ones included)
  std::int64_t skipped_steps;        // steps skipped for non-finite gradients
  std::int64_t last_overflow_step;   // index of the last skipped step, -1 if none
  std::int64_t consecutive_skips;    // steps skipped in a row, ending with the last step (0 after a clean step)
  unsigned long long non_finite;     // non-finite values counted this step (this rank)
};

/// Adds one to *counter from any number of GPU threads, or from the one host thread.
LOCKSTEP_HD inline void add_count(unsigned long long* counter, unsigned long long n) {
#if defined(__CUDA_ARCH__)
  atomicAdd(counter, n);
#else
  *counter += n;
#endif
}

/// Counts the gradient values that are not finite once unscaled: to_float(g) * inv_scale. Group: [grad].
template <class T>
struct count_non_finite_op {
  scaler_state* state;
  struct bound {
    float inv_scale;
    unsigned long long* counter;
    LOCKSTEP_HD bool bad(const T* g, std::size_t i) const { return !is_finite(to_float(g[i]) * inv_scale); }
    LOCKSTEP_HD void operator()(const tensor_group<1>& g, std::size_t i) const {
      if (bad(static_cast<const T*>(g.ptr[0]), i)) add_count(counter, 1);  // rare: one atomic per bad value
    }
    /// The host loop: a branch-free count, added once. When unscaling cannot overflow (inv_scale <= 1: the
    /// scale is at least 1, as always with its default floor), a value is bad exactly when it is not finite
    /// already, which for f16/bf16 is a test of the exponent bits, without converting.
    void for_group(const tensor_group<1>& g) const {
      const T* __restrict__ p = static_cast<const T*>(g.ptr[0]);
      unsigned long long n = 0;
      if (inv_scale <= 1.0f) {
        // Counted in 32-bit blocks: a 64-bit count per value made GCC widen each 16-bit lane twice, and the
        // bf16 check ran at a third of the speed (11 against 30 GB/s, one Xeon core).
        constexpr std::size_t block = std::size_t{1} << 16;
        for (std::size_t base = 0; base < g.size; base += block) {
          const std::size_t end = g.size - base < block ? g.size : base + block;
          std::uint32_t k = 0;
          for (std::size_t i = base; i < end; ++i) k += is_finite(p[i]) ? 0u : 1u;
          n += k;
        }
      } else {
        for (std::size_t i = 0; i < g.size; ++i) n += bad(p, i) ? 1u : 0u;
      }
      *counter += n;
    }
  };
  LOCKSTEP_HD bound bind() const { return bound{state->inv_scale, &state->non_finite}; }
  LOCKSTEP_HD void operator()(const tensor_group<1>& g, std::size_t i) const { bind()(g, i); }
};

/// g *= inv_scale in place (f32 gradients: PyTorch's GradScaler.unscale_). Group: [grad].
struct unscale_op {
  const scaler_state* state;
  struct bound {
    float inv_scale;
    LOCKSTEP_HD void operator()(const tensor_group<1>& g, std::size_t i) const {
      static_cast<float*>(g.ptr[0])[i] *= inv_scale;
    }
    void for_group(const tensor_group<1>& g) const {
      float* __restrict__ p = static_cast<float*>(g.ptr[0]);
      for (std::size_t i = 0; i < g.size; ++i) p[i] *= inv_scale;
    }
  };
  LOCKSTEP_HD bound bind() const { return bound{state->inv_scale}; }
  LOCKSTEP_HD void operator()(const tensor_group<1>& g, std::size_t i) const { bind()(g, i); }
};

/// Before a check: nothing counted yet. One element.
struct begin_check_op {
  scaler_state* state;
  LOCKSTEP_HD void operator()(std::size_t) const {
    state->non_finite = 0;
    state->found_inf = 0.0f;
  }
};

/// After a check: the flag the optimizer and the other ranks read. One element.
struct end_check_op {
  scaler_state* state;
  LOCKSTEP_HD void operator()(std::size_t) const { state->found_inf = state->non_finite != 0 ? 1.0f : 0.0f; }
};

/// After the optimizer step: back off on overflow, grow after `interval` clean steps, within [floor, ceiling].
/// With dynamic scaling off the scale never changes (skips are still counted). One element.
struct update_scale_op {
  scaler_state* state;
  float growth_factor;
  float backoff_factor;
  std::int32_t interval;
  float ceiling;
  float floor;
  bool dynamic;
  LOCKSTEP_HD void operator()(std::size_t) const {
    scaler_state& s = *state;
    if (s.found_inf != 0.0f) {
      ++s.skipped_steps;
      ++s.consecutive_skips;
      s.last_overflow_step = s.steps;
      s.growth_tracker = 0;
      if (dynamic) {
        const float backed = s.scale * backoff_factor;
        s.scale = backed < floor ? floor : backed;
      }
    } else {
      s.consecutive_skips = 0;
    }
    if (s.found_inf == 0.0f && dynamic && ++s.growth_tracker >= interval) {
      const float grown = s.scale * growth_factor;
      s.scale = grown > ceiling ? ceiling : grown;
      s.growth_tracker = 0;
    }
    s.inv_scale = 1.0f / s.scale;
    ++s.steps;
  }
};

}  // namespace kernels
LOCKSTEP_ABI_END
