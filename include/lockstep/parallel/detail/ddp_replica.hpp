// lockstep/parallel/detail/ddp_replica.hpp — what every part of distributed_data_parallel reads: the rank's
// context, communicator and streams, the wrapped parameters, and the gradient buckets (their layout from
// bucket_plan.hpp and the memory behind it). The parts (gradient_sync, exact_partials, zero_shards) each keep
// their own state and reach the others' only through the wrapper.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/config.hpp"
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/parallel/detail/bucket_plan.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_DETAIL_BEGIN

/// A bucket: its layout and the memory behind it.
struct ddp_bucket {
  bucket_layout layout;
  std::shared_ptr<tensor> flat;   // what the collective reads (shared with the parameters whose gradients live in it)
  std::optional<event> done;      // its collective (and, under ZeRO-2, the copy out of it) finished
  std::size_t ready = 0;          // this backward: parameters whose gradients are complete
  // ZeRO
  std::shared_ptr<tensor> values;    // the values forward reads, in the values' layout (ZeRO-3: while gathered)
  std::shared_ptr<tensor> values_shard;  // ZeRO-3: the rank's range of them, what it gathers from
  std::optional<event> released;     // ZeRO-2: `flat` (a reused buffer) was reduced and copied out
  std::optional<event> gathered;     // `values` was all-gathered
  // deterministic mode: each parameter's count of partial gradients outside the exact window (gathered partials)
  std::shared_ptr<tensor> outside;
  // deterministic mode with all_reduce_exact: the gradients, in the values' layout
  std::shared_ptr<tensor> grads;
};

/// The rank's side of the wrapper, shared by its parts.
struct ddp_replica {
  ddp_replica(context& c, communicator_ref cm, stream_ref cs, parameter_list ps, bool det)
      : ctx(&c), comm(cm), comm_stream(cs), params(std::move(ps)), deterministic(det), handoff(c.get_device()) {
    for (std::size_t i = 0; i < params.size(); ++i) index.emplace(params[i].param, i);
  }

  context* ctx;
  communicator_ref comm;
  stream_ref comm_stream;
  parameter_list params;
  std::unordered_map<parameter*, std::size_t> index;
  std::vector<ddp_bucket> buckets;
  std::vector<std::size_t> bucket_of;  // per parameter
  bool deterministic;          // buckets of exact accumulators (nn/deterministic.hpp), rounded after the collective
  bool sharded = false;        // ZeRO on more than one rank
  bool reused_buffers = false; // ZeRO-2 and 3
  bool values_sharded = false; // ZeRO-3
  bool exact_collective = false;  // the communicator sums exact partials itself (all_reduce_exact)
  event handoff;               // orders one stream after the other's work so far (after())

  [[nodiscard]] stream_ref compute_stream() const noexcept { return ctx->stream(); }
  [[nodiscard]] device get_device() const noexcept { return ctx->get_device(); }
  [[nodiscard]] parameter& param(std::size_t k) const { return *params[k].param; }
  [[nodiscard]] parameter& param(const ddp_bucket& b, std::size_t i) const { return *params[b.layout.params[i]].param; }

  /// `waiter` waits for the work queued on `s` so far.
  void after(stream_ref waiter, stream_ref s) {
    handoff.record(s);
    waiter.wait(handoff);
  }

  /// A failed collective of an earlier step ends training here, on the calling thread, before another step is
  /// queued: the communicator's own failure (an abort, a timeout, NCCL's asynchronous error) or, on a host device,
  /// the error kept by the communication stream (which also failed the compute stream that waited for it).
  void check_communication() const {
    comm.check();
    if (comm_stream.get_device().is_host()) comm_stream.host_state().rethrow_if_failed();
  }

  /// Where the gradient (in deterministic mode: the exact accumulator) of the i-th parameter of bucket b goes in
  /// its buffer.
  [[nodiscard]] tensor_view slot(const ddp_bucket& b, std::size_t i) const {
    const parameter& p = param(b, i);
    const shape dims = deterministic ? shape{p.exact_words()} : p.dims();
    return tensor_view(static_cast<std::byte*>(b.flat->data()) + b.layout.offsets[i] * size_of(b.layout.wire),
                       b.layout.wire, dims, get_device());
  }
  /// Where the values of the i-th parameter of bucket b go in a buffer of the values' layout.
  [[nodiscard]] tensor_view value_slot(const ddp_bucket& b, std::size_t i, const tensor& buffer) const {
    return tensor_view(static_cast<std::byte*>(const_cast<void*>(buffer.data())) + b.layout.value_offsets[i] * size_of(buffer.type()),
                       buffer.type(), param(b, i).dims(), get_device());
  }
  /// Whether the i-th parameter's gradient (or exact accumulator) lives in bucket b's buffer (no copy needed).
  [[nodiscard]] bool in_place(const ddp_bucket& b, std::size_t i) const {
    const parameter& p = param(b, i);
    return (deterministic ? p.exact_grad() : p.grad()).data() == slot(b, i).data();
  }
};

/// Copies `from` into `to` (same number of elements), casting between floating types.
inline void convert_floating(const tensor_view& from, const tensor_view& to, stream_ref s) {
  dispatch_floating(from.type(), "ddp gradient", [&]<class F>() {
    dispatch_floating(to.type(), "ddp gradient", [&]<class T>() {
      const device_span<const F> src(from.span<F>());
      if constexpr (std::is_same_v<F, T>) {
        copy(to.span<T>(), src, s);
      } else {
        cast<T, F>(src, to.span<T>(), s);
      }
    });
  });
}

/// Calls f(group, index in group, parameter index in r.params) for every wrapped parameter for which `opt` holds
/// state (all of a group's state tensors exist once it has any).
template <class Optimizer, class F>
void for_each_state(const ddp_replica& r, Optimizer& opt, F&& f) {
  for (std::size_t g = 0; g < opt.group_count(); ++g) {
    if (!opt.has_state(g)) continue;
    const auto& ps = opt.params(g);
    for (std::size_t i = 0; i < ps.size(); ++i) {
      const auto it = r.index.find(ps[i]);
      if (it != r.index.end()) f(g, i, it->second);
    }
  }
}

/// zero_shards::visit_state where every rank holds the whole tensors (plain DDP, or inside a consolidation): each
/// read to the host as it is, one tensor at a time, on the context's stream.
template <class Optimizer, class Take>
void visit_whole_state_as_held(const ddp_replica& r, Optimizer& opt, Take&& take) {
  const stream_ref s = r.compute_stream();
  opt.materialize_state(s);
  visit_values_on_host(r.params, s, [&](std::size_t k, std::span<const float> v) { take(r.param(k), master_values_tensor, v); });
  for_each_state(r, opt, [&](std::size_t g, std::size_t i, std::size_t k) {
    for (int which = 0; which < Optimizer::state_count; ++which) {
      const std::vector<float> v = to_vector(opt.state(g, i, which).template span<const float>(), s);
      take(r.param(k), which, std::span<const float>(v));
    }
  });
}

LOCKSTEP_DETAIL_END
