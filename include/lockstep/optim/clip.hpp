// lockstep/optim/clip.hpp — clipping gradients by their total norm (torch.nn.utils.clip_grad_norm_), on the device.
//
//   gradient_clipper clip(s);
//   scaler.unscale_and_check(params, s);                                   // mixed precision: overflow check first
//   step_inputs in = clip.clip_grad_norm(params, {.max_norm = 1.0f}, s, scaler.optimizer_inputs());
//   opt.step(s, in);                                                       // reads the clipped multiplier
//   scaler.update(s);
//   float norm = clip.total_norm(s);                                       // only if you want it: synchronizes
//
// The norm is PyTorch's: the 2-norm (or the largest |g|) of all the gradients together, computed in fp32 from the
// unscaled gradients (the gradients times the incoming multiplier, the loss scaler's inverse scale), and the
// coefficient min(1, max_norm / (norm + 1e-6)). Instead of rewriting the gradients in place (lossy for f16 and
// bf16 gradients, which the optimizer unscales as it reads them), the coefficient is folded into the multiplier
// the optimizer step applies to every gradient: the update is PyTorch's clipped update. A norm that is not finite
// skips the step: it sets the loss scaler's skip flag when one is given (the scaler then backs off, as for an
// overflow) or the clipper's own.
//
// Nothing waits for the device. Each gradient is reduced separately (per-tensor partials, added in parameter
// order), so the norm does not depend on how tensors are batched. With `shards` (each rank holding a part of the
// gradients, as ZeRO shards do: parameter::grad_shard()) the local result is all-reduced (sum of squares, or max)
// before the square root; it is required when the parameters are sharded. Do not pass `shards` after a plain
// distributed_data_parallel's backward: every rank then holds all the gradients, and they would count N times.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <span>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/config.hpp"
#include "lockstep/kernels/optim.hpp"
#include "lockstep/kernels/reduce.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN

/// Which norm of the gradients: the 2-norm (norm_type=2) or the largest absolute value (norm_type=inf).
enum class grad_norm : std::uint8_t { l2, inf };

struct clip_options {
  float max_norm = 1.0f;
  grad_norm norm = grad_norm::l2;
};

/// Clips gradients by their total norm on one device. Holds its device state (the norm, the clipped multiplier,
/// a skip flag) and per-tensor partials: allocated once, reused every step. Move-only.
class gradient_clipper {
 public:
  /// State on the device of `s`, initialized in stream order on `s`.
  explicit gradient_clipper(stream_ref s) : state_(shape{sizeof(kernels::clip_state)}, dtype::u8, s) {
    fill_zero(state_.view().bytes(), s);
  }

  /// Queues on `s`: the total norm of the gradients of `params` (all on s's device; unscaled by `in`'s multiplier),
  /// the clip coefficient, and a skip when the norm is not finite. Returns what the optimizer step reads: the
  /// multiplier with the coefficient folded in, and the skip flag (in.skip when given, else the clipper's own).
  /// The returned inputs point into this clipper: use them for this step, before the next clip_grad_norm.
  /// Throws precondition_error for a max_norm that is not positive and finite, or memory of another device.
  step_inputs clip_grad_norm(std::span<parameter* const> params, clip_options options, stream_ref s,
                             step_inputs in = {}, std::optional<communicator_ref> shards = std::nullopt) {
    LOCKSTEP_EXPECTS(options.max_norm > 0.0f && options.max_norm - options.max_norm == 0.0f,
                     "clip_grad_norm: max_norm must be positive and finite, got ", options.max_norm);
    const device d = s.get_device();
    LOCKSTEP_EXPECTS(state_.get_device() == d, "clip_grad_norm: the clipper's state is on ", state_.get_device().str(),
                     " but the stream is of ", d.str());
    detail::expect_pointer_on_device(d, in.grad_multiplier, "clip_grad_norm's incoming multiplier (step_inputs)");
    detail::expect_pointer_on_device(d, in.skip, "clip_grad_norm's skip flag (step_inputs)");
    detail::expect_ranks_for_shards(params, shards.has_value(), "clip_grad_norm",
                                    "(`shards`) so that the norm covers every rank's shard");
    if (!settings_ || options.max_norm != last_.max_norm || options.norm != last_.norm) {
      settings_ = std::make_shared<const std::string>(detail::concat(
          "clip_grad_norm(max_norm=", detail::shortest(options.max_norm), ", norm=", options.norm == grad_norm::l2 ? "l2" : "inf", ")"));
      last_ = options;
    }
    detail::set_update_settings(params, update_role::clipping, settings_);
    const bool l2 = options.norm == grad_norm::l2;
    partials_.ensure(shape{static_cast<std::int64_t>(params.empty() ? 1 : params.size())}, dtype::f32, s);
    const device_span<float> partials = partials_.view().span<float>();
    for (std::size_t i = 0; i < params.size(); ++i) {
      parameter& p = *params[i];
      LOCKSTEP_EXPECTS(p.get_device() == d, "clip_grad_norm: parameter ", p.name(), " is on ",
                       p.get_device().str(), " but the stream is of ", d.str());
      p.materialize_grad(s);
      const tensor_view g = p.grad_shard();
      dispatch_floating(g.type(), "clip_grad_norm", [&]<class T>() {
        const device_span<const T> values = g.span<const T>();
        if (l2) {
          detail::transform_reduce(values, partials.subspan(i, 1), kernels::plus_op{}, kernels::square_op<T>{}, 0.0f,
                                   s, "clip_grad_norm (sum of squares)", &workspace_);
        } else {
          detail::transform_reduce(values, partials.subspan(i, 1), kernels::max_nan_op{}, kernels::abs_op<T>{}, 0.0f,
                                   s, "clip_grad_norm (max |g|)", &workspace_);
        }
      });
    }
    kernels::clip_state* st = state();
    launch_elementwise(1, kernels::clip_reduce_partials_op{partials.data(), params.size(), !l2, st}, s,
                       "clip_grad_norm (partials)");
    if (shards && shards->size() > 1) {
      shards->all_reduce(&st->reduced, &st->reduced, 1, dtype::f32, l2 ? reduce_op::sum : reduce_op::max, s);
    }
    // The skip flag a loss scaler hands out is its own mutable state, given as const for the optimizer's reads.
    float* skip = in.skip ? const_cast<float*>(in.skip) : &st->skip;
    launch_elementwise(1, kernels::clip_finish_op{st, in.grad_multiplier, skip, options.max_norm, l2}, s,
                       "clip_grad_norm");
    return step_inputs{&st->multiplier, skip};
  }

  /// The total norm of the last clip_grad_norm (of the unscaled gradients, before clipping); synchronizes `s`.
  [[nodiscard]] float total_norm(stream_ref s) const {
    const auto bytes = to_vector(device_span<const std::uint8_t>(state_.view().bytes()), s);
    kernels::clip_state st{};
    std::memcpy(&st, bytes.data(), sizeof st);
    return st.total_norm;
  }

  /// Device pointer to the total norm (a float), for work that reads it without synchronizing.
  [[nodiscard]] const float* total_norm_on_device() const noexcept { return &state()->total_norm; }

 private:
  [[nodiscard]] kernels::clip_state* state() const noexcept {
    return reinterpret_cast<kernels::clip_state*>(const_cast<std::byte*>(static_cast<const std::byte*>(state_.data())));
  }

  tensor state_;      // one kernels::clip_state
  tensor partials_;   // [params] f32: each gradient's sum of squares or max |g|
  tensor workspace_;  // the reductions' temporary storage on a GPU
  clip_options last_;  // the options settings_ describes
  std::shared_ptr<const std::string> settings_;  // as parameters carry them (set_update_settings)
};

LOCKSTEP_ABI_END
