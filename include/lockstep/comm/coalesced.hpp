// lockstep/comm/coalesced.hpp — the DataParallel primitives, as copies between devices:
//
//   chunk_rows            PyTorch's torch.chunk rule for splitting a batch over devices
//   scatter_rows          row ranges of a tensor copied to one tensor per device
//   gather_rows           one tensor per device copied into row ranges of a tensor on one device
//   coalesced_broadcast   many tensors of one device copied to every other device in one copy per device
//   coalesced_reduce_add  many tensors of every device summed into one device's, one copy per device
//
// Everything is stream-ordered. Work on different devices is ordered with events: a function that reads
// memory written on another stream takes the event the caller recorded after that write (or records its
// own on the streams it is given), so no host thread ever waits for a device. On GPUs the cross-device
// copies are peer copies (cudaMemcpyPeerAsync); on host devices they are memcpys run by the stream workers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/kernels/exact.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/stream.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN

/// Rows [begin, begin + rows) of a batch.
struct row_range {
  std::int64_t begin = 0;
  std::int64_t rows = 0;
  friend bool operator==(const row_range&, const row_range&) = default;
};

/// Splits `rows` into at most `parts` chunks of ceil(rows / parts) rows (the last one smaller), like
/// torch.chunk and PyTorch's scatter: 130 rows on 4 devices give 33, 33, 33, 31; 3 rows on 4 devices give
/// three chunks of 1 (a chunk is never empty, so some devices may get none).
inline std::vector<row_range> chunk_rows(std::int64_t rows, std::size_t parts) {
  LOCKSTEP_EXPECTS(parts >= 1, "chunk_rows: at least one part");
  LOCKSTEP_EXPECTS(rows >= 0, "chunk_rows: rows must be >= 0, got ", rows);
  std::vector<row_range> out;
  if (rows == 0) return out;
  const std::int64_t size = (rows + static_cast<std::int64_t>(parts) - 1) / static_cast<std::int64_t>(parts);
  for (std::int64_t begin = 0; begin < rows; begin += size) out.push_back({begin, std::min(size, rows - begin)});
  return out;
}

/// Deterministic mode (nn/deterministic.hpp): the rows of a global batch of `rows` rows that rank `rank` of
/// `world` takes: whole chunks of `chunk_rows` rows, contiguous in rank order, as even as chunks allow (the first
/// ranks take one chunk more). 130 rows in chunks of 32 over 3 ranks: [0, 64), [64, 128), [128, 130). A rank may
/// get no rows (fewer chunks than ranks).
inline row_range deterministic_shard(std::int64_t rows, std::int64_t chunk_rows, int rank, int world) {
  LOCKSTEP_EXPECTS(rows >= 0 && chunk_rows > 0 && world > 0 && rank >= 0 && rank < world,
                   "deterministic_shard: rows ", rows, ", chunk_rows ", chunk_rows, ", rank ", rank, " of ", world,
                   ": expected rows >= 0, chunk_rows > 0 and 0 <= rank < world");
  const std::int64_t chunks = (rows + chunk_rows - 1) / chunk_rows, w = world, r = rank;
  const auto first_chunk = [&](std::int64_t k) { return (chunks / w) * k + std::min(k, chunks % w); };
  const std::int64_t begin = std::min(rows, first_chunk(r) * chunk_rows);
  const std::int64_t end = std::min(rows, first_chunk(r + 1) * chunk_rows);
  return {begin, end - begin};
}

/// The non-empty deterministic_shard()s of `rows` rows over `parts` devices, in order (data_parallel's split
/// in deterministic mode).
inline std::vector<row_range> deterministic_shards(std::int64_t rows, std::int64_t chunk_rows, std::size_t parts) {
  std::vector<row_range> out;
  for (std::size_t i = 0; i < parts; ++i) {
    const row_range r = deterministic_shard(rows, chunk_rows, static_cast<int>(i), static_cast<int>(parts));
    if (r.rows > 0) out.push_back(r);
  }
  return out;
}

/// For each i, copies rows ranges[i] of `input` into outputs[i] (made [rows_i, ...] of input's dtype on
/// streams[i]'s device, reusing its memory), in stream order on streams[i], after streams[i] waits for
/// `input_ready` (an event recorded on the stream that produced `input`).
inline void scatter_rows(const tensor_view& input, event_ref input_ready, std::span<const row_range> ranges,
                         std::span<tensor> outputs, std::span<const stream_ref> streams) {
  LOCKSTEP_EXPECTS(ranges.size() <= outputs.size() && ranges.size() <= streams.size(), "scatter_rows: ",
                   ranges.size(), " ranges for ", outputs.size(), " outputs and ", streams.size(), " streams");
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const tensor_view part = input.slice_rows(ranges[i].begin, ranges[i].rows);
    outputs[i].ensure(part.dims(), part.type(), streams[i]);
    streams[i].wait(input_ready);
    copy(outputs[i].bytes(), device_span<const std::uint8_t>(part.bytes()), streams[i]);
  }
}

/// Copies parts[i] into rows [offset_i, offset_i + rows_i) of `output` (made [sum of rows, ...] on
/// out_stream's device), in stream order on out_stream after it waits for ready[i] (recorded on the stream
/// that produced parts[i]). All parts have the same dtype and row shape.
inline void gather_rows(std::span<const tensor_view> parts, std::span<const event_ref> ready, tensor& output,
                        stream_ref out_stream) {
  LOCKSTEP_EXPECTS(!parts.empty() && ready.size() == parts.size(), "gather_rows: ", parts.size(), " parts and ",
                   ready.size(), " events");
  std::int64_t rows = 0;
  for (const auto& p : parts) {
    LOCKSTEP_EXPECTS(p.type() == parts[0].type() && p.cols() == parts[0].cols(), "gather_rows: part of shape ",
                     p.dims().str(), " (", name_of(p.type()), ") does not match ", parts[0].dims().str(), " (",
                     name_of(parts[0].type()), ")");
    rows += p.rows();
  }
  output.ensure(parts[0].dims().with_rows(rows), parts[0].type(), out_stream);
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const tensor_view dst = output.view().slice_rows(offset, parts[i].rows());
    out_stream.wait(ready[i]);
    copy(dst.bytes(), device_span<const std::uint8_t>(parts[i].bytes()), out_stream);
    offset += parts[i].rows();
  }
}

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN
/// Packs `tensors` (all on s's device) into `flat` or unpacks `flat` into them, in stream order on s.
enum class pack_direction : std::uint8_t { pack, unpack };
inline void pack_bytes(std::span<const tensor_view> tensors, tensor& flat, pack_direction dir, stream_ref s) {
  std::size_t offset = 0;
  auto* base = static_cast<std::uint8_t*>(flat.data());
  for (const auto& t : tensors) {
    const std::size_t n = t.size_bytes();
    device_span<std::uint8_t> slot(base + offset, n, flat.get_device());
    device_span<std::uint8_t> tensor_bytes(static_cast<std::uint8_t*>(t.data()), n, t.get_device());
    if (dir == pack_direction::pack) {
      copy(slot, device_span<const std::uint8_t>(tensor_bytes), s);
    } else {
      copy(tensor_bytes, device_span<const std::uint8_t>(slot), s);
    }
    offset += n;
  }
}
inline std::size_t total_bytes(std::span<const tensor_view> tensors) {
  std::size_t n = 0;
  for (const auto& t : tensors) n += t.size_bytes();
  return n;
}
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Copies the tensors of one device to their counterparts on other devices with one cross-device copy per
/// destination device (PyTorch's broadcast_coalesced): the sources are packed into one buffer, that buffer is
/// copied to each destination, and unpacked there. Owns its buffers and events: reuse one instance per step.
class coalesced_broadcast {
 public:
  /// sources[j] (on src's device, written in stream order on src) to destinations[d][j] (on dst[d]'s device)
  /// for every destination device d. Tensors j must have equal byte sizes on every device.
  void operator()(std::span<const tensor_view> sources, stream_ref src,
                  std::span<const std::vector<tensor_view>> destinations, std::span<const stream_ref> dst) {
    LOCKSTEP_EXPECTS(destinations.size() == dst.size(), "coalesced_broadcast: ", destinations.size(),
                     " destination lists for ", dst.size(), " streams");
    const std::size_t bytes = detail::total_bytes(sources);
    for (const auto& d : destinations) {
      LOCKSTEP_EXPECTS(d.size() == sources.size() && detail::total_bytes(d) == bytes,
                       "coalesced_broadcast: destination tensors do not match the sources (", d.size(), " vs ",
                       sources.size(), " tensors)");
    }
    if (bytes == 0) return;
    packed_.ensure(shape{static_cast<std::int64_t>(bytes)}, dtype::u8, src);
    detail::pack_bytes(sources, packed_, detail::pack_direction::pack, src);
    if (!packed_event_ || packed_event_->get_device() != src.get_device()) packed_event_.emplace(src.get_device());
    packed_event_->record(src);
    landing_.resize(dst.size());
    done_.resize(dst.size());
    for (std::size_t d = 0; d < dst.size(); ++d) {
      landing_[d].ensure(shape{static_cast<std::int64_t>(bytes)}, dtype::u8, dst[d]);
      dst[d].wait(*packed_event_);
      copy(landing_[d].span<std::uint8_t>(), packed_.span<const std::uint8_t>(), dst[d]);
      detail::pack_bytes(destinations[d], landing_[d], detail::pack_direction::unpack, dst[d]);
      // The source buffer is reused by the next call: src must not repack before every copy read it.
      if (!done_[d] || done_[d]->get_device() != dst[d].get_device()) done_[d].emplace(dst[d].get_device());
      done_[d]->record(dst[d]);
      src.wait(*done_[d]);
    }
  }

 private:
  tensor packed_;
  std::optional<event> packed_event_;
  std::vector<tensor> landing_;
  std::vector<std::optional<event>> done_;
};

/// Sums tensors of several devices into the matching tensors of one device (PyTorch's reduce_add_coalesced):
/// each device packs its tensors into one buffer, which is copied to the destination device in one copy and
/// added there. Owns its buffers and events: reuse one instance per step.
class coalesced_reduce_add {
 public:
  /// destination[j] += sum over d of sources[d][j], in stream order on `dst` (after sources[d] were written
  /// in stream order on src[d]). Tensors are f32, f16 or bf16 of equal sizes; additions are done in f32 and
  /// rounded once per source. i64 tensors (exact accumulators, kernels/exact.hpp) are added as integers.
  void operator()(std::span<const std::vector<tensor_view>> sources, std::span<const stream_ref> src,
                  std::span<const tensor_view> destination, stream_ref dst) {
    LOCKSTEP_EXPECTS(sources.size() == src.size(), "coalesced_reduce_add: ", sources.size(), " source lists for ",
                     src.size(), " streams");
    const std::size_t bytes = detail::total_bytes(destination);
    if (bytes == 0 || sources.empty()) return;
    packed_.resize(src.size());
    packed_event_.resize(src.size());
    landing_.ensure(shape{static_cast<std::int64_t>(bytes)}, dtype::u8, dst);
    for (std::size_t d = 0; d < src.size(); ++d) {
      LOCKSTEP_EXPECTS(sources[d].size() == destination.size() && detail::total_bytes(sources[d]) == bytes,
                       "coalesced_reduce_add: the tensors of source ", d, " do not match the destination");
      packed_[d].ensure(shape{static_cast<std::int64_t>(bytes)}, dtype::u8, src[d]);
      detail::pack_bytes(sources[d], packed_[d], detail::pack_direction::pack, src[d]);
      if (!packed_event_[d] || packed_event_[d]->get_device() != src[d].get_device()) {
        packed_event_[d].emplace(src[d].get_device());
      }
      packed_event_[d]->record(src[d]);
      dst.wait(*packed_event_[d]);
      copy(landing_.span<std::uint8_t>(), packed_[d].span<const std::uint8_t>(), dst);
      // src[d] may repack only once dst has copied this buffer out.
      if (!copied_ || copied_->get_device() != dst.get_device()) copied_.emplace(dst.get_device());
      copied_->record(dst);
      src[d].wait(*copied_);
      std::size_t offset = 0;
      for (const auto& t : destination) {
        if (t.type() == dtype::i64) {  // exact accumulators (deterministic mode): integer sums
          const auto* landed = reinterpret_cast<const std::int64_t*>(static_cast<const std::uint8_t*>(landing_.data()) + offset);
          launch_elementwise(static_cast<std::size_t>(t.numel()), kernels::exact_add_words_op{landed, t.as<std::int64_t>()},
                             dst, "coalesced_reduce_add");
          offset += t.size_bytes();
          continue;
        }
        dispatch_floating(t.type(), "coalesced_reduce_add", [&]<class T>() {
          const auto* landed = reinterpret_cast<const T*>(static_cast<const std::uint8_t*>(landing_.data()) + offset);
          axpy<T>(1.0f, device_span<const T>(landed, static_cast<std::size_t>(t.numel()), t.get_device()), t.span<T>(),
                  dst);
        });
        offset += t.size_bytes();
      }
    }
  }

 private:
  std::vector<tensor> packed_;
  std::vector<std::optional<event>> packed_event_;
  tensor landing_;
  std::optional<event> copied_;
};

LOCKSTEP_ABI_END
