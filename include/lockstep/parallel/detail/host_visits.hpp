// lockstep/parallel/detail/host_visits.hpp — under ZeRO, the whole fp32 master values and optimizer state streamed
// to the host for checkpoints and weights_sha256 (distributed_data_parallel::visit_whole_state, visit_master_values)
// without a whole tensor, or a whole bucket, on any device: each bucket is gathered in chunks through one device
// buffer of every rank's part of a chunk (ddp_options::visit_chunk_bytes), each chunk copied into a host image of the
// bucket, and the bucket's tensors are given from that image.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/parallel/detail/ddp_replica.hpp"
#include "lockstep/parallel/detail/zero_shards.hpp"

LOCKSTEP_DETAIL_BEGIN

/// Whole fp32 tensors from every rank's shards, into host memory (zero_shards::gather_chunks): for each parameter k
/// with wanted(k) (the same on every rank), piece(k) is its shard on this rank and take(k, values) receives all
/// numel() values (host memory, valid during the call), in ascending order of k. Each bucket's chunks of at most
/// `chunk_bytes` over all ranks go through one device buffer into a host image of the bucket, whose tensors are
/// given when it is whole. On the communication stream (the context's stream waits for it at the end). Collective.
template <class Wanted, class Piece, class Take>
void gather_to_host(ddp_replica& r, const zero_shards& shards, std::size_t chunk_bytes, Wanted&& wanted, Piece&& piece,
                    Take&& take) {
  const stream_ref s = r.comm_stream;
  const auto world = static_cast<std::size_t>(r.comm.size());
  std::size_t largest = 0;  // a rank's range in the largest bucket
  for (const auto& b : r.buckets) largest = std::max(largest, b.layout.shard_elements);
  const std::size_t chunk = std::max<std::size_t>(1, std::min(largest, chunk_bytes / sizeof(float) / world));
  tensor buffer(shape{static_cast<std::int64_t>(world * chunk)}, dtype::f32, s);
  std::vector<float> image;  // the bucket's values, in the values' layout
  try {
    shards.gather_chunks(
        chunk, wanted, piece,
        [&](const ddp_bucket& b) {
          image.resize(b.layout.value_elements);  // (every element arrives: the ranks' ranges cover the bucket)
          return buffer.span<float>();
        },
        [&](const ddp_bucket& b, std::size_t at, std::size_t n, device_span<const float> gathered) {
          const bucket_layout& l = b.layout;
          for (std::size_t q = 0; q < world; ++q) {
            const std::size_t to = l.rank_offset(static_cast<int>(q)) + at;  // rank q's part in the image
            copy(std::span<float>(image).subspan(to, n), gathered.subspan(q * n, n), s);
          }
          if (at + n < l.shard_elements) return;
          s.synchronize();  // the image is whole
          for (std::size_t i = l.params.size(); i-- > 0;) {  // ascending k
            const std::size_t k = l.params[i];
            if (wanted(k)) {
              take(k, std::span<const float>(image).subspan(l.value_offsets[i],
                                                            static_cast<std::size_t>(r.param(k).numel())));
            }
          }
        });
  } catch (...) {  // copies into the image may still be queued: they end before it does
    try {
      s.synchronize();
    } catch (...) {
    }
    throw;
  }
  r.after(r.compute_stream(), s);  // (the copies to the host waited for the reads already; this keeps the order explicit)
}

/// Calls take(k, values) for every parameter k, in order, with its whole fp32 master values in host memory (valid
/// during the call), through gather_to_host (the host holds one bucket's values at a time). Inside a
/// consolidation the values are whole already: read as they are.
template <class Take>
void visit_masters(ddp_replica& r, const zero_shards& shards, std::size_t chunk_bytes, Take&& take) {
  if (shards.consolidated()) {
    visit_values_on_host(r.params, r.compute_stream(), take);
    return;
  }
  r.check_communication();
  gather_to_host(r, shards, chunk_bytes, [](std::size_t) { return true; },
                 [&](std::size_t k) { return r.param(k).master_shard(); }, take);  // (in ascending order)
}

/// Calls take(p, which, values) for every parameter p with its whole fp32 master values (which ==
/// master_values_tensor) and with each of its optimizer state tensors (which = 0, 1), in host memory (valid during
/// the call), through gather_to_host: every optimizer state tensor of one index, then of the next, then the master
/// values (checkpoint_state::sharded). Collective. Every rank first materializes the optimizer's state (zeros before
/// the first step), so that every rank gathers the same tensors.
template <class Optimizer, class Take>
void visit_state(ddp_replica& r, zero_shards& shards, std::size_t chunk_bytes, Optimizer& opt, Take&& take) {
  if (shards.consolidated()) {
    visit_whole_state_as_held(r, opt, take);
    return;
  }
  r.check_communication();
  opt.materialize_state(r.compute_stream());
  const auto to_host = [&](auto&& wanted, auto&& piece, auto&& each) {
    gather_to_host(r, shards, chunk_bytes, wanted, piece, each);
  };
  shards.gather_state(opt, to_host, [&](std::size_t k, std::size_t, std::size_t, int which, std::span<const float> whole) {
    take(r.param(k), which, whole);
  });
  to_host([](std::size_t) { return true; }, [&](std::size_t k) { return r.param(k).master_shard(); },
          [&](std::size_t k, std::span<const float> whole) { take(r.param(k), master_values_tensor, whole); });
}

LOCKSTEP_DETAIL_END
