// lockstep/nn/parameter.hpp — trainable parameters and the ordered lists of them.
//
// A parameter holds fp32 master values, a gradient, and, under a reduced-precision policy (amp/), a working
// copy in that precision that forward and backward read. Gradients are stored in the compute precision.
//
// Gradients accumulate (as in PyTorch): backward adds into them. `zero_grad` does not write memory; it marks
// the gradient as zero, and the first accumulation after it overwrites instead of adding (beta = 0 in a
// GEMM), which saves a pass over every gradient per step. Code that reads gradients calls
// `materialize_grad` first, which zeroes a gradient nobody wrote since (an unused parameter).
//
// A gradient may live in memory the parameter shares rather than owns (`share_grad_storage`): DDP places the
// gradients of a bucket side by side in the bucket's buffer, as PyTorch's gradient_as_bucket_view, so that
// backward writes them where the all-reduce reads them and no copy is needed either way. The values forward
// reads (the working copy, or the master values under f32) can be placed the same way (`share_compute_storage`):
// ZeRO all-gathers them in place (ZeRO-3 keeps only a shard of them: parameter_sharding::shards_values).
//
// A wrapper that shards parameters over ranks (ZeRO: parallel/detail/zero_shards.hpp) attaches a
// `parameter_sharding` to each: its state (the range of elements this rank updates, the shard's master values
// and gradient kept apart, whether the values are stale) is the wrapper's, and the parameter asks it before
// reads and writes. The optimizer, the loss scaler and the clipper read and write `master_shard()`,
// `grad_shard()` and `working_shard()` (the whole tensors when nothing shards the parameter). Under f16/bf16
// the master values outside the shard are not kept at all (`value()` then refuses, naming the way to get them).
//
// Under a `deferred_master_values` scope (DeepSpeed's zero.Init), a parameter keeps no fp32 master values at first:
// its initializer becomes a recipe (`initial_values`, fp32 values by element) from which an f16/bf16 working copy is
// written in bounded chunks (an f32 parameter keeps nothing but the recipe: forward cannot read it yet), and a ZeRO
// wrapper later writes only its shard's master values, so that no device ever holds the whole model's masters, not
// even while the model is built. Nor its whole gradient: a deferred parameter has no gradient memory until a
// wrapper's buckets give it some (or materialize_masters gives it its own).
#pragma once

#include <algorithm>
#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/kernels/exact.hpp"
#include "lockstep/runtime/tensor.hpp"
#include "lockstep/runtime/copy.hpp"

LOCKSTEP_ABI_BEGIN

/// The elements [begin, end) of a flattened tensor.
struct element_range {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  [[nodiscard]] std::int64_t size() const noexcept { return end > begin ? end - begin : 0; }
  [[nodiscard]] bool empty() const noexcept { return end <= begin; }
  friend bool operator==(const element_range&, const element_range&) = default;
};

class parameter;

/// Which whole fp32 tensor of a parameter a whole-state visitor gives (checkpoint_state::sharded,
/// distributed_data_parallel::visit_whole_state): its master values, or (0, 1) the optimizer's state tensor of that
/// index (SGD's momentum_buffer; AdamW's exp_avg, exp_avg_sq).
inline constexpr int master_values_tensor = -1;

/// A parameter's initial fp32 values, by element: writes those of elements [first, first + out.size()) into `out`
/// (host memory). The same elements give the same values however the range is split.
using initial_values = std::function<void(std::int64_t first, std::span<float> out)>;

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN
/// How many deferred_master_values scopes are open on this thread.
inline thread_local int deferred_masters_depth = 0;
/// Elements per chunk when a deferred parameter's working copy is written from its initial values.
inline constexpr std::int64_t initial_values_chunk = std::int64_t{1} << 20;
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// While it lives, the parameters constructed on this thread defer their fp32 master values (see the file comment):
/// build the model inside it when a ZeRO wrapper (distributed_data_parallel with zero_stage::optimizer_state,
/// gradients or parameters) will shard it, and the whole model's masters never exist on the device. f16/bf16
/// parameters keep their working copy, f32 ones nothing (their masters are the values forward reads): only ZeRO-3
/// (zero_stage::parameters) keeps them sharded; the other wrappers (DDP without ZeRO-3 or on one rank,
/// data_parallel) give the f32 parameters whole masters again, and without ZeRO the f16/bf16 ones too. Anything
/// else that needs them (forward of an f32 model, an optimizer on the bare model, value()) says so, or calls
/// materialize_masters.
class deferred_master_values {
 public:
  deferred_master_values() noexcept { ++detail::deferred_masters_depth; }
  deferred_master_values(const deferred_master_values&) = delete;
  deferred_master_values& operator=(const deferred_master_values&) = delete;
  ~deferred_master_values() { --detail::deferred_masters_depth; }
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN
/// The data-parallel wrapper whose backward runs on this thread (gradient_owner_scope), or nullptr: a parameter that
/// receives a gradient there must be one of the wrapper's (parameter::set_owner), or it would be neither reduced
/// over the replicas nor stepped. Per thread: each rank or replica runs its backward on a thread of its own.
inline thread_local const void* backward_owner = nullptr;
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// While it lives, backward on this thread runs for `owner` (see detail::backward_owner).
class gradient_owner_scope {
 public:
  explicit gradient_owner_scope(const void* owner) : previous_(detail::backward_owner) { detail::backward_owner = owner; }
  gradient_owner_scope(const gradient_owner_scope&) = delete;
  gradient_owner_scope& operator=(const gradient_owner_scope&) = delete;
  ~gradient_owner_scope() { detail::backward_owner = previous_; }

 private:
  const void* previous_;
};

/// What a wrapper that shards a parameter over ranks (ZeRO) tells it, and hears from it. The state is the
/// wrapper's (parallel/detail/zero_shards.hpp); the parameter holds it by a shared pointer, so that it outlives
/// the wrapper.
class parameter_sharding {
 public:
  virtual ~parameter_sharding() = default;
  /// Whether the parameter is sharded now (false while a consolidation holds it whole).
  [[nodiscard]] virtual bool active() const noexcept = 0;
  /// The elements whose update this rank owns.
  [[nodiscard]] virtual element_range range() const noexcept = 0;
  /// Whether the wrapper keeps the fp32 master values of range() (f16/bf16: the parameter then holds no master
  /// values of its own), and those values, flat.
  [[nodiscard]] virtual bool keeps_masters() const noexcept = 0;
  [[nodiscard]] virtual tensor_view masters() const noexcept = 0;
  /// Whether the wrapper keeps the gradient of range() apart from the whole gradient (ZeRO-2), and that gradient.
  [[nodiscard]] virtual bool keeps_gradient() const noexcept = 0;
  [[nodiscard]] virtual tensor_view gradient() const noexcept = 0;
  /// compute_value() of `p` is about to read the values: throws while they are stale (updated on other ranks and
  /// not yet gathered); otherwise may order the reader after their gather.
  virtual void before_read(const parameter& p) = 0;
  /// The whole gradient's memory, logically zero, is about to be written (the wrapper may reuse that memory).
  virtual void before_first_write() = 0;
  /// zero_grad() was called: the gradient kept apart is logically zero too.
  virtual void zero_grad() noexcept = 0;
  /// materialize_grad(): zeros into the gradient kept apart when it is logically zero, in stream order on `s`.
  virtual void materialize_gradient(stream_ref s) = 0;
  /// The values forward reads are about to be written on the context's stream (load_values, write_values_range,
  /// refresh_working_copy): orders it after a gather of them still in flight.
  virtual void before_write() = 0;
  /// An optimizer is about to update range() of `p` in stream order on `s`: orders it after a gather still in
  /// flight, and the values held gathered are stale from then on (the next forward gathers again). Throws while a
  /// consolidation holds `p` whole (only range()'s gradient was reduced on this rank), and when `s` is not the
  /// stream the wrapper computes on (its gathers and backward are ordered on that stream only).
  virtual void before_update(const parameter& p, stream_ref s) = 0;
  /// Whether the wrapper keeps the values forward reads too (ZeRO-3): the parameter then holds none of its own;
  /// keeps_masters() is true (under f32 the master values are the values) and the whole values exist only while
  /// the wrapper holds them gathered.
  [[nodiscard]] virtual bool shards_values() const noexcept { return false; }
  /// ZeRO-3: the whole values forward reads, in the wrapper's gathered buffer (asked after before_read).
  [[nodiscard]] virtual tensor_view values() const noexcept { return {}; }
  /// ZeRO-3: the working copy's elements of range(), flat (f16/bf16; empty under f32).
  [[nodiscard]] virtual tensor_view working_shard() const noexcept { return {}; }
};

/// Who sets a parameter's update settings (parameter::set_update_settings).
enum class update_role : std::uint8_t { optimizer, loss_scaler, clipping };
inline constexpr std::size_t update_role_count = 3;
[[nodiscard]] constexpr const char* name_of(update_role r) noexcept {
  return r == update_role::optimizer ? "optimizer" : r == update_role::loss_scaler ? "loss scaler" : "gradient clipping";
}

class parameter {
 public:
  parameter() = default;

  /// A parameter named `name` (local to its layer: "weight") of shape `dims` on the device of `s`, with
  /// uninitialized fp32 values and a gradient in `compute_type`, marked zero. Inside a deferred_master_values scope
  /// it keeps no master values (masters_deferred()) and no gradient memory (it comes with the master values, or with
  /// a ZeRO wrapper's buckets); its values are zeros until set.
  parameter(std::string name, shape dims, stream_ref s, dtype compute_type = dtype::f32)
      : parameter(std::move(name), dims, s, compute_type, dims.numel() > 0 && detail::deferred_masters_depth > 0) {}

  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] const shape& dims() const noexcept { return dims_; }
  [[nodiscard]] std::int64_t numel() const noexcept { return dims_.numel(); }
  [[nodiscard]] device get_device() const noexcept { return device_; }

  /// The fp32 master values (what the optimizer updates and checkpoints store). Throws precondition_error while
  /// ZeRO shards the parameter: this rank updates only its shard (see master_shard()), and under f16/bf16 keeps
  /// only the shard's master values.
  [[nodiscard]] tensor_view value() const {
    if (is_sharded()) {
      const element_range r = sharding_->range();
      throw precondition_error(detail::concat(
          "parameter ", name_, ": ZeRO shards it over the ranks: this rank updates elements [", r.begin, ", ",
          r.end, ") of its ", numel(), sharding_->keeps_masters() ? " and keeps only their fp32 master values" : "",
          "; read master_shard(); a checkpoint reads whole values through distributed_data_parallel::"
          "visit_whole_state (checkpoint_state::sharded), weights_sha256 through visit_master_values; or gather them "
          "on every rank with distributed_data_parallel::consolidated(optimizer)"));
    }
    expect_masters("value()");
    return value_.view();
  }
  /// What forward and backward read: the working copy under f16/bf16, the master values under f32. Throws
  /// precondition_error between a ZeRO backward and the gather of the updated values (they are stale).
  [[nodiscard]] tensor_view compute_value() const {
    if (sharding_) {
      sharding_->before_read(*this);
      if (is_sharded() && sharding_->shards_values()) return sharding_->values();
    }
    if (!working_.empty()) return working_.view();
    expect_masters("forward (compute_value())");  // f32 built under deferred_master_values
    return value_.view();
  }
  /// The gradient, in the compute precision.
  [[nodiscard]] tensor_view grad() const noexcept { return grad_.view(); }
  [[nodiscard]] dtype compute_type() const noexcept { return compute_type_; }

  /// True when the gradient is logically zero (zero_grad was called and nothing accumulated since).
  [[nodiscard]] bool grad_is_zero() const noexcept { return grad_zero_; }

  /// Marks the gradient zero without writing it.
  void zero_grad() noexcept {
    grad_zero_ = true;
    exact_holds_sum_ = false;
    if (sharding_) sharding_->zero_grad();
  }

  /// For code about to accumulate into the gradient: returns the factor for the old contents (0 when the
  /// gradient is logically zero, so the accumulation overwrites; 1 otherwise) and marks it written. The
  /// sharding wrapper hears of it before a logically zero gradient is written.
  [[nodiscard]] float begin_accumulate() {
    if (detail::backward_owner != nullptr && owner_ != detail::backward_owner) [[unlikely]] {
      throw precondition_error(detail::concat(
          "parameter ", name_, " ", dims_.str(), " received a gradient in a data-parallel backward but is not one of "
          "the model's parameters (parameters_of(model) does not list it), so it would be neither reduced over the "
          "replicas nor updated by the optimizer: a layer's parameters(list) must add each of its parameters and call "
          "parameters(list) of each of its sub-layers"));
    }
    if (!grad_zero_) return 1.0f;
    expect_grad_memory();
    if (sharding_) sharding_->before_first_write();
    grad_zero_ = false;
    return 0.0f;
  }

  /// Writes zeros into what readers of the gradient read when it is logically zero: the gradient's memory (and
  /// its exact accumulator, when it has one), or under ZeRO-2 the gradient shard's own storage.
  void materialize_grad(stream_ref s) {
    if (is_sharded() && sharding_->keeps_gradient()) {
      sharding_->materialize_gradient(s);
      return;
    }
    materialize_full_grad(s);
  }

  /// Writes zeros into the whole gradient's memory when it is logically zero (running the first-write hook).
  void materialize_full_grad(stream_ref s) {
    if (!grad_zero_) return;
    expect_grad_memory();
    if (sharding_) sharding_->before_first_write();
    fill_zero(grad_.view().bytes(), s);
    if (!exact_.empty()) {
      fill_zero(exact_.view().bytes(), s);
      exact_holds_sum_ = true;  // the sum of nothing
    }
    grad_zero_ = false;
  }

  /// Deterministic mode (nn/deterministic.hpp): the exact accumulator of the gradient, kernels::exact_words(numel())
  /// i64 words (kernels/exact.hpp), allocated on the device of `s` at the first call. Whether it holds
  /// anything follows the gradient: begin_accumulate() says whether to overwrite or add.
  tensor_view exact_grad(stream_ref s) {
    if (exact_.empty()) exact_.own(tensor(shape{exact_words()}, dtype::i64, s));
    return exact_.view();
  }
  /// Whether the exact accumulator holds the gradient's exact sum since zero_grad, or (when a wrapper gathers
  /// partial gradients, exact_partials_target) the partials are in their slots (false after zero_grad, and after a
  /// one-pass sum, a gathered sum, or a layer that wrote the gradient directly: nn/deterministic.hpp). Set by the
  /// code that accumulates.
  [[nodiscard]] bool exact_grad_holds_sum() const noexcept { return exact_holds_sum_; }
  void set_exact_grad_holds_sum(bool holds) noexcept { exact_holds_sum_ = holds; }
  /// The exact accumulator, or an empty view when deterministic mode never ran.
  [[nodiscard]] tensor_view exact_grad() const noexcept { return exact_.view(); }
  /// The size of the exact accumulator, in i64 words.
  [[nodiscard]] std::int64_t exact_words() const noexcept {
    return static_cast<std::int64_t>(kernels::exact_words(static_cast<std::size_t>(numel())));
  }

  /// Deterministic mode under distributed_data_parallel, when it gathers the chunks' partial gradients instead of
  /// exact sums: where this backward writes them. Chunk j of the replica's rows goes to the numel() values (of
  /// the compute type) at `first` + j * `stride` elements, for j < `slots`; the slots it has no chunk for get
  /// zeros. `slots` 0: the exact accumulator, as usual.
  struct exact_partials {
    void* first = nullptr;
    std::int64_t stride = 0;
    std::int64_t slots = 0;
  };
  [[nodiscard]] const exact_partials& exact_partials_target() const noexcept { return partials_; }
  void set_exact_partials_target(exact_partials target) noexcept { partials_ = target; }

  /// Moves the exact accumulator into `storage` (exact_words() i64 words on this parameter's device),
  /// kept alive by `owner`, as share_grad_storage does for the gradient. Its contents are not kept: call it
  /// while the gradient is logically zero (before a step's backward).
  void share_exact_storage(const tensor_view& storage, std::shared_ptr<const void> owner) {
    LOCKSTEP_EXPECTS(storage.type() == dtype::i64 &&
                         storage.numel() == exact_words() &&
                         storage.get_device() == get_device(),
                     "parameter ", name_, ": shared exact storage must be ",
                     exact_words(), " i64 words on ", get_device().str(),
                     ", got ", storage.numel(), " of ", name_of(storage.type()), " on ", storage.get_device().str());
    exact_.borrow(storage, std::move(owner));
  }

  /// Moves the gradient into `storage` (this parameter's shape and compute type, on its device), which `owner`
  /// keeps alive for as long as the parameter uses it; the parameter's own gradient memory is freed. The
  /// gradient's value is kept (copied in stream order on `s` unless it is logically zero). It stays there until
  /// set_compute_type changes the type or share_grad_storage is called again.
  void share_grad_storage(const tensor_view& storage, std::shared_ptr<const void> owner, stream_ref s) {
    LOCKSTEP_EXPECTS(storage.type() == compute_type() && storage.numel() == numel() &&
                         storage.get_device() == get_device(),
                     "parameter ", name_, ": shared gradient storage must be ", numel(), " elements of ",
                     name_of(compute_type()), " on ", get_device().str(), ", got ", storage.numel(), " of ",
                     name_of(storage.type()), " on ", storage.get_device().str());
    const tensor_view target = storage.reshaped(dims());
    const bool keep = !grad_zero_ && target.data() != grad_.view().data();
    if (keep) copy(target.bytes(), device_span<const std::uint8_t>(grad_.view().bytes()), s);
    // the old memory freed after the copy that reads it
    grad_.borrow(target, std::move(owner), keep ? std::optional<stream_ref>(s) : std::nullopt);
  }

  /// Moves what forward reads (the working copy under f16/bf16, the master values under f32) into `storage`
  /// (this parameter's number of elements, in its compute type, on its device), kept alive by `owner`; the
  /// values are copied in stream order on `s`. Like share_grad_storage, for a wrapper that moves them in place.
  void share_compute_storage(const tensor_view& storage, std::shared_ptr<const void> owner, stream_ref s) {
    LOCKSTEP_EXPECTS(storage.type() == compute_type() && storage.numel() == numel() &&
                         storage.get_device() == get_device() && !(is_sharded() && sharding_->keeps_masters()),
                     "parameter ", name_, ": shared compute storage must be ", numel(), " elements of ",
                     name_of(compute_type()), " on ", get_device().str(), ", got ", storage.numel(), " of ",
                     name_of(storage.type()), " on ", storage.get_device().str());
    const tensor_view target = storage.reshaped(dims_);
    maybe_owned_tensor& moved = working_.empty() ? value_ : working_;
    copy(target.bytes(), device_span<const std::uint8_t>(moved.view().bytes()), s);
    moved.borrow(target, std::move(owner), s);  // the old memory freed after the copy
  }

  // ---- sharding (see the file comment) ----

  /// The elements whose update this rank owns: all of them unless a wrapper shards the parameter.
  [[nodiscard]] element_range shard() const noexcept { return is_sharded() ? sharding_->range() : element_range{0, numel()}; }
  [[nodiscard]] bool is_sharded() const noexcept { return sharding_ && sharding_->active(); }
  /// The fp32 master values of shard(), flat.
  [[nodiscard]] tensor_view master_shard() const {
    if (is_sharded() && sharding_->keeps_masters()) return sharding_->masters();
    expect_masters("master_shard()");
    return flat_range(value_.view(), shard());
  }
  /// The gradient's elements of shard(), flat: a part of grad(), or the gradient the wrapper keeps apart (ZeRO-2).
  [[nodiscard]] tensor_view grad_shard() const {
    if (is_sharded() && sharding_->keeps_gradient()) return sharding_->gradient();
    return flat_range(grad_.view(), shard());
  }
  /// The working copy's elements of shard(), flat; empty under f32.
  [[nodiscard]] tensor_view working_shard() const {
    if (shards_values()) return sharding_->working_shard();
    if (working_.empty()) return {};
    return flat_range(working_.view(), shard());
  }

  /// Attaches the wrapper's `sharding` (null: detaches). When it is active and keeps the master values, the
  /// parameter's own are freed in stream order on `s` (the wrapper copied its range first, on `s`); when it keeps
  /// the values forward reads (ZeRO-3), the working copy too.
  void set_sharding(std::shared_ptr<parameter_sharding> sharding, stream_ref s) {
    sharding_ = std::move(sharding);
    if (is_sharded() && sharding_->keeps_masters()) value_.reset(s);
    if (shards_values()) working_.reset(s);
  }
  /// Whether a wrapper keeps the values forward reads as shards (ZeRO-3; see parameter_sharding::shards_values).
  [[nodiscard]] bool shards_values() const noexcept { return is_sharded() && sharding_->shards_values(); }
  /// A consolidation's whole master values (`full`: all numel() of them, flat fp32 on this device, copied in
  /// stream order on `s`) replace those the wrapper kept for its range (which then deactivates its sharding).
  void restore_values(const tensor_view& full, stream_ref s) {
    LOCKSTEP_EXPECTS(full.type() == dtype::f32 && full.numel() == numel() && full.get_device() == get_device(),
                     "parameter ", name_, ": restore_values needs its ", numel(), " fp32 master values on ",
                     get_device().str());
    tensor whole(dims_, dtype::f32, s);
    copy(whole.span<float>(), full.span<const float>(), s);
    value_.own(std::move(whole), s);
    initial_ = nullptr;
  }
  /// With restore_values, when the wrapper kept the values forward reads (ZeRO-3) of an f16/bf16 parameter: its
  /// working copy whole again from `values` (all numel() of them in the compute type, on this device), copied in
  /// stream order on `s`.
  void restore_working_copy(const tensor_view& values, stream_ref s) {
    LOCKSTEP_EXPECTS(values.type() == compute_type_ && compute_type_ != dtype::f32 && values.numel() == numel() &&
                         values.get_device() == get_device(),
                     "parameter ", name_, ": restore_working_copy needs its ", numel(), " values of ",
                     name_of(compute_type_), " on ", get_device().str());
    tensor whole(dims_, compute_type_, s);
    copy(whole.bytes(), device_span<const std::uint8_t>(values.bytes()), s);
    working_.own(std::move(whole), s);
  }

  /// Writes all numel() fp32 master values from `full` (flat, on this device) in stream order on `s` (the
  /// context's stream), sharded or not: the shard's range into the master values the wrapper keeps (f16/bf16 under
  /// ZeRO), or into the parameter's own; and the values forward reads (the working copy, or the f32 values) whole,
  /// so that no gather is needed (under ZeRO-3, the values shard, and the whole values if the wrapper holds them
  /// gathered: values already stale stay stale, and the next forward gathers them).
  void load_values(const tensor_view& full, stream_ref s) {
    LOCKSTEP_EXPECTS(full.type() == dtype::f32 && full.numel() == numel() && full.get_device() == get_device(),
                     "parameter ", name_, ": load_values needs its ", numel(), " fp32 master values on ",
                     get_device().str());
    if (sharding_) sharding_->before_write();
    const auto values = full.span<const float>();
    if (is_sharded() && sharding_->keeps_masters()) {
      const element_range r = sharding_->range();
      if (!r.empty()) {
        copy(sharding_->masters().span<float>(),
             values.subspan(static_cast<std::size_t>(r.begin), static_cast<std::size_t>(r.size())), s);
      }
    } else {
      const bool deferred = masters_deferred();
      if (deferred) value_.own(tensor(dims_, dtype::f32, s));  // every value is written here
      copy(value_.view().span<float>(), values, s);
      initial_ = nullptr;
      if (deferred) restore_grad_memory(s);  // (it comes with the master values)
    }
    if (shards_values()) {  // (f32: the master values written above are the values)
      write_sharded_values(0, values, s);
      return;
    }
    if (working_.empty()) return;
    dispatch_floating(working_.view().type(), "load_values", [&]<class T>() { cast<T, float>(values, working_.view().span<T>(), s); });
  }

  /// An optimizer is about to update shard() (its master values and working copy) in stream order on `s`, which
  /// must be the context's stream (the stream the wrapper computes on): a wrapper that shards the parameter (ZeRO)
  /// orders the update after a gather still in flight, and gathers again before the next forward (also when the
  /// model was used, and the values gathered, between backward and the step); it refuses another stream. An
  /// optimizer of the user's own that writes master_shard() or working_shard() calls it first, for every
  /// parameter, on every rank.
  void before_update(stream_ref s) {
    if (sharding_) sharding_->before_update(*this, s);
  }

  /// The gradient's memory is about to be reused by the wrapper that owns it: the next write overwrites it.
  void release_full_grad() noexcept { grad_zero_ = true; }

  /// For a wrapper about to move the gradient into storage of its own (share_grad_storage): frees the
  /// parameter's own gradient memory now, in stream order on `s`, if the gradient is logically zero and the memory
  /// is its own, so that the wrapper's buffers are never allocated beside it. Until share_grad_storage or
  /// restore_grad_memory, accumulating into the gradient is an error.
  void release_grad_memory(stream_ref s) {
    if (grad_zero_ && !grad_.borrowed()) grad_.reset(s);
  }
  /// Gives the parameter gradient memory of its own again if release_grad_memory left it none.
  void restore_grad_memory(stream_ref s) {
    if (grad_.empty()) grad_.own(tensor(dims_, compute_type_, s));
  }

  /// Switches the compute precision: allocates the gradient in `type` and, for f16/bf16, a working copy
  /// refreshed from the master values (in stream order on `s`). f32 drops the working copy.
  void set_compute_type(dtype type, stream_ref s) {
    LOCKSTEP_EXPECTS(is_floating(type), "parameter ", name_, ": compute type must be f32, f16 or bf16, got ",
                     name_of(type));
    LOCKSTEP_EXPECTS(!is_sharded() && !working_.borrowed() && !value_.borrowed(), "parameter ", name_,
                     ": its compute type cannot change while a wrapper shards or holds its values");
    if (type == dtype::f32 && compute_type_ != dtype::f32) materialize_masters(s);  // forward reads them
    if (masters_deferred()) {
      grad_.reset(s);  // (its memory comes with the master values, or with a wrapper's buckets)
    } else if (grad_.empty() || grad_.view().type() != type) {
      grad_.own(tensor(dims_, type, s));
    }
    compute_type_ = type;
    grad_zero_ = true;
    if (type == dtype::f32) {
      working_.reset();
    } else {
      working_.ensure(dims_, type, s);
      refresh_working_copy(s);
    }
  }

  /// Rounds the master values into the working copy (after an optimizer step); under ZeRO, the shard's only.
  /// No-op under f32, except under ZeRO-3, where this rank's range of the whole values held gathered is written.
  void refresh_working_copy(stream_ref s) {
    if (shards_values()) {  // (and the copy held gathered)
      sharding_->before_write();
      write_sharded_values(shard().begin, master_shard().span<const float>(), s);
      return;
    }
    if (working_.empty()) return;
    if (masters_deferred()) {
      write_initial_working_copy(initial_, s);
      return;
    }
    const tensor_view to = working_shard();
    dispatch_floating(to.type(), "refresh_working_copy", [&]<class T>() {
      cast<T, float>(master_shard().span<const float>(), to.span<T>(), s);
    });
  }

  // ---- deferred master values (deferred_master_values; see the file comment) ----

  /// Whether the fp32 master values are deferred: neither the parameter nor a wrapper holds them yet, only the
  /// recipe of the initial values.
  [[nodiscard]] bool masters_deferred() const noexcept {
    return static_cast<bool>(initial_) && !(is_sharded() && sharding_->keeps_masters());
  }
  /// Sets the parameter's values to `values` (whole: initializers and write_values call it), in stream order on
  /// `s`: into the master values and the working copy, or, with the master values deferred, into the working copy
  /// alone (in chunks: no whole fp32 copy on the device), keeping `values` as the recipe of the master values.
  void set_initial_values(initial_values values, stream_ref s) {
    LOCKSTEP_EXPECTS(!is_sharded(), "parameter ", name_, ": initialize it before a data-parallel wrapper shards it");
    if (!initial_) {
      std::vector<float> host(static_cast<std::size_t>(numel()));
      values(0, host);
      auto staged = to_device(host, s);
      copy(value_.view().span<float>(), device_span<const float>(staged.span()), s);
      refresh_working_copy(s);
      return;
    }
    // (f32: no working copy; a failure may leave it partly written: refresh_working_copy redoes it)
    if (!working_.empty()) write_initial_working_copy(values, s);
    initial_ = std::move(values);
  }
  /// Whether the parameter keeps the recipe of its initial values (its master values deferred, or sharded by a
  /// wrapper that has not yet written them).
  [[nodiscard]] bool has_initial_values() const noexcept { return static_cast<bool>(initial_); }
  /// The initial values of elements [first, first + out.size()) into host memory `out`: what a wrapper that
  /// shards deferred master values writes (see write_values_range). Only while has_initial_values().
  void initial_values_of(std::int64_t first, std::span<float> out) const {
    LOCKSTEP_EXPECTS(initial_ && first >= 0 && first + static_cast<std::int64_t>(out.size()) <= numel(), "parameter ",
                     name_, ": initial values [", first, ", ", first + static_cast<std::int64_t>(out.size()), ") of ",
                     numel(), initial_ ? "" : " (its master values are not deferred)");
    initial_(first, out);
  }
  /// Writes the fp32 values of elements [first, first + values.numel()) from `values` (flat fp32, on this device)
  /// in stream order on `s`: the part in this rank's master values (the wrapper's shard, or the parameter's own) and
  /// the working copy's elements. A wrapper sharding deferred master values streams a parameter through this.
  void write_values_range(std::int64_t first, const tensor_view& values, stream_ref s) {
    const std::int64_t n = values.numel();
    LOCKSTEP_EXPECTS(values.type() == dtype::f32 && values.get_device() == get_device() && first >= 0 &&
                         first + n <= numel(),
                     "parameter ", name_, ": write_values_range of ", n, " ", name_of(values.type()), " values on ",
                     values.get_device().str(), " at element ", first, " of ", numel());
    if (sharding_) sharding_->before_write();  // after a gather of the values still in flight
    const auto from = values.span<const float>();
    const bool keeps = is_sharded() && sharding_->keeps_masters();
    LOCKSTEP_EXPECTS(keeps || !masters_deferred(), "parameter ", name_,
                     ": write_values_range needs master values to write: shard it or materialize_masters first");
    const element_range mine = keeps ? sharding_->range() : element_range{0, numel()};
    const std::int64_t begin = std::max(first, mine.begin), end = std::min(first + n, mine.end);
    if (begin < end) {
      const tensor_view to = keeps ? sharding_->masters() : value_.view();
      copy(to.span<float>().subspan(static_cast<std::size_t>(begin - mine.begin), static_cast<std::size_t>(end - begin)),
           from.subspan(static_cast<std::size_t>(begin - first), static_cast<std::size_t>(end - begin)), s);
    }
    if (shards_values()) {
      write_sharded_values(first, from, s);
      return;
    }
    if (working_.empty() || n == 0) return;
    dispatch_floating(working_.view().type(), "write_values_range", [&]<class T>() {
      cast<T, float>(from, working_.view().span<T>().subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(n)), s);
    });
  }
  /// Ends the deferral once a wrapper wrote its shard's master values (write_values_range): the recipe is dropped.
  void forget_initial_values() noexcept {
    if (is_sharded() && sharding_->keeps_masters()) initial_ = nullptr;
  }
  /// Gives a parameter whose master values are deferred all of them, from the recipe, in stream order on `s`
  /// (no-op otherwise).
  void materialize_masters(stream_ref s) {
    if (!masters_deferred()) return;
    tensor whole(dims_, dtype::f32, s);
    std::vector<float> host(static_cast<std::size_t>(numel()));
    initial_(0, host);
    auto staged = to_device(host, s);
    copy(whole.span<float>(), device_span<const float>(staged.span()), s);
    value_.own(std::move(whole));  // (a failure before leaves the parameter deferred)
    initial_ = nullptr;
    restore_grad_memory(s);
  }

  /// The working copy, for a fused optimizer that writes it directly; empty under f32, and under ZeRO-3 (which
  /// keeps a shard of it: working_shard()).
  [[nodiscard]] tensor_view working() const noexcept { return working_.view(); }

  /// The data-parallel wrapper this parameter belongs to (nullptr: none); see gradient_owner_scope.
  void set_owner(const void* owner) noexcept { owner_ = owner; }
  [[nodiscard]] const void* owner() const noexcept { return owner_; }

  /// What updates this parameter, and with which options: a description set by the optimizer (when the parameter
  /// joins one of its groups), the loss scaler and the gradient clipper (when they first handle it).
  /// distributed_data_parallel compares them across ranks, so that ranks started with other options (another
  /// learning rate, no clipping) fail at their first backward naming both values instead of training apart.
  void set_update_settings(update_role role, std::shared_ptr<const std::string> text) noexcept {
    settings_[static_cast<std::size_t>(role)] = std::move(text);
  }
  [[nodiscard]] const std::shared_ptr<const std::string>& update_settings(update_role role) const noexcept {
    return settings_[static_cast<std::size_t>(role)];
  }

  /// A copy of this parameter on the device of `s` (values copied in stream order on `s`; the caller makes
  /// `s` wait for the work that produced the source values). The gradient starts zero.
  [[nodiscard]] parameter clone(stream_ref s) const {
    if (masters_deferred()) {  // the recipe and the working copy (f32: none)
      parameter p(name_, dims_, s, compute_type(), true);
      if (!working_.empty()) copy(p.working_.view().bytes(), device_span<const std::uint8_t>(working_.view().bytes()), s);
      p.initial_ = initial_;
      return p;
    }
    parameter p(name_, dims_, s, compute_type(), false);
    copy(p.value_.view().span<float>(), value().span<const float>(), s);
    p.refresh_working_copy(s);
    return p;
  }

 private:
  // `deferred`: no master values and no gradient memory (a ZeRO wrapper's buckets give it; materialize_masters
  // too), the recipe of zeros until set_initial_values, and under f16/bf16 a working copy of zeros.
  parameter(std::string name, shape dims, stream_ref s, dtype compute_type, bool deferred)
      : name_(std::move(name)), dims_(dims), device_(s.get_device()) {
    if (!deferred) {
      value_.own(tensor(dims, dtype::f32, s));
      set_compute_type(compute_type, s);
      return;
    }
    LOCKSTEP_EXPECTS(is_floating(compute_type), "parameter ", name_, ": compute type must be f32, f16 or bf16, got ",
                     name_of(compute_type));
    compute_type_ = compute_type;
    if (compute_type != dtype::f32) {
      working_.own(tensor(dims_, compute_type, s));
      fill_zero(working_.view().bytes(), s);
    }
    initial_ = [](std::int64_t, std::span<float> out) { std::fill(out.begin(), out.end(), 0.0f); };
  }

  // Accumulating into a gradient without memory (deferred master values, whose gradient memory comes with them;
  // release_grad_memory, and a wrapper's construction failed out of memory before it gave the parameter storage or
  // its memory back).
  void expect_grad_memory() const {
    if (grad_.empty()) expect_masters("backward (its gradient, whose memory comes with them)");
    LOCKSTEP_EXPECTS(!grad_.empty() || numel() == 0, "parameter ", name_, " ", dims_.str(),
                     " has no gradient memory: a data-parallel wrapper whose construction failed out of memory took "
                     "it; build the model again");
  }

  void expect_masters(const char* what) const {
    if (!masters_deferred()) return;
    throw precondition_error(detail::concat(
        "parameter ", name_, ": ", what, " needs its fp32 master values, which are deferred (it was built inside a "
        "deferred_master_values scope, for a ZeRO wrapper to keep only its shard of them): wrap the model in "
        "distributed_data_parallel with zero_stage::",
        compute_type_ == dtype::f32 ? "parameters (an f32 model: forward reads them)"
                                    : "optimizer_state, gradients or parameters",
        " before building the optimizer, or call materialize_masters(stream) to hold them whole"));
  }

  // The working copy from `initial` (a recipe of initial values), in chunks of detail::initial_values_chunk elements.
  void write_initial_working_copy(const initial_values& initial, stream_ref s) {
    const std::int64_t n = numel();
    std::vector<float> host(static_cast<std::size_t>(std::min(n, detail::initial_values_chunk)));
    for (std::int64_t first = 0; first < n; first += detail::initial_values_chunk) {
      const auto count = static_cast<std::size_t>(std::min(detail::initial_values_chunk, n - first));
      initial(first, std::span<float>(host).first(count));
      const auto staged = to_device(host, s);  // (a copy of the whole host vector: its first `count` are read)
      dispatch_floating(working_.view().type(), "refresh_working_copy", [&]<class T>() {
        cast<T, float>(device_span<const float>(staged.span()).first(count),
                       working_.view().span<T>().subspan(static_cast<std::size_t>(first), count), s);
      });
    }
  }

  // ZeRO-3: elements [first, first + from.size()) of the values forward reads, from the fp32 `from`, in stream order
  // on `s`: their part of this rank's working-copy shard (f32: nothing, the master values are the values), and all
  // of them in the copy the wrapper holds gathered, if it holds one (which so stays current, as stages 1 and 2
  // write their whole values: a write never changes which collectives the ranks issue).
  void write_sharded_values(std::int64_t first, device_span<const float> from, stream_ref s) {
    const tensor_view shard = sharding_->working_shard(), held = sharding_->values();
    const element_range mine = sharding_->range();
    const auto n = static_cast<std::int64_t>(from.size());
    const std::int64_t begin = std::max(first, mine.begin), end = std::min(first + n, mine.end);
    dispatch_floating(compute_type_, "write_values_range", [&]<class T>() {
      const auto put = [&](device_span<const float> f, device_span<T> to) {
        if constexpr (std::is_same_v<T, float>) {
          copy(to, f, s);
        } else {
          cast<T, float>(f, to, s);
        }
      };
      if (!shard.empty() && begin < end) {
        put(from.subspan(static_cast<std::size_t>(begin - first), static_cast<std::size_t>(end - begin)),
            shard.span<T>().subspan(static_cast<std::size_t>(begin - mine.begin), static_cast<std::size_t>(end - begin)));
      }
      if (!held.empty() && n > 0) put(from, held.span<T>().subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(n)));
    });
  }

  // The elements `r` of `t`, flat.
  [[nodiscard]] static tensor_view flat_range(const tensor_view& t, element_range r) {
    if (r.empty()) return tensor_view(t.data(), t.type(), shape{0}, t.get_device());
    return tensor_view(static_cast<std::byte*>(t.data()) + static_cast<std::size_t>(r.begin) * size_of(t.type()),
                       t.type(), shape{r.size()}, t.get_device());
  }

  std::string name_;
  shape dims_;
  device device_{};
  dtype compute_type_ = dtype::f32;  // the gradient's and the working copy's
  const void* owner_ = nullptr;  // the data-parallel wrapper of the parameter, if any
  std::array<std::shared_ptr<const std::string>, update_role_count> settings_;  // see set_update_settings
  maybe_owned_tensor value_;    // the fp32 master values (under ZeRO f16/bf16: the shard's); f32: shared by ZeRO
  maybe_owned_tensor working_;  // the working copy (f16/bf16; empty under f32), shared by ZeRO
  maybe_owned_tensor grad_;     // the gradient, shared by DDP's buckets
  maybe_owned_tensor exact_;    // deterministic mode's accumulator, shared by DDP's buckets
  bool exact_holds_sum_ = false;
  exact_partials partials_;
  bool grad_zero_ = true;
  std::shared_ptr<parameter_sharding> sharding_;  // a wrapper's (ZeRO), or null
  initial_values initial_;  // set while the master values are deferred (deferred_master_values), else empty
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

/// Gives each parameter of `params` the setting `text` for `role` (parameter::set_update_settings) where it has
/// another: what optimizers, the loss scaler and the clipper record for distributed_data_parallel to compare.
inline void set_update_settings(std::span<parameter* const> params, update_role role,
                                const std::shared_ptr<const std::string>& text) noexcept {
  for (parameter* p : params) {
    if (p->update_settings(role) != text) p->set_update_settings(role, text);
  }
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// A parameter and its qualified name ("fc1.weight").
struct named_parameter {
  std::string name;
  parameter* param;
};

/// A buffer (a layer's state that training changes without a gradient: batch norm's running statistics) and its
/// qualified name ("bn1.running_mean").
struct named_buffer {
  std::string name;
  tensor* buffer;
};

/// The parameters of a model in a stable order (the order layers add them: creation order within a layer,
/// layer order within a container), and its buffers, in the same way. Containers open a scope per child so names
/// are qualified. Iterating the list, size() and pointers() see the parameters only (what optimizers and gradient
/// wrappers take); buffers() lists the buffers, which checkpoints save with the parameters (PyTorch's state_dict
/// names) and the data-parallel wrappers keep equal on every replica (rank 0's, as PyTorch's broadcast_buffers).
class parameter_list {
 public:
  /// Appends `p` under the current scope.
  void add(parameter& p) { items_.push_back(named_parameter{prefix_ + p.name(), &p}); }
  /// Appends buffer `t`, named `name` in its layer ("running_mean"), under the current scope.
  void add_buffer(std::string_view name, tensor& t) {
    buffers_.push_back(named_buffer{prefix_ + std::string(name), &t});
  }

  /// Names the parameters added until the returned guard ends with `scope` + ".".
  [[nodiscard]] auto scope(std::string_view name) {
    struct guard {
      guard(parameter_list* l, std::size_t p) noexcept : list(l), previous(p) {}
      guard(const guard&) = delete;
      guard& operator=(const guard&) = delete;
      ~guard() { list->prefix_.resize(previous); }
      parameter_list* list;
      std::size_t previous;
    };
    const std::size_t previous = prefix_.size();
    prefix_ += name;
    prefix_ += '.';
    return guard{this, previous};
  }

  [[nodiscard]] const std::vector<named_parameter>& items() const noexcept { return items_; }
  [[nodiscard]] std::size_t size() const noexcept { return items_.size(); }
  [[nodiscard]] bool empty() const noexcept { return items_.empty(); }
  [[nodiscard]] auto begin() const noexcept { return items_.begin(); }
  [[nodiscard]] auto end() const noexcept { return items_.end(); }
  [[nodiscard]] const named_parameter& operator[](std::size_t i) const { return items_.at(i); }
  [[nodiscard]] const std::vector<named_buffer>& buffers() const noexcept { return buffers_; }

  /// The parameters alone, in order.
  [[nodiscard]] std::vector<parameter*> pointers() const {
    std::vector<parameter*> out;
    out.reserve(items_.size());
    for (const auto& item : items_) out.push_back(item.param);
    return out;
  }

  /// Total number of elements.
  [[nodiscard]] std::int64_t numel() const noexcept {
    std::int64_t n = 0;
    for (const auto& item : items_) n += item.param->numel();
    return n;
  }

 private:
  std::vector<named_parameter> items_;
  std::vector<named_buffer> buffers_;
  std::string prefix_;
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

/// Calls f(k, values) for every parameter k of `params`, in order, with its whole fp32 master values
/// (value()) copied to host memory (valid during the call); synchronizes `s` once per parameter.
template <class F>
void visit_values_on_host(const parameter_list& params, stream_ref s, F&& f) {
  for (std::size_t k = 0; k < params.size(); ++k) {
    const std::vector<float> v = to_vector(params[k].param->value().span<const float>(), s);
    f(k, std::span<const float>(v));
  }
}

/// Under ZeRO each rank holds a shard of the gradients: a check or a norm over them needs the ranks (`what`
/// names the call, `why` says what the ranks are for).
inline void expect_ranks_for_shards(std::span<parameter* const> params, bool have_ranks, const char* what,
                                    const char* why) {
  if (have_ranks) return;
  for (const parameter* p : params) {
    LOCKSTEP_EXPECTS(!p->is_sharded(), what, ": parameter ", p->name(), " is sharded (ZeRO: this rank holds ",
                     p->shard().size(), " of its ", p->numel(), " gradient elements); pass the communicator ", why);
  }
}

LOCKSTEP_DETAIL_END
