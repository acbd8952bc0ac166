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
// Failures: a failed all-reduce (a peer that died, stopped or aborted; a timeout; ranks that issue different
// collectives) fails the step on every rank. On host devices the communication stream keeps the error and the
// compute stream, which waits for the all-reduce, fails with it: the step's later work (unpacking, the
// optimizer step) does not run, and the next synchronization throws. On GPUs the communicator's watchdog
// aborts it. Either way the next backward() throws before queuing anything (comm.check()).
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

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
        grads_ready_(ctx.get_device()), compute_timeline_(ctx.get_device()), comm_timeline_(ctx.get_device()) {
    LOCKSTEP_EXPECTS(comm.get_device() == ctx.get_device() && comm_stream.get_device() == ctx.get_device(),
                     "distributed_data_parallel: the context is on ", ctx.get_device().str(), ", the communicator on ",
                     comm.get_device().str(), " and the communication stream on ", comm_stream.get_device().str(),
                     ": all must be the rank's device");
    LOCKSTEP_EXPECTS(options.bucket_bytes > 0 && options.first_bucket_bytes > 0,
                     "distributed_data_parallel: bucket sizes must be positive");
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
    check_same_parameters();
    broadcast_parameters();
    build_buckets();
  }

  distributed_data_parallel(const distributed_data_parallel&) = delete;
  distributed_data_parallel& operator=(const distributed_data_parallel&) = delete;

  [[nodiscard]] int rank() const { return comm_.rank(); }
  [[nodiscard]] int world_size() const { return comm_.size(); }
  [[nodiscard]] Model& module() noexcept { return *model_; }
  [[nodiscard]] context& module_context() noexcept { return *ctx_; }
  /// Number of gradient buckets, and the parameters (indices into parameters_of(model)) of bucket b.
  [[nodiscard]] std::size_t bucket_count() const noexcept { return buckets_.size(); }
  [[nodiscard]] const std::vector<std::size_t>& bucket_parameters(std::size_t b) const { return buckets_.at(b).params; }

  /// The model's forward on this rank's shard.
  tensor_view forward(const tensor_view& x) {
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
    LOCKSTEP_EXPECTS(ctx_->deterministic().has_value() == deterministic_,
                     "distributed_data_parallel::backward: the context's deterministic mode changed since the wrapper was "
                     "built (its buckets hold ", deterministic_ ? "exact sums" : "gradients", "); build the wrapper after "
                     "setting the mode");
    if (!syncing_) {
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
      if (deterministic_) {
        for (const std::size_t k : b.params) round_exact_gradient(*params_[k].param, s);
      } else {
        unpack(b);
      }
    }
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
    return r;
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
    std::shared_ptr<tensor> flat;      // shared with the parameters whose gradients live in it
    std::optional<event> done;
    std::size_t ready = 0;
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
      const std::size_t n = elements * size_of(wire);
      if (!current.params.empty() && (bytes + n > limit || wire != current.wire)) {
        buckets_.push_back(std::move(current));
        current = bucket{};
        bytes = 0;
        limit = options_.bucket_bytes;
      }
      current.wire = wire;
      current.params.push_back(k);
      current.offsets.push_back(current.elements);
      current.elements += round_up(elements, alignment / size_of(wire));
      bytes += n;
    }
    if (!current.params.empty()) buckets_.push_back(std::move(current));
    const stream_ref s = ctx_->stream();
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      auto& bk = buckets_[b];
      bk.flat = std::make_shared<tensor>(shape{static_cast<std::int64_t>(bk.elements)}, bk.wire, s);
      fill_zero(bk.flat->bytes(), s);  // the padding between gradients stays zero
      bk.done.emplace(ctx_->get_device());
      for (std::size_t i = 0; i < bk.params.size(); ++i) {
        bucket_of_.emplace(bk.params[i], b);
        parameter& p = *params_[bk.params[i]].param;
        if (deterministic_) {
          p.share_exact_storage(slot(bk, i), bk.flat);
        } else if (p.compute_type() == bk.wire) {
          p.share_grad_storage(slot(bk, i), bk.flat, s);
        }
      }
    }
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
      p.materialize_grad(s);
      if (!in_place(b, i)) convert(p.grad(), slot(b, i), s);
    }
    grads_ready_.record(s);
    comm_stream_.wait(grads_ready_);
    comm_timeline_.begin(phase::communication, comm_stream_);
    comm_.all_reduce(b.flat->data(), b.flat->data(), b.elements, b.wire,
                     options_.reduction == gradient_reduction::mean ? reduce_op::mean : reduce_op::sum, comm_stream_);
    comm_timeline_.end(comm_stream_);
    b.done->record(comm_stream_);
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
    constexpr std::size_t record = name_bytes + 8 * shape::max_rank + 8;
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
      return "'" + name + "' " + dims + "]";
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
  timeline compute_timeline_;
  timeline comm_timeline_;
};

LOCKSTEP_ABI_END
