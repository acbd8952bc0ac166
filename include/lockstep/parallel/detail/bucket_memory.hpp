// lockstep/parallel/detail/bucket_memory.hpp — the memory behind distributed_data_parallel's buckets: the layout
// (bucket_plan.hpp) allocated, every parameter's gradient (and, under ZeRO, its values) placed in it, ZeRO's shards
// taken once every bucket exists; and the bytes the rank then holds for parameters and gradients (its report).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/parallel/detail/bucket_plan.hpp"
#include "lockstep/parallel/detail/ddp_replica.hpp"
#include "lockstep/parallel/detail/gradient_sync.hpp"
#include "lockstep/parallel/detail/zero_shards.hpp"
#include "lockstep/runtime/memory.hpp"

LOCKSTEP_DETAIL_BEGIN

/// ZeRO-2 in deterministic mode: where the i-th parameter's whole gradient goes in bucket b's reused buffer.
[[nodiscard]] inline tensor_view reused_grad_slot(const ddp_replica& r, const ddp_bucket& b, std::size_t i) {
  return tensor_view(static_cast<std::byte*>(b.flat->data()) + b.layout.reused_grad_offset(i), b.layout.value_type,
                     r.param(b, i).dims(), r.get_device());
}

/// The buckets of `plan`, their parameters' gradients (and, under ZeRO, values) placed in them.
inline void allocate_buckets(ddp_replica& r, zero_shards& shards, const gradient_sync& sync, bucket_plan& plan) {
  const stream_ref s = r.compute_stream();
  // The pool's cached blocks (the model's initialization staging, say) go back first, so that the buckets
  // (allocated once, for the whole run) are not served by larger cached blocks; see build_buckets. (It waits for
  // the frees still pending on streams.)
  release_cached_memory(r.get_device());
  if (r.reused_buffers) shards.create_reused_buffers(plan);
  r.buckets.resize(plan.buckets.size());
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    ddp_bucket& bk = r.buckets[b];
    bk.layout = std::move(plan.buckets[b]);
    const bucket_layout& l = bk.layout;
    if (r.reused_buffers) {
      bk.flat = shards.reused_buffer(b);
      bk.released.emplace(r.get_device());
    } else {
      bk.flat = std::make_shared<tensor>(shape{static_cast<std::int64_t>(l.buffer_elements)}, l.wire, s);
      fill_zero(bk.flat->bytes(), s);  // the padding between gradients stays zero
    }
    if (r.sharded) shards.create_values(bk);
    bk.done.emplace(r.get_device());
    if (r.deterministic) {
      bk.outside = std::make_shared<tensor>(shape{static_cast<std::int64_t>(l.params.size())}, dtype::i64, s);
    }
    if (!l.exact_ends.empty()) {  // one all_reduce_exact per bucket (exact_partials::collect)
      bk.grads = std::make_shared<tensor>(shape{static_cast<std::int64_t>(l.value_elements)}, l.value_type, s);
      fill_zero(bk.grads->bytes(), s);
    }
    for (std::size_t i = 0; i < l.params.size(); ++i) {
      parameter& p = r.param(bk, i);
      if (bk.grads) p.share_grad_storage(r.value_slot(bk, i, *bk.grads), bk.grads, s);
      if (r.deterministic) {
        p.share_exact_storage(r.slot(bk, i), bk.flat);
        // ZeRO-2: the whole gradient (only ever zeroed: the sums are rounded into the shard) after the words
        if (r.reused_buffers) p.share_grad_storage(reused_grad_slot(r, bk, i), bk.flat, s);
      } else if (p.compute_type() == l.wire) {
        p.share_grad_storage(r.slot(bk, i), bk.flat, s);
      }
      if (r.sharded) {
        shards.place(bk, i);
        if (r.reused_buffers) {
          shards.set_first_write_hook(l.params[i], [&shards, &sync, b] { shards.before_first_write(b, sync.launched()); });
        }
      }
    }
  }
}

/// The buckets' layout (bucket_plan.hpp, with `options`; `hook_type`: the type gradients travel in without ZeRO),
/// then their memory, and every parameter's gradient (and under ZeRO its values) placed in it; under ZeRO, the
/// parameters sharded last. `shards` and `sync` are r's parts (ZeRO-2's first-write hooks call them). `units`: each
/// parameter's layer (with options.whole_units), or empty.
inline void build_buckets(ddp_replica& r, zero_shards& shards, gradient_sync& sync, const bucket_plan_options& options,
                          dtype hook_type, std::span<const std::size_t> units = {}) {
  const stream_ref s = r.compute_stream();
  std::vector<planned_parameter> planned;
  for (std::size_t k = 0; k < r.params.size(); ++k) {
    const parameter& p = r.param(k);
    planned.push_back({p.numel(), p.compute_type(), units.empty() ? 0 : units[k]});
  }
  bucket_plan plan = plan_buckets(planned, options, hook_type);
  r.bucket_of = plan.bucket_of;
  // The model's gradients move into the buckets (most of them): their own memory goes first, so that the
  // buckets are never allocated beside it (ZeRO-2: buckets share buffers, so a gradient must start zero, its
  // first write then waiting for the buffer's previous bucket: what one held before the wrapper is dropped).
  // Those the buckets do not take get memory of their own again at the end, also when this throws.
  try {
    for (const auto& p : r.params) {
      if (r.reused_buffers) p.param->zero_grad();
      p.param->release_grad_memory(s);
    }
    allocate_buckets(r, shards, sync, plan);
  } catch (...) {
    try {
      for (const auto& p : r.params) p.param->restore_grad_memory(s);
    } catch (...) {  // (out of memory again: those left without refuse to accumulate, naming the parameter)
    }
    throw;
  }
  for (const auto& p : r.params) p.param->restore_grad_memory(s);
  sync.create_staging();  // ZeRO with f16/bf16 on NCCL: their reduce-scatters' f32 buffer
  // What the wrapper freed (gradients moved into buckets; under ZeRO the working copies, then the whole masters)
  // goes back to the device rather than staying cached in its pool, where a later allocation of another size
  // could take a block up to twice its size (host devices) and hold memory training does not need.
  release_cached_memory(r.get_device());
  if (r.sharded) {
    shards.shard_parameters();
    release_cached_memory(r.get_device());
  }
}

/// Bytes r holds for the parameters: the values forward reads (the working copies, or the master values under
/// f32) and the fp32 master values (under ZeRO and f16/bf16: the shard's).
[[nodiscard]] inline std::uint64_t parameter_bytes(const ddp_replica& r, const zero_shards& shards) {
  std::uint64_t n = 0;
  for (const auto& p : r.params) {
    const parameter& q = *p.param;
    const auto numel = static_cast<std::uint64_t>(q.numel());
    if (q.compute_type() == dtype::f32) {
      n += r.sharded ? 0 : 4 * numel;  // under ZeRO in the buckets' value buffers (or values shards), counted below
    } else {
      n += 4 * static_cast<std::uint64_t>(q.master_shard().numel()) + (r.sharded ? 0 : numel * size_of(q.compute_type()));
    }
  }
  return n + shards.values_bytes();
}

/// Bytes r holds for the gradients: the buckets (with their padding), gradients kept apart from them,
/// deterministic mode's accumulators, under ZeRO-2 the two reused buffers and the gradient shards, and under ZeRO
/// with f16/bf16 on NCCL the f32 buffer of their reduce-scatters.
[[nodiscard]] inline std::uint64_t gradient_bytes(const ddp_replica& r, const zero_shards& shards,
                                                  const gradient_sync& sync) {
  if (r.reused_buffers) return shards.reused_gradient_bytes() + sync.staging_bytes();
  std::uint64_t n = sync.staging_bytes();
  for (const auto& b : r.buckets) {
    n += b.flat->size_bytes();
    if (b.grads) {  // deterministic mode with all_reduce_exact: the gradients in a buffer of the bucket
      n += b.grads->size_bytes();
      continue;
    }
    for (std::size_t i = 0; i < b.layout.params.size(); ++i) {
      // deterministic mode: the buckets hold the accumulators, the gradients their own memory
      if (r.deterministic || !r.in_place(b, i)) n += static_cast<std::uint64_t>(r.param(b, i).grad().bytes().size());
    }
  }
  return n;
}

LOCKSTEP_DETAIL_END
