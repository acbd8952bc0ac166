// lockstep/runtime/tensor.hpp — tensors: a dtype, a row-major shape and memory on one device.
//
// Tensors live in runtime/ rather than nn/ because the data loader (data/, below nn/) hands batches out as
// tensors; they are defined by runtime types alone.
//
// `tensor_view` points at memory it does not own (a layer's output, a slice of a batch); `tensor` owns its
// memory (a device_buffer of bytes); `maybe_owned_tensor` either owns one or borrows a view (kept alive by its
// owner). All are dynamically typed: kernels dispatch on the dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#include "lockstep/config.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/shape.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/stream.hpp"

LOCKSTEP_ABI_BEGIN

/// A non-owning view of a tensor. Cheap to copy.
class tensor_view {
 public:
  tensor_view() = default;
  /// Views `dims` elements of type `type` at `data` on `dev`.
  tensor_view(void* data, dtype type, shape dims, device dev) noexcept
      : data_(data), type_(type), shape_(dims), dev_(dev) {}

  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] dtype type() const noexcept { return type_; }
  [[nodiscard]] const shape& dims() const noexcept { return shape_; }
  [[nodiscard]] device get_device() const noexcept { return dev_; }
  [[nodiscard]] std::int64_t numel() const noexcept { return shape_.numel(); }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return static_cast<std::size_t>(numel()) * size_of(type_); }
  [[nodiscard]] std::int64_t rows() const noexcept { return shape_.rows(); }
  [[nodiscard]] std::int64_t cols() const noexcept { return shape_.cols(); }
  /// True when the view points at no memory (default-constructed, or a tensor of no elements).
  [[nodiscard]] bool empty() const noexcept { return data_ == nullptr; }

  /// The memory as T*; throws precondition_error when T is not the view's dtype.
  template <class T>
  [[nodiscard]] T* as() const {
    LOCKSTEP_EXPECTS(dtype_of_v<T> == type_, "a tensor of shape ", shape_.str(), " and dtype ", name_of(type_),
                     " accessed as ", name_of(dtype_of_v<T>),
                     type_ == dtype::f16 || type_ == dtype::bf16
                         ? " (the context computes in f16 or bf16: a layer of your own reads its input, output gradient "
                           "and parameters in ctx.compute_type(), e.g. with dispatch_floating; docs/custom-layers.md)"
                         : "");
    return static_cast<T*>(data_);
  }
  /// The elements as a device_span<T> (none for an empty view, whose default shape is a scalar's).
  template <class T>
  [[nodiscard]] device_span<T> span() const {
    return device_span<T>(as<T>(), empty() ? 0 : static_cast<std::size_t>(numel()), dev_);
  }

  /// The memory as bytes, whatever the dtype (for copies); none for an empty view.
  [[nodiscard]] device_span<std::uint8_t> bytes() const noexcept {
    return device_span<std::uint8_t>(static_cast<std::uint8_t*>(data_), empty() ? 0 : size_bytes(), dev_);
  }

  /// Rows [begin, begin + count) along the outermost dimension (a batch slice); no copy.
  [[nodiscard]] tensor_view slice_rows(std::int64_t begin, std::int64_t count) const {
    LOCKSTEP_EXPECTS(shape_.rank() >= 1, "slice_rows of a scalar");
    LOCKSTEP_EXPECTS(begin >= 0 && count >= 0 && begin + count <= rows(), "slice_rows(", begin, ", ", count,
                     ") out of range of a tensor with ", rows(), " rows");
    auto* p = static_cast<std::byte*>(data_) + static_cast<std::size_t>(begin * cols()) * size_of(type_);
    return tensor_view(p, type_, shape_.with_rows(count), dev_);
  }

  /// The same memory with another shape of the same number of elements.
  [[nodiscard]] tensor_view reshaped(shape dims) const {
    LOCKSTEP_EXPECTS(dims.numel() == numel(), "cannot view a tensor of shape ", shape_.str(), " as ", dims.str());
    return tensor_view(data_, type_, dims, dev_);
  }

 private:
  void* data_ = nullptr;
  dtype type_ = dtype::f32;
  shape shape_{};
  device dev_{};
};

/// An owned tensor on one device. Move-only; its memory is allocated and freed in stream order.
class tensor {
 public:
  tensor() = default;
  /// Uninitialized memory for `dims` elements of `type` on the device of `s`.
  tensor(shape dims, dtype type, stream_ref s)
      : storage_(static_cast<std::size_t>(dims.numel()) * size_of(type), s), type_(type), shape_(dims) {}

  /// Makes this tensor `dims` of `type`, reusing the memory when it is large enough (activations of a
  /// smaller last batch, for instance) and allocating in stream order on `s` only otherwise. The contents
  /// are unspecified afterwards. Returns true when it allocated.
  bool ensure(shape dims, dtype type, stream_ref s) {
    const std::size_t bytes = static_cast<std::size_t>(dims.numel()) * size_of(type);
    const bool grow = storage_.empty() || bytes > storage_.size() || storage_.get_device() != s.get_device();
    if (grow) storage_ = device_buffer<std::byte>(bytes, s);
    type_ = type;
    shape_ = dims;
    return grow;
  }

  [[nodiscard]] tensor_view view() const noexcept {
    return tensor_view(const_cast<std::byte*>(storage_.data()), type_, shape_, storage_.get_device());
  }
  // NOLINTNEXTLINE(google-explicit-constructor)
  operator tensor_view() const noexcept { return view(); }

  [[nodiscard]] void* data() const noexcept { return view().data(); }
  [[nodiscard]] dtype type() const noexcept { return type_; }
  [[nodiscard]] const shape& dims() const noexcept { return shape_; }
  [[nodiscard]] device get_device() const noexcept { return storage_.get_device(); }
  [[nodiscard]] std::int64_t numel() const noexcept { return shape_.numel(); }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return view().size_bytes(); }
  /// Bytes of memory held (at least size_bytes()).
  [[nodiscard]] std::size_t capacity_bytes() const noexcept { return storage_.size(); }
  [[nodiscard]] bool empty() const noexcept { return storage_.empty(); }
  template <class T>
  [[nodiscard]] T* as() const {
    return view().as<T>();
  }
  template <class T>
  [[nodiscard]] device_span<T> span() const {
    return view().span<T>();
  }
  [[nodiscard]] device_span<std::uint8_t> bytes() const noexcept { return view().bytes(); }
  /// Frees the memory on `s` instead of the stream that allocated it (device_buffer::set_stream).
  void set_stream(stream_ref s) {
    if (!storage_.empty()) storage_.set_stream(s);
  }

 private:
  device_buffer<std::byte> storage_;
  dtype type_ = dtype::f32;
  shape shape_{};
};

/// A tensor that a holder either owns or borrows: the memory of a `tensor` it owns, or a view of memory that
/// belongs to someone else, kept alive by a shared owner (a wrapper that places many tensors side by side in one
/// buffer, as DDP's buckets). One type instead of a hand-kept triple of owned tensor, owner and view, so that
/// the view cannot point at memory the holder let go of.
class maybe_owned_tensor {
 public:
  maybe_owned_tensor() = default;
  explicit maybe_owned_tensor(tensor t) noexcept : owned_(std::move(t)), view_(owned_.view()) {}

  /// What the holder reads and writes.
  [[nodiscard]] const tensor_view& view() const noexcept { return view_; }
  [[nodiscard]] bool empty() const noexcept { return view_.empty(); }
  /// Whether the memory is borrowed (someone else's, kept alive by an owner).
  [[nodiscard]] bool borrowed() const noexcept { return owner_ != nullptr; }

  /// Owns `t` from now on; memory owned before is freed in stream order on `s` (its stream when `s` is absent).
  void own(tensor t, std::optional<stream_ref> s = std::nullopt) {
    release(s);
    owned_ = std::move(t);
    view_ = owned_.view();
  }
  /// Owns `dims` of `type`, reusing owned memory when it is large enough (tensor::ensure).
  void ensure(shape dims, dtype type, stream_ref s) {
    if (borrowed()) release(s);
    owned_.ensure(dims, type, s);
    view_ = owned_.view();
  }
  /// Borrows `v`, which `owner` keeps alive; memory owned before is freed in stream order on `s` (after the
  /// work queued there so far: a copy out of it, say), or on its own stream when `s` is absent.
  void borrow(const tensor_view& v, std::shared_ptr<const void> owner, std::optional<stream_ref> s = std::nullopt) {
    release(s);
    owner_ = std::move(owner);
    view_ = v;
  }
  /// Holds nothing; owned memory is freed in stream order on `s` (its own stream when absent).
  void reset(std::optional<stream_ref> s = std::nullopt) {
    release(s);
    view_ = {};
  }

 private:
  void release(std::optional<stream_ref> s) {
    if (s) owned_.set_stream(*s);
    owned_ = tensor();
    owner_.reset();
  }

  tensor owned_;
  std::shared_ptr<const void> owner_;
  tensor_view view_;
};

/// Calls `f.template operator()<T>()` with T the C++ type of a floating dtype (float, half, bfloat16);
/// throws precondition_error naming `what` for other dtypes. The one place floating dtypes are dispatched.
template <class F>
decltype(auto) dispatch_floating(dtype t, const char* what, F&& f) {
  switch (t) {
    case dtype::f32: return f.template operator()<float>();
    case dtype::f16: return f.template operator()<half>();
    case dtype::bf16: return f.template operator()<bfloat16>();
    default: break;
  }
  throw precondition_error(detail::concat(what, ": expected a floating dtype (f32, f16, bf16), got ", name_of(t)));
}

LOCKSTEP_ABI_END
