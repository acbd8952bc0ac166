// lockstep/parallel/detail/exact_partials.hpp — deterministic mode's second way of summing gradients over the
// ranks: instead of all-reducing exact accumulators (i64 words, four times the gradients' bytes), every rank's
// chunks' partial gradients are gathered and each gradient is the exact sum of all of them, rounded once. The
// bits are the same either way (both are the correctly rounded exact sum of the chunks' partials); gathering is
// chosen when it moves fewer bytes, and only when every rank can decide it alike (see begin_backward).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "lockstep/comm/coalesced.hpp"
#include "lockstep/config.hpp"
#include "lockstep/nn/deterministic.hpp"
#include "lockstep/parallel/detail/ddp_replica.hpp"

LOCKSTEP_DETAIL_BEGIN

class exact_partials {
 public:
  explicit exact_partials(ddp_replica& r) noexcept : r_(&r) {}

  /// Before a backward (deterministic mode): decides whether it gathers partial gradients, and tells the
  /// parameters where they go. Every rank must decide alike, so the decision rests on what every rank has: the
  /// global batch (context::set_global_rows), the world size, the buckets, whether no_sync() backward calls came
  /// before (`accumulated`: every rank makes them, with rows or not, and this backward adds to their exact sums),
  /// and the gradients being zero (zero_grad, which every rank calls; after a synchronized backward every rank's
  /// are written). It gathers when every rank's slots (as many as the most chunks a rank holds,
  /// deterministic_shard) fit in the memory of the bucket's accumulators. When it does not gather, buffers a
  /// gathered step left dirty are zeroed again (the i64 all-reduce then adds zeros in their padding).
  void begin_backward(bool syncing, bool accumulated) {
    if (gathering()) set_targets(0);  // a backward that threw may have left the targets set
    if (syncing) start(accumulated);
    if (r_->deterministic && !gathering() && std::exchange(dirty_, false)) {
      for (const auto& b : r_->buckets) fill_zero(b.flat->bytes(), r_->compute_stream());
    }
    dirty_ = dirty_ || gathering();
  }
  /// After a backward: the parameters' targets back to their exact accumulators.
  void end_backward() {
    if (gathering()) set_targets(0);
  }
  /// Whether this backward gathers partial gradients.
  [[nodiscard]] bool gathering() const noexcept { return slots_ != 0; }

  /// A parameter backward did not reach contributes zeros (in stream order on `s`).
  static void contribute_zeros(parameter& p, stream_ref s) {
    if (!p.grad_is_zero()) return;
    (void)p.begin_accumulate();
    zero_partials_slots(p, 0, s);
    p.set_exact_grad_holds_sum(true);
  }

  /// The collective of bucket b, on `s`: all_reduce_exact sums every rank's slots and rounds them into the
  /// gradients (the bucket's `grads`); otherwise every rank's slots are all-gathered (in place: this rank's are at
  /// its offset) for sum().
  void collect(ddp_bucket& b, stream_ref s) const {
    const bucket_layout& l = b.layout;
    if (r_->exact_collective) {
      r_->comm.all_reduce_exact(b.flat->data(), static_cast<std::size_t>(slots_), l.value_elements, b.grads->data(),
                                l.value_elements, l.value_type, l.exact_ends, s);
      return;
    }
    const std::size_t piece = static_cast<std::size_t>(slots_) * l.value_elements;
    r_->comm.all_gather(static_cast<std::byte*>(b.flat->data()) +
                            static_cast<std::size_t>(r_->comm.rank()) * piece * size_of(l.value_type),
                        b.flat->data(), piece, l.value_type, s);
  }

  /// After collect(): each gradient of bucket b the exact sum of every rank's slots, rounded once (in stream
  /// order on the context's stream).
  void sum(const ddp_bucket& b) const {
    const stream_ref s = r_->compute_stream();
    const bucket_layout& l = b.layout;
    if (!r_->exact_collective) fill_zero(b.outside->bytes(), s);
    const auto terms = static_cast<std::size_t>(slots_ * r_->comm.size());
    for (std::size_t i = 0; i < l.params.size(); ++i) {
      parameter& p = r_->param(b, i);
      const auto n = static_cast<std::size_t>(p.numel());
      if (n == 0) continue;
      expect_exact_gradient(p);  // its slots were written by exact_gradient (or zeroed by contribute_zeros)
      p.set_exact_grad_holds_sum(false);  // the slots are summed: a next backward without zero_grad is refused
      if (r_->exact_collective) continue;  // all_reduce_exact summed them
      dispatch_floating(l.value_type, "exact gradient sum", [&]<class T>() {
        const T* partials = static_cast<const T*>(b.flat->data()) + l.value_offsets[i];  // [world * slots][elements]
        sum_exact_terms<T>(partials, terms, l.value_elements, n, p.grad().as<T>(), b.outside->template as<std::int64_t>() + i, s);
      });
    }
  }

 private:
  void start(bool accumulated) {
    const context& ctx = *r_->ctx;
    if (!r_->deterministic || r_->sharded || accumulated || ctx.global_rows() == 0) return;
    const std::int64_t cr = ctx.deterministic()->chunk_rows, world = r_->comm.size();
    // rank 0 holds the most chunks of any rank
    const std::int64_t slots = (deterministic_shard(ctx.global_rows(), cr, 0, r_->comm.size()).rows + cr - 1) / cr;
    // (see bucket_plan; all_reduce_exact reads every rank's slots where they are: a bucket holds its own only)
    const std::int64_t held = r_->exact_collective ? slots : world * slots;
    for (const auto& b : r_->buckets) {
      if (static_cast<std::size_t>(held) * size_of(b.layout.value_type) > 16) return;
    }
    for (const auto& p : r_->params) {
      if (!p.param->grad_is_zero()) return;
    }
    set_targets(slots);
  }

  // Tells every parameter where this backward's partial gradients go: its values' place in this rank's `slots`
  // slots of its bucket (each slot one bucket of values, in the values' layout); with 0, the exact accumulators.
  void set_targets(std::int64_t slots) {
    for (const auto& b : r_->buckets) {
      const bucket_layout& l = b.layout;
      const std::size_t es = size_of(l.value_type);
      const std::int64_t first = r_->exact_collective ? 0 : r_->comm.rank() * slots;  // an all-gather's place for this rank
      auto* mine = static_cast<std::byte*>(b.flat->data()) + static_cast<std::size_t>(first) * l.value_elements * es;
      for (std::size_t i = 0; i < l.params.size(); ++i) {
        r_->param(b, i).set_exact_partials_target(
            slots == 0 ? parameter::exact_partials{}
                       : parameter::exact_partials{mine + l.value_offsets[i] * es, static_cast<std::int64_t>(l.value_elements), slots});
      }
    }
    slots_ = slots;
  }

  ddp_replica* r_;
  std::int64_t slots_ = 0;  // each rank's slots of partial gradients while a backward gathers them (else 0)
  bool dirty_ = false;      // partial gradients were gathered in the buckets since they were last zeroed
};

LOCKSTEP_DETAIL_END
