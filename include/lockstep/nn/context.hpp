// lockstep/nn/context.hpp — what a layer needs to run on one device: the device, its compute stream, a BLAS
// handle bound to that stream, the compute precision, the training mode, and the random-number state.
//
// One context per device replica. Contexts are passed explicitly to every forward and backward: there is no
// global current stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <utility>

#include "lockstep/blas/blas_handle.hpp"
#include "lockstep/config.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/runtime/stream.hpp"

LOCKSTEP_ABI_BEGIN

class parameter;

/// Training (dropout active, gradients needed) or evaluation.
enum class run_mode : std::uint8_t { train, eval };

/// Whether backward must compute the gradient of the layer's input (the first layer's is not needed).
enum class input_grad : std::uint8_t { required, not_required };

/// Deterministic mode (nn/deterministic.hpp, docs/determinism.md): the global batch is cut into chunks of
/// `chunk_rows` rows, each computed with the same GEMM shapes wherever it runs, and the chunks' gradients are
/// added exactly, so that the parameters do not depend on how the batch is split over devices or ranks.
struct deterministic_options {
  std::int64_t chunk_rows = 32;
  /// On one device (the layers round the sums, exact_rounding::by_layer): whether gradients may accumulate over
  /// several backward calls without zero_grad in between (micro-batches). `per_backward` sums each backward's
  /// chunks in one pass straight into the gradient (the fast path) and refuses a second backward before
  /// zero_grad; `across_backward_calls` keeps every parameter's exact sum between calls (16 bytes per parameter
  /// written and read by every backward), so that k micro-batches give the bits of one batch of all their rows.
  /// data_parallel and distributed_data_parallel (exact_rounding::by_wrapper) always keep the sums.
  enum class accumulation : std::uint8_t { per_backward, across_backward_calls };
  accumulation gradients = accumulation::per_backward;
};

/// Who rounds the exact gradient sums of deterministic mode into the gradients: the layer, at the end of its
/// backward (one device), or a wrapper after it has added the accumulators of every device (data_parallel,
/// distributed_data_parallel).
enum class exact_rounding : std::uint8_t { by_layer, by_wrapper };

/// The replicas of one step, for a layer whose forward or backward needs the others' numbers (a synchronized batch
/// norm's per-channel sums). nn/ declares it and calls it; parallel/ implements it (data_parallel over its replica
/// threads, distributed_data_parallel over its communicator) and sets it on each replica's context, so that nn/
/// never reaches up into comm/ or parallel/.
class replica_group {
 public:
  virtual ~replica_group() = default;
  /// Replaces data[0, n) (device memory of the context's device) by its element-wise sum over the replicas, in
  /// stream order on `s`, the replica's compute stream: the sum is ready for the work queued on `s` after the call.
  /// Every replica calls the same sums in the same order (also one with no rows this step). Sums of f32 (in an
  /// order that may depend on the replicas' count) and of i64 (exact: deterministic mode's limbs).
  virtual void sum(float* data, std::size_t n, stream_ref s) = 0;
  virtual void sum(std::int64_t* data, std::size_t n, stream_ref s) = 0;
  /// How many replicas take part.
  [[nodiscard]] virtual int size() const noexcept = 0;
};

/// A replica's rows as a share of a global batch: distributed_data_parallel fills it in each training forward, for the
/// loss computed on that forward's output. The loss then divides its mean by the rows of the global batch (every
/// rank's together), so that the ranks' gradients add up to those of one device on the whole batch, and registers its
/// value, which the wrapper's backward sums over the ranks (read_loss then gives the loss of the global batch).
struct batch_share {
  /// Whether a forward's loss is pending, and that forward's output: its memory (an output of no rows may have
  /// none), its rows and its values (a loss on another tensor is this replica's own).
  bool pending = false;
  const void* output = nullptr;
  std::int64_t rows = 0;
  std::int64_t values = 0;
  /// Rows of the global batch: known on the host, or else (global_rows_on_device not null) in device memory of the
  /// context's device, an i64 summed over the ranks, ready once the context's stream waits for `rows_ready`.
  std::int64_t global_rows = 0;
  const std::int64_t* global_rows_on_device = nullptr;
  const event* rows_ready = nullptr;
  /// Set by the loss: its [1] f32 value on the device, summed over the ranks in the wrapper's next backward.
  float* loss = nullptr;
};

class context {
 public:
  /// A context running on `s` (a stream of the replica's device) computing in `compute_type`.
  explicit context(stream_ref s, dtype compute_type = dtype::f32) : stream_(s), blas_(s), compute_type_(compute_type) {
    LOCKSTEP_EXPECTS(is_floating(compute_type), "a context computes in f32, f16 or bf16, not ", name_of(compute_type));
  }
  context(const context&) = delete;
  context& operator=(const context&) = delete;

  [[nodiscard]] device get_device() const noexcept { return stream_.get_device(); }
  [[nodiscard]] stream_ref stream() const noexcept { return stream_; }
  [[nodiscard]] blas_handle& blas() noexcept { return blas_; }
  /// The precision activations and gradients are stored in (f32 unless a mixed-precision policy is set).
  [[nodiscard]] dtype compute_type() const noexcept { return compute_type_; }
  void set_compute_type(dtype t) {
    LOCKSTEP_EXPECTS(is_floating(t), "a context computes in f32, f16 or bf16, not ", name_of(t));
    compute_type_ = t;
  }

  [[nodiscard]] run_mode mode() const noexcept { return mode_; }
  [[nodiscard]] bool training() const noexcept { return mode_ == run_mode::train; }
  void set_mode(run_mode m) noexcept { mode_ = m; }

  /// Random numbers (dropout) are a pure function of (seed, step, layer, global element index), so that a
  /// batch split across devices draws the same numbers as on one device.
  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }
  void set_seed(std::uint64_t s) noexcept { seed_ = s; }
  ///
  /// The step advances by itself: every loss's backward in training mode adds one (one per training step, so that
  /// dropout draws new masks each step; micro-batches draw new masks each). set_step sets it (to resume a run with
  /// the masks it would have drawn, or to give micro-batches the masks of one batch in deterministic mode).
  [[nodiscard]] std::uint64_t step() const noexcept { return step_; }
  void set_step(std::uint64_t s) noexcept { step_ = s; }
  /// Called by losses at the end of a backward in training mode.
  void advance_step() noexcept {
    if (training()) ++step_;
  }
  /// Index, in the global batch, of this replica's first row (0 on one device). Under distributed_data_parallel,
  /// unless set here, the wrapper sets rank x rows of this forward (the global row of equal shards), so that ranks
  /// draw different dropout masks; set it when shards are uneven (deterministic mode's slices of the global batch).
  [[nodiscard]] std::int64_t row_offset() const noexcept { return row_offset_; }
  void set_row_offset(std::int64_t r) noexcept {
    row_offset_ = r;
    row_offset_set_ = true;
  }
  /// Whether set_row_offset was called (the wrappers then leave the offset alone).
  [[nodiscard]] bool row_offset_set() const noexcept { return row_offset_set_; }
  /// The wrappers' default offset: leaves an offset set with set_row_offset as it is.
  void default_row_offset(std::int64_t r) noexcept {
    if (!row_offset_set_) row_offset_ = r;
  }
  /// Deterministic mode under distributed_data_parallel: the rows of the global batch (every rank's together),
  /// the same on every rank; 0 (the default) when not told. Knowing it, the wrapper can gather the chunks'
  /// partial gradients themselves instead of all-reducing exact accumulators when the batch has few chunks (the
  /// same bits, less memory traffic; see docs/determinism.md).
  [[nodiscard]] std::int64_t global_rows() const noexcept { return global_rows_; }
  void set_global_rows(std::int64_t rows) {
    LOCKSTEP_EXPECTS(rows >= 0, "context::set_global_rows: rows must be >= 0, got ", rows);
    global_rows_ = rows;
  }

  /// Called by containers after a child's backward has been queued, with the child's parameters: their
  /// gradients are final once the work queued so far on stream() has run. DistributedDataParallel uses it
  /// to start all-reducing a bucket while the rest of backward runs.
  using gradients_ready_fn = std::function<void(std::span<parameter* const>)>;
  void set_gradients_ready_hook(gradients_ready_fn f) { on_gradients_ready_ = std::move(f); }
  void gradients_ready(std::span<parameter* const> params) {
    if (on_gradients_ready_ && !params.empty()) on_gradients_ready_(params);
  }
  [[nodiscard]] bool has_gradients_ready_hook() const noexcept { return static_cast<bool>(on_gradients_ready_); }
  /// The hook set now (empty when none), e.g. to restore it after a container reports its children itself.
  [[nodiscard]] const gradients_ready_fn& gradients_ready_hook() const noexcept { return on_gradients_ready_; }

  /// Called by graph and sequential before a child's forward is queued, with the child's parameters (a container
  /// inside a child does not report again: the hook is unset during the child's forward). Under ZeRO-3,
  /// DistributedDataParallel gathers the parameters of the next children and frees those of the children before.
  using parameters_needed_fn = std::function<void(std::span<parameter* const>)>;
  void set_parameters_needed_hook(parameters_needed_fn f) { on_parameters_needed_ = std::move(f); }
  [[nodiscard]] bool has_parameters_needed_hook() const noexcept { return static_cast<bool>(on_parameters_needed_); }
  /// Takes the hook out (to report a child, then run it without the hook), leaving none.
  [[nodiscard]] parameters_needed_fn take_parameters_needed_hook() noexcept { return std::exchange(on_parameters_needed_, {}); }

  /// Deterministic mode, or nullopt (the default: GEMMs over whole shards, gradients summed in floats).
  [[nodiscard]] const std::optional<deterministic_options>& deterministic() const noexcept { return deterministic_; }
  void set_deterministic(std::optional<deterministic_options> d) {
    LOCKSTEP_EXPECTS(!d || d->chunk_rows > 0, "deterministic_options: chunk_rows must be positive, got ",
                     d ? d->chunk_rows : 0);
    deterministic_ = d;
  }
  [[nodiscard]] exact_rounding gradient_rounding() const noexcept { return rounding_; }
  void set_gradient_rounding(exact_rounding r) noexcept { rounding_ = r; }

  /// The share of a global batch the next loss computes (set by distributed_data_parallel), or nullptr: the batch is
  /// this replica's alone.
  [[nodiscard]] batch_share* share() const noexcept { return share_; }
  void set_share(batch_share* b) noexcept { share_ = b; }

  /// The replicas this one trains with (set by the data-parallel wrappers), or nullptr: alone.
  [[nodiscard]] replica_group* replicas() const noexcept { return replicas_; }
  void set_replicas(replica_group* g) noexcept { replicas_ = g; }

  /// Device pointer to the loss scale (amp/): losses multiply the gradient they start backward with by it.
  /// nullptr means 1.
  [[nodiscard]] const float* loss_scale() const noexcept { return loss_scale_; }
  void set_loss_scale(const float* device_scale) noexcept { loss_scale_ = device_scale; }

 private:
  stream_ref stream_;
  blas_handle blas_;
  dtype compute_type_;
  run_mode mode_ = run_mode::train;
  std::uint64_t seed_ = 0;
  std::uint64_t step_ = 0;
  std::int64_t row_offset_ = 0;
  bool row_offset_set_ = false;
  std::int64_t global_rows_ = 0;
  batch_share* share_ = nullptr;
  gradients_ready_fn on_gradients_ready_;
  parameters_needed_fn on_parameters_needed_;
  const float* loss_scale_ = nullptr;
  std::optional<deterministic_options> deterministic_;
  exact_rounding rounding_ = exact_rounding::by_layer;
  replica_group* replicas_ = nullptr;
};

/// Sets ctx.replicas() to `group` for as long as it lives, then back to what it was: the data-parallel wrappers
/// install their group around the model's forward and backward only, so that two wrappers may share a context and a
/// forward outside the wrapper runs alone.
class replicas_scope {
 public:
  replicas_scope(context& ctx, replica_group* group) : ctx_(&ctx), previous_(ctx.replicas()) { ctx.set_replicas(group); }
  replicas_scope(const replicas_scope&) = delete;
  replicas_scope& operator=(const replicas_scope&) = delete;
  ~replicas_scope() { ctx_->set_replicas(previous_); }

 private:
  context* ctx_;
  replica_group* previous_;
};

LOCKSTEP_ABI_END
