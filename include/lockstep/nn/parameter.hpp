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
// ZeRO all-gathers them in place.
//
// ZeRO (parallel/distributed_data_parallel.hpp) gives a parameter a shard: the range of its elements whose
// update this rank owns (`shard()`; all of them otherwise). The optimizer, the loss scaler and the clipper read
// and write `master_shard()`, `grad_shard()` and `working_shard()`, never the whole tensors. Under f16/bf16 the
// master values of the other elements are not kept at all (`value()` then refuses, naming the way to get them),
// and under ZeRO-2 the gradient shard has storage of its own while the whole gradient lives only during
// backward, in memory reused bucket after bucket (a first-write hook lets the owner of that memory order the
// writes after its previous use). Between a ZeRO backward and the gather of the updated values the compute
// values are stale: `compute_value()` refuses; after the gather, its first call orders the reader (the context's
// stream) after the parameter's all-gather (a read hook).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
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

class parameter {
 public:
  parameter() = default;

  /// A parameter named `name` (local to its layer: "weight") of shape `dims` on the device of `s`, with
  /// uninitialized fp32 values and a gradient in `compute_type`, marked zero.
  parameter(std::string name, shape dims, stream_ref s, dtype compute_type = dtype::f32)
      : name_(std::move(name)), dims_(dims), value_(dims, dtype::f32, s), value_view_(value_.view()) {
    set_compute_type(compute_type, s);
  }

  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] const shape& dims() const noexcept { return dims_; }
  [[nodiscard]] std::int64_t numel() const noexcept { return dims_.numel(); }
  [[nodiscard]] device get_device() const noexcept { return value_view_.get_device(); }

  /// The fp32 master values (what the optimizer updates and checkpoints store). Throws precondition_error while
  /// ZeRO shards the parameter: this rank updates only its shard (see master_shard()), and under f16/bf16 keeps
  /// only the shard's master values.
  [[nodiscard]] tensor_view value() const {
    if (sharded_) {
      throw precondition_error(detail::concat(
          "parameter ", name_, ": ZeRO shards it over the ranks: this rank updates elements [", shard_.begin, ", ",
          shard_.end, ") of its ", numel(), master_sharded_ ? " and keeps only their fp32 master values" : "",
          "; read master_shard(), or gather whole values with distributed_data_parallel::consolidated(optimizer) "
          "(save, load and hash checkpoints inside it)"));
    }
    return value_view_;
  }
  /// What forward and backward read: the working copy under f16/bf16, the master values under f32. Throws
  /// precondition_error between a ZeRO backward and the gather of the updated values (they are stale).
  [[nodiscard]] tensor_view compute_value() const {
    if (stale_) {
      throw precondition_error(detail::concat(
          "parameter ", name_, ": its values on this rank are stale (ZeRO updates a shard per rank; the others' "
          "updates arrive with the next distributed_data_parallel::forward or gather_parameters()); call "
          "ddp.gather_parameters() before using the model outside the wrapper"));
    }
    if (read_hook_) std::exchange(read_hook_, nullptr)();
    return working_view_.empty() ? value_view_ : working_view_;
  }
  /// The gradient, in the compute precision.
  [[nodiscard]] tensor_view grad() const noexcept { return grad_view_; }
  [[nodiscard]] dtype compute_type() const noexcept { return grad_view_.type(); }

  /// True when the gradient is logically zero (zero_grad was called and nothing accumulated since).
  [[nodiscard]] bool grad_is_zero() const noexcept { return grad_zero_; }

  /// Marks the gradient zero without writing it.
  void zero_grad() noexcept {
    grad_zero_ = true;
    shard_grad_zero_ = true;
    exact_holds_sum_ = false;
  }

  /// For code about to accumulate into the gradient: returns the factor for the old contents (0 when the
  /// gradient is logically zero, so the accumulation overwrites; 1 otherwise) and marks it written. The
  /// first-write hook (ZeRO-2) runs before a logically zero gradient is written.
  [[nodiscard]] float begin_accumulate() {
    if (!grad_zero_) return 1.0f;
    if (first_write_) first_write_();
    grad_zero_ = false;
    return 0.0f;
  }

  /// Writes zeros into what readers of the gradient read when it is logically zero: the gradient's memory (and
  /// its exact accumulator, when it has one), or under ZeRO-2 the gradient shard's own storage.
  void materialize_grad(stream_ref s) {
    if (own_grad_shard_) {
      if (std::exchange(shard_grad_zero_, false)) fill_zero(grad_shard_.view().bytes(), s);
      return;
    }
    materialize_full_grad(s);
  }

  /// Writes zeros into the whole gradient's memory when it is logically zero (running the first-write hook).
  void materialize_full_grad(stream_ref s) {
    if (!grad_zero_) return;
    if (first_write_) first_write_();
    fill_zero(grad_view_.bytes(), s);
    if (!exact_view_.empty()) {
      fill_zero(exact_view_.bytes(), s);
      exact_holds_sum_ = true;  // the sum of nothing
    }
    grad_zero_ = false;
  }

  /// Deterministic mode (nn/deterministic.hpp): the exact accumulator of the gradient, kernels::exact_words(numel())
  /// i64 words (kernels/exact.hpp), allocated on the device of `s` at the first call. Whether it holds
  /// anything follows the gradient: begin_accumulate() says whether to overwrite or add.
  tensor_view exact_grad(stream_ref s) {
    if (exact_view_.empty()) {
      exact_ = tensor(shape{exact_words()}, dtype::i64, s);
      exact_view_ = exact_.view();
    }
    return exact_view_;
  }
  /// Whether the exact accumulator holds the gradient's exact sum since zero_grad, or (when a wrapper gathers
  /// partial gradients, exact_partials_target) the partials are in their slots (false after zero_grad, and after a
  /// one-pass sum, a gathered sum, or a layer that wrote the gradient directly: nn/deterministic.hpp). Set by the
  /// code that accumulates.
  [[nodiscard]] bool exact_grad_holds_sum() const noexcept { return exact_holds_sum_; }
  void set_exact_grad_holds_sum(bool holds) noexcept { exact_holds_sum_ = holds; }
  /// The exact accumulator, or an empty view when deterministic mode never ran.
  [[nodiscard]] tensor_view exact_grad() const noexcept { return exact_view_; }
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
    exact_ = tensor();
    exact_owner_ = std::move(owner);
    exact_view_ = storage;
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
    if (!grad_zero_ && target.data() != grad_view_.data()) {
      copy(target.bytes(), device_span<const std::uint8_t>(grad_view_.bytes()), s);
      grad_.set_stream(s);  // freed after the copy that reads it
    }
    grad_ = tensor();
    grad_owner_ = std::move(owner);
    grad_view_ = target;
  }

  /// Moves what forward reads (the working copy under f16/bf16, the master values under f32) into `storage`
  /// (this parameter's number of elements, in its compute type, on its device), kept alive by `owner`; the
  /// values are copied in stream order on `s`. Like share_grad_storage, for a wrapper that moves them in place.
  void share_compute_storage(const tensor_view& storage, std::shared_ptr<const void> owner, stream_ref s) {
    LOCKSTEP_EXPECTS(storage.type() == compute_type() && storage.numel() == numel() &&
                         storage.get_device() == get_device() && !master_sharded_,
                     "parameter ", name_, ": shared compute storage must be ", numel(), " elements of ",
                     name_of(compute_type()), " on ", get_device().str(), ", got ", storage.numel(), " of ",
                     name_of(storage.type()), " on ", storage.get_device().str());
    const tensor_view target = storage.reshaped(dims_);
    if (working_view_.empty()) {
      copy(target.bytes(), device_span<const std::uint8_t>(value_view_.bytes()), s);
      value_.set_stream(s);
      value_ = tensor();
      value_owner_ = std::move(owner);
      value_view_ = target;
    } else {
      copy(target.bytes(), device_span<const std::uint8_t>(working_view_.bytes()), s);
      working_.set_stream(s);
      working_ = tensor();
      working_owner_ = std::move(owner);
      working_view_ = target;
    }
  }

  // ---- ZeRO's shard (see the file comment) ----

  /// The elements whose update this rank owns: all of them unless ZeRO sharded the parameter.
  [[nodiscard]] element_range shard() const noexcept { return sharded_ ? shard_ : element_range{0, numel()}; }
  [[nodiscard]] bool is_sharded() const noexcept { return sharded_; }
  /// The fp32 master values of shard(), flat.
  [[nodiscard]] tensor_view master_shard() const {
    if (master_sharded_) return value_view_;
    return flat_range(value_view_, shard());
  }
  /// The gradient's elements of shard(), flat: a part of grad(), or under ZeRO-2 the shard's own storage.
  [[nodiscard]] tensor_view grad_shard() const {
    if (own_grad_shard_) return grad_shard_.view();
    return flat_range(grad_view_, shard());
  }
  /// The working copy's elements of shard(), flat; empty under f32.
  [[nodiscard]] tensor_view working_shard() const {
    if (working_view_.empty()) return {};
    return flat_range(working_view_, shard());
  }

  /// Makes `range` this rank's shard, in stream order on `s`. Under f16/bf16 the master values outside it are
  /// freed; value() refuses while the parameter is sharded. With `own_grad_storage` (ZeRO-2) the gradient shard
  /// gets storage of its own: what clear_shard kept aside for the same range (with what it holds), else new
  /// storage marked zero.
  void set_shard(element_range range, bool own_grad_storage, stream_ref s) {
    LOCKSTEP_EXPECTS(!sharded_ && range.begin >= 0 && range.begin <= range.end && range.end <= numel(),
                     "parameter ", name_, ": shard [", range.begin, ", ", range.end, ") of ", numel(),
                     " elements", sharded_ ? " (it is sharded already)" : "");
    if (range.empty()) range = element_range{};
    if (!working_view_.empty()) {
      tensor kept(shape{range.size()}, dtype::f32, s);
      if (!range.empty()) copy(kept.span<float>(), flat_range(value_view_, range).span<const float>(), s);
      value_.set_stream(s);
      value_ = std::move(kept);
      value_owner_.reset();
      value_view_ = value_.view();
      master_sharded_ = true;
    }
    if (own_grad_storage) {
      if (parked_grad_shard_.has_value() && parked_grad_shard_->numel() == range.size()) {
        grad_shard_ = std::move(*parked_grad_shard_);  // what it held before clear_shard (and its zero flag)
      } else {
        grad_shard_ = tensor(shape{range.size()}, compute_type(), s);
        shard_grad_zero_ = true;
      }
      own_grad_shard_ = true;
    }
    parked_grad_shard_.reset();
    shard_ = range;
    sharded_ = true;
  }

  /// Undoes set_shard: `full` holds all numel() master values (flat fp32 on this device; read under f16/bf16
  /// only, copied in stream order on `s`). The gradient shard's own storage (ZeRO-2) is kept aside, with what it
  /// holds, for the next set_shard of the same range.
  void clear_shard(const tensor_view& full, stream_ref s) {
    if (!sharded_) return;
    if (master_sharded_) {
      LOCKSTEP_EXPECTS(full.type() == dtype::f32 && full.numel() == numel() && full.get_device() == get_device(),
                       "parameter ", name_, ": clear_shard needs its ", numel(), " fp32 master values on ",
                       get_device().str());
      tensor whole(dims_, dtype::f32, s);
      copy(whole.span<float>(), full.span<const float>(), s);
      value_.set_stream(s);
      value_ = std::move(whole);
      value_view_ = value_.view();
      master_sharded_ = false;
    }
    if (own_grad_shard_) parked_grad_shard_ = std::move(grad_shard_);  // kept for set_shard with the same range
    grad_shard_ = tensor();
    own_grad_shard_ = false;
    sharded_ = false;
    shard_ = element_range{};
  }

  /// ZeRO-2: the factor for the gradient shard's old contents when adding a reduced gradient into it (0 when it
  /// is logically zero), marking it written.
  [[nodiscard]] float begin_shard_accumulate() noexcept { return std::exchange(shard_grad_zero_, false) ? 0.0f : 1.0f; }
  /// ZeRO-2: the whole gradient's memory is about to be reused: the next write overwrites it.
  void release_full_grad() noexcept { grad_zero_ = true; }
  /// Runs before a logically zero gradient's memory is first written (empty: nothing). ZeRO-2 orders that write
  /// after the memory's previous use.
  void set_first_write_hook(std::function<void()> hook) { first_write_ = std::move(hook); }
  /// Marks the compute values stale (ZeRO, after backward) or current (after the gather).
  void set_stale(bool stale) noexcept { stale_ = stale; }
  /// Runs once, at the next compute_value() (empty: nothing). ZeRO orders the first read of gathered values after
  /// their bucket's all-gather, so that forward starts before the last bucket arrives.
  void set_read_hook(std::function<void()> hook) { read_hook_ = std::move(hook); }

  /// Switches the compute precision: allocates the gradient in `type` and, for f16/bf16, a working copy
  /// refreshed from the master values (in stream order on `s`). f32 drops the working copy.
  void set_compute_type(dtype type, stream_ref s) {
    LOCKSTEP_EXPECTS(is_floating(type), "parameter ", name_, ": compute type must be f32, f16 or bf16, got ",
                     name_of(type));
    LOCKSTEP_EXPECTS(!sharded_ && !working_owner_ && !value_owner_, "parameter ", name_,
                     ": its compute type cannot change while a wrapper shards or holds its values");
    if (grad_view_.empty() || grad_view_.type() != type) {
      grad_ = tensor(dims_, type, s);
      grad_owner_.reset();
      grad_view_ = grad_.view();
    }
    grad_zero_ = true;
    if (type == dtype::f32) {
      working_ = tensor();
      working_view_ = {};
    } else {
      working_.ensure(dims_, type, s);
      working_view_ = working_.view();
      refresh_working_copy(s);
    }
  }

  /// Rounds the master values into the working copy (after an optimizer step); under ZeRO, the shard's only.
  /// No-op under f32.
  void refresh_working_copy(stream_ref s) {
    if (working_view_.empty()) return;
    const tensor_view to = working_shard();
    dispatch_floating(to.type(), "refresh_working_copy", [&]<class T>() {
      cast<T, float>(master_shard().span<const float>(), to.span<T>(), s);
    });
  }

  /// The working copy, for a fused optimizer that writes it directly; empty under f32.
  [[nodiscard]] tensor_view working() const noexcept { return working_view_; }

  /// A copy of this parameter on the device of `s` (values copied in stream order on `s`; the caller makes
  /// `s` wait for the work that produced the source values). The gradient starts zero.
  [[nodiscard]] parameter clone(stream_ref s) const {
    parameter p(name_, dims_, s, compute_type());
    copy(p.value_.span<float>(), value().span<const float>(), s);
    p.refresh_working_copy(s);
    return p;
  }

 private:
  // The elements `r` of `t`, flat.
  [[nodiscard]] static tensor_view flat_range(const tensor_view& t, element_range r) {
    if (r.empty()) return tensor_view(t.data(), t.type(), shape{0}, t.get_device());
    return tensor_view(static_cast<std::byte*>(t.data()) + static_cast<std::size_t>(r.begin) * size_of(t.type()),
                       t.type(), shape{r.size()}, t.get_device());
  }

  std::string name_;
  shape dims_;
  tensor value_;                             // the master values' memory (under ZeRO f16/bf16: the shard's), unless shared:
  std::shared_ptr<const void> value_owner_;  // keeps shared master memory alive (f32 compute storage)
  tensor_view value_view_;
  tensor working_;                             // the working copy's memory, unless shared:
  std::shared_ptr<const void> working_owner_;
  tensor_view working_view_;
  tensor grad_;                             // the gradient's memory, unless shared:
  std::shared_ptr<const void> grad_owner_;  // keeps shared gradient memory alive
  tensor_view grad_view_;                   // the gradient (in grad_ or in shared memory)
  tensor exact_;                            // deterministic mode's accumulator, unless shared:
  std::shared_ptr<const void> exact_owner_;
  tensor_view exact_view_;
  bool exact_holds_sum_ = false;
  exact_partials partials_;
  bool grad_zero_ = true;
  // ZeRO
  bool sharded_ = false;
  bool master_sharded_ = false;  // value_ holds the shard's master values only
  element_range shard_;
  tensor grad_shard_;            // ZeRO-2: the gradient shard's own storage
  bool own_grad_shard_ = false;
  std::optional<tensor> parked_grad_shard_;  // between clear_shard and set_shard
  bool shard_grad_zero_ = true;
  bool stale_ = false;
  std::function<void()> first_write_;
  mutable std::function<void()> read_hook_;
};

/// A parameter and its qualified name ("fc1.weight").
struct named_parameter {
  std::string name;
  parameter* param;
};

/// The parameters of a model in a stable order (the order layers add them: creation order within a layer,
/// layer order within a container). Containers open a scope per child so names are qualified.
class parameter_list {
 public:
  /// Appends `p` under the current scope.
  void add(parameter& p) { items_.push_back(named_parameter{prefix_ + p.name(), &p}); }

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
  std::string prefix_;
};

LOCKSTEP_ABI_END
