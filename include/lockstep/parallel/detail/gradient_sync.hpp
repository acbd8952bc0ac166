// lockstep/parallel/detail/gradient_sync.hpp — how a synchronized backward sums the gradients over the ranks,
// bucket by bucket: a bucket is launched (packed, then its collective queued on the communication stream) as
// soon as its parameters' gradients, and the buckets before it, are complete, so that communication overlaps
// the rest of backward (on a host device whose collectives run on the compute stream, host_collectives.hpp, they
// run in its order instead); at the end each bucket is finished (its collective waited for, its result unpacked or
// rounded) in stream order on the context's stream. One sync_kind per backward (bucket_plan.hpp), one switch to
// launch and one to finish.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/nn/deterministic.hpp"
#include "lockstep/parallel/detail/ddp_replica.hpp"
#include "lockstep/parallel/detail/exact_partials.hpp"
#include "lockstep/parallel/detail/gathered_values.hpp"
#include "lockstep/parallel/detail/zero_shards.hpp"
#include "lockstep/parallel/timeline.hpp"

LOCKSTEP_DETAIL_BEGIN

class gradient_sync {
 public:
  /// `op`: sum or mean over the ranks; `partials`, `shards` and `values` are the replica's other parts (exact
  /// partials in deterministic mode, ZeRO's shards when sharded, ZeRO-3's layer-by-layer values); collectives are
  /// timed on `t`.
  gradient_sync(ddp_replica& r, reduce_op op, exact_partials& partials, zero_shards& shards, gathered_values& values,
                timeline& t)
      : r_(&r), op_(op), partials_(&partials), shards_(&shards), values_(&values), timeline_(&t),
        reported_(r.params.size(), false) {}

  /// How this backward sums gradients (after exact_partials::begin_backward decided whether it gathers).
  [[nodiscard]] sync_kind kind() const noexcept {
    if (partials_->gathering()) return sync_kind::exact_gathered;
    if (r_->deterministic) return sync_kind::exact_words;  // under ZeRO too: the words are all-reduced
    return r_->sharded ? sync_kind::reduce_scatter : sync_kind::all_reduce;
  }

  /// Buckets whose collectives were queued this backward.
  [[nodiscard]] std::size_t launched() const noexcept { return next_launch_; }

  /// ZeRO with f16/bf16 gradients on a communicator that adds them in their type (NCCL: reduces_in_f32() is
  /// false): allocates the f32 buffer their buckets are reduce-scattered in (the largest such bucket, plus a
  /// shard for the result), on the communication stream. Nothing otherwise.
  void create_staging() {
    if (!r_->sharded || r_->deterministic || r_->comm.reduces_in_f32()) return;
    std::size_t n = 0;
    for (const auto& b : r_->buckets) {
      if (b.layout.wire != dtype::f32) n = std::max(n, b.layout.elements + b.layout.shard_elements);
    }
    if (n > 0) staging_ = tensor(shape{static_cast<std::int64_t>(n)}, dtype::f32, r_->comm_stream);
  }
  /// Bytes of the f32 staging buffer (create_staging).
  [[nodiscard]] std::uint64_t staging_bytes() const noexcept { return staging_.capacity_bytes(); }

  /// The compute bracket open during the model's backward when the collectives run on the compute stream (null
  /// otherwise): a collective launched inside it closes it and opens it again after, so that its time is counted as
  /// communication only.
  void set_compute_bracket(timeline* t) noexcept { compute_ = t; }

  /// Before a synchronized backward: no bucket ready, none launched.
  void begin() {
    for (auto& b : r_->buckets) b.ready = 0;
    next_launch_ = 0;
    std::fill(reported_.begin(), reported_.end(), false);
  }

  /// The context's gradients-ready hook: counts the parameters whose gradients are complete and launches the
  /// longest ready prefix of buckets. Buckets go in bucket order, whatever order backward finishes them in
  /// (another graph order, an unused parameter, a rank without data): every rank must issue the same
  /// collectives in the same order, so a bucket that is ready early waits for the ones before it.
  void gradients_ready(std::span<parameter* const> ps) {
    for (parameter* p : ps) {
      auto it = r_->index.find(p);
      if (it == r_->index.end() || reported_[it->second]) continue;  // nested containers may report twice
      reported_[it->second] = true;
      ++r_->buckets[r_->bucket_of[it->second]].ready;
    }
    auto& buckets = r_->buckets;
    while (next_launch_ < buckets.size() && buckets[next_launch_].ready == buckets[next_launch_].layout.params.size()) {
      launch(next_launch_++);
    }
  }

  /// After backward: buckets whose parameters received no gradient (unused parameters, or no data on this rank)
  /// go now, with zeros where nothing was written (every rank must take part in every collective, in bucket
  /// order); then every bucket is finished.
  void finish() {
    while (next_launch_ < r_->buckets.size()) launch(next_launch_++);
    const stream_ref s = r_->compute_stream();
    const sync_kind k = kind();
    for (auto& b : r_->buckets) {
      s.wait(*b.done);
      switch (k) {
        case sync_kind::exact_gathered:
          partials_->sum(b);
          break;
        case sync_kind::exact_words:
          if (r_->reused_buffers) break;  // ZeRO-2 rounded its shards in copy_out
          // under ZeRO-1 the shard alone: the optimizer, the scaler and the clipper read nothing else
          for (std::size_t i = 0; i < b.layout.params.size(); ++i) {
            parameter& p = r_->param(b, i);
            round_exact_gradient(p, p.shard(), p.grad_shard(), s);
          }
          break;
        case sync_kind::all_reduce:  // gradients that travelled in another type go back into their own
          for (std::size_t i = 0; i < b.layout.params.size(); ++i) {
            if (!r_->in_place(b, i)) convert_floating(r_->slot(b, i), r_->param(b, i).grad(), s);
          }
          break;
        case sync_kind::reduce_scatter:  // each parameter's shard of the gradient is the reduced range, in place
          break;
      }
    }
  }

 private:
  // Packs bucket `index`'s gradients (in stream order after the backward work that wrote them), then queues its
  // collective on the communication stream.
  void launch(std::size_t index) {
    ddp_bucket& b = r_->buckets[index];
    const bucket_layout& l = b.layout;
    const stream_ref s = r_->compute_stream(), cs = r_->comm_stream;
    const sync_kind k = kind();
    for (std::size_t i = 0; i < l.params.size(); ++i) {
      parameter& p = r_->param(b, i);
      if (k == sync_kind::exact_gathered) {
        exact_partials::contribute_zeros(p, s);
        continue;
      }
      p.materialize_full_grad(s);
      if (!r_->in_place(b, i)) convert_floating(p.grad(), r_->slot(b, i), s);
    }
    r_->after(cs, s);
    if (compute_ != nullptr) compute_->end(s);
    timeline_->begin(phase::communication, cs);
    switch (k) {
      case sync_kind::exact_gathered:
        partials_->collect(b, cs);
        break;
      case sync_kind::reduce_scatter:  // this rank's range of the buffer receives the sum of everyone's
        reduce_scatter(b, cs);
        break;
      case sync_kind::exact_words:
      case sync_kind::all_reduce:
        r_->comm.all_reduce(b.flat->data(), b.flat->data(), l.elements, l.wire, op_, cs);
        break;
    }
    timeline_->end(cs);
    if (r_->reused_buffers) shards_->copy_out(b);
    b.done->record(cs);
    values_->after_launch(index);  // ZeRO-3, layer by layer: b's values freed, b + 2's gathered
    if (compute_ != nullptr) compute_->begin(phase::compute, s);
  }

  // ZeRO: this rank's range of bucket b's buffer receives the sum of every rank's, on `cs`. In place, in the
  // gradients' type, when the communicator sums in f32 (f32 gradients; host cliques and MPI widen f16/bf16 and
  // round once). Otherwise (f16/bf16 on NCCL) the bucket is widened into the f32 staging buffer, reduce-scattered
  // there (out of place) and this rank's range rounded back into the bucket once: DDP's fp32 sum and cast, not a
  // rounding at every step of NCCL's ring. The staging buffer serves one bucket after the other, in order on `cs`.
  void reduce_scatter(ddp_bucket& b, stream_ref cs) {
    const bucket_layout& l = b.layout;
    const std::size_t at = l.rank_offset(r_->comm.rank());
    if (l.wire == dtype::f32 || staging_.empty()) {
      r_->comm.reduce_scatter(b.flat->data(), static_cast<std::byte*>(b.flat->data()) + at * size_of(l.wire),
                              l.shard_elements, l.wire, op_, cs);
      return;
    }
    const auto n = static_cast<std::int64_t>(l.elements);
    const auto m = static_cast<std::int64_t>(l.shard_elements);
    const tensor_view grads(b.flat->data(), l.wire, shape{n}, r_->get_device());
    const tensor_view wide(staging_.data(), dtype::f32, shape{n + m}, r_->get_device());
    const element_range whole{0, n}, mine{static_cast<std::int64_t>(at), static_cast<std::int64_t>(at) + m},
        result{n, n + m};
    convert_floating(grads, flat_part(wide, whole), cs);
    r_->comm.reduce_scatter(wide.data(), flat_part(wide, result).data(), l.shard_elements, dtype::f32, op_, cs);
    convert_floating(flat_part(wide, result), flat_part(grads, mine), cs);
  }

  ddp_replica* r_;
  reduce_op op_;
  exact_partials* partials_;
  zero_shards* shards_;
  gathered_values* values_;
  timeline* timeline_;
  timeline* compute_ = nullptr;  // set_compute_bracket
  std::vector<bool> reported_;   // this backward: parameters whose gradients were reported complete
  std::size_t next_launch_ = 0;  // the next bucket to launch, in bucket order
  tensor staging_;               // ZeRO, f16/bf16 on NCCL: the f32 buffer of their reduce-scatters (create_staging)
};

LOCKSTEP_DETAIL_END
