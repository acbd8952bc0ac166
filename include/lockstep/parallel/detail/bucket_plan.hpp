// lockstep/parallel/detail/bucket_plan.hpp — the layout of DDP's gradient buckets: which parameters go in which
// bucket, where each one's gradient (or exact accumulator) and values sit, and each rank's shard. Pure
// arithmetic: no memory, no communication, no hooks, so that it can be tested alone.
//
// Parameters go into buckets in reverse model order (the order backward produces their gradients); a bucket
// closes when the next parameter would take it past its byte limit (the first bucket's limit is smaller, so that
// communication starts early) or changes the type on the wire (or, with shards or exact sums, the values' type);
// with whole units (ZeRO-3 gathering layer by layer) a layer's parameters stay in one bucket however many bytes they
// take, and a bucket closes between layers once it holds the first bucket's limit, so that the values gathered at
// a time are a layer's, or a few small layers' (DeepSpeed's prefetch bucket).
// Two layouts per bucket: the buffer the collective reads (`offsets`, `elements`, in `wire` elements) and the
// values' layout in their compute type (`value_offsets`, `value_elements`; ZeRO's shards and gathered values
// use it). Every tensor starts at a 256-byte boundary, as cudaMalloc's allocations do. Under ZeRO the values'
// layout is padded so that each of the world's ranks owns a range of the same size.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/kernels/exact.hpp"
#include "lockstep/nn/parameter.hpp"

LOCKSTEP_DETAIL_BEGIN

/// What the plan needs to know of a parameter.
struct planned_parameter {
  std::int64_t numel = 0;
  dtype compute_type = dtype::f32;
  std::size_t unit = 0;  // the layer it belongs to (with bucket_plan_options::whole_units)
};

/// How a bucket's gradients are summed over the ranks (one per bucket kind; parallel/detail/gradient_sync.hpp).
enum class sync_kind : std::uint8_t {
  all_reduce,      // the gradients (in `wire`), summed in place on every rank: DDP
  reduce_scatter,  // the gradients, each rank receiving the sum of its range only: ZeRO-1/2
  exact_words,     // deterministic mode: exact accumulators (i64 words), all-reduced as integers
  exact_gathered,  // deterministic mode: the chunks' partial gradients gathered and summed exactly
};

/// The inputs of a plan other than the parameters.
struct bucket_plan_options {
  std::size_t bucket_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  bool deterministic = false;  // exact accumulators (i64 words) travel instead of gradients
  bool own_type = false;       // gradients travel in their own type (ZeRO asked for, even on one rank)
  bool sharded = false;        // ZeRO-1/2 on more than one rank: reduce-scatter into equal ranges
  bool reused_buffers = false; // ZeRO-2: the buckets take turns in two buffers
  bool exact_collective = false;  // the communicator sums exact partials itself (all_reduce_exact)
  bool whole_units = false;       // ZeRO-3's layer-by-layer gathers: a bucket closes only between units, and at
                                  // the first one after first_bucket_bytes
  int world = 1;
};

/// One bucket's layout.
struct bucket_layout {
  static constexpr std::size_t alignment = 256;  // bytes, as cudaMalloc's

  std::vector<std::size_t> params;   // indices into the plan's parameters, in the order backward reaches them
  std::vector<std::size_t> offsets;  // element offset of each parameter's gradient (or accumulator) in the buffer
  std::size_t elements = 0;          // of the buffer the collective reads, padding included
  dtype wire = dtype::f32;           // the buffer's element type
  std::vector<std::size_t> value_offsets;  // each parameter's place in the values' layout
  std::size_t value_elements = 0;
  dtype value_type = dtype::f32;     // the parameters' compute type
  std::size_t shard_elements = 0;    // ZeRO: value_elements / world, each rank's range
  std::size_t buffer_elements = 0;   // `wire` elements to allocate for the buffer (not under reused_buffers)
  // deterministic mode with all_reduce_exact: the ends of the tensors the collective sums (each parameter's
  // values, then its padding)
  std::vector<std::size_t> exact_ends;

  /// The first element of `rank`'s range (ZeRO).
  [[nodiscard]] std::size_t rank_offset(int rank) const noexcept { return static_cast<std::size_t>(rank) * shard_elements; }
  /// The elements of the i-th parameter (of `numel` elements) that fall in `rank`'s range (ZeRO).
  [[nodiscard]] element_range shard_of(std::size_t i, std::int64_t numel, int rank) const {
    const auto at = static_cast<std::int64_t>(value_offsets[i]);
    const auto first = static_cast<std::int64_t>(rank_offset(rank));
    const auto last = first + static_cast<std::int64_t>(shard_elements);
    const element_range r{std::clamp<std::int64_t>(first - at, 0, numel), std::clamp<std::int64_t>(last - at, 0, numel)};
    return r.empty() ? element_range{} : r;
  }
  /// ZeRO-2: the bytes of a reused buffer this bucket takes: its gradients (deterministic mode: its exact
  /// accumulators, then the whole gradients in the values' layout, at a 256-byte boundary).
  [[nodiscard]] std::size_t reused_bytes(bool deterministic) const noexcept {
    const std::size_t words = elements * size_of(wire);
    return deterministic ? round_up(words, alignment) + value_elements * size_of(value_type) : words;
  }
  /// ZeRO-2 in deterministic mode: the byte offset of the i-th parameter's whole gradient in the reused buffer.
  [[nodiscard]] std::size_t reused_grad_offset(std::size_t i) const noexcept {
    return round_up(elements * size_of(wire), alignment) + value_offsets[i] * size_of(value_type);
  }

  static constexpr std::size_t round_up(std::size_t n, std::size_t m) noexcept { return (n + m - 1) / m * m; }
};

/// The whole plan: the buckets, in the order they are reduced, and which bucket each parameter is in.
struct bucket_plan {
  std::vector<bucket_layout> buckets;
  std::vector<std::size_t> bucket_of;       // per parameter
  std::array<std::size_t, 2> reused_bytes{};  // ZeRO-2: the two buffers' sizes (bucket b uses buffer b % 2)
};

/// The type a gradient of type `grad` travels in: `hook` is the comm hook's type (f32 when none).
[[nodiscard]] inline dtype wire_type(dtype grad, const bucket_plan_options& o, dtype hook) noexcept {
  if (o.deterministic) return dtype::i64;  // exact accumulators (kernels/exact.hpp)
  if (o.own_type) return grad;             // in place, summed in fp32 (gradient_sync.hpp widens them for NCCL)
  return hook;
}

/// Plans the buckets of `params` (in model order). `hook`: the type gradients travel in without ZeRO or exact
/// sums (f32, or a comm hook's f16 / bf16).
[[nodiscard]] inline bucket_plan plan_buckets(const std::vector<planned_parameter>& params, const bucket_plan_options& o,
                                              dtype hook = dtype::f32) {
  constexpr std::size_t alignment = bucket_layout::alignment;
  const auto round_up = bucket_layout::round_up;
  bucket_plan plan;
  std::size_t limit = o.first_bucket_bytes;
  bucket_layout current;
  std::size_t bytes = 0;
  for (std::size_t k = params.size(); k-- > 0;) {
    const planned_parameter& p = params[k];
    const dtype wire = wire_type(p.compute_type, o, hook);
    const auto numel = static_cast<std::size_t>(p.numel);
    const std::size_t elements = o.deterministic ? kernels::exact_words(numel) : numel;
    // a bucket's size counts its gradients' values, as the partials travel in them (deterministic mode without
    // ZeRO: its 16-byte accumulators would make the first bucket a quarter as large, and then nothing overlaps
    // the backward of the model's first layers); ZeRO-2 sizes its reused buffers by the words
    const std::size_t n = o.deterministic && !o.sharded ? numel * size_of(p.compute_type) : elements * size_of(wire);
    const bool unit_ends = !o.whole_units || k + 1 == params.size() || params[k + 1].unit != p.unit;  // (k + 1: the one before)
    // by layer, a bucket also closes between layers once it holds first_bucket_bytes: what is gathered at a time
    const bool full = bytes + n > limit || (o.whole_units && bytes >= o.first_bucket_bytes);
    if (!current.params.empty() && ((unit_ends && full) || wire != current.wire ||
                                     ((o.sharded || o.deterministic) && p.compute_type != current.value_type))) {
      plan.buckets.push_back(std::move(current));
      current = bucket_layout{};
      bytes = 0;
      limit = o.bucket_bytes;
    }
    current.wire = wire;
    current.value_type = p.compute_type;
    current.params.push_back(k);
    current.offsets.push_back(current.elements);
    current.elements += round_up(elements, alignment / size_of(wire));
    current.value_offsets.push_back(current.value_elements);
    current.value_elements += round_up(numel, alignment / size_of(current.value_type));
    bytes += n;
  }
  if (!current.params.empty()) plan.buckets.push_back(std::move(current));
  const auto world = static_cast<std::size_t>(o.world);
  plan.bucket_of.assign(params.size(), 0);
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    bucket_layout& bk = plan.buckets[b];
    for (const std::size_t k : bk.params) plan.bucket_of[k] = b;
    if (o.sharded) {  // every rank's range the same size, at a 256-byte boundary
      bk.value_elements = round_up(bk.value_elements, world * (alignment / size_of(bk.value_type)));
      bk.shard_elements = bk.value_elements / world;
      // reduce-scattered in the values' layout; deterministic mode's words are all-reduced
      if (!o.deterministic) bk.elements = bk.value_elements;
    }
    // deterministic mode: room for the exact accumulators, or for the partial gradients gathered in their place
    // (16 bytes per value: as much as the accumulators, but for the values' alignment)
    bk.buffer_elements = o.deterministic && !o.sharded ? std::max(bk.elements, 2 * bk.value_elements) : bk.elements;
    if (o.reused_buffers) {
      plan.reused_bytes[b % 2] = std::max(plan.reused_bytes[b % 2], bk.reused_bytes(o.deterministic));
    }
    if (o.deterministic && !o.sharded && o.exact_collective) {
      for (std::size_t i = 0; i < bk.params.size(); ++i) {
        bk.exact_ends.push_back(bk.value_offsets[i] + static_cast<std::size_t>(params[bk.params[i]].numel));
        bk.exact_ends.push_back(i + 1 < bk.params.size() ? bk.value_offsets[i + 1] : bk.value_elements);
      }
    }
  }
  return plan;
}

LOCKSTEP_DETAIL_END
