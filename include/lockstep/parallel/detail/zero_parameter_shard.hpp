// lockstep/parallel/detail/zero_parameter_shard.hpp — one parameter's shard as ZeRO keeps it (zero_shards.hpp
// keeps one per parameter and attaches it to the parameter as its parameter_sharding): the range this rank updates,
// the range's fp32 master values (f16/bf16; under ZeRO-3 for every type), ZeRO-2's gradient of the range, ZeRO-3's
// values of the range (a slice of the bucket's values shard) and the whole values while they are gathered.
#pragma once

#include <functional>
#include <memory>
#include <utility>

#include "lockstep/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/memory.hpp"
#include "lockstep/runtime/stream.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_DETAIL_BEGIN

/// The elements `r` of `t`, flat.
inline tensor_view flat_part(const tensor_view& t, element_range r) {
  return tensor_view(static_cast<std::byte*>(t.data()) + static_cast<std::size_t>(r.begin) * size_of(t.type()), t.type(),
                     shape{r.size()}, t.get_device());
}

/// One parameter's shard, as ZeRO keeps it (parameter_sharding): the range this rank updates, under f16/bf16
/// the range's fp32 master values, under ZeRO-2 the range's gradient in storage of its own (kept, with what it
/// holds, while a consolidation holds the parameter whole), and whether the values are stale. Under ZeRO-3 the
/// range's values forward reads live in a slice of the bucket's values shard (under f32 they are the master
/// values), and the whole values only in the bucket's gathered buffer, while the wrapper holds it.
class zero_parameter_shard final : public parameter_sharding {
 public:
  /// The shard of `range`, for a wrapper that computes (and orders its gathers) on `compute`.
  zero_parameter_shard(element_range range, stream_ref compute) noexcept
      : range_(range.empty() ? element_range{} : range), compute_(compute) {}

  [[nodiscard]] bool active() const noexcept override { return active_; }
  [[nodiscard]] element_range range() const noexcept override { return range_; }
  [[nodiscard]] bool keeps_masters() const noexcept override { return active_ && keeps_masters_; }
  [[nodiscard]] tensor_view masters() const noexcept override {
    return values_are_masters_ ? shard_values_ : masters_.view();
  }
  [[nodiscard]] bool keeps_gradient() const noexcept override { return active_ && keeps_gradient_; }
  [[nodiscard]] tensor_view gradient() const noexcept override { return gradient_.view(); }

  [[nodiscard]] bool shards_values() const noexcept override { return active_ && shards_values_; }
  [[nodiscard]] tensor_view values() const noexcept override { return gathered_; }
  [[nodiscard]] tensor_view working_shard() const noexcept override {
    return values_are_masters_ ? tensor_view{} : shard_values_;
  }

  void before_read(const parameter& p) override {
    const bool unheld = shards_values() && gathered_.empty();
    if (stale_ || unheld) {
      throw precondition_error(concat(
          "parameter ", p.name(),
          unheld ? ": ZeRO-3 keeps only this rank's shard of its values between steps (distributed_data_parallel::"
                   "forward gathers them, a graph or sequential one layer at a time, freed after use; a synchronized "
                   "backward frees the rest)"
                 : ": its values on this rank are stale (ZeRO updates a shard per rank; the others' updates arrive "
                   "with the next distributed_data_parallel::forward or gather_parameters())",
          "; call ddp.gather_parameters() before using the model outside the wrapper"));
    }
    if (read_hook_) std::exchange(read_hook_, nullptr)();
  }
  void before_first_write() override {
    if (first_write_) first_write_();
  }
  void before_write() override {
    if (read_hook_) std::exchange(read_hook_, nullptr)();  // the values' all-gather, if still pending
  }
  void before_update(const parameter& p, stream_ref s) override {
    // (inactive: a consolidation holds the parameter whole, yet only the range's gradient was reduced here, and
    // under ZeRO-2 the whole gradient is gone: a step would diverge the ranks)
    LOCKSTEP_EXPECTS(active_, "parameter ", p.name(), ": an optimizer step while distributed_data_parallel::",
                     "consolidated() holds the model whole; step after the consolidation's guard ends");
    // (the gathers that read the shard, backward's gradient writes and the next forward's gathers are ordered on the
    // wrapper's stream: an update on another one races them)
    LOCKSTEP_EXPECTS(s == compute_, "parameter ", p.name(), ": an optimizer step on another stream of ",
                     s.get_device().str(), " than the one distributed_data_parallel computes on (ZeRO orders the "
                     "shard's gathers and gradients on that stream only): step on the context's stream, ctx.stream()");
    before_write();  // (the all-gather reads the range the update writes)
    stale_ = true;
  }
  void zero_grad() noexcept override { gradient_zero_ = true; }
  void materialize_gradient(stream_ref s) override {
    if (std::exchange(gradient_zero_, false)) fill_zero(gradient_.view().bytes(), s);
  }

  /// ZeRO-3: the range's values live in `shard` (range().size() elements of the compute type, in the bucket's
  /// values shard, which `owner` keeps alive) from the next activate() on.
  void keep_values_in(const tensor_view& shard, std::shared_ptr<const void> owner) {
    shard_values_ = shard;
    shard_owner_ = std::move(owner);
    shards_values_ = true;
  }

  /// Shards `p` (again), in stream order on `s`: under f16/bf16 the range's master values are copied apart and
  /// the parameter's freed; with `keep_gradient` (ZeRO-2) the range's gradient gets storage of its own (what it
  /// held before a consolidation, else new storage marked zero); under ZeRO-3 the range's values are copied into
  /// the values shard and the parameter's whole values freed (stale: not gathered).
  void activate(const std::shared_ptr<zero_parameter_shard>& self, parameter& p, bool keep_gradient, stream_ref s) {
    LOCKSTEP_EXPECTS(!active_ && range_.end <= p.numel(), "parameter ", p.name(), ": shard [", range_.begin, ", ",
                     range_.end, ") of ", p.numel(), " elements", active_ ? " (it is sharded already)" : "");
    const bool f32 = p.compute_type() == dtype::f32;
    // (deferred master values: the working copy holds the initial values; under f32 there is none, and
    // detail::broadcast_deferred_parameters writes the range after this)
    if (shards_values_ && !range_.empty() && !(f32 && p.masters_deferred())) {
      const tensor_view whole = f32 ? p.value() : p.working();
      copy(shard_values_.bytes(), device_span<const std::uint8_t>(flat_part(whole, range_).bytes()), s);
    }
    values_are_masters_ = shards_values_ && f32;
    keeps_masters_ = !f32 || shards_values_;
    if (!f32) {
      tensor kept(shape{range_.size()}, dtype::f32, s);
      // (deferred master values: written after this by detail::broadcast_deferred_parameters)
      if (!range_.empty() && !p.masters_deferred()) {
        copy(kept.span<float>(), flat_part(p.value(), range_).span<const float>(), s);
      }
      masters_ = std::move(kept);
    }
    keeps_gradient_ = keep_gradient;
    active_ = true;
    p.set_sharding(self, s);  // frees the whole master values before the gradient shard is allocated
    if (keep_gradient && (!has_gradient_ || gradient_.numel() != range_.size())) {
      gradient_ = tensor(shape{range_.size()}, p.compute_type(), s);
      gradient_zero_ = true;
      has_gradient_ = true;
    }
  }
  /// Holds `p` whole again: `whole` (its numel() fp32 master values) replaces the range's under f16/bf16, copied
  /// in stream order on `s`; the range's gradient storage is kept for the next activate().
  void deactivate(parameter& p, const tensor_view& whole, stream_ref s) {
    if (keeps_masters()) {
      p.restore_values(whole, s);  // checks `whole` before anything changes
      masters_.set_stream(s);      // read by the gather that produced `whole`
      masters_ = tensor();
    }
    // ZeRO-3, f16/bf16: the working copy whole again, from the gathered values (which `s` comes after)
    if (shards_values() && !values_are_masters_) p.restore_working_copy(gathered_, s);
    active_ = false;
  }

  /// ZeRO-2: the factor for the gradient's old contents when adding a reduced gradient into it (0 when it is
  /// logically zero), marking it written.
  [[nodiscard]] float begin_accumulate() noexcept { return std::exchange(gradient_zero_, false) ? 0.0f : 1.0f; }
  void set_stale(bool stale) noexcept { stale_ = stale; }
  /// Whether the values must be gathered before they are read (set for all parameters at once, or by an update).
  [[nodiscard]] bool stale() const noexcept { return stale_; }
  /// ZeRO-3: where the whole values are gathered (an empty view: no longer held).
  void set_gathered(const tensor_view& values) noexcept { gathered_ = values; }
  /// Runs once, at the next read of the values (empty: nothing).
  void set_read_hook(std::function<void()> hook) { read_hook_ = std::move(hook); }
  /// Runs before the whole gradient's memory, logically zero, is first written (empty: nothing).
  void set_first_write_hook(std::function<void()> hook) { first_write_ = std::move(hook); }

 private:
  element_range range_;
  stream_ref compute_;  // the stream the wrapper computes on (an update is ordered there)
  bool active_ = false;
  bool keeps_masters_ = false;
  bool keeps_gradient_ = false;
  tensor masters_;
  tensor gradient_;
  bool has_gradient_ = false;
  bool gradient_zero_ = true;
  bool stale_ = false;
  bool shards_values_ = false;       // ZeRO-3
  bool values_are_masters_ = false;  // ZeRO-3 under f32: the master values are the values shard's
  tensor_view shard_values_;         // ZeRO-3: the range's values, in the bucket's values shard
  std::shared_ptr<const void> shard_owner_;  // keeps that shard alive
  tensor_view gathered_;             // ZeRO-3: the whole values, while the wrapper holds them gathered
  std::function<void()> read_hook_;
  std::function<void()> first_write_;
};

LOCKSTEP_DETAIL_END
