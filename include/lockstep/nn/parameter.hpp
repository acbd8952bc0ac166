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
// backward writes them where the all-reduce reads them and no copy is needed either way.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/kernels/exact.hpp"
#include "lockstep/runtime/tensor.hpp"
#include "lockstep/runtime/copy.hpp"

LOCKSTEP_ABI_BEGIN

class parameter {
 public:
  parameter() = default;

  /// A parameter named `name` (local to its layer: "weight") of shape `dims` on the device of `s`, with
  /// uninitialized fp32 values and a gradient in `compute_type`, marked zero.
  parameter(std::string name, shape dims, stream_ref s, dtype compute_type = dtype::f32)
      : name_(std::move(name)), value_(dims, dtype::f32, s) {
    set_compute_type(compute_type, s);
  }

  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] const shape& dims() const noexcept { return value_.dims(); }
  [[nodiscard]] std::int64_t numel() const noexcept { return value_.numel(); }
  [[nodiscard]] device get_device() const noexcept { return value_.get_device(); }

  /// The fp32 master values (what the optimizer updates and checkpoints store).
  [[nodiscard]] tensor_view value() const noexcept { return value_.view(); }
  /// What forward and backward read: the working copy under f16/bf16, the master values under f32.
  [[nodiscard]] tensor_view compute_value() const noexcept { return working_.empty() ? value_.view() : working_.view(); }
  /// The gradient, in the compute precision.
  [[nodiscard]] tensor_view grad() const noexcept { return grad_view_; }
  [[nodiscard]] dtype compute_type() const noexcept { return grad_view_.type(); }

  /// True when the gradient is logically zero (zero_grad was called and nothing accumulated since).
  [[nodiscard]] bool grad_is_zero() const noexcept { return grad_zero_; }

  /// Marks the gradient zero without writing it.
  void zero_grad() noexcept {
    grad_zero_ = true;
    exact_holds_sum_ = false;
  }

  /// For code about to accumulate into the gradient: returns the factor for the old contents (0 when the
  /// gradient is logically zero, so the accumulation overwrites; 1 otherwise) and marks it written.
  [[nodiscard]] float begin_accumulate() noexcept { return std::exchange(grad_zero_, false) ? 0.0f : 1.0f; }

  /// Writes zeros into a gradient that is logically zero (and into its exact accumulator, when it has one), so
  /// that readers of its memory see them.
  void materialize_grad(stream_ref s) {
    if (!grad_zero_) return;
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
  /// Whether the exact accumulator holds the gradient's exact sum since zero_grad (false after zero_grad, and
  /// after a one-pass sum or a layer that wrote the gradient directly: nn/deterministic.hpp). Set by the code
  /// that accumulates.
  [[nodiscard]] bool exact_grad_holds_sum() const noexcept { return exact_holds_sum_; }
  void set_exact_grad_holds_sum(bool holds) noexcept { exact_holds_sum_ = holds; }
  /// The exact accumulator, or an empty view when deterministic mode never ran.
  [[nodiscard]] tensor_view exact_grad() const noexcept { return exact_view_; }
  /// The size of the exact accumulator, in i64 words.
  [[nodiscard]] std::int64_t exact_words() const noexcept {
    return static_cast<std::int64_t>(kernels::exact_words(static_cast<std::size_t>(numel())));
  }

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

  /// Switches the compute precision: allocates the gradient in `type` and, for f16/bf16, a working copy
  /// refreshed from the master values (in stream order on `s`). f32 drops the working copy.
  void set_compute_type(dtype type, stream_ref s) {
    LOCKSTEP_EXPECTS(is_floating(type), "parameter ", name_, ": compute type must be f32, f16 or bf16, got ",
                     name_of(type));
    if (grad_view_.empty() || grad_view_.type() != type) {
      grad_ = tensor(value_.dims(), type, s);
      grad_owner_.reset();
      grad_view_ = grad_.view();
    }
    grad_zero_ = true;
    if (type == dtype::f32) {
      working_ = tensor();
    } else {
      working_.ensure(value_.dims(), type, s);
      refresh_working_copy(s);
    }
  }

  /// Rounds the master values into the working copy (after an optimizer step). No-op under f32.
  void refresh_working_copy(stream_ref s) {
    if (working_.empty()) return;
    dispatch_floating(working_.type(), "refresh_working_copy", [&]<class T>() {
      cast<T, float>(value_.span<const float>(), working_.span<T>(), s);
    });
  }

  /// The working copy, for a fused optimizer that writes it directly; empty under f32.
  [[nodiscard]] tensor_view working() const noexcept { return working_.view(); }

  /// A copy of this parameter on the device of `s` (values copied in stream order on `s`; the caller makes
  /// `s` wait for the work that produced the source values). The gradient starts zero.
  [[nodiscard]] parameter clone(stream_ref s) const {
    parameter p(name_, value_.dims(), s, compute_type());
    copy(p.value_.span<float>(), value_.span<const float>(), s);
    p.refresh_working_copy(s);
    return p;
  }

 private:
  std::string name_;
  tensor value_;
  tensor working_;
  tensor grad_;                             // the gradient's memory, unless shared:
  std::shared_ptr<const void> grad_owner_;  // keeps shared gradient memory alive
  tensor_view grad_view_;                   // the gradient (in grad_ or in shared memory)
  tensor exact_;                            // deterministic mode's accumulator, unless shared:
  std::shared_ptr<const void> exact_owner_;
  tensor_view exact_view_;
  bool exact_holds_sum_ = false;
  bool grad_zero_ = true;
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
