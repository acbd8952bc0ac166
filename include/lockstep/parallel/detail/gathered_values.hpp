// lockstep/parallel/detail/gathered_values.hpp — ZeRO-3's values layer by layer (PyTorch FSDP's and DeepSpeed's
// schedule): instead of every bucket's whole values from forward to the end of backward, a device holds those of
// the layers at work and of the next bucket, gathered ahead (prefetched) while the current layers compute.
//
// It needs a model that reports its layers: graph and sequential tell the context's parameters_needed hook before
// each child's forward (nn/layer.hpp forward_and_report), and the buckets never split a child (bucket_plan.hpp's
// whole units). Buckets hold the layers in reverse order, so forward walks them from the last to the first:
// - forward starts with the last two buckets; a child reaching buckets [lo, hi] frees the buckets above hi (the
//   children before it are queued), but for buckets 0 and 1, which backward starts with, and gathers down to
//   lo - 1; at the end every bucket was gathered once, and buckets 0 and 1 are held;
// - backward walks them from the first: when bucket b's gradients are launched (its layers' backward is queued),
//   b is freed and b + 2 gathered, for the layers after.
// Every rank issues the same collectives in the same order, whatever its rows and timing: forward's gathers go
// from the last bucket to the first (the reports only decide when), backward's follow the launches, which go in
// bucket order on every rank (a rank without rows launches them all at the end of its backward). A rank that calls
// backward without a training forward first issues the forward's gathers (so every forward through the wrapper, an
// evaluation's too, is one every rank makes; such a rank must not consolidate between the others' forward and
// backward: it calls forward on its empty batch then). Any other model (a layer of the user's own, which
// reports nothing) is gathered whole before forward, as is a model held whole and current
// (gather_parameters(): no collective then, so that one rank may run it alone).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/parallel/detail/ddp_replica.hpp"
#include "lockstep/parallel/detail/zero_shards.hpp"
#include "lockstep/parallel/timeline.hpp"

LOCKSTEP_DETAIL_BEGIN

class gathered_values {
 public:
  /// The replica's values, gathered through `shards`, the collectives timed on `t`.
  gathered_values(ddp_replica& r, zero_shards& shards, timeline& t) : r_(&r), shards_(&shards), timeline_(&t) {}

  /// At construction: the model reports its layers (graph, sequential), and the buckets keep them whole.
  void enable() noexcept { enabled_ = true; }

  /// The bracket of computing time open around the model's forward when the collectives run on the compute
  /// stream (null otherwise): a gather queued inside it closes it and opens it again after.
  void set_compute_bracket(timeline* t) noexcept { compute_ = t; }

  /// Before a forward: under ZeRO-3 with a model that reports its layers, and values not held whole and current,
  /// starts gathering layer by layer (returns true: the forward reports its layers to needed(), and end_forward()
  /// follows). Otherwise, under ZeRO, gathers whole as before (zero_shards::gather, a no-op when nothing changed).
  bool begin_forward() {
    forwarded_ = forwarded_ || r_->ctx->training();  // (an evaluation's forward is not the step's: see before_backward)
    if (!r_->sharded) return false;  // (nothing to gather)
    if (!enabled_ || !r_->values_sharded || shards_->consolidated() || shards_->held_whole()) {
      shards_->gather(*timeline_);
      streaming_ = false;
      return false;
    }
    r_->check_communication();
    release_from(0);  // what a forward without a backward left (an evaluation): start again, as every rank does
    streaming_ = true;
    lowest_ = r_->buckets.size();
    gather_down_to(lowest_ >= 2 ? lowest_ - 2 : 0);
    return true;
  }

  /// The context's parameters_needed hook during a layer-by-layer forward: the buckets of `ps` and the next one
  /// gathered, those of the layers before freed.
  void needed(std::span<parameter* const> ps) {
    std::size_t lo = r_->buckets.size(), hi = 0;
    for (parameter* p : ps) {
      const auto it = r_->index.find(p);
      if (it == r_->index.end()) continue;
      const std::size_t b = r_->bucket_of[it->second];
      lo = std::min(lo, b);
      hi = std::max(hi, b);
    }
    if (lo > hi) return;  // none of the wrapper's
    release_from(std::max<std::size_t>(hi + 1, 2));  // (buckets 0 and 1 stay: backward starts with them)
    gather_down_to(lo > 0 ? lo - 1 : 0);
  }

  /// After a layer-by-layer forward: every bucket gathered once (also those of layers it did not reach), buckets 0
  /// and 1 held for backward's first layers, the others freed.
  void end_forward() {
    gather_down_to(0);
    release_from(2);
  }

  /// At the start of backward: a rank that called no training forward since the last backward (a rank without
  /// rows) issues the forward's gathers, as the other ranks' forward did, and is left as a forward would leave it
  /// (as every rank counts the rows in a training forward only: an evaluation's forward through the wrapper is one
  /// every rank makes). After a forward, the values backward starts with are gathered again if something freed them
  /// between (a consolidation, on every rank); a model gathered whole is gathered if it is not held (a no-op else).
  void before_backward() {
    if (!forwarded_) {
      if (begin_forward()) end_forward();
      return;
    }
    if (!streaming_) {
      if (r_->sharded) shards_->gather(*timeline_);
      return;
    }
    const std::size_t first = std::min<std::size_t>(2, r_->buckets.size());
    bool held = true;
    for (std::size_t b = 0; b < first; ++b) held = held && shards_->held(b);
    if (held) return;
    release_from(0);
    lowest_ = first;
    gather_down_to(0);
  }

  /// In a layer-by-layer backward, after bucket b's collective was queued: its layers' backward is queued, so b is
  /// freed, and bucket b + 2 gathered for the layers after b + 1.
  void after_launch(std::size_t b) {
    if (!streaming_) return;
    shards_->release_bucket(b);
    if (b + 2 < r_->buckets.size()) shards_->gather_bucket(b + 2, *timeline_);
  }

  /// After a synchronized backward (which frees every bucket: zero_shards::mark_updated).
  void end_backward() noexcept {
    streaming_ = false;
    forwarded_ = false;
  }

 private:
  // Gathers the buckets from lowest_ - 1 down to `target`, in that order.
  void gather_down_to(std::size_t target) {
    while (lowest_ > target) {
      const stream_ref s = r_->compute_stream();
      if (compute_ != nullptr) compute_->end(s);
      shards_->gather_bucket(--lowest_, *timeline_);
      if (compute_ != nullptr) compute_->begin(phase::compute, s);
    }
  }
  // Frees the buckets from `first` up.
  void release_from(std::size_t first) {
    for (std::size_t b = first; b < r_->buckets.size(); ++b) shards_->release_bucket(b);
  }

  ddp_replica* r_;
  zero_shards* shards_;
  timeline* timeline_;
  timeline* compute_ = nullptr;  // set_compute_bracket
  bool enabled_ = false;         // the model reports its layers, the buckets keep them whole
  bool streaming_ = false;       // this forward and backward gather layer by layer
  bool forwarded_ = false;       // a forward since the last synchronized backward
  std::size_t lowest_ = 0;       // layer by layer: the lowest bucket gathered in this forward
};

/// ZeRO-3: the layer (a child of a graph or sequential, which report their children's forward: parameter_units) of
/// each parameter of `model`, in the order of parameters_of(model); empty for a model of another kind, gathered whole.
template <class Model>
std::vector<std::size_t> layer_of_each_parameter(Model& model) {
  std::vector<std::size_t> layer;
  if constexpr (requires(Model& m) { { m.parameter_units() } -> std::same_as<std::vector<std::size_t>>; }) {
    const std::vector<std::size_t> units = model.parameter_units();
    for (std::size_t u = 0; u < units.size(); ++u) layer.insert(layer.end(), units[u], u);
    if (layer.size() != parameters_of(model).size()) layer.clear();  // (a container that reports otherwise)
  }
  return layer;
}

/// While it lives (the model's forward), the context reports each layer's parameters to `values` (null: nothing
/// to do); `bracket` is the compute time's bracket when the collectives share the compute stream (else null).
class layer_gathers {
 public:
  layer_gathers(gathered_values* values, context& ctx, timeline* bracket) : values_(values), ctx_(&ctx) {
    if (values_ == nullptr) return;
    values_->set_compute_bracket(bracket);
    ctx.set_parameters_needed_hook([v = values_](std::span<parameter* const> ps) { v->needed(ps); });
  }
  layer_gathers(const layer_gathers&) = delete;
  layer_gathers& operator=(const layer_gathers&) = delete;
  ~layer_gathers() {
    if (values_ == nullptr) return;
    ctx_->set_parameters_needed_hook(nullptr);
    values_->set_compute_bracket(nullptr);
  }

 private:
  gathered_values* values_;
  context* ctx_;
};

LOCKSTEP_DETAIL_END
