// lockstep/optim/lr_schedule.hpp — learning-rate schedules (PyTorch's torch.optim.lr_scheduler): a schedule
// is a factor of the step number, and `lr_scheduler` sets every parameter group's learning rate to its base
// rate times that factor.
//
//   sgd opt(params, {.lr = 0.05f, .momentum = 0.9f});
//   lr_scheduler sched(opt, cosine_schedule{.total_steps = epochs * steps_per_epoch});
//   for (...) { opt.zero_grad(); ...; opt.step(s); sched.step(); }
//
// The learning rate is a host value read when a step is queued (it travels with the launch), so changing it
// between steps needs no synchronization, and queued steps keep the rate they were queued with.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <utility>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/error.hpp"

LOCKSTEP_ABI_BEGIN

/// The factor 1 at every step: the optimizer's own learning rate.
struct constant_schedule {
  [[nodiscard]] double operator()(std::int64_t /*step*/) const noexcept { return 1.0; }
};

/// Linear warm-up from 1/(warmup_steps + 1) to 1 over the first `warmup_steps` steps, then cosine annealing
/// from 1 to `final_factor` at step `total_steps`, where it stays (PyTorch's CosineAnnealingLR with
/// eta_min = final_factor x lr and T_max = total_steps, when warmup_steps is 0).
struct cosine_schedule {
  std::int64_t total_steps = 0;
  std::int64_t warmup_steps = 0;
  double final_factor = 0.0;

  /// Throws precondition_error unless 0 <= warmup_steps < total_steps and final_factor is in [0, 1].
  void validate() const {
    LOCKSTEP_EXPECTS(total_steps > 0, "cosine_schedule: total_steps must be > 0, got ", total_steps);
    LOCKSTEP_EXPECTS(warmup_steps >= 0 && warmup_steps < total_steps,
                     "cosine_schedule: warmup_steps must be in [0, total_steps = ", total_steps, "), got ", warmup_steps);
    LOCKSTEP_EXPECTS(final_factor >= 0.0 && final_factor <= 1.0,
                     "cosine_schedule: final_factor must be in [0, 1], got ", final_factor);
  }

  [[nodiscard]] double operator()(std::int64_t step) const noexcept {
    if (step < warmup_steps) return static_cast<double>(step + 1) / static_cast<double>(warmup_steps + 1);
    if (step >= total_steps) return final_factor;
    const double t = static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
    return final_factor + (1.0 - final_factor) * 0.5 * (1.0 + std::cos(std::numbers::pi * t));
  }
};

/// gamma^floor(step / step_size): the rate multiplied by gamma every `step_size` steps (PyTorch's StepLR).
struct step_schedule {
  std::int64_t step_size = 0;
  double gamma = 0.1;

  /// Throws precondition_error unless step_size > 0 and gamma is in (0, 1].
  void validate() const {
    LOCKSTEP_EXPECTS(step_size > 0, "step_schedule: step_size must be > 0, got ", step_size);
    LOCKSTEP_EXPECTS(gamma > 0.0 && gamma <= 1.0, "step_schedule: gamma must be in (0, 1], got ", gamma);
  }

  [[nodiscard]] double operator()(std::int64_t step) const noexcept {
    return std::pow(gamma, static_cast<double>(step / step_size));
  }
};

/// Applies `Schedule` to every parameter group of `Optimizer` (sgd, adamw, or anything with group_count()
/// and options(i).lr): group i's rate at step t is base_i x schedule(t), base_i being its rate when the
/// scheduler first saw it (at construction, or at the first step() after the group was added).
/// The constructor sets step 0's rates; call step() once after each optimizer step. A step the loss scaler
/// skips (an overflow) still advances the schedule, as in PyTorch.
template <class Optimizer, class Schedule>
class lr_scheduler {
 public:
  lr_scheduler(Optimizer& optimizer, Schedule schedule) : optimizer_(&optimizer), schedule_(std::move(schedule)) {
    if constexpr (requires { schedule_.validate(); }) schedule_.validate();
    apply();
  }

  /// Moves to the next step and sets its rates.
  void step() {
    ++step_;
    apply();
  }

  /// Steps taken by step() so far: the step whose rates are set.
  [[nodiscard]] std::int64_t last_step() const noexcept { return step_; }
  /// The current factor of the base rates.
  [[nodiscard]] double factor() const noexcept { return schedule_(step_); }
  /// Group `index`'s base rate.
  [[nodiscard]] float base_lr(std::size_t index = 0) const { return base_.at(index); }
  [[nodiscard]] const Schedule& schedule() const noexcept { return schedule_; }
  /// The optimizer's number of parameter groups.
  [[nodiscard]] std::size_t group_count() const { return optimizer_->group_count(); }
  /// The base rates of the groups seen so far.
  [[nodiscard]] const std::vector<float>& base_lrs() const noexcept { return base_; }

  /// Continues a run: sets the step and the groups' base rates (as saved by a checkpoint) and applies the
  /// step's rates. Throws precondition_error unless step >= 0 and there is one base rate per group.
  void restore(std::int64_t step, std::vector<float> base_lrs) {
    LOCKSTEP_EXPECTS(step >= 0, "lr_scheduler::restore: step must be >= 0, got ", step);
    LOCKSTEP_EXPECTS(base_lrs.size() == optimizer_->group_count(), "lr_scheduler::restore: ", base_lrs.size(),
                     " base rates for an optimizer of ", optimizer_->group_count(), " groups");
    step_ = step;
    base_ = std::move(base_lrs);
    apply();
  }

 private:
  void apply() {
    for (std::size_t i = base_.size(); i < optimizer_->group_count(); ++i) base_.push_back(optimizer_->options(i).lr);
    const double f = schedule_(step_);
    for (std::size_t i = 0; i < base_.size(); ++i) {
      optimizer_->options(i).lr = static_cast<float>(static_cast<double>(base_[i]) * f);
    }
  }

  Optimizer* optimizer_;
  Schedule schedule_;
  std::vector<float> base_;
  std::int64_t step_ = 0;
};

LOCKSTEP_ABI_END
