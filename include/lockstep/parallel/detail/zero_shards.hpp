// lockstep/parallel/detail/zero_shards.hpp — ZeRO's shards (Rajbhandari et al. 2019): each rank owns a
// contiguous range of every bucket (bucket_plan.hpp), keeps the fp32 master values (under f16/bf16) and the
// optimizer state of that range only, and steps it alone; the values forward reads live in one flat buffer per
// bucket, all-gathered in place before the next forward (gather()). Stage 2 also keeps only the range's
// gradients: the whole gradients of a bucket live in one of two buffers reused bucket after bucket, and the
// reduced range is copied out of it into each parameter's gradient shard (copy_out). Stage 3 also keeps only the
// range's values between steps, in a values shard per bucket: gather() allocates the whole buffers and all-gathers
// into them, a synchronized backward frees them (mark_updated); gather_bucket() and release_bucket() do it one
// bucket at a time, for the layer-by-layer schedule of gathered_values.hpp. consolidate() and
// reshard() gather whole values and optimizer state on every rank, and shard them again (host_visits.hpp streams
// them to the host instead, without whole tensors on the device).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/nn/deterministic.hpp"
#include "lockstep/parallel/detail/ddp_replica.hpp"
#include "lockstep/parallel/detail/zero_parameter_shard.hpp"
#include "lockstep/parallel/timeline.hpp"
#include "lockstep/runtime/memory.hpp"

LOCKSTEP_DETAIL_BEGIN

class zero_shards {
 public:
  explicit zero_shards(ddp_replica& r) : r_(&r), parts_(r.params.size()), gathered_(r.get_device()) {}
  zero_shards(const zero_shards&) = delete;
  zero_shards& operator=(const zero_shards&) = delete;
  ~zero_shards() {
    if (pending_reads_) r_->compute_stream().wait(gathered_);  // nobody waits for the gathers after this
    detach_hooks();  // (also when the wrapper's constructor threw after placing them)
  }

  // ---- placement (at construction) ----

  /// ZeRO-2: the two buffers buckets take turns in (bucket b in buffer b % 2), zeroed.
  void create_reused_buffers(const bucket_plan& plan) {
    for (int i = 0; i < 2; ++i) {
      const std::size_t bytes = plan.reused_bytes[static_cast<std::size_t>(i)];
      if (bytes == 0) continue;
      reused_[i] = std::make_shared<tensor>(shape{static_cast<std::int64_t>(bytes)}, dtype::u8, r_->compute_stream());
      fill_zero(reused_[i]->bytes(), r_->compute_stream());
    }
  }
  /// ZeRO-2: the buffer bucket b uses.
  [[nodiscard]] const std::shared_ptr<tensor>& reused_buffer(std::size_t b) const { return reused_[b % 2]; }

  /// The buffer of the values forward reads, for a bucket (ZeRO-3: the rank's range of it, the whole one only
  /// while gathered).
  void create_values(ddp_bucket& b) const {
    const bucket_layout& l = b.layout;
    std::shared_ptr<tensor>& kept = r_->values_sharded ? b.values_shard : b.values;
    kept = r_->values_sharded
               ? std::make_shared<tensor>(shape{static_cast<std::int64_t>(l.shard_elements)}, l.value_type, r_->compute_stream())
               : whole_values(l);
    fill_zero(kept->bytes(), r_->compute_stream());
    b.gathered.emplace(r_->get_device());
  }
  /// The i-th parameter of bucket b reads its values from the bucket's values buffer (ZeRO-3: keeps its range's
  /// in the values shard); its range is noted.
  void place(const ddp_bucket& b, std::size_t i) {
    parameter& p = r_->param(b, i);
    const element_range range = b.layout.shard_of(i, p.numel(), r_->comm.rank());
    auto part = std::make_shared<zero_parameter_shard>(range, r_->compute_stream());
    if (r_->values_sharded) {
      const bucket_layout& l = b.layout;
      const std::size_t at = range.empty() ? 0 : l.value_offsets[i] + static_cast<std::size_t>(range.begin) - l.rank_offset(r_->comm.rank());
      part->keep_values_in(flat_part(b.values_shard->view(), element_range{static_cast<std::int64_t>(at), static_cast<std::int64_t>(at) + range.size()}),
                           b.values_shard);
    } else {
      p.share_compute_storage(r_->value_slot(b, i, *b.values), b.values, r_->compute_stream());
    }
    parts_[b.layout.params[i]] = std::move(part);
  }
  /// ZeRO-2: `hook` runs before parameter k's whole gradient, logically zero, is first written.
  void set_first_write_hook(std::size_t k, std::function<void()> hook) { parts_[k]->set_first_write_hook(std::move(hook)); }
  /// After placement: every parameter gets its range as its shard (freeing the master values outside it), and
  /// under ZeRO-2 in deterministic mode each gradient shard an exact sum kept across micro-batches.
  void shard_parameters() {
    const stream_ref s = r_->compute_stream();
    activate_all();
    if (r_->reused_buffers && r_->deterministic) {
      exact_shards_.resize(r_->params.size());
      for (std::size_t k = 0; k < r_->params.size(); ++k) {
        const auto m = static_cast<std::size_t>(parts_[k]->range().size());
        exact_shards_[k] = tensor(shape{static_cast<std::int64_t>(kernels::exact_words(m))}, dtype::i64, s);
      }
    }
  }

  // ---- training ----

  /// After a synchronized backward: each rank updates its shard, the others' values arrive with the next gather
  /// (ZeRO-3: the whole values are freed until then).
  void mark_updated() {
    mark_stale();
    if (r_->values_sharded) release_values();
  }

  /// All-gathers the values each rank updated into every rank's copy (ZeRO-3: into whole buffers allocated for
  /// them), in stream order on the context's stream (a collective), timed on `t`. No-op when nothing changed since
  /// the last gather and every bucket is held: every rank decides alike, since the values go stale only at calls
  /// every rank makes (a synchronized backward, an optimizer step: parameter::before_update), ZeRO-3's buckets are
  /// gathered and freed at such calls too (gathered_values.hpp), and writes keep the gathered copy current.
  void gather(timeline& t) {
    if (held_whole()) return;
    r_->check_communication();
    const stream_ref cs = r_->comm_stream;
    for (ddp_bucket& bk : r_->buckets) {  // ZeRO-3, where the values go (on the context's stream, as the reads)
      if (r_->values_sharded) allocate_gathered(bk);
    }
    r_->after(cs, r_->compute_stream());  // the optimizer step that updated the shards
    t.begin(phase::communication, cs);
    // Last bucket first: it holds the first layers, which forward reads first. Each parameter's first read waits
    // for its own bucket only (a read hook), so that forward overlaps the later gathers.
    for (std::size_t b = r_->buckets.size(); b-- > 0;) gather_into(r_->buckets[b]);
    t.end(cs);
  }
  /// Whether every parameter's values are held whole and current (gather() would do nothing), also inside a
  /// consolidation (the parameters hold their own).
  [[nodiscard]] bool held_whole() const {
    if (std::any_of(parts_.begin(), parts_.end(), [](const auto& part) { return !part->active(); })) return true;
    if (r_->values_sharded) {  // (every parameter is in a bucket)
      for (std::size_t b = 0; b < r_->buckets.size(); ++b) {
        if (!held(b)) return false;
      }
      return true;
    }
    return std::none_of(parts_.begin(), parts_.end(), [](const auto& part) { return part->stale(); });
  }
  /// ZeRO-3: bucket b's whole values all-gathered into a buffer allocated for them (on the context's stream), on the
  /// communication stream after the context's stream's work so far (a collective), timed on `t`; its parameters'
  /// first reads wait for it.
  void gather_bucket(std::size_t b, timeline& t) {
    ddp_bucket& bk = r_->buckets[b];
    allocate_gathered(bk);
    const stream_ref cs = r_->comm_stream;
    r_->after(cs, r_->compute_stream());  // the buffer's allocation, and the reads of the one it may reuse
    t.begin(phase::communication, cs);
    gather_into(bk);
    t.end(cs);
  }
  /// ZeRO-3: whether bucket b's whole values are held, and current.
  [[nodiscard]] bool held(std::size_t b) const {
    const ddp_bucket& bk = r_->buckets[b];
    return bk.values && std::none_of(bk.layout.params.begin(), bk.layout.params.end(),
                                     [&](std::size_t k) { return parts_[k]->stale(); });
  }
  /// ZeRO-3: bucket b's whole values freed in stream order on the context's stream (after the reads queued so far,
  /// and its gather); its parameters hold no values until it is gathered again.
  void release_bucket(std::size_t b) {
    ddp_bucket& bk = r_->buckets[b];
    if (!bk.values) return;
    r_->compute_stream().wait(*bk.gathered);
    for (const std::size_t k : bk.layout.params) {
      parts_[k]->set_gathered(tensor_view{});
      parts_[k]->set_read_hook(nullptr);
    }
    free_gathered(bk);
  }
  /// ZeRO-3: the most bytes of whole values held gathered at once (the buckets' buffers) since construction or
  /// reset_gathered_peak() (which starts again from those held now).
  [[nodiscard]] std::uint64_t gathered_peak_bytes() const noexcept { return gathered_peak_bytes_; }
  void reset_gathered_peak() noexcept { gathered_peak_bytes_ = gathered_bytes_; }
  /// Orders the context's stream after every all-gather of the last gather() (the read hooks ordered only the
  /// reads forward made): backward and the step after it come after every all-gather, which reads the shards.
  void wait_for_gathers() {
    if (!pending_reads_) return;
    r_->compute_stream().wait(gathered_);
    for (const auto& part : parts_) part->set_read_hook(nullptr);
    pending_reads_ = false;
  }

  /// ZeRO-2: the whole gradient of a parameter of bucket b is about to be written into its buffer, which bucket
  /// b - 2 used before: the write waits until that bucket was reduced and copied out (`launched`: the buckets
  /// whose collectives were queued). Buckets 0 and 1 follow the previous step's last buckets, which backward
  /// waited for.
  void before_first_write(std::size_t b, std::size_t launched) const {
    if (b < 2) return;
    LOCKSTEP_EXPECTS(launched > b - 2, "distributed_data_parallel (ZeRO-2): a gradient of bucket ", b,
                     " is written before bucket ", b - 2, ", which shares its buffer, was reduced (a layer whose "
                     "parameters span three buckets); raise ddp_options::bucket_bytes");
    r_->compute_stream().wait(*r_->buckets[b - 2].released);
  }

  /// ZeRO-2: the reduced range of bucket b into the parameters' own gradient shards (added to what they hold
  /// since zero_grad), on the communication stream; then the buffer may be reused.
  void copy_out(ddp_bucket& b) {
    const stream_ref cs = r_->comm_stream;
    const bucket_layout& l = b.layout;
    for (std::size_t i = 0; i < l.params.size(); ++i) {
      parameter& p = r_->param(b, i);
      zero_parameter_shard& part = *parts_[l.params[i]];
      const element_range r = part.range();
      const tensor_view to = p.grad_shard();
      p.release_full_grad();
      if (r.empty()) continue;
      const float keep = part.begin_accumulate();
      if (r_->deterministic) {
        add_exact_shard(b, i, keep == 0.0f);
        continue;
      }
      const tensor_view from(static_cast<std::byte*>(b.flat->data()) + (l.offsets[i] + static_cast<std::size_t>(r.begin)) * size_of(l.wire),
                             l.wire, shape{r.size()}, r_->get_device());
      dispatch_floating(l.wire, "ZeRO-2 gradient shard", [&]<class T>() {
        if (keep == 0.0f) {
          copy(to.span<T>(), from.span<const T>(), cs);
        } else {
          axpy<T>(1.0f, from.span<const T>(), to.span<T>(), cs);
        }
      });
    }
    b.released->record(cs);
  }

  // ---- checkpoints ----

  /// The whole master values and optimizer state on every rank (distributed_data_parallel::consolidated).
  /// Nested calls: the outermost one gathers.
  template <class Optimizer>
  void consolidate(Optimizer& opt, timeline& comm_timeline) {
    if (consolidations_++ > 0) return;
    // The values whole and current for the guard's readers (a step that follows, after a save between backward and
    // the step, marks them stale again: parameter::before_update).
    gather(comm_timeline);
    wait_for_gathers();  // the guard's readers (checkpoints) read the values on any stream
    // Every rank gathers the same state tensors: a rank that saved before the first step has state (the save
    // materialized it) that the others lack, so all materialize it (zeros; the next step stays a first step).
    opt.materialize_state(r_->compute_stream());
    const stream_ref s = r_->comm_stream;
    const auto to_device = [this](auto&& wanted, auto&& piece, auto&& take) { gather_whole(wanted, piece, take); };
    gather_state(opt, to_device, [&](std::size_t k, std::size_t g, std::size_t i, int which, const tensor_view& whole) {
      tensor t(r_->param(k).dims(), dtype::f32, s);
      copy(t.span<float>(), whole.span<const float>(), s);
      // the shard was read on this stream (gather_whole's copy): freed after that read
      opt.replace_state(g, i, which, std::move(t)).set_stream(s);
    });
    gather_whole([&](std::size_t k) { return parts_[k]->keeps_masters(); },  // f16/bf16: masters sharded
                 [&](std::size_t k) { return r_->param(k).master_shard(); },
                 [&](std::size_t k, const tensor_view& whole) { parts_[k]->deactivate(r_->param(k), whole, s); });
    for (std::size_t k = 0; k < parts_.size(); ++k) {  // the f32 ones: nothing to gather
      if (parts_[k]->active()) parts_[k]->deactivate(r_->param(k), tensor_view{}, s);
    }
    if (r_->values_sharded) release_values();  // ZeRO-3: the parameters hold their own now (copied before gathered_)
    r_->comm.synchronize(s);
  }

  /// Every optimizer state tensor of `opt` whole, through `gather` (gather_whole's signature: the device, or the
  /// host in chunks): take(parameter index, group, index in group, which state tensor, whole values) for each, one
  /// state index after the other.
  template <class Optimizer, class Gather, class Take>
  void gather_state(Optimizer& opt, Gather&& gather, Take&& take) const {
    std::unordered_map<std::size_t, std::pair<std::size_t, std::size_t>> where;  // parameter -> (group, index)
    for_each_state(*r_, opt, [&](std::size_t g, std::size_t i, std::size_t k) { where.emplace(k, std::pair{g, i}); });
    for (int which = 0; which < Optimizer::state_count; ++which) {
      gather([&](std::size_t k) { return where.contains(k); },
             [&](std::size_t k) { return opt.state(where.at(k).first, where.at(k).second, which); },
             [&](std::size_t k, const auto& whole) { take(k, where.at(k).first, where.at(k).second, which, whole); });
    }
  }
  /// Parameter k's range on this rank.
  [[nodiscard]] element_range range(std::size_t k) const { return parts_[k]->range(); }
  /// Whole fp32 tensors from every rank's shards, on the communication stream (which first waits for the context's
  /// stream). Bucket by bucket, the last first (it holds the first parameters: within a bucket, and from bucket to
  /// bucket, the parameters come in descending order), for each bucket holding a parameter k with wanted(k) (the
  /// same on every rank): buffer(b) gives a device span of at least world x m floats, m = min(chunk, b's
  /// shard_elements); each rank's range is gathered in chunks [at, at + n), n <= m (one chunk at least, so that every
  /// rank issues the same collectives), this rank's from piece(k) (its shard: range(k).size() floats, zeros
  /// elsewhere), and arrived(b, at, n, gathered) receives rank q's part of the chunk at q x n of `gathered`.
  template <class Wanted, class Piece, class Buffer, class Arrived>
  void gather_chunks(std::size_t chunk, Wanted&& wanted, Piece&& piece, Buffer&& buffer, Arrived&& arrived) const {
    LOCKSTEP_EXPECTS(chunk > 0, "zero_shards::gather_chunks: chunks of 0 elements");
    const stream_ref s = r_->comm_stream;
    const auto world = static_cast<std::size_t>(r_->comm.size()), me = static_cast<std::size_t>(r_->comm.rank());
    r_->after(s, r_->compute_stream());
    for (std::size_t bi = r_->buckets.size(); bi-- > 0;) {
      const ddp_bucket& b = r_->buckets[bi];
      const bucket_layout& l = b.layout;
      if (std::none_of(l.params.begin(), l.params.end(), wanted)) continue;
      const std::size_t most = std::min(chunk, l.shard_elements);
      const device_span<float> room = buffer(b);
      std::size_t at = 0;
      do {  // this rank's [from, from + n); once for a bucket without elements
        const std::size_t n = std::min(most, l.shard_elements - at);
        const std::size_t from = l.rank_offset(static_cast<int>(me)) + at;
        const device_span<float> mine = room.subspan(me * n, n);
        fill_zero(mine, s);
        for (std::size_t i = 0; i < l.params.size(); ++i) {
          const std::size_t k = l.params[i];
          const element_range r = parts_[k]->range();
          if (!wanted(k) || r.empty()) continue;
          const std::size_t begin = l.value_offsets[i] + static_cast<std::size_t>(r.begin);  // the shard in the bucket
          const std::size_t first = std::max(begin, from), last = std::min(begin + static_cast<std::size_t>(r.size()), from + n);
          if (first >= last) continue;
          copy(mine.subspan(first - from, last - first), piece(k).template span<const float>().subspan(first - begin, last - first), s);
        }
        r_->comm.all_gather(mine.data(), room.data(), n, dtype::f32, s);
        arrived(b, at, n, device_span<const float>(room.subspan(0, world * n)));
        at += n;
      } while (at < l.shard_elements);
    }
  }
  /// Whether a consolidation holds the tensors whole (consolidate() not yet resharded).
  [[nodiscard]] bool consolidated() const noexcept { return consolidations_ > 0; }

  /// Back to shards after consolidate(): the optimizer state and the master values keep this rank's range.
  template <class Optimizer>
  void reshard(Optimizer& opt) {
    if (--consolidations_ > 0) return;
    const stream_ref s = r_->compute_stream();
    for (int which = 0; which < Optimizer::state_count; ++which) {
      for_each_state(*r_, opt, [&](std::size_t g, std::size_t i, std::size_t k) {
        const element_range r = parts_[k]->range();
        tensor part(shape{r.size()}, dtype::f32, s);
        if (!r.empty()) {
          copy(part.span<float>(),
               opt.state(g, i, which).template span<const float>().subspan(static_cast<std::size_t>(r.begin),
                                                                            static_cast<std::size_t>(r.size())),
               s);
        }
        opt.replace_state(g, i, which, std::move(part)).set_stream(s);  // the whole state, read above on `s`
      });
    }
    activate_all();
  }

  // ---- memory ----

  /// Bytes of the values buffers forward reads (ZeRO-3: the values shards, and the whole buffers while held).
  [[nodiscard]] std::uint64_t values_bytes() const {
    std::uint64_t n = 0;
    for (const auto& b : r_->buckets) {
      n += b.values ? b.layout.value_elements * size_of(b.layout.value_type) : 0;
      n += b.values_shard ? b.values_shard->size_bytes() : 0;
    }
    return n;
  }
  /// ZeRO-2: bytes of the reused buffers, the gradient shards and their exact sums.
  [[nodiscard]] std::uint64_t reused_gradient_bytes() const {
    std::uint64_t n = 0;
    for (const auto& buffer : reused_) n += buffer ? buffer->capacity_bytes() : 0;
    for (const auto& p : r_->params) n += static_cast<std::uint64_t>(p.param->grad_shard().numel()) * size_of(p.param->compute_type());
    for (const auto& t : exact_shards_) n += t.size_bytes();
    return n;
  }

 private:
  // The wrapper ends: its hooks go (the parameters keep their shards, stale or not). (ZeRO-2's first-write hooks
  // capture the wrapper's gradient_sync, destroyed just before this: nothing runs a hook in between.)
  void detach_hooks() {
    for (const auto& part : parts_) {
      if (!part) continue;
      part->set_first_write_hook(nullptr);
      part->set_read_hook(nullptr);
      if (r_->values_sharded) part->set_gathered(tensor_view{});  // the whole values go with the buckets
    }
  }
  // A bucket's whole values, on the context's stream.
  [[nodiscard]] std::shared_ptr<tensor> whole_values(const bucket_layout& l) const {
    return std::make_shared<tensor>(shape{static_cast<std::int64_t>(l.value_elements)}, l.value_type, r_->compute_stream());
  }
  // Bucket bk's all-gather into its values (the whole buffer), queued on the communication stream; its parameters'
  // first reads wait for it, and under ZeRO-3 read the gathered buffer.
  void gather_into(ddp_bucket& bk) {
    const stream_ref cs = r_->comm_stream;
    const bucket_layout& l = bk.layout;
    const void* mine = r_->values_sharded ? bk.values_shard->data()
                                          : static_cast<const std::byte*>(bk.values->data()) + l.rank_offset(r_->comm.rank()) * size_of(l.value_type);
    r_->comm.all_gather(mine, bk.values->data(), l.shard_elements, l.value_type, cs);
    bk.gathered->record(cs);
    gathered_.record(cs);
    pending_reads_ = true;
    for (std::size_t i = 0; i < l.params.size(); ++i) {
      zero_parameter_shard& part = *parts_[l.params[i]];
      part.set_read_hook([this, &bk] { r_->compute_stream().wait(*bk.gathered); });
      if (r_->values_sharded) part.set_gathered(r_->value_slot(bk, i, *bk.values));
      part.set_stale(false);
    }
  }
  // ZeRO-3: the whole values freed, in stream order on the context's stream (after their gathers).
  void release_values() {
    wait_for_gathers();
    for (const auto& part : parts_) part->set_gathered(tensor_view{});
    for (ddp_bucket& b : r_->buckets) free_gathered(b);
  }
  // ZeRO-3: bucket bk's whole values, allocated unless held, and counted.
  void allocate_gathered(ddp_bucket& bk) {
    if (bk.values) return;
    bk.values = whole_values(bk.layout);
    gathered_bytes_ += bk.values->size_bytes();
    gathered_peak_bytes_ = std::max(gathered_peak_bytes_, gathered_bytes_);
  }
  // ZeRO-3: bucket bk's whole values freed in stream order on the context's stream (after the reads queued so far).
  void free_gathered(ddp_bucket& bk) {
    if (!bk.values) return;
    gathered_bytes_ -= bk.values->size_bytes();
    bk.values->set_stream(r_->compute_stream());
    bk.values.reset();
  }
  // Every parameter's values stale (after backward; a gather makes them current again).
  void mark_stale() {
    for (const auto& part : parts_) part->set_stale(true);
  }
  // Every parameter sharded (again), in stream order on the context's stream.
  void activate_all() {
    if (r_->values_sharded) {  // ZeRO-3: nothing held whole until the next gather (also if this fails midway)
      release_values();         // (after a gather in flight, which reads the values shards written below)
      mark_stale();
    }
    for (std::size_t k = 0; k < parts_.size(); ++k) {
      parts_[k]->activate(parts_[k], r_->param(k), r_->reused_buffers, r_->compute_stream());
    }
  }

  // ZeRO-2, deterministic mode: the all-reduced exact sums of the range of bucket b's i-th parameter written over
  // (`overwrite`) or added to its shard's exact sum, which is then rounded into the gradient shard; on the
  // communication stream.
  void add_exact_shard(const ddp_bucket& b, std::size_t i, bool overwrite) {
    const stream_ref cs = r_->comm_stream;
    const std::size_t k = b.layout.params[i];
    parameter& p = r_->param(k);
    const element_range r = parts_[k]->range();
    const auto n = static_cast<std::size_t>(p.numel()), m = static_cast<std::size_t>(r.size());
    const std::int64_t* words = static_cast<const std::int64_t*>(b.flat->data()) + b.layout.offsets[i];
    std::int64_t* shard = exact_shards_[k].as<std::int64_t>();
    const std::int64_t* from[3] = {words + r.begin, words + n + r.begin, words + 2 * n};  // hi, lo, count
    std::int64_t* to[3] = {shard, shard + m, shard + 2 * m};
    for (int part = 0; part < 3; ++part) {
      const std::size_t count = part < 2 ? m : 1;
      if (overwrite) {
        copy(device_span<std::int64_t>(to[part], count, r_->get_device()),
             device_span<const std::int64_t>(from[part], count, r_->get_device()), cs);
      } else {
        launch_elementwise(count, kernels::exact_add_words_op{from[part], to[part]}, cs, "ZeRO-2 exact shard");
      }
    }
    round_exact_limbs(p.compute_type(), to[0], to[1], to[2], p.grad_shard().data(), m, cs);
  }

  // Whole fp32 tensors from every rank's shards (gather_chunks), each bucket's in one temporary device buffer of its
  // values' layout, in stream order on the communication stream (the context's stream waits for it at the end):
  // take(k, whole) receives parameter k's numel() values (for every k with wanted(k)) in that buffer.
  template <class Wanted, class Piece, class Take>
  void gather_whole(Wanted&& wanted, Piece&& piece, Take&& take) {
    const stream_ref s = r_->comm_stream;
    tensor flat;
    gather_chunks(
        std::numeric_limits<std::size_t>::max(), wanted, piece,
        [&](const ddp_bucket& b) {
          flat = tensor();  // the last bucket's freed first (its readers were queued on `s`)
          flat = tensor(shape{static_cast<std::int64_t>(b.layout.value_elements)}, dtype::f32, s);
          return flat.span<float>();  // one chunk of each rank's whole range: the values' layout
        },
        [&](const ddp_bucket& b, std::size_t, std::size_t, device_span<const float>) {
          for (std::size_t i = b.layout.params.size(); i-- > 0;) {
            if (wanted(b.layout.params[i])) take(b.layout.params[i], r_->value_slot(b, i, flat));
          }
        });
    gathered_.record(s);
    r_->compute_stream().wait(gathered_);
  }

  ddp_replica* r_;
  std::vector<std::shared_ptr<zero_parameter_shard>> parts_;  // each parameter's shard on this rank
  std::shared_ptr<tensor> reused_[2];      // ZeRO-2: the buffers buckets take turns in
  std::vector<tensor> exact_shards_;       // ZeRO-2, deterministic mode: each gradient shard's exact sum
  event gathered_;                         // the last gather's (or gather_whole's) collectives
  int consolidations_ = 0;                 // consolidate() calls not yet resharded
  bool pending_reads_ = false;             // gathered, and the context's stream not yet after every gather
  std::uint64_t gathered_bytes_ = 0;       // ZeRO-3: the buckets' whole values held now (allocate_gathered)
  std::uint64_t gathered_peak_bytes_ = 0;  // and the most held at once (reset_gathered_peak)
};

LOCKSTEP_DETAIL_END
