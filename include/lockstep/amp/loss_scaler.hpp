// lockstep/amp/loss_scaler.hpp — dynamic loss scaling (PyTorch's GradScaler), on the device.
//
// f16 has a narrow range: small gradients underflow to zero. Multiplying the loss (its gradient, in practice)
// by a large scale before backward keeps them representable; gradients are multiplied back by 1/scale when the
// optimizer reads them, in f32 (never in their own precision, which would lose them again). Each step:
//
//   loss_scaler scaler(ctx);                        attached: losses on ctx multiply the gradient they start with
//   ... forward, loss, backward (DDP all-reduce) ...
//   scaler.unscale_and_check(params, s [, comm]);   one fused kernel: non-finite values counted (all ranks)
//   optimizer.step(s, scaler.optimizer_inputs());    skipped, weights and state untouched, on overflow
//   scaler.update(s);                               back off on overflow, grow after `growth_interval` steps
//
// The scale, the overflow flag and the counters stay on the device: a step never waits for the host. Read the
// telemetry (`read`) when you want to print it. bf16 has f32's range and needs no scaling: its default options
// (for_precision(bf16)) keep the scale at 1 and only skip steps with non-finite gradients.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/config.hpp"
#include "lockstep/kernels/amp.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/kernels/multi_tensor.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/kernels/optim.hpp"  // step_inputs: what the optimizer step reads
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN

struct loss_scaler_options {
  /// Dynamic scaling (grow and back off). Off: the scale stays `initial_scale`.
  bool dynamic = true;
  float initial_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  std::int32_t growth_interval = 2000;
  /// The scale never exceeds `max_scale` nor drops below `min_scale`.
  float max_scale = 16777216.0f;  // 2^24
  float min_scale = 1.0f;

  /// The defaults for a compute precision: dynamic scaling from 65536 for f16; none (scale 1) for bf16 and f32,
  /// whose range is f32's. Steps with non-finite gradients are skipped either way.
  static loss_scaler_options for_precision(dtype t) {
    loss_scaler_options o;
    if (t != dtype::f16) {
      o.dynamic = false;
      o.initial_scale = 1.0f;
    }
    return o;
  }
};

/// What the scaler has done so far (a copy read from the device).
struct loss_scaler_telemetry {
  float scale = 0;
  std::int64_t steps = 0;
  std::int64_t skipped_steps = 0;
  std::int64_t last_overflow_step = -1;  // -1: never
  std::int32_t growth_tracker = 0;       // clean steps since the scale last changed
  std::int64_t consecutive_skipped_steps = 0;  // skipped in a row, ending with the last step: a run whose gradients
                                               // are not finite at any scale (diverged) only grows this
  std::uint64_t non_finite_values = 0;   // found by the last check on this rank
};

class loss_scaler {
 public:
  /// A scaler whose state lives on the device of `s`, initialized in stream order on `s`.
  explicit loss_scaler(stream_ref s, loss_scaler_options options = {}) : options_(options) {
    LOCKSTEP_EXPECTS(options.initial_scale > 0 && options.growth_factor >= 1 && options.backoff_factor > 0 &&
                         options.backoff_factor <= 1 && options.growth_interval >= 1 && options.min_scale > 0 &&
                         options.min_scale <= options.initial_scale && options.initial_scale <= options.max_scale,
                     "loss_scaler: expected initial_scale > 0, growth_factor >= 1, 0 < backoff_factor <= 1, "
                     "growth_interval >= 1 and 0 < min_scale <= initial_scale <= max_scale; got initial ",
                     options.initial_scale, ", growth ", options.growth_factor, ", backoff ", options.backoff_factor,
                     ", interval ", options.growth_interval, ", range [", options.min_scale, ", ", options.max_scale, "]");
    kernels::scaler_state init{};
    init.scale = options.initial_scale;
    init.inv_scale = 1.0f / options.initial_scale;
    init.last_overflow_step = -1;
    std::vector<std::uint8_t> bytes(sizeof init);
    std::memcpy(bytes.data(), &init, sizeof init);
    state_ = to_device(bytes, s);
  }

  /// A scaler on the device of `ctx` (initialized in stream order on its stream), attached to it (attach): the
  /// losses computed with `ctx` scale the gradients they start backward with. The usual way to make one.
  explicit loss_scaler(context& ctx, loss_scaler_options options = {}) : loss_scaler(ctx.stream(), options) {
    attach(ctx);
  }

  [[nodiscard]] const loss_scaler_options& options() const noexcept { return options_; }
  [[nodiscard]] device get_device() const noexcept { return state_.get_device(); }

  /// Device pointer to the current scale: give it to the context (ctx.set_loss_scale) so that losses scale
  /// the gradient they start backward with.
  [[nodiscard]] const float* scale() const noexcept {
    handed_out_ = true;
    return &state()->scale;
  }

  /// Gives the context where the loss is computed the scale (ctx.set_loss_scale(scale())), after checking that
  /// it runs on the scaler's device: a loss on another device would read this device's memory. Under
  /// data_parallel with an output_device other than device_ids[0], create the scaler on the output device.
  void attach(context& ctx) const {
    LOCKSTEP_EXPECTS(ctx.stream().get_device() == get_device(), "loss_scaler::attach: the scaler's state is on ",
                     get_device().str(), " but the context computes on ", ctx.stream().get_device().str(),
                     "; create the scaler with a stream of the device where the loss is computed");
    ctx.set_loss_scale(scale());
  }

  /// The fused check, in stream order on `s` (a stream of the scaler's device): one multi-tensor launch counts
  /// the gradient values of `params` that are not finite once unscaled, and sets the overflow flag. With a
  /// communicator, the flag is then reduced (max) over its ranks, so that every rank skips the same steps.
  void unscale_and_check(std::span<parameter* const> params, stream_ref s,
                         std::optional<communicator_ref> ranks = std::nullopt) {
    expect_on_scaler_device(params, s, "loss_scaler::unscale_and_check");
    expect_attached("loss_scaler::unscale_and_check");
    detail::expect_ranks_for_shards(params, ranks.has_value(), "loss_scaler::unscale_and_check",
                            "so that every rank skips the same steps");
    if (!settings_) {
      using detail::shortest;
      settings_ = std::make_shared<const std::string>(detail::concat(
          options_.dynamic ? "dynamic" : "static", "(initial_scale=", shortest(options_.initial_scale),
          ", growth_factor=", shortest(options_.growth_factor), ", backoff_factor=", shortest(options_.backoff_factor),
          ", growth_interval=", options_.growth_interval, ", min_scale=", shortest(options_.min_scale),
          ", max_scale=", shortest(options_.max_scale), ")"));
    }
    detail::set_update_settings(params, update_role::loss_scaler, settings_);
    launch_elementwise(1, kernels::begin_check_op{state()}, s, "loss scaler check");
    for_each_gradient_type(params, s, [&]<class T>(std::span<const tensor_group<1>> groups) {
      launch_multi_tensor<1>(groups, kernels::count_non_finite_op<T>{state()}, s, "non-finite gradient count");
    });
    launch_elementwise(1, kernels::end_check_op{state()}, s, "loss scaler check");
    if (ranks && ranks->size() > 1) {
      ranks->all_reduce(&state()->found_inf, &state()->found_inf, 1, dtype::f32, reduce_op::max, s);
    }
    unscaled_ = false;
  }

  /// Multiplies f32 gradients by 1/scale in place (before clipping them, say), in stream order on `s`; the next
  /// optimizer step then reads them as they are. Low-precision gradients cannot be unscaled in their own type
  /// without losing the small values loss scaling protects: precondition_error (PyTorch refuses it too).
  void unscale_(std::span<parameter* const> params, stream_ref s) {
    std::vector<tensor_group<1>> groups;
    expect_on_scaler_device(params, s, "loss_scaler::unscale_");
    expect_attached("loss_scaler::unscale_");
    for (parameter* p : params) {
      LOCKSTEP_EXPECTS(p->compute_type() == dtype::f32, "loss_scaler::unscale_: gradient of ", p->name(), " is ",
                       name_of(p->compute_type()), "; only f32 gradients can be unscaled in place (the optimizer "
                       "unscales low-precision gradients as it reads them)");
      p->materialize_grad(s);
      const tensor_view g = p->grad_shard();
      if (g.numel() > 0) groups.push_back(tensor_group<1>{{g.data()}, static_cast<std::size_t>(g.numel())});
    }
    launch_multi_tensor<1>(std::span<const tensor_group<1>>(groups), kernels::unscale_op{state()}, s, "unscale");
    unscaled_ = true;
  }

  /// What the optimizer step reads: the inverse scale (unless unscale_ already applied it) and the skip flag.
  [[nodiscard]] kernels::step_inputs optimizer_inputs() const noexcept {
    return kernels::step_inputs{unscaled_ ? nullptr : &state()->inv_scale, &state()->found_inf};
  }

  /// Updates the scale after the optimizer step, in stream order on `s`.
  void update(stream_ref s) {
    launch_elementwise(1,
                       kernels::update_scale_op{state(), options_.growth_factor, options_.backoff_factor,
                                                options_.growth_interval, options_.max_scale, options_.min_scale,
                                                options_.dynamic},
                       s, "loss scale update");
    unscaled_ = false;
  }

  /// The device state (a kernels::scaler_state), for checkpoints.
  [[nodiscard]] device_span<std::uint8_t> state_bytes() noexcept { return state_.span(); }

  /// The state, copied from the device; synchronizes `s`.
  [[nodiscard]] loss_scaler_telemetry read(stream_ref s) const {
    const auto bytes = to_vector(device_span<const std::uint8_t>(state_.span()), s);
    kernels::scaler_state st{};
    std::memcpy(&st, bytes.data(), sizeof st);
    return loss_scaler_telemetry{.scale = st.scale, .steps = st.steps, .skipped_steps = st.skipped_steps,
                                 .last_overflow_step = st.last_overflow_step, .growth_tracker = st.growth_tracker,
                                 .consecutive_skipped_steps = st.consecutive_skips, .non_finite_values = st.non_finite};
  }

 private:
  [[nodiscard]] kernels::scaler_state* state() const noexcept {
    return reinterpret_cast<kernels::scaler_state*>(const_cast<std::uint8_t*>(state_.data()));
  }

  // The gradients were scaled: some context was given the scale (attach, or set_loss_scale(scale())). Without it the
  // optimizer would divide unscaled gradients by the scale, every update `scale` times too small, silently.
  // (A scale that stays 1, bf16's and f32's default, scales nothing: nothing to attach.)
  void expect_attached(const char* what) const {
    if (!options_.dynamic && options_.initial_scale == 1.0f) return;
    LOCKSTEP_EXPECTS(handed_out_, what, ": no loss was given this scaler's scale, so the gradients are not scaled and "
                     "every update would be ", options_.initial_scale, " times too small; make the scaler with the "
                     "context where the loss is computed, loss_scaler(ctx, options), or call scaler.attach(ctx) once "
                     "before the first backward");
  }

  // The stream and every gradient are on the scaler's device: its kernels read them all in one launch.
  void expect_on_scaler_device(std::span<parameter* const> params, stream_ref s, const char* what) const {
    LOCKSTEP_EXPECTS(s.get_device() == get_device(), what, ": the scaler's state is on ", get_device().str(),
                     " but the stream is of ", s.get_device().str());
    for (parameter* p : params) {
      const device d = p->get_device();
      LOCKSTEP_EXPECTS(d == get_device(), what, ": parameter ", p->name(), " is on ", d.str(), ", the scaler on ",
                       get_device().str(), "; one kernel cannot read both (on GPUs: an illegal address). Use a "
                       "scaler per device, or the scaler of the device that holds these parameters");
    }
  }

  // Calls launch.template operator()<T>(groups) for the gradients of each storage type T.
  template <class Launch>
  static void for_each_gradient_type(std::span<parameter* const> params, stream_ref s, Launch&& launch) {
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
      std::vector<tensor_group<1>> groups;
      for (parameter* p : params) {
        if (p->compute_type() != t) continue;
        p->materialize_grad(s);
        const tensor_view g = p->grad_shard();  // under ZeRO, this rank's part (the ranks' flags are combined)
        if (g.numel() > 0) groups.push_back(tensor_group<1>{{g.data()}, static_cast<std::size_t>(g.numel())});
      }
      if (groups.empty()) continue;
      dispatch_floating(t, "loss scaler", [&]<class T>() { launch.template operator()<T>(std::span<const tensor_group<1>>(groups)); });
    }
  }

  loss_scaler_options options_;
  std::shared_ptr<const std::string> settings_;  // the options, as parameters carry them (set_update_settings)
  device_buffer<std::uint8_t> state_;
  bool unscaled_ = false;
  mutable bool handed_out_ = false;  // scale() was given to a context
};

LOCKSTEP_ABI_END
