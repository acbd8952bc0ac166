// lockstep/parallel/detail/host_visits.hpp — under ZeRO, the whole fp32 master values and optimizer state streamed
// to the host for checkpoints and weights_sha256 (distributed_data_parallel::visit_whole_state, visit_master_values)
// without a whole tensor, or a whole bucket, on any device: each bucket is gathered in chunks through one device
// buffer of every rank's part of a chunk (ddp_options::visit_chunk_bytes), each chunk copied into a host image of the
// bucket, and the bucket's tensors are given from that image.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/parallel/detail/ddp_replica.hpp"
#include "lockstep/parallel/detail/zero_shards.hpp"

LOCKSTEP_DETAIL_BEGIN

/// Whole fp32 tensors from every rank's shards, into host memory: for each parameter k with wanted(k) (the same on
/// every rank), piece(k) is its shard on this rank (shards.range(k).size() floats) and take(k, values) receives all
/// numel() values (host memory, valid during the call). Bucket by bucket, the last first (it holds the first
/// parameters); within a bucket, in chunks of at most `chunk_bytes` over all ranks, on the communication stream
/// (which waits for the context's stream first; the context's stream waits for it at the end). Collective.
template <class Wanted, class Piece, class Take>
void gather_to_host(ddp_replica& r, const zero_shards& shards, std::size_t chunk_bytes, Wanted&& wanted, Piece&& piece,
                    Take&& take) {
  const stream_ref s = r.comm_stream;
  const auto world = static_cast<std::size_t>(r.comm.size());
  const auto me = static_cast<std::size_t>(r.comm.rank());
  std::size_t largest = 0;  // a rank's range in the largest bucket
  for (const auto& b : r.buckets) largest = std::max(largest, b.layout.shard_elements);
  const std::size_t chunk = std::max<std::size_t>(1, std::min(largest, chunk_bytes / sizeof(float) / world));
  r.after(s, r.compute_stream());
  tensor buffer(shape{static_cast<std::int64_t>(world * chunk)}, dtype::f32, s);
  std::vector<float> image;  // the bucket's values, in the values' layout
  for (std::size_t bi = r.buckets.size(); bi-- > 0;) {
    const bucket_layout& l = r.buckets[bi].layout;
    if (std::none_of(l.params.begin(), l.params.end(), wanted)) continue;
    image.assign(l.value_elements, 0.0f);
    for (std::size_t at = 0; at < l.shard_elements; at += chunk) {  // this rank's elements [from, from + n) of the bucket
      const std::size_t n = std::min(chunk, l.shard_elements - at), from = l.rank_offset(static_cast<int>(me)) + at;
      const device_span<float> mine = buffer.span<float>().subspan(me * n, n);
      fill_zero(mine, s);
      for (std::size_t i = 0; i < l.params.size(); ++i) {
        const std::size_t k = l.params[i];
        const element_range range = shards.range(k);
        if (!wanted(k) || range.empty()) continue;
        const std::size_t begin = l.value_offsets[i] + static_cast<std::size_t>(range.begin);  // the piece in the bucket
        const std::size_t first = std::max(begin, from), last = std::min(begin + static_cast<std::size_t>(range.size()), from + n);
        if (first >= last) continue;
        copy(mine.subspan(first - from, last - first), piece(k).template span<const float>().subspan(first - begin, last - first), s);
      }
      r.comm.all_gather(mine.data(), buffer.data(), n, dtype::f32, s);
      const std::vector<float> arrived = to_vector(buffer.span<const float>().subspan(0, world * n), s);
      for (std::size_t q = 0; q < world; ++q) {
        std::copy_n(arrived.begin() + static_cast<std::ptrdiff_t>(q * n), n,
                    image.begin() + static_cast<std::ptrdiff_t>(l.rank_offset(static_cast<int>(q)) + at));
      }
    }
    for (std::size_t i = 0; i < l.params.size(); ++i) {
      const std::size_t k = l.params[i];
      if (wanted(k)) take(k, std::span<const float>(image).subspan(l.value_offsets[i], static_cast<std::size_t>(r.param(k).numel())));
    }
  }
  r.after(r.compute_stream(), s);  // (to_vector waited for the reads already; this keeps the order explicit)
}

/// Calls take(k, values) for every parameter k, in order, with its whole fp32 master values in host memory (valid
/// during the call), through gather_to_host (the host holds about one bucket's values at a time: the last bucket,
/// holding the first parameters, comes first). Inside a consolidation the values are whole already: read as they are.
template <class Take>
void visit_masters(ddp_replica& r, const zero_shards& shards, std::size_t chunk_bytes, Take&& take) {
  std::size_t next = 0;
  if (!shards.consolidated()) {
    r.check_communication();
    std::map<std::size_t, std::vector<float>> arrived;  // gathered before their turn (a bucket's run backwards)
    gather_to_host(r, shards, chunk_bytes, [](std::size_t) { return true; },
                   [&](std::size_t k) { return r.param(k).master_shard(); },
                   [&](std::size_t k, std::span<const float> whole) {
                     arrived.emplace(k, std::vector<float>(whole.begin(), whole.end()));
                     for (auto it = arrived.find(next); it != arrived.end(); it = arrived.find(++next)) {
                       take(next, std::span<const float>(it->second));
                       arrived.erase(it);
                     }
                   });
  }
  visit_values_on_host(r.params, r.compute_stream(), take, next);  // inside a consolidation
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
