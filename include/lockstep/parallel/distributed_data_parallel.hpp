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
// rest of backward (a host device short of cores runs them on the compute stream: host_collectives.hpp). Inside
// `no_sync()` gradients accumulate locally; the first backward after it reduces everything accumulated.
//
// Sum or mean is explicit (`gradient_reduction`): `sum` (the default) pairs with a loss whose mean divides by the
// GLOBAL batch size, which gives exactly the gradients of one device training on the whole batch, even when shards
// differ in size. The wrapper sees to it: each training forward (no_sync() included) sums the ranks' rows (one
// 8-byte all-reduce on the communication stream, which only the loss waits for; none when context::set_global_rows
// told it) and tells the loss computed on its output (nn/context.hpp's batch_share), and a synchronized backward
// sums the ranks' losses, so that `loss.read_loss` gives the global batch's loss on every rank. `mean` is
// PyTorch's convention (each rank averages its own shard, gradients are averaged over ranks), exact only for equal
// shards; the loss is then each rank's own.
// Dropout: unless the user set the context's row offset, each forward sets rank x rows (the global row of equal
// shards), so that ranks draw different masks; the context's step advances with every loss's backward.
// Gradients live in their buckets (PyTorch's gradient_as_bucket_view): each bucket is one buffer, and every
// parameter whose gradient travels in its own type has its gradient placed in it, at a 256-byte boundary, so the
// all-reduce reads and leaves them in place, with no second copy. f16/bf16 gradients travel in their own type where
// the communicator sums them in fp32 (host cliques, MPI: an fp32 all-reduce's bits) or under a hook of their type;
// the others (on NCCL, which adds in the type; under a hook of another type) are cast into the bucket and back.
//
// Buffers (batch norm's running statistics: parameter_list::buffers()) are rank 0's on every rank: broadcast at
// construction and before each forward outside no_sync() (ddp_options::broadcast_buffers, PyTorch's default).
// A rank whose shard of a step is empty (a batch smaller than the world) calls backward with an empty
// gradient: it contributes zeros and takes part in every all-reduce, as the others expect.
//
// ZeRO (`ddp_options::zero`, Rajbhandari et al. 2019; parallel/detail/zero_shards.hpp): stage 1 reduce-scatters each bucket instead of
// all-reducing it, so that each rank receives the sum of its shard only, a contiguous range of the bucket (buckets
// are padded so that every rank's range has the same size). The parameters learn their shard
// (parameter::shard()): the optimizer keeps state for it and steps it alone, the loss scaler and the clipper read
// it (with the communicator, so that every rank skips the same steps and the norm covers every shard), and
// under f16/bf16 the fp32 master values outside it are freed. The values forward reads live in one flat buffer
// per bucket, so the next forward() (or gather_parameters()) all-gathers the updated shards in place. Stage 2
// also frees the gradients outside the shard: the whole gradients of a bucket live in one of two buffers reused
// bucket after bucket (a write into a buffer waits for the bucket that used it before to be reduced and copied
// out), and each parameter keeps its shard's gradient in storage of its own. Stage 3 also frees the values
// outside the shard between steps: each rank keeps its range of every bucket's values (under f32 those are the
// master values); a graph or sequential is gathered layer by layer during forward and backward, freed as it goes
// (parallel/detail/gathered_values.hpp), any other model whole before forward (as gather_parameters() does), and a
// synchronized backward frees what is left (a model used outside the wrapper after it needs gather_parameters()). Gradients travel in their own
// type when the communicator sums f16/bf16 in fp32 and rounds once (host cliques, MPI: the bits of DDP's fp32
// all-reduce); on NCCL, which adds them in the type, an f16/bf16 bucket is widened into one f32 buffer for its
// reduce-scatter and each rank's range rounded back once (parallel/detail/gradient_sync.hpp): DDP's sums there too.
// Inside no_sync(), stage 1 accumulates whole gradients as DDP does; stage 2 reduce-scatters every backward
// and adds into the shard. Checkpoints and weights_sha256 read whole tensors through the host, in chunks
// (visit_whole_state, visit_master_values; a load writes each rank's range); `consolidated(optimizer)` gathers the
// master values and the optimizer state whole on every rank's device for as long as its guard lives.
//
// Failures: a failed all-reduce (a peer that died, stopped or aborted; a timeout; ranks that issue different
// collectives) fails the step on every rank. On host devices the stream of the collectives keeps the error and
// the compute stream (which waits for the all-reduce, or is that stream) fails with it: the step's later work
// (unpacking, the optimizer step) does not run, and the next synchronization throws. On GPUs the communicator's
// watchdog aborts it. Either way the next backward() throws before queuing anything (comm.check()).
//
// The parts (parallel/detail/): bucket_plan (the pure layout), bucket_memory (the buckets allocated and the
// gradients placed in them), gradient_sync (one sync_kind per backward: launch and finish), exact_partials
// (deterministic mode's gathered partial gradients), zero_shards (ZeRO's shards, gathers and consolidation),
// gathered_values (ZeRO-3's schedule of gathers, layer by layer),
// replica_agreement (the same parameters and settings on every rank, rank 0's values broadcast), global_batch (the
// loss's share of the global batch), over ddp_replica (what they share). This file orders them: construction,
// forward, backward, no_sync, consolidated, the report.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/config.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/deterministic.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/parallel/ddp_options.hpp"
#include "lockstep/parallel/detail/bucket_memory.hpp"
#include "lockstep/parallel/detail/bucket_plan.hpp"
#include "lockstep/parallel/detail/ddp_replica.hpp"
#include "lockstep/parallel/detail/exact_partials.hpp"
#include "lockstep/parallel/detail/gathered_values.hpp"
#include "lockstep/parallel/detail/global_batch.hpp"
#include "lockstep/parallel/detail/gradient_sync.hpp"
#include "lockstep/parallel/detail/host_visits.hpp"
#include "lockstep/parallel/detail/replica_agreement.hpp"
#include "lockstep/parallel/detail/replica_groups.hpp"
#include "lockstep/parallel/detail/zero_shards.hpp"
#include "lockstep/parallel/host_collectives.hpp"
#include "lockstep/parallel/timeline.hpp"
#include "lockstep/runtime/memory.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN

template <layer Model>
class distributed_data_parallel {
 public:
  /// Wraps `model` (on ctx's device) for rank comm.rank() of comm.size(). Collectives run on `comm_stream`
  /// (another stream of the device; host devices: host_collective_stream). Checks that every rank has the same
  /// parameters and options, then broadcasts rank 0's values (this waits for the other ranks: every rank must
  /// construct its wrapper). `model`, `ctx`, `comm` and the stream must outlive this object.
  distributed_data_parallel(Model& model, context& ctx, communicator_ref comm, stream_ref comm_stream,
                            ddp_options options = {})
      : model_(&model), options_(checked(options, ctx, comm, comm_stream)),
        replica_(ctx, comm, detail::collective_stream(options_.host_collectives, ctx.stream(), comm, comm_stream),
                 parameters_of(model),
                 options.deterministic.has_value() || ctx.deterministic().has_value()),
        compute_timeline_(ctx.get_device()), comm_timeline_(ctx.get_device()), partials_(replica_),
        shards_(replica_), values_(replica_, shards_, comm_timeline_),
        sync_(replica_, options.reduction == gradient_reduction::mean ? reduce_op::mean : reduce_op::sum, partials_,
              shards_, values_, comm_timeline_),
        replicas_(comm, replica_.comm_stream) {
    if (options.deterministic) ctx.set_deterministic(options.deterministic);
    if (replica_.deterministic) {
      LOCKSTEP_EXPECTS(options.reduction == gradient_reduction::sum && options.hook == comm_hook::none,
                       "distributed_data_parallel: the context is in deterministic mode, which all-reduces exact sums: "
                       "use gradient_reduction::sum (with a loss whose mean divides by the global batch) and "
                       "comm_hook::none");
      ctx.set_gradient_rounding(exact_rounding::by_wrapper);
    }
    replica_.sharded = options.zero != zero_stage::none && comm.size() > 1;
    replica_.reused_buffers = replica_.sharded && options.zero >= zero_stage::gradients;
    replica_.values_sharded = replica_.sharded && options.zero == zero_stage::parameters;
    replica_.exact_collective = comm.supports(collective_kind::all_reduce_exact);
    detail::check_same_settings({options_line(options_, ctx)}, comm, replica_.comm_stream);  // they shape the collectives
    // a model built under deferred_master_values: whole masters without ZeRO, and for f32 (forward reads them) below ZeRO-3
    for (const auto& p : replica_.params) {
      if (!replica_.sharded || (!replica_.values_sharded && p.param->compute_type() == dtype::f32)) {
        p.param->materialize_masters(ctx.stream());
      }
    }
    detail::check_same_parameters(replica_.params, comm, replica_.comm_stream);
    detail::broadcast_parameters(replica_.params, comm, replica_.comm_stream);
    synchronize(ctx.get_device());  // the buffers' initial values are written (a model may have no parameters)
    detail::broadcast_buffers(replica_.params, comm, replica_.comm_stream, buffers_flat_);
    comm.synchronize(replica_.comm_stream);
    const std::vector<std::size_t> units = replica_.values_sharded ? detail::layer_of_each_parameter(model) : std::vector<std::size_t>{};
    if (!units.empty()) values_.enable();  // ZeRO-3 layer by layer (gathered_values.hpp)
    detail::build_buckets(replica_, shards_, sync_,
                          {.bucket_bytes = options_.bucket_bytes,
                           .first_bucket_bytes = options_.first_bucket_bytes,
                           .deterministic = replica_.deterministic,
                           .own_type = options_.zero != zero_stage::none ||
                                       (options_.hook == comm_hook::none && comm.reduces_in_f32()),
                           .sharded = replica_.sharded,
                           .reused_buffers = replica_.reused_buffers,
                           .exact_collective = replica_.exact_collective,
                           .whole_units = !units.empty(),
                           .world = comm.size()},
                          hook_type(options_.hook), units);
    if (replica_.sharded) {  // deferred master values, into the shards (a failure here: build the model again)
      detail::broadcast_deferred_parameters(replica_.params, comm, replica_.comm_stream,
                                            std::max<std::int64_t>(1, static_cast<std::int64_t>(options_.visit_chunk_bytes / 4)));
    }
    batch_.emplace(replica_, options_.reduction == gradient_reduction::sum);  // registers the loss's share
    for (const auto& p : replica_.params) p.param->set_owner(this);  // last: a constructor that throws leaves none
  }

  distributed_data_parallel(const distributed_data_parallel&) = delete;
  distributed_data_parallel& operator=(const distributed_data_parallel&) = delete;
  /// The parameters stay as they are (sharded under ZeRO: use consolidated() before, to keep whole values).
  ~distributed_data_parallel() {  // (ZeRO's hooks go with shards_)
    for (const auto& p : replica_.params) {
      if (p.param->owner() == this) p.param->set_owner(nullptr);
    }
  }

  /// The ZeRO stage in effect: options.zero, or none on one rank (nothing to shard).
  [[nodiscard]] zero_stage zero() const noexcept { return replica_.sharded ? options_.zero : zero_stage::none; }

  /// The stream this rank's collectives run on: the communication stream, or on a host device the compute stream
  /// (ddp_options::host_collectives).
  [[nodiscard]] stream_ref collective_stream() const noexcept { return replica_.comm_stream; }

  [[nodiscard]] int rank() const { return replica_.comm.rank(); }
  [[nodiscard]] int world_size() const { return replica_.comm.size(); }
  [[nodiscard]] Model& module() noexcept { return *model_; }
  [[nodiscard]] context& module_context() noexcept { return *replica_.ctx; }
  /// Deterministic mode: whether the last backward gathered the chunks' partial gradients (possible when the
  /// context knows the global batch, context::set_global_rows, and it has few chunks) rather than all-reducing
  /// exact accumulators. The bits are the same either way.
  [[nodiscard]] bool gathered_partials() const noexcept { return gathered_partials_; }
  /// Number of gradient buckets, and the parameters (indices into parameters_of(model)) of bucket b.
  [[nodiscard]] std::size_t bucket_count() const noexcept { return replica_.buckets.size(); }
  [[nodiscard]] const std::vector<std::size_t>& bucket_parameters(std::size_t b) const {
    return replica_.buckets.at(b).layout.params;
  }

  /// The model's forward on this rank's shard. Under ZeRO, first gathers the values updated since the last
  /// backward (gather_parameters(); ZeRO-3: a graph or sequential layer by layer as it runs). In training with
  /// gradient_reduction::sum, a loss computed on the output is this rank's share of the global batch's (see the file
  /// comment).
  tensor_view forward(const tensor_view& x) {
    batch_->count(x.rows());  // first: the rows' sum does not wait behind ZeRO's gathers
    if (syncing_) sync_buffers();  // (before the gathers, as in the backward of a rank without a forward)
    const bool by_layer = values_.begin_forward();  // ZeRO: the gathers (ZeRO-3 by layer: the first ones)
    context& ctx = *replica_.ctx;
    compute_timeline_.begin(phase::compute, ctx.stream());
    replicas_.reset_calls();
    const replicas_scope group(ctx, &replicas_);  // a synchronized batch norm sums over the ranks
    tensor_view y;
    {
      const bool shared = replica_.comm_stream == replica_.compute_stream();  // (then time them apart from compute)
      const detail::layer_gathers gathers(by_layer ? &values_ : nullptr, ctx, shared ? &compute_timeline_ : nullptr);
      y = model_->forward(x, ctx);
      if (by_layer) values_.end_forward();
    }
    forward_used_replicas_ = replicas_.calls() > 0;
    output_ = y;
    batch_->forward_output(y);
    compute_timeline_.end(ctx.stream());
    return y;
  }

  /// Back-propagates dL/doutput of the last forward and leaves in every parameter's gradient the sum (or mean)
  /// over ranks, in stream order on the context's stream. An empty `grad_output` means this rank had no data
  /// this step. Inside no_sync(), accumulates locally only.
  void backward(const tensor_view& grad_output) {
    context& ctx = *replica_.ctx;
    const stream_ref s = ctx.stream();
    replica_.check_communication();
    if (!batch_->counted()) batch_->count(0);  // a rank without rows this step calls backward without forward: the
    if (syncing_) sync_buffers();               // rows' sum, the buffers' broadcast
    values_.before_backward();                  // and ZeRO's gathers
    batch_->loss_ran();
    shards_.wait_for_gathers();  // backward and the step after it: after every all-gather (which reads the shards)
    LOCKSTEP_EXPECTS(ctx.deterministic().has_value() == replica_.deterministic,
                     "distributed_data_parallel::backward: the context's deterministic mode changed since the wrapper was "
                     "built (its buckets hold ", replica_.deterministic ? "exact sums" : "gradients", "); build the "
                     "wrapper after setting the mode");
    agree_on_settings();
    partials_.begin_backward(syncing_, accumulated_);
    gathered_partials_ = partials_.gathering();
    // A rank without rows whose forward (on no rows) went through the replica group (a synchronized batch norm)
    // runs backward on no rows too: the layer's backward sums are collectives every rank takes part in.
    const bool run_model = !grad_output.empty() || std::exchange(forward_used_replicas_, false);
    const tensor_view grad =
        grad_output.empty() && run_model
            ? tensor_view(nullptr, output_.type(), output_.dims().with_rows(0), output_.get_device())
            : grad_output;
    const replicas_scope group(ctx, &replicas_);
    const gradient_owner_scope owner(this);  // a gradient written for a parameter the wrapper does not know is an error
    // ZeRO-2 keeps no whole gradients to accumulate into: it reduces every time
    if (!syncing_ && !replica_.reused_buffers) {
      accumulated_ = true;  // every rank's call, with rows or not: the next backward adds to these sums
      batch_->keep_local_loss();  // no communication
      if (run_model) {
        compute_timeline_.begin(phase::compute, s);
        model_->backward(grad, ctx, input_grad::not_required);
        compute_timeline_.end(s);
      }
      return;
    }
    const bool summed_loss = batch_->sum_loss();
    sync_.begin();
    if (run_model) {
      ctx.set_gradients_ready_hook([this](std::span<parameter* const> ps) { sync_.gradients_ready(ps); });
      compute_timeline_.begin(phase::compute, s);
      sync_.set_compute_bracket(replica_.comm_stream == s ? &compute_timeline_ : nullptr);
      try {
        model_->backward(grad, ctx, input_grad::not_required);
      } catch (...) {
        ctx.set_gradients_ready_hook(nullptr);
        sync_.set_compute_bracket(nullptr);
        throw;
      }
      sync_.set_compute_bracket(nullptr);
      compute_timeline_.end(s);
      ctx.set_gradients_ready_hook(nullptr);
    }
    sync_.finish();
    if (summed_loss) replica_.after(s, replica_.comm_stream);  // loss() is the global loss for what follows
    partials_.end_backward();
    accumulated_ = false;
    buffers_stale_ = true;  // the next forward's batch statistics update them again
    if (replica_.sharded) shards_.mark_updated();
    values_.end_backward();
  }

  /// ZeRO: all-gathers the values each rank updated into every rank's copy, in stream order on the context's
  /// stream (a collective: every rank calls it, as forward() does). No-op when nothing changed since the last
  /// gather, and without ZeRO.
  void gather_parameters() {
    if (replica_.sharded) shards_.gather(comm_timeline_);
  }

  /// ZeRO: while the returned guard lives, every rank holds whole parameters (their fp32 master values) and the
  /// whole state of `opt` (the optimizer of these parameters), as plain DDP does, for code that reads or writes them
  /// whole on the device. Its end shards them again (keeping whatever was written). Checkpoints and weights_sha256
  /// need no consolidation, and no whole tensors on any device: visit_whole_state, visit_master_values, and loads
  /// write each rank's range. Collective: every rank creates and ends it at the same point. An optimizer step inside
  /// it throws precondition_error (each rank reduced only its shard's gradient). Without ZeRO, a guard that does
  /// nothing.
  template <class Optimizer>
  [[nodiscard]] auto consolidated(Optimizer& opt) {
    struct guard {
      guard(distributed_data_parallel* d, Optimizer* o) : ddp(d), optimizer(o), unwinding(std::uncaught_exceptions()) {
        if (ddp->replica_.sharded) ddp->shards_.consolidate(*optimizer, ddp->comm_timeline_);
      }
      guard(const guard&) = delete;
      guard& operator=(const guard&) = delete;
      ~guard() noexcept(false) {
        if (!ddp->replica_.sharded) return;
        try {
          ddp->shards_.reshard(*optimizer);
        } catch (...) {  // leaving by an exception: shard again if possible, and keep the first exception
          if (std::uncaught_exceptions() == unwinding) throw;
        }
      }
      distributed_data_parallel* ddp;
      Optimizer* optimizer;
      int unwinding;
    };
    return guard(this, &opt);
  }

  /// Calls f(k, values) for every parameter k of parameters_of(model), in order, with its whole fp32 master values
  /// in host memory (valid during the call). Under ZeRO no device holds the whole values meanwhile: each bucket's
  /// are gathered in chunks through a buffer of options.visit_chunk_bytes and copied to the host (which holds about
  /// one bucket's values at a time), so that hashing the weights (weights_sha256 with this as its master_values_source) needs no
  /// more device memory than training, unlike consolidated(). Collective: every rank calls it at the same point.
  void visit_master_values(const std::function<void(std::size_t, std::span<const float>)>& f) {
    if (replica_.sharded) {
      detail::visit_masters(replica_, shards_, options_.visit_chunk_bytes, f);
      return;
    }
    detail::visit_values_on_host(replica_.params, replica_.compute_stream(), f);
  }

  /// Calls f(p, which, values) for every parameter p of parameters_of(model) with its whole fp32 master values
  /// (which == master_values_tensor) and with each of its state tensors in `opt` (which = 0, 1), in host memory
  /// (valid during the call), in no particular order. Under ZeRO no device holds whole tensors meanwhile (as in
  /// visit_master_values, in chunks), so that saving a checkpoint needs no more device memory than training:
  /// give it to the checkpoint (`state.sharded([&](const auto& f) { ddp.visit_whole_state(opt, f); })`). Every rank
  /// first materializes the optimizer's state (zeros before the first step). Collective: every rank calls it at
  /// the same point.
  template <class Optimizer, class F>
  void visit_whole_state(Optimizer& opt, F&& f) {
    if (replica_.sharded) {
      detail::visit_state(replica_, shards_, options_.visit_chunk_bytes, opt, f);
      return;
    }
    detail::visit_whole_state_as_held(replica_, opt, f);
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

  /// Runs f() (the caller's work on the context's stream: the loss, the optimizer step) as computing time of report()
  /// rather than idle time, and returns what f returns. f must not call forward or backward; collectives it queues
  /// (a loss scaler's overflow check, ZeRO's clipping norm) count as computing.
  template <class F>
  decltype(auto) compute(F&& f) {
    return timed(compute_timeline_, phase::compute, replica_.ctx->stream(), std::forward<F>(f));
  }
  /// Peak memory and time spent computing (forward, backward, compute()) and communicating (all-reduces: overlapped
  /// with backward, or on a host device in its order, host_collectives.hpp) since construction or reset_report();
  /// the bytes of the training state; under ZeRO-3 the most bytes of whole values held gathered at once.
  [[nodiscard]] device_report report() {
    device_report r = compute_timeline_.report();
    const device_report c = comm_timeline_.report();
    r.communication_ms = c.communication_ms;
    r.wall_ms = std::max(r.wall_ms, c.wall_ms);
    const bool apart = replica_.comm_stream != replica_.compute_stream();  // else the streams' work is serial
    r.idle_ms = std::max(0.0, r.wall_ms - r.compute_ms - (apart ? 0.0 : r.communication_ms));
    r.parameter_bytes = parameter_bytes();
    r.gradient_bytes = gradient_bytes();
    r.gathered_peak_bytes = shards_.gathered_peak_bytes();
    return r;
  }

  /// Bytes this rank holds for the parameters: the values forward reads (the working copies, or the master
  /// values under f32) and the fp32 master values (under ZeRO and f16/bf16: the shard's).
  [[nodiscard]] std::uint64_t parameter_bytes() const { return detail::parameter_bytes(replica_, shards_); }
  /// Bytes this rank holds for the gradients: the buckets (with their padding), gradients kept apart from them,
  /// deterministic mode's accumulators, under ZeRO-2 the two reused buffers and the gradient shards, and under ZeRO
  /// with f16/bf16 on NCCL the f32 buffer of their reduce-scatters.
  [[nodiscard]] std::uint64_t gradient_bytes() const { return detail::gradient_bytes(replica_, shards_, sync_); }
  /// Starts a new window of the report; at the first call the memory peak so far becomes its setup_peak_bytes.
  void reset_report() {
    compute_timeline_.reset();  // (both timelines reset the device's memory peak: the first keeps the setup peak)
    comm_timeline_.reset();
    shards_.reset_gathered_peak();
  }

 private:
  using ddp_replica = detail::ddp_replica;

  // The options, checked before anything is built.
  static const ddp_options& checked(const ddp_options& options, const context& ctx, communicator_ref comm,
                                    stream_ref comm_stream) {
    LOCKSTEP_EXPECTS(comm.get_device() == ctx.get_device() && comm_stream.get_device() == ctx.get_device(),
                     "distributed_data_parallel: the context is on ", ctx.get_device().str(), ", the communicator on ",
                     comm.get_device().str(), " and the communication stream on ", comm_stream.get_device().str(),
                     ": all must be the rank's device");
    LOCKSTEP_EXPECTS(options.bucket_bytes > 0 && options.first_bucket_bytes > 0,
                     "distributed_data_parallel: bucket sizes must be positive");
    LOCKSTEP_EXPECTS(options.visit_chunk_bytes >= sizeof(float) * static_cast<std::size_t>(comm.size()),
                     "distributed_data_parallel: visit_chunk_bytes must hold a float per rank (", comm.size(), " ranks: ",
                     sizeof(float) * static_cast<std::size_t>(comm.size()), " bytes), got ", options.visit_chunk_bytes);
    (void)to_zero_stage(static_cast<int>(options.zero));
    LOCKSTEP_EXPECTS(options.zero == zero_stage::none || options.hook == comm_hook::none,
                     "distributed_data_parallel: ZeRO stage ", static_cast<int>(options.zero), " reduces gradients in "
                     "their own type; it cannot be combined with a comm hook (use zero_stage::none for that)");
    return options;
  }

  /// Rank 0's buffers to every rank on the communication stream, after the compute stream's last update of them
  /// and before the forward that reads them: once per synchronized step (in forward, or in the backward of a rank
  /// without rows), so every rank issues the same collectives.
  void sync_buffers() {
    if (!buffers_stale_) return;
    buffers_stale_ = false;
    if (!options_.broadcast_buffers || replica_.params.buffers().empty() || replica_.comm.size() == 1) return;
    replica_.after(replica_.comm_stream, replica_.compute_stream());
    detail::broadcast_buffers(replica_.params, replica_.comm, replica_.comm_stream, buffers_flat_);
    replica_.after(replica_.compute_stream(), replica_.comm_stream);
  }

  // The options every rank must share (compared at construction): what shapes the wrapper's collectives, with the
  // context's deterministic mode in effect (exact sums in the buckets; its chunks make the gathered partials).
  static std::string options_line(const ddp_options& o, const context& ctx) {
    const std::string deterministic =
        ctx.deterministic() ? detail::concat("deterministic in chunks of ", ctx.deterministic()->chunk_rows, " rows")
                            : std::string("not deterministic");
    return detail::settings_line(
        "wrapper", 0, "",
        detail::concat("buckets of ", o.bucket_bytes, " bytes (the first ", o.first_bucket_bytes, "), ZeRO stage ",
                       static_cast<int>(o.zero), ", reduction ", o.reduction == gradient_reduction::sum ? "sum" : "mean",
                       ", hook ", o.hook == comm_hook::none ? "none" : name_of(hook_type(o.hook)), ", buffers ",
                       o.broadcast_buffers ? "broadcast" : "own", ", visit chunks of ", o.visit_chunk_bytes, " bytes, ",
                       deterministic));
  }

  static dtype hook_type(comm_hook hook) noexcept {
    return hook == comm_hook::fp16 ? dtype::f16 : hook == comm_hook::bf16 ? dtype::bf16 : dtype::f32;
  }

  Model* model_;
  ddp_options options_;
  ddp_replica replica_;
  timeline compute_timeline_;
  timeline comm_timeline_;
  detail::exact_partials partials_;
  detail::zero_shards shards_;
  detail::gathered_values values_;
  detail::gradient_sync sync_;
  bool syncing_ = true;             // outside no_sync()
  detail::communicator_replicas replicas_;  // the context's replica_group (synchronized batch norm)
  bool forward_used_replicas_ = false;      // the last forward summed over the ranks
  std::optional<detail::global_batch> batch_;  // the loss's share of the global batch (after the buckets)
  tensor_view output_;                      // the last forward's output
  tensor buffers_flat_;             // the buffers packed for their broadcast
  bool buffers_stale_ = false;      // a synchronized backward ran since their last broadcast
  bool accumulated_ = false;        // no_sync() backward calls since the last synchronized one
  bool gathered_partials_ = false;  // deterministic mode: the last backward gathered partial gradients
  int settings_compared_ = 0;  // synchronized backward calls that compared the settings (the first two do)

  /// At the first two synchronized backward calls (every rank the same ones: the loss scaler and the clipper set
  /// their settings at the first step, after the first backward), the settings compared across ranks
  /// (detail::check_same_settings), one blocking exchange each. Ranks started with another learning rate, scaler,
  /// clipping or precision then fail at once, naming both values, instead of training apart.
  void agree_on_settings() {
    if (!syncing_ || settings_compared_ >= 2) return;
    detail::check_same_settings(detail::settings_lines(*replica_.ctx, replica_.params), replica_.comm, replica_.comm_stream);
    ++settings_compared_;  // (after the check: a refused backward called again checks again)
  }
};

LOCKSTEP_ABI_END
