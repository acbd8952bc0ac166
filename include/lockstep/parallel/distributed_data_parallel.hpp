// lockstep/parallel/distributed_data_parallel.hpp — `distributed_data_parallel<Model>`: PyTorch's
// DistributedDataParallel for a rank of a communicator (a thread of run_on_devices, or a process under mpirun).
//
// Every rank holds a whole replica and trains on its own shard of the global batch. At construction the
// parameters of rank 0 are broadcast to every rank, after checking that all ranks have the same parameters
// (names and shapes; a mismatch names the rank and the parameter). Backward all-reduces the gradients in
// buckets: parameters are grouped in reverse order of the model (the order backward produces them) into
// buckets of about 25 MiB, the first one smaller (1 MiB) so that communication starts early; a bucket is
// all-reduced on the communication stream as soon as the layers it covers, and the buckets before it, have
// finished their backward (every rank issues the all-reduces in bucket order), so communication overlaps the
// rest of backward. Inside `no_sync()` gradients accumulate locally with no
// communication (gradient accumulation); the first backward after it reduces everything accumulated.
//
// Sum or mean is explicit (`gradient_reduction`): `sum` pairs with a loss whose mean divides by the GLOBAL
// batch size (each rank passes mean_over = global batch), which gives exactly the gradients of one device
// training on the whole batch, even when shards differ in size; `mean` is PyTorch's convention (each rank
// averages its own shard, gradients are averaged over ranks), exact only for equal shards.
//
// Gradients live in their buckets (PyTorch's gradient_as_bucket_view): each bucket is one buffer, and every
// parameter whose gradient travels in its own type (no hook, or a hook of the gradients' type) has its
// gradient placed in it, each at a 256-byte boundary. Backward writes the gradients where the all-reduce reads
// them, and the all-reduce leaves the result in place: no copy either way, and no second copy of the
// gradients in memory. Gradients that change type on the wire are packed (cast) into the bucket and unpacked.
//
// A rank whose shard of a step is empty (a batch smaller than the world) calls backward with an empty
// gradient: it contributes zeros and takes part in every all-reduce, as the others expect.
//
// ZeRO (`ddp_options::zero`, Rajbhandari et al. 2019): stage 1 reduce-scatters each bucket instead of
// all-reducing it, so that each rank receives the sum of its shard only, a contiguous range of the bucket (buckets
// are padded so that every rank's range has the same size). The parameters learn their shard
// (parameter::shard()): the optimizer keeps state for it and steps it alone, the loss scaler and the clipper read
// it (with the communicator, so that every rank skips the same steps and the norm covers every shard), and
// under f16/bf16 the fp32 master values outside it are freed. The values forward reads live in one flat buffer
// per bucket, so the next forward() (or gather_parameters()) all-gathers the updated shards in place. Stage 2
// also frees the gradients outside the shard: the whole gradients of a bucket live in one of two buffers reused
// bucket after bucket (a write into a buffer waits for the bucket that used it before to be reduced and copied
// out), and each parameter keeps its shard's gradient in storage of its own. Gradients travel in their own
// type (host and MPI communicators sum f16/bf16 in fp32 and round once: the bits of DDP's fp32 all-reduce).
// Inside no_sync(), stage 1 accumulates whole gradients as DDP does; stage 2 reduce-scatters every backward
// and adds into the shard. Checkpoints and weights_sha256 need whole values: `consolidated(optimizer)`
// gathers the master values and the optimizer state on every rank for as long as its guard lives.
//
// Failures: a failed all-reduce (a peer that died, stopped or aborted; a timeout; ranks that issue different
// collectives) fails the step on every rank. On host devices the communication stream keeps the error and the
// compute stream, which waits for the all-reduce, fails with it: the step's later work (unpacking, the
// optimizer step) does not run, and the next synchronization throws. On GPUs the communicator's watchdog
// aborts it. Either way the next backward() throws before queuing anything (comm.check()).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "lockstep/comm/coalesced.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/config.hpp"
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/deterministic.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/parallel/timeline.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN

/// How gradients are combined across ranks (see the file comment).
enum class gradient_reduction : std::uint8_t { sum, mean };

/// The precision gradients travel in. `none` all-reduces in fp32 (whatever the gradients' storage type);
/// `fp16` / `bf16` halve the bytes on the wire: gradients are rounded to that type, all-reduced (sums in fp32,
/// rounded once) and restored into the gradients' own type.
enum class comm_hook : std::uint8_t { none, fp16, bf16 };

struct ddp_options {
  std::size_t bucket_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  gradient_reduction reduction = gradient_reduction::sum;
  comm_hook hook = comm_hook::none;
  /// Deterministic mode (nn/deterministic.hpp), set on the context by the constructor; without it the wrapper
  /// follows the context's own setting. The buckets then hold exact accumulators, all-reduced as i64 sums.
  std::optional<deterministic_options> deterministic = std::nullopt;
  /// ZeRO stage: 0 is plain DDP (every rank holds everything), 1 shards the optimizer state and the fp32 master
  /// values over the ranks, 2 also the gradients (see the file comment).
  int zero = 0;
};

template <layer Model>
class distributed_data_parallel {
 public:
  /// Wraps `model` (on ctx's device) for rank comm.rank() of comm.size(). Collectives run on `comm_stream`
  /// (a second stream of the same device). Checks that every rank has the same parameters, then broadcasts
  /// rank 0's values (this waits for the other ranks: every rank must construct its wrapper). `model`, `ctx`,
  /// `comm` and the stream must outlive this object.
  distributed_data_parallel(Model& model, context& ctx, communicator_ref comm, stream_ref comm_stream,
                            ddp_options options = {})
      : model_(&model), ctx_(&ctx), comm_(comm), comm_stream_(comm_stream), options_(options),
        deterministic_(options.deterministic.has_value() || ctx.deterministic().has_value()),
        grads_ready_(ctx.get_device()), sharding_(options.zero > 0 && comm.size() > 1),
        stage2_(sharding_ && options.zero == 2), gathered_(ctx.get_device()), compute_timeline_(ctx.get_device()),
        comm_timeline_(ctx.get_device()) {
    LOCKSTEP_EXPECTS(comm.get_device() == ctx.get_device() && comm_stream.get_device() == ctx.get_device(),
                     "distributed_data_parallel: the context is on ", ctx.get_device().str(), ", the communicator on ",
                     comm.get_device().str(), " and the communication stream on ", comm_stream.get_device().str(),
                     ": all must be the rank's device");
    LOCKSTEP_EXPECTS(options.bucket_bytes > 0 && options.first_bucket_bytes > 0,
                     "distributed_data_parallel: bucket sizes must be positive");
    LOCKSTEP_EXPECTS(options.zero >= 0 && options.zero <= 2, "distributed_data_parallel: zero must be 0 (plain DDP), "
                     "1 (optimizer state sharded) or 2 (gradients too), got ", options.zero);
    LOCKSTEP_EXPECTS(options.zero == 0 || options.hook == comm_hook::none, "distributed_data_parallel: ZeRO stage ",
                     options.zero, " reduces gradients in their own type; it cannot be combined with a comm hook (use "
                     "zero = 0 for that)");
    if (options.deterministic) ctx.set_deterministic(options.deterministic);
    if (deterministic_) {
      LOCKSTEP_EXPECTS(options.reduction == gradient_reduction::sum && options.hook == comm_hook::none,
                       "distributed_data_parallel: the context is in deterministic mode, which all-reduces exact sums: "
                       "use gradient_reduction::sum (with a loss whose mean divides by the global batch) and "
                       "comm_hook::none");
      ctx.set_gradient_rounding(exact_rounding::by_wrapper);
    }
    params_ = parameters_of(model);
    for (std::size_t i = 0; i < params_.size(); ++i) index_.emplace(params_[i].param, i);
    ranges_.resize(params_.size());
    exact_collective_ = comm.supports(collective_kind::all_reduce_exact);
    check_same_parameters();
    broadcast_parameters();
    build_buckets();
  }

  distributed_data_parallel(const distributed_data_parallel&) = delete;
  distributed_data_parallel& operator=(const distributed_data_parallel&) = delete;
  /// The parameters stay as they are (sharded under ZeRO: use consolidated() before, to keep whole values).
  ~distributed_data_parallel() {
    if (pending_reads_) ctx_->stream().wait(gathered_);  // nobody waits for the gathers after this
    for (const auto& p : params_) {
      p.param->set_first_write_hook(nullptr);
      p.param->set_read_hook(nullptr);
    }
  }

  /// The ZeRO stage in effect: options.zero, or 0 on one rank (nothing to shard).
  [[nodiscard]] int zero_stage() const noexcept { return sharding_ ? options_.zero : 0; }

  [[nodiscard]] int rank() const { return comm_.rank(); }
  [[nodiscard]] int world_size() const { return comm_.size(); }
  [[nodiscard]] Model& module() noexcept { return *model_; }
  [[nodiscard]] context& module_context() noexcept { return *ctx_; }
  /// Deterministic mode: whether the last backward gathered the chunks' partial gradients (possible when the
  /// context knows the global batch, context::set_global_rows, and it has few chunks) rather than all-reducing
  /// exact accumulators. The bits are the same either way.
  [[nodiscard]] bool gathered_partials() const noexcept { return gathered_partials_; }
  /// Number of gradient buckets, and the parameters (indices into parameters_of(model)) of bucket b.
  [[nodiscard]] std::size_t bucket_count() const noexcept { return buckets_.size(); }
  [[nodiscard]] const std::vector<std::size_t>& bucket_parameters(std::size_t b) const { return buckets_.at(b).params; }

  /// The model's forward on this rank's shard. Under ZeRO, first gathers the values updated since the last
  /// backward (gather_parameters()).
  tensor_view forward(const tensor_view& x) {
    gather_parameters();
    compute_timeline_.begin(phase::compute, ctx_->stream());
    tensor_view y = model_->forward(x, *ctx_);
    compute_timeline_.end(ctx_->stream());
    return y;
  }

  /// Back-propagates dL/doutput of the last forward and leaves in every parameter's gradient the sum (or mean)
  /// over ranks, in stream order on the context's stream. An empty `grad_output` means this rank had no data
  /// this step. Inside no_sync(), accumulates locally only.
  void backward(const tensor_view& grad_output) {
    const stream_ref s = ctx_->stream();
    check_communication();
    gather_parameters();  // a rank without rows this step calls backward without forward: it gathers here
    wait_for_gathers();   // backward and the step after it: after every all-gather (which reads the shards)
    LOCKSTEP_EXPECTS(ctx_->deterministic().has_value() == deterministic_,
                     "distributed_data_parallel::backward: the context's deterministic mode changed since the wrapper was "
                     "built (its buckets hold ", deterministic_ ? "exact sums" : "gradients", "); build the wrapper after "
                     "setting the mode");
    // deterministic mode: partial gradients gathered, or exact sums (whose buffers' padding a gathered step left
    // dirty: zeros again, so that the i64 all-reduce adds zeros there). A backward that threw may have left the
    // targets set.
    if (gathering()) set_partials_targets(0);
    if (syncing_) start_gathering();
    gathered_partials_ = gathering();
    if (deterministic_ && !gathering() && std::exchange(buckets_dirty_, false)) {
      for (const auto& b : buckets_) fill_zero(b.flat->bytes(), s);
    }
    buckets_dirty_ = buckets_dirty_ || gathering();
    if (!syncing_ && !stage2_) {  // ZeRO-2 keeps no whole gradients to accumulate into: it reduces every time
      accumulated_ = true;  // every rank's call, with rows or not: the next backward adds to these sums
      if (!grad_output.empty()) {
        compute_timeline_.begin(phase::compute, s);
        model_->backward(grad_output, *ctx_, input_grad::not_required);
        compute_timeline_.end(s);
      }
      return;
    }
    for (auto& b : buckets_) b.ready = 0;
    next_launch_ = 0;
    std::fill(reported_.begin(), reported_.end(), false);
    if (!grad_output.empty()) {
      ctx_->set_gradients_ready_hook([this](std::span<parameter* const> ps) { on_gradients_ready(ps); });
      compute_timeline_.begin(phase::compute, s);
      try {
        model_->backward(grad_output, *ctx_, input_grad::not_required);
      } catch (...) {
        ctx_->set_gradients_ready_hook(nullptr);
        throw;
      }
      compute_timeline_.end(s);
      ctx_->set_gradients_ready_hook(nullptr);
    }
    // Buckets whose parameters received no gradient (unused parameters, or no data on this rank) go now, with
    // zeros where nothing was written: every rank must take part in every all-reduce, in bucket order.
    while (next_launch_ < buckets_.size()) launch(next_launch_++);
    // The gradients: wait for each bucket's all-reduce and unpack it (or round its exact sums).
    for (auto& b : buckets_) {
      s.wait(*b.done);
      if (gathering()) {
        sum_gathered(b);
      } else if (deterministic_ && !stage2_) {  // (ZeRO-2 rounded its shards in copy_out)
        // under ZeRO-1 the shard alone: the optimizer, the scaler and the clipper read nothing else
        for (const std::size_t k : b.params) {
          parameter& p = *params_[k].param;
          round_exact_gradient(p, p.shard(), p.grad_shard(), s);
        }
      } else if (!sharding_) {
        unpack(b);
      }
    }
    if (gathering()) set_partials_targets(0);
    accumulated_ = false;
    if (sharding_) set_stale(true);  // each rank updates its shard: the others' values arrive with the next gather
  }

  /// ZeRO: all-gathers the values each rank updated into every rank's copy, in stream order on the context's
  /// stream (a collective: every rank calls it, as forward() does). No-op when nothing changed since the last
  /// gather, and without ZeRO.
  void gather_parameters() {
    if (!stale_) return;
    check_communication();
    const stream_ref s = ctx_->stream();
    grads_ready_.record(s);  // the optimizer step that updated the shards
    comm_stream_.wait(grads_ready_);
    comm_timeline_.begin(phase::communication, comm_stream_);
    // Last bucket first: it holds the first layers, which forward reads first. Each parameter's first read waits
    // for its own bucket only (a read hook), so that forward overlaps the later gathers.
    for (std::size_t b = buckets_.size(); b-- > 0;) {
      bucket& bk = buckets_[b];
      const std::size_t es = size_of(bk.value_type);
      comm_.all_gather(static_cast<const std::byte*>(bk.values->data()) + rank_offset(bk) * es, bk.values->data(),
                       bk.shard_elements, bk.value_type, comm_stream_);
      bk.gathered->record(comm_stream_);
      for (const std::size_t k : bk.params) {
        params_[k].param->set_read_hook([this, &bk] { ctx_->stream().wait(*bk.gathered); });
      }
    }
    comm_timeline_.end(comm_stream_);
    gathered_.record(comm_stream_);
    pending_reads_ = true;
    set_stale(false);
  }

  /// ZeRO: while the returned guard lives, every rank holds whole parameters (their fp32 master values) and the
  /// whole state of `opt` (the optimizer of these parameters), as plain DDP does: save or load checkpoints, or
  /// compute weights_sha256, inside it. Its end shards them again (keeping whatever was loaded). Collective:
  /// every rank creates and ends it at the same point. Without ZeRO, a guard that does nothing.
  template <class Optimizer>
  [[nodiscard]] auto consolidated(Optimizer& opt) {
    struct guard {
      guard(distributed_data_parallel* d, Optimizer* o) : ddp(d), optimizer(o), unwinding(std::uncaught_exceptions()) {
        ddp->unshard(*optimizer);
      }
      guard(const guard&) = delete;
      guard& operator=(const guard&) = delete;
      ~guard() noexcept(false) {
        if (std::uncaught_exceptions() > unwinding) {  // leaving by an exception: shard again if possible
          try {
            ddp->reshard(*optimizer);
          } catch (...) {
          }
          return;
        }
        ddp->reshard(*optimizer);
      }
      distributed_data_parallel* ddp;
      Optimizer* optimizer;
      int unwinding;
    };
    return guard(this, &opt);
  }

  /// While the returned guard lives, backward accumulates gradients locally without communication.
  [[nodiscard]] auto no_sync() {
    struct guard {
      explicit guard(distributed_data_parallel* d) : ddp(d), previous(std::exchange(d->syncing_, false)) {}
      guard(const guard&) = delete;
      guard& operator=(const guard&) = delete;
      ~guard() { ddp->syncing_ = previous; }
      distributed_data_parallel* ddp;
      bool previous;
    };
    return guard(this);
  }

  /// Peak memory and time spent computing (forward, backward) and communicating (all-reduces, overlapped
  /// with backward) on this rank since construction or reset_report(). Waits for the measured work.
  [[nodiscard]] device_report report() {
    device_report r = compute_timeline_.report();
    const device_report c = comm_timeline_.report();
    r.communication_ms = c.communication_ms;
    r.wall_ms = std::max(r.wall_ms, c.wall_ms);
    r.idle_ms = std::max(0.0, r.wall_ms - r.compute_ms);  // communication overlaps compute: idle is non-compute
    r.parameter_bytes = parameter_bytes();
    r.gradient_bytes = gradient_bytes();
    return r;
  }

  /// Bytes this rank holds for the parameters: the values forward reads (the working copies, or the master
  /// values under f32) and the fp32 master values (under ZeRO and f16/bf16: the shard's).
  [[nodiscard]] std::uint64_t parameter_bytes() const {
    std::uint64_t n = 0;
    for (const auto& p : params_) {
      const parameter& q = *p.param;
      const auto numel = static_cast<std::uint64_t>(q.numel());
      if (q.working().empty()) {
        n += sharding_ ? 0 : 4 * numel;  // under ZeRO in the buckets' value buffers, counted below
      } else {
        n += 4 * static_cast<std::uint64_t>(q.master_shard().numel()) + (sharding_ ? 0 : numel * size_of(q.compute_type()));
      }
    }
    for (const auto& b : buckets_) n += b.values ? b.value_elements * size_of(b.value_type) : 0;
    return n;
  }
  /// Bytes this rank holds for the gradients: the buckets (with their padding), gradients kept apart from them,
  /// deterministic mode's accumulators, and under ZeRO-2 the two reused buffers and the gradient shards.
  [[nodiscard]] std::uint64_t gradient_bytes() const {
    std::uint64_t n = 0;
    if (stage2_) {
      for (const auto& buffer : grad_buffers_) n += buffer ? buffer->capacity_bytes() : 0;
      for (const auto& p : params_) n += static_cast<std::uint64_t>(p.param->grad_shard().numel()) * size_of(p.param->compute_type());
      for (const auto& t : exact_shards_) n += t.size_bytes();
      return n;
    }
    for (const auto& b : buckets_) {
      n += b.flat->size_bytes();
      if (b.grads) {  // deterministic mode with all_reduce_exact: the gradients in a buffer of the bucket
        n += b.grads->size_bytes();
        continue;
      }
      for (std::size_t i = 0; i < b.params.size(); ++i) {
        // deterministic mode: the buckets hold the accumulators, the gradients their own memory
        if (deterministic_ || !in_place(b, i)) n += static_cast<std::uint64_t>(params_[b.params[i]].param->grad().bytes().size());
      }
    }
    return n;
  }
  void reset_report() {
    compute_timeline_.reset();
    comm_timeline_.reset();
    reset_memory_stats(ctx_->get_device());
  }

 private:
  struct bucket {
    std::vector<std::size_t> params;   // indices into params_
    std::vector<std::size_t> offsets;  // element offset of each parameter's gradient in `flat`
    std::size_t elements = 0;          // of `flat`, padding included
    dtype wire = dtype::f32;
    // The layout of the parameters' values, in their compute type (ZeRO's shards and `values`): the layout of
    // `flat` when gradients travel in that type, else (deterministic mode's i64 words, a comm hook) its own.
    std::vector<std::size_t> value_offsets;
    std::size_t value_elements = 0;
    dtype value_type = dtype::f32;
    std::shared_ptr<tensor> flat;      // shared with the parameters whose gradients live in it
    std::optional<event> done;
    std::size_t ready = 0;
    // ZeRO
    std::size_t shard_elements = 0;     // value_elements / world: each rank's range (of the values, and of `flat`
                                        // when it has their layout)
    std::shared_ptr<tensor> values;     // the values forward reads, in the values' layout
    std::optional<event> released;      // stage 2: `flat` (a reused buffer) was reduced and copied out
    std::optional<event> gathered;      // `values` was all-gathered
    // deterministic mode: each parameter's count of partial gradients outside the exact window (gathered partials)
    std::shared_ptr<tensor> outside;
    // deterministic mode with all_reduce_exact: the gradients, in the values' layout, and the ends of the tensors
    // the collective sums (each parameter's values, then its padding: garbage there poisons nobody)
    std::shared_ptr<tensor> grads;
    std::vector<std::size_t> ends;
  };

  // A failed all-reduce of an earlier step ends training here, on the calling thread, before another step is
  // queued: the communicator's own failure (an abort, a timeout, NCCL's asynchronous error) or, on a host device,
  // the error kept by the communication stream (which also failed the compute stream that waited for it).
  void check_communication() {
    comm_.check();
    if (comm_stream_.get_device().is_host()) comm_stream_.host_state().rethrow_if_failed();
  }

  [[nodiscard]] dtype wire_type(dtype grad) const {
    if (deterministic_) return dtype::i64;  // exact accumulators (kernels/exact.hpp)
    if (options_.zero > 0) return grad;     // in place, reduced in fp32 by host and MPI communicators
    switch (options_.hook) {
      case comm_hook::fp16: return dtype::f16;
      case comm_hook::bf16: return dtype::bf16;
      case comm_hook::none: break;
    }
    (void)grad;
    return dtype::f32;
  }

  void build_buckets() {
    reported_.assign(params_.size(), false);
    std::size_t limit = options_.first_bucket_bytes;
    bucket current;
    std::size_t bytes = 0;
    for (std::size_t k = params_.size(); k-- > 0;) {
      parameter& p = *params_[k].param;
      const dtype wire = wire_type(p.compute_type());
      const auto elements = static_cast<std::size_t>(deterministic_ ? p.exact_words() : p.numel());
      // a bucket's size counts its gradients' values, as the partials travel in them (deterministic mode without
      // ZeRO: its 16-byte accumulators would make the first bucket a quarter as large, and then nothing overlaps
      // the backward of the model's first layers); ZeRO-2 sizes its reused buffers by the words
      const std::size_t n = deterministic_ && !sharding_ ? static_cast<std::size_t>(p.numel()) * size_of(p.compute_type())
                                                         : elements * size_of(wire);
      if (!current.params.empty() && (bytes + n > limit || wire != current.wire ||
                                       ((sharding_ || deterministic_) && p.compute_type() != current.value_type))) {
        buckets_.push_back(std::move(current));
        current = bucket{};
        bytes = 0;
        limit = options_.bucket_bytes;
      }
      current.wire = wire;
      current.value_type = p.compute_type();
      current.params.push_back(k);
      current.offsets.push_back(current.elements);
      current.elements += round_up(elements, alignment / size_of(wire));
      current.value_offsets.push_back(current.value_elements);
      current.value_elements += round_up(static_cast<std::size_t>(p.numel()), alignment / size_of(current.value_type));
      bytes += n;
    }
    if (!current.params.empty()) buckets_.push_back(std::move(current));
    const stream_ref s = ctx_->stream();
    const auto world = static_cast<std::size_t>(comm_.size());
    // The pool's cached blocks (the model's initialization staging, say) go back first, so that the buckets
    // (allocated once, for the whole run) are not served by larger cached blocks; see the end. (It waits for the
    // frees still pending on streams.)
    release_cached_memory(ctx_->get_device());
    if (sharding_) {  // every rank's range the same size, at a 256-byte boundary
      for (auto& bk : buckets_) {
        bk.value_elements = round_up(bk.value_elements, world * (alignment / size_of(bk.value_type)));
        bk.shard_elements = bk.value_elements / world;
        // reduce-scattered in the values' layout; deterministic mode's words are all-reduced (see launch)
        if (!deterministic_) bk.elements = bk.value_elements;
      }
    }
    if (stage2_) {  // two buffers, bucket b using buffer b % 2, each as large as its largest bucket
      std::size_t bytes_of[2] = {0, 0};
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        bytes_of[b % 2] = std::max(bytes_of[b % 2], stage2_bytes(buckets_[b]));
      }
      for (int i = 0; i < 2; ++i) {
        if (bytes_of[i] == 0) continue;
        grad_buffers_[i] = std::make_shared<tensor>(shape{static_cast<std::int64_t>(bytes_of[i])}, dtype::u8, s);
        fill_zero(grad_buffers_[i]->bytes(), s);
      }
    }
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      auto& bk = buckets_[b];
      if (stage2_) {
        bk.flat = grad_buffers_[b % 2];
        bk.released.emplace(ctx_->get_device());
      } else {
        // deterministic mode: room for the exact accumulators, or for the partial gradients start_gathering()
        // gathers (16 bytes per value: as much as the accumulators, but for the values' alignment)
        const std::size_t words = deterministic_ && !sharding_ ? std::max(bk.elements, 2 * bk.value_elements) : bk.elements;
        bk.flat = std::make_shared<tensor>(shape{static_cast<std::int64_t>(words)}, bk.wire, s);
        fill_zero(bk.flat->bytes(), s);  // the padding between gradients stays zero
      }
      if (sharding_) {
        bk.values = std::make_shared<tensor>(shape{static_cast<std::int64_t>(bk.value_elements)}, bk.value_type, s);
        fill_zero(bk.values->bytes(), s);
        bk.gathered.emplace(ctx_->get_device());
      }
      bk.done.emplace(ctx_->get_device());
      if (deterministic_) {
        bk.outside = std::make_shared<tensor>(shape{static_cast<std::int64_t>(bk.params.size())}, dtype::i64, s);
      }
      if (deterministic_ && !sharding_ && exact_collective_) {  // one all_reduce_exact per bucket: see launch
        bk.grads = std::make_shared<tensor>(shape{static_cast<std::int64_t>(bk.value_elements)}, bk.value_type, s);
        fill_zero(bk.grads->bytes(), s);
        for (std::size_t i = 0; i < bk.params.size(); ++i) {
          bk.ends.push_back(bk.value_offsets[i] + static_cast<std::size_t>(params_[bk.params[i]].param->numel()));
          bk.ends.push_back(i + 1 < bk.params.size() ? bk.value_offsets[i + 1] : bk.value_elements);
        }
      }
      for (std::size_t i = 0; i < bk.params.size(); ++i) {
        bucket_of_.emplace(bk.params[i], b);
        parameter& p = *params_[bk.params[i]].param;
        // ZeRO-2: buckets share buffers, so a gradient must start zero (its first write then waits for the
        // buffer's previous bucket): what one held before the wrapper is dropped
        if (stage2_) p.zero_grad();
        if (bk.grads) p.share_grad_storage(value_slot(bk, i, *bk.grads), bk.grads, s);
        if (deterministic_) {
          p.share_exact_storage(slot(bk, i), bk.flat);
          // ZeRO-2: the whole gradient (only ever zeroed: the sums are rounded into the shard) after the words
          if (stage2_) p.share_grad_storage(stage2_grad_slot(bk, i), bk.flat, s);
        } else if (p.compute_type() == bk.wire) {
          p.share_grad_storage(slot(bk, i), bk.flat, s);
        }
        if (sharding_) {
          p.share_compute_storage(value_slot(bk, i, *bk.values), bk.values, s);
          ranges_[bk.params[i]] = shard_of(bk, i);
          if (stage2_) p.set_first_write_hook([this, b] { before_first_write(b); });
        }
      }
    }
    // What the wrapper freed (gradients moved into buckets; under ZeRO the working copies, then the whole masters)
    // goes back to the device rather than staying cached in its pool, where a later allocation of another size
    // could take a block up to twice its size (host devices) and hold memory training does not need.
    release_cached_memory(ctx_->get_device());
    if (sharding_) {
      for (std::size_t k = 0; k < params_.size(); ++k) params_[k].param->set_shard(ranges_[k], stage2_, s);
      if (stage2_ && deterministic_) {  // each gradient shard's exact sum, kept across micro-batches
        exact_shards_.resize(params_.size());
        for (std::size_t k = 0; k < params_.size(); ++k) {
          const auto m = static_cast<std::size_t>(ranges_[k].size());
          exact_shards_[k] = tensor(shape{static_cast<std::int64_t>(kernels::exact_words(m))}, dtype::i64, s);
        }
      }
      release_cached_memory(ctx_->get_device());
    }
  }

  // ZeRO-2: the bytes of a reused buffer that bucket b takes: its gradients (in deterministic mode its exact
  // accumulators, then the whole gradients in the values' layout, at a 256-byte boundary).
  [[nodiscard]] std::size_t stage2_bytes(const bucket& b) const {
    const std::size_t words = b.elements * size_of(b.wire);
    return deterministic_ ? round_up(words, alignment) + b.value_elements * size_of(b.value_type) : words;
  }
  [[nodiscard]] tensor_view stage2_grad_slot(const bucket& b, std::size_t i) const {
    const std::size_t at = round_up(b.elements * size_of(b.wire), alignment) + b.value_offsets[i] * size_of(b.value_type);
    return tensor_view(static_cast<std::byte*>(b.flat->data()) + at, b.value_type, params_[b.params[i]].param->dims(),
                       ctx_->get_device());
  }

  // ZeRO: the first element of this rank's range in bucket b.
  [[nodiscard]] std::size_t rank_offset(const bucket& b) const noexcept {
    return static_cast<std::size_t>(comm_.rank()) * b.shard_elements;
  }
  // ZeRO: the elements of the i-th parameter of bucket b that fall in this rank's range.
  [[nodiscard]] element_range shard_of(const bucket& b, std::size_t i) const {
    const auto n = static_cast<std::int64_t>(params_[b.params[i]].param->numel());
    const auto at = static_cast<std::int64_t>(b.value_offsets[i]);
    const auto first = static_cast<std::int64_t>(rank_offset(b));
    const auto last = first + static_cast<std::int64_t>(b.shard_elements);
    const element_range r{std::clamp<std::int64_t>(first - at, 0, n), std::clamp<std::int64_t>(last - at, 0, n)};
    return r.empty() ? element_range{} : r;
  }

  // ZeRO-2: the whole gradient of a parameter of bucket b is about to be written into its buffer, which bucket
  // b - 2 used before: the write waits until that bucket was reduced and copied out. (Buckets 0 and 1 follow the
  // previous step's last buckets, which backward waited for.)
  void before_first_write(std::size_t b) {
    if (b < 2) return;
    LOCKSTEP_EXPECTS(next_launch_ > b - 2, "distributed_data_parallel (ZeRO-2): a gradient of bucket ", b,
                     " is written before bucket ", b - 2, ", which shares its buffer, was reduced (a layer whose "
                     "parameters span three buckets); raise ddp_options::bucket_bytes");
    ctx_->stream().wait(*buckets_[b - 2].released);
  }

  static constexpr std::size_t alignment = 256;  // bytes, as cudaMalloc's
  static constexpr std::size_t round_up(std::size_t n, std::size_t m) noexcept { return (n + m - 1) / m * m; }

  // Where the gradient (in deterministic mode: the exact accumulator) of the i-th parameter of bucket b goes in
  // its buffer.
  [[nodiscard]] tensor_view slot(const bucket& b, std::size_t i) const {
    const parameter& p = *params_[b.params[i]].param;
    const shape dims = deterministic_ ? shape{p.exact_words()} : p.dims();
    return tensor_view(static_cast<std::byte*>(b.flat->data()) + b.offsets[i] * size_of(b.wire), b.wire, dims,
                       ctx_->get_device());
  }
  // Where the values of the i-th parameter of bucket b go in a buffer of the values' layout (ZeRO's `values`).
  [[nodiscard]] tensor_view value_slot(const bucket& b, std::size_t i, const tensor& buffer) const {
    return tensor_view(static_cast<std::byte*>(const_cast<void*>(buffer.data())) + b.value_offsets[i] * size_of(buffer.type()),
                       buffer.type(), params_[b.params[i]].param->dims(), ctx_->get_device());
  }
  // Whether the i-th parameter's gradient (or exact accumulator) lives in bucket b's buffer (no copy needed).
  [[nodiscard]] bool in_place(const bucket& b, std::size_t i) const {
    const parameter& p = *params_[b.params[i]].param;
    return (deterministic_ ? p.exact_grad() : p.grad()).data() == slot(b, i).data();
  }

  void on_gradients_ready(std::span<parameter* const> ps) {
    for (parameter* p : ps) {
      auto it = index_.find(p);
      if (it == index_.end() || reported_[it->second]) continue;  // nested containers may report twice
      reported_[it->second] = true;
      ++buckets_[bucket_of_.at(it->second)].ready;
    }
    // Buckets are all-reduced in bucket order, whatever order backward finishes them in (another graph order,
    // an unused parameter, a rank without data): every rank must issue the same collectives in the same order.
    // So the longest ready prefix goes: a bucket that is ready early waits for the ones before it.
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready == buckets_[next_launch_].params.size()) {
      launch(next_launch_++);
    }
  }

  // Packs a bucket's gradients (in stream order after the backward work that wrote them), then all-reduces it
  // on the communication stream.
  void launch(std::size_t index) {
    bucket& b = buckets_[index];
    const stream_ref s = ctx_->stream();
    for (std::size_t i = 0; i < b.params.size(); ++i) {
      parameter& p = *params_[b.params[i]].param;
      if (gathering()) {  // a parameter backward did not reach contributes zeros
        if (!p.grad_is_zero()) continue;
        (void)p.begin_accumulate();
        zero_partials_slots(p, 0, s);
        p.set_exact_grad_holds_sum(true);
        continue;
      }
      p.materialize_full_grad(s);
      if (!in_place(b, i)) convert(p.grad(), slot(b, i), s);
    }
    grads_ready_.record(s);
    comm_stream_.wait(grads_ready_);
    comm_timeline_.begin(phase::communication, comm_stream_);
    const reduce_op op = options_.reduction == gradient_reduction::mean ? reduce_op::mean : reduce_op::sum;
    if (gathering() && exact_collective_) {
      // each gradient the exact sum of every rank's slots, rounded once, by the communicator: the bucket's
      // gradients at once (this rank's slots at the start of `flat`, the gradients in `grads`)
      comm_.all_reduce_exact(b.flat->data(), static_cast<std::size_t>(gather_slots_), b.value_elements, b.grads->data(),
                             b.value_elements, b.value_type, b.ends, comm_stream_);
    } else if (gathering()) {
      // every rank's slots of partial gradients to every rank (in place: this rank's are at its offset)
      const std::size_t piece = static_cast<std::size_t>(gather_slots_) * b.value_elements;
      comm_.all_gather(static_cast<std::byte*>(b.flat->data()) + static_cast<std::size_t>(comm_.rank()) * piece * size_of(b.value_type),
                       b.flat->data(), piece, b.value_type, comm_stream_);
    } else if (sharding_ && !deterministic_) {
      // in place: this rank's range of the buffer receives the sum of everyone's
      comm_.reduce_scatter(b.flat->data(), static_cast<std::byte*>(b.flat->data()) + rank_offset(b) * size_of(b.wire),
                           b.shard_elements, b.wire, op, comm_stream_);
    } else {
      comm_.all_reduce(b.flat->data(), b.flat->data(), b.elements, b.wire, op, comm_stream_);
    }
    comm_timeline_.end(comm_stream_);
    if (stage2_) copy_out(b);
    b.done->record(comm_stream_);
  }

  // Deterministic mode: decides whether this backward gathers the chunks' partial gradients themselves rather than
  // exact accumulators (the same bits either way: both give each gradient the correctly rounded exact sum of its
  // chunks' partials). Every rank must decide alike, so the decision rests on what every rank has: the global
  // batch (context::set_global_rows), the world size, the buckets, whether no_sync() backward calls came before
  // (every rank makes them, with rows or not: this backward adds to their exact sums), and the gradients being
  // zero (zero_grad, which every rank calls; after a synchronized backward every rank's are written). It gathers
  // when every rank's slots (as many as the most chunks a rank holds, deterministic_shard) fit in the memory of the
  // bucket's accumulators; then each parameter learns where its partials go.
  void start_gathering() {
    if (!deterministic_ || sharding_ || accumulated_ || ctx_->global_rows() == 0) return;
    const std::int64_t cr = ctx_->deterministic()->chunk_rows, world = comm_.size();
    // rank 0 holds the most chunks of any rank
    const std::int64_t slots = (deterministic_shard(ctx_->global_rows(), cr, 0, comm_.size()).rows + cr - 1) / cr;
    // (see build_buckets; all_reduce_exact reads every rank's slots where they are: a bucket holds its own only)
    const std::int64_t held = exact_collective_ ? slots : world * slots;
    for (const auto& b : buckets_) {
      if (static_cast<std::size_t>(held) * size_of(b.value_type) > 16) return;
    }
    for (const auto& p : params_) {
      if (!p.param->grad_is_zero()) return;
    }
    set_partials_targets(slots);
  }
  // Whether this backward gathers partial gradients: the parameters know their slots.
  [[nodiscard]] bool gathering() const noexcept { return gather_slots_ != 0; }

  // Tells every parameter where this backward's partial gradients go: its values' place in this rank's `slots`
  // slots of its bucket (each slot one bucket of values, in the values' layout); with 0, the exact accumulators.
  void set_partials_targets(std::int64_t slots) {
    for (const auto& b : buckets_) {
      const std::size_t es = size_of(b.value_type);
      const std::int64_t first = exact_collective_ ? 0 : comm_.rank() * slots;  // an all-gather's place for this rank
      auto* mine = static_cast<std::byte*>(b.flat->data()) + static_cast<std::size_t>(first) * b.value_elements * es;
      for (std::size_t i = 0; i < b.params.size(); ++i) {
        params_[b.params[i]].param->set_exact_partials_target(
            slots == 0 ? parameter::exact_partials{}
                       : parameter::exact_partials{mine + b.value_offsets[i] * es, static_cast<std::int64_t>(b.value_elements), slots});
      }
    }
    gather_slots_ = slots;
  }

  // Deterministic mode, gathered: each gradient of bucket b the exact sum of every rank's slots, rounded once (in
  // stream order on the context's stream, after the all-gather).
  void sum_gathered(const bucket& b) {
    const stream_ref s = ctx_->stream();
    if (!exact_collective_) fill_zero(b.outside->bytes(), s);
    const auto terms = static_cast<std::size_t>(gather_slots_ * comm_.size());
    for (std::size_t i = 0; i < b.params.size(); ++i) {
      parameter& p = *params_[b.params[i]].param;
      const auto n = static_cast<std::size_t>(p.numel());
      if (n == 0) continue;
      expect_exact_gradient(p);  // its slots were written by exact_gradient (or zeroed by launch)
      p.set_exact_grad_holds_sum(false);  // the slots are summed: a next backward without zero_grad is refused
      if (exact_collective_) continue;    // all_reduce_exact summed them
      dispatch_floating(b.value_type, "exact gradient sum", [&]<class T>() {
        const T* partials = static_cast<const T*>(b.flat->data()) + b.value_offsets[i];  // [world * slots][elements]
        sum_exact_terms<T>(partials, terms, b.value_elements, n, p.grad().as<T>(), b.outside->template as<std::int64_t>() + i, s);
      });
    }
  }

  // ZeRO: orders the context's stream after every all-gather of the last gather_parameters() (the read hooks
  // ordered only the reads forward made).
  void wait_for_gathers() {
    if (!pending_reads_) return;
    ctx_->stream().wait(gathered_);
    for (const auto& p : params_) p.param->set_read_hook(nullptr);
    pending_reads_ = false;
  }

  // ZeRO-2: the reduced shard of bucket b into the parameters' own gradient shards (added to what they hold since
  // zero_grad), on the communication stream; then the buffer may be reused.
  void copy_out(bucket& b) {
    for (std::size_t i = 0; i < b.params.size(); ++i) {
      parameter& p = *params_[b.params[i]].param;
      const element_range r = ranges_[b.params[i]];
      const tensor_view to = p.grad_shard();
      p.release_full_grad();
      if (r.empty()) continue;
      const float keep = p.begin_shard_accumulate();
      if (deterministic_) {
        add_exact_shard(b, i, keep == 0.0f);
        continue;
      }
      const tensor_view from(static_cast<std::byte*>(b.flat->data()) + (b.offsets[i] + static_cast<std::size_t>(r.begin)) * size_of(b.wire),
                             b.wire, shape{r.size()}, ctx_->get_device());
      dispatch_floating(b.wire, "ZeRO-2 gradient shard", [&]<class T>() {
        if (keep == 0.0f) {
          copy(to.span<T>(), from.span<const T>(), comm_stream_);
        } else {
          axpy<T>(1.0f, from.span<const T>(), to.span<T>(), comm_stream_);
        }
      });
    }
    b.released->record(comm_stream_);
  }

  // ZeRO-2, deterministic mode: the all-reduced exact sums of the shard of bucket b's i-th parameter written over
  // (`overwrite`) or added to its shard's exact sum, which is then rounded into the gradient shard; on the
  // communication stream.
  void add_exact_shard(const bucket& b, std::size_t i, bool overwrite) {
    const std::size_t k = b.params[i];
    parameter& p = *params_[k].param;
    const element_range r = ranges_[k];
    const auto n = static_cast<std::size_t>(p.numel()), m = static_cast<std::size_t>(r.size());
    const std::int64_t* words = static_cast<const std::int64_t*>(b.flat->data()) + b.offsets[i];
    std::int64_t* shard = exact_shards_[k].as<std::int64_t>();
    const std::int64_t* from[3] = {words + r.begin, words + n + r.begin, words + 2 * n};  // hi, lo, count
    std::int64_t* to[3] = {shard, shard + m, shard + 2 * m};
    for (int part = 0; part < 3; ++part) {
      const std::size_t count = part < 2 ? m : 1;
      if (overwrite) {
        copy(device_span<std::int64_t>(to[part], count, ctx_->get_device()),
             device_span<const std::int64_t>(from[part], count, ctx_->get_device()), comm_stream_);
      } else {
        launch_elementwise(count, kernels::exact_add_words_op{from[part], to[part]}, comm_stream_, "ZeRO-2 exact shard");
      }
    }
    round_exact_limbs(p.compute_type(), to[0], to[1], to[2], p.grad_shard().data(), m, comm_stream_);
  }

  // ZeRO: whole fp32 tensors from every rank's shards, bucket by bucket, in stream order on the communication
  // stream (which waits for the context's stream first; the context's stream waits for it at the end). For each
  // parameter k with wanted(k) (the same on every rank), piece(k) is its shard on this rank (shard().size()
  // floats) and take(k, whole) receives all numel() values, flat, in a temporary buffer.
  template <class Wanted, class Piece, class Take>
  void gather_whole(Wanted&& wanted, Piece&& piece, Take&& take) {
    const stream_ref s = comm_stream_;
    grads_ready_.record(ctx_->stream());
    s.wait(grads_ready_);
    for (auto& b : buckets_) {
      if (std::none_of(b.params.begin(), b.params.end(), wanted)) continue;
      tensor flat(shape{static_cast<std::int64_t>(b.value_elements)}, dtype::f32, s);
      fill_zero(flat.span<float>(), s);
      for (std::size_t i = 0; i < b.params.size(); ++i) {
        const std::size_t k = b.params[i];
        if (!wanted(k) || ranges_[k].empty()) continue;
        copy(flat.span<float>().subspan(b.value_offsets[i] + static_cast<std::size_t>(ranges_[k].begin),
                                        static_cast<std::size_t>(ranges_[k].size())),
             piece(k).template span<const float>(), s);
      }
      comm_.all_gather(flat.span<float>().data() + rank_offset(b), flat.data(), b.shard_elements, dtype::f32, s);
      for (std::size_t i = 0; i < b.params.size(); ++i) {
        const std::size_t k = b.params[i];
        if (!wanted(k)) continue;
        take(k, value_slot(b, i, flat));
      }
    }
    gathered_.record(s);
    ctx_->stream().wait(gathered_);
  }

  // ZeRO: the whole master values and optimizer state on every rank (consolidated()).
  template <class Optimizer>
  void unshard(Optimizer& opt) {
    if (!sharding_ || consolidations_++ > 0) return;  // nested guards: the outermost one gathers
    // The values whole and current for the guard's readers; if a step may still come (a save between backward
    // and the step), the next forward gathers again (reshard marks them stale again).
    regather_ = stale_;
    gather_parameters();
    wait_for_gathers();  // the guard's readers (checkpoints) read the values on any stream
    // Every rank gathers the same state tensors: a rank that saved before the first step has state (the save
    // materialized it) that the others lack, so all materialize it (zeros; the next step stays a first step).
    opt.materialize_state(ctx_->stream());
    const stream_ref s = comm_stream_;
    std::unordered_map<std::size_t, std::pair<std::size_t, std::size_t>> where;  // parameter -> (group, index)
    for_each_state(opt, [&](std::size_t g, std::size_t i, std::size_t k) { where.emplace(k, std::pair{g, i}); });
    for (int which = 0; which < Optimizer::state_count; ++which) {
      gather_whole([&](std::size_t k) { return where.contains(k); },
                   [&](std::size_t k) { return opt.state(where.at(k).first, where.at(k).second, which); },
                   [&](std::size_t k, const tensor_view& whole) {
                     tensor t(params_[k].param->dims(), dtype::f32, s);
                     copy(t.span<float>(), whole.span<const float>(), s);
                     // the shard was read on this stream (gather_whole's copy): freed after that read
                     opt.replace_state(where.at(k).first, where.at(k).second, which, std::move(t)).set_stream(s);
                   });
    }
    gather_whole([&](std::size_t k) { return !params_[k].param->working().empty(); },  // f16/bf16: masters sharded
                 [&](std::size_t k) { return params_[k].param->master_shard(); },
                 [&](std::size_t k, const tensor_view& whole) { params_[k].param->clear_shard(whole, s); });
    for (const auto& p : params_) p.param->clear_shard(tensor_view{}, s);  // the f32 ones: nothing to gather
    comm_.synchronize(s);
  }

  // ZeRO: back to shards after consolidated(): the optimizer state and the master values keep this rank's range.
  template <class Optimizer>
  void reshard(Optimizer& opt) {
    if (!sharding_ || --consolidations_ > 0) return;
    const stream_ref s = ctx_->stream();
    for (int which = 0; which < Optimizer::state_count; ++which) {
      for_each_state(opt, [&](std::size_t g, std::size_t i, std::size_t k) {
        const element_range r = ranges_[k];
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
    for (std::size_t k = 0; k < params_.size(); ++k) params_[k].param->set_shard(ranges_[k], stage2_, s);
    if (std::exchange(regather_, false)) set_stale(true);
  }

  // ZeRO: every parameter's values stale (after backward) or current (after a gather).
  void set_stale(bool stale) {
    for (const auto& p : params_) p.param->set_stale(stale);
    stale_ = stale;
  }

  // Calls f(group, index in group, parameter index) for every parameter of this wrapper for which `opt` holds
  // state (all of a group's state tensors exist once it has any).
  template <class Optimizer, class F>
  void for_each_state(Optimizer& opt, F&& f) {
    for (std::size_t g = 0; g < opt.group_count(); ++g) {
      if (!opt.has_state(g)) continue;
      const auto& ps = opt.params(g);
      for (std::size_t i = 0; i < ps.size(); ++i) {
        const auto it = index_.find(ps[i]);
        if (it != index_.end()) f(g, i, it->second);
      }
    }
  }

  // Copies `from` into `to` (same number of elements), casting between floating types.
  static void convert(const tensor_view& from, const tensor_view& to, stream_ref s) {
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

  // Restores the gradients that travelled in another type from the all-reduced bucket.
  void unpack(const bucket& b) {
    for (std::size_t i = 0; i < b.params.size(); ++i) {
      if (!in_place(b, i)) convert(slot(b, i), params_[b.params[i]].param->grad(), ctx_->stream());
    }
  }

  // Every rank must have the same parameters in the same order: names (first 56 bytes) and shapes are
  // gathered and compared; a mismatch names the rank and the parameter.
  void check_same_parameters() {
    const stream_ref s = comm_stream_;
    const int world = comm_.size();
    constexpr std::size_t name_bytes = 56;
    constexpr std::size_t record = name_bytes + 8 * shape::max_rank + 8 + 8;  // name, rank and dims, compute type
    // 1. the counts
    auto count = to_device(std::vector<std::int64_t>{static_cast<std::int64_t>(params_.size())}, s);
    device_buffer<std::int64_t> counts(static_cast<std::size_t>(world), s);
    comm_.all_gather(device_span<const std::int64_t>(count.span()), counts.span(), s);
    comm_.synchronize(s);
    const auto all_counts = to_vector(device_span<const std::int64_t>(counts.span()), s);
    for (int r = 0; r < world; ++r) {
      if (all_counts[static_cast<std::size_t>(r)] != all_counts[0]) {
        throw precondition_error(detail::concat(
            "distributed_data_parallel: rank ", r, " has ", all_counts[static_cast<std::size_t>(r)],
            " parameters but rank 0 has ", all_counts[0], ": every rank must wrap the same model"));
      }
    }
    if (params_.empty()) return;
    // 2. name and shape of every parameter
    std::vector<std::uint8_t> mine(params_.size() * record, 0);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      std::uint8_t* rec = mine.data() + i * record;
      const std::string& name = params_[i].name;
      std::memcpy(rec, name.data(), std::min(name.size(), name_bytes));
      const shape& dims = params_[i].param->dims();
      std::int64_t fields[shape::max_rank + 1] = {dims.rank()};
      for (int d = 0; d < dims.rank(); ++d) fields[d + 1] = dims[d];
      std::memcpy(rec + name_bytes, fields, sizeof fields);
      // the compute type too: it decides the buckets' layout (under ZeRO, the type gradients travel in)
      const auto type = static_cast<std::int64_t>(params_[i].param->compute_type());
      std::memcpy(rec + name_bytes + sizeof fields, &type, sizeof type);
    }
    auto mine_dev = to_device(mine, s);
    device_buffer<std::uint8_t> all(mine.size() * static_cast<std::size_t>(world), s);
    comm_.all_gather(device_span<const std::uint8_t>(mine_dev.span()), all.span(), s);
    comm_.synchronize(s);
    const auto everyone = to_vector(device_span<const std::uint8_t>(all.span()), s);
    auto describe = [&](const std::uint8_t* rec) {
      std::string name(reinterpret_cast<const char*>(rec), name_bytes);
      name.resize(std::strlen(name.c_str()));
      std::int64_t fields[shape::max_rank + 1];
      std::memcpy(fields, rec + name_bytes, sizeof fields);
      std::string dims = "[";
      for (std::int64_t d = 0; d < fields[0]; ++d) dims += (d ? ", " : "") + std::to_string(fields[d + 1]);
      std::int64_t type = 0;
      std::memcpy(&type, rec + name_bytes + sizeof fields, sizeof type);
      return "'" + name + "' " + dims + "] " + std::string(name_of(static_cast<dtype>(type)));
    };
    for (int r = 1; r < world; ++r) {
      for (std::size_t i = 0; i < params_.size(); ++i) {
        const std::uint8_t* theirs = everyone.data() + (static_cast<std::size_t>(r) * params_.size() + i) * record;
        const std::uint8_t* first = everyone.data() + i * record;
        if (std::memcmp(theirs, first, record) != 0) {
          throw precondition_error(detail::concat("distributed_data_parallel: parameter ", i, " of rank ", r, " is ",
                                                  describe(theirs), " but rank 0's is ", describe(first),
                                                  ": every rank must wrap the same model"));
        }
      }
    }
  }

  // Rank 0's fp32 values to every rank, packed into one buffer; working copies refreshed.
  void broadcast_parameters() {
    if (comm_.size() == 1 || params_.empty()) return;
    const stream_ref s = comm_stream_;
    synchronize(ctx_->get_device());  // the model's initialization, on whatever stream it ran
    std::size_t total = 0;
    for (const auto& p : params_) total += static_cast<std::size_t>(p.param->numel());
    device_buffer<float> flat(total, s);
    std::size_t offset = 0;
    for (const auto& p : params_) {
      const auto n = static_cast<std::size_t>(p.param->numel());
      copy(flat.span().subspan(offset, n), p.param->value().span<const float>(), s);
      offset += n;
    }
    comm_.broadcast(flat.span(), 0, s);
    offset = 0;
    for (const auto& p : params_) {
      const auto n = static_cast<std::size_t>(p.param->numel());
      copy(p.param->value().span<float>(), device_span<const float>(flat.span().subspan(offset, n)), s);
      p.param->refresh_working_copy(s);
      offset += n;
    }
    comm_.synchronize(s);
  }

  Model* model_;
  context* ctx_;
  communicator_ref comm_;
  stream_ref comm_stream_;
  ddp_options options_;
  bool deterministic_;  // buckets of exact accumulators (nn/deterministic.hpp), rounded after the all-reduce
  parameter_list params_;
  std::unordered_map<parameter*, std::size_t> index_;
  std::unordered_map<std::size_t, std::size_t> bucket_of_;
  std::vector<bucket> buckets_;
  std::vector<bool> reported_;
  std::size_t next_launch_ = 0;  // the next bucket to all-reduce, in bucket order
  event grads_ready_;
  bool syncing_ = true;
  bool gathered_partials_ = false;  // deterministic mode: the last backward gathered partial gradients
  bool buckets_dirty_ = false;      // partial gradients were gathered in the buckets since they were last zeroed
  bool accumulated_ = false;        // no_sync() backward calls since the last synchronized one
  std::int64_t gather_slots_ = 0;  // each rank's slots of partial gradients while a backward gathers them (else 0)
  bool exact_collective_ = false;  // the communicator sums the slots itself (all_reduce_exact): no gather
  // ZeRO
  bool sharding_ = false;                        // zero > 0 on more than one rank
  bool stage2_ = false;                          // and zero == 2
  int consolidations_ = 0;                       // consolidated() guards alive
  bool regather_ = false;                        // stale when the outermost guard began: stale again at its end
  bool pending_reads_ = false;                   // gathered, and the context's stream not yet after every gather
  bool stale_ = false;                           // shards updated since the last gather
  std::vector<element_range> ranges_;            // each parameter's shard on this rank
  std::shared_ptr<tensor> grad_buffers_[2];      // stage 2: the buffers buckets take turns in
  std::vector<tensor> exact_shards_;             // stage 2, deterministic mode: each gradient shard's exact sum
  event gathered_;
  timeline compute_timeline_;
  timeline comm_timeline_;
};

LOCKSTEP_ABI_END
