// lockstep/data/dataset.hpp — what a dataset is: a number of samples of one fixed layout, each of which can be
// written into caller-provided bytes.
//
// A dataset owns no staging memory and knows nothing of batches or devices: the data loader asks it to write
// sample `i` into the bytes of a batch slot (`sample_ref`), from several worker threads at once. Samples are
// written with memcpy, so the destination needs no particular alignment.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep {

namespace detail {

/// "[60000, 28, 28]"; "[]" for a scalar. Used on failure paths.
inline std::string format_dims(const std::vector<std::size_t>& dims) {
  std::string s = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (i != 0) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + ']';
}

/// Product of `dims` (1 for an empty shape); false when it does not fit in a size_t.
constexpr bool checked_elements(const std::vector<std::size_t>& dims, std::size_t& product) noexcept {
  std::size_t p = 1;
  for (std::size_t d : dims) {
    if (d != 0 && p > std::numeric_limits<std::size_t>::max() / d) return false;
    p *= d;
  }
  product = p;
  return true;
}

/// Product of `dims`, 1 for an empty shape. The caller has made sure it does not overflow.
constexpr std::size_t elements_of(const std::vector<std::size_t>& dims) noexcept {
  std::size_t p = 1;
  for (std::size_t d : dims) p *= d;
  return p;
}

}  // namespace detail

/// The shape and element type of one sample's input and target. A target of shape `{}` is a scalar (one
/// element), the usual case for a class label. Cheap to compare; copying it copies two small vectors.
struct sample_layout {
  std::vector<std::size_t> input_shape;  // without the batch dimension
  dtype input_type = dtype::f32;
  std::vector<std::size_t> target_shape;  // {} for a scalar
  dtype target_type = dtype::i32;

  /// Elements in one sample's input: the product of `input_shape` (1 for `{}`).
  [[nodiscard]] std::size_t input_elements() const noexcept { return detail::elements_of(input_shape); }
  /// Bytes in one sample's input.
  [[nodiscard]] std::size_t input_bytes() const noexcept { return input_elements() * size_of(input_type); }
  /// Elements in one sample's target: the product of `target_shape` (1 for `{}`).
  [[nodiscard]] std::size_t target_elements() const noexcept { return detail::elements_of(target_shape); }
  /// Bytes in one sample's target.
  [[nodiscard]] std::size_t target_bytes() const noexcept { return target_elements() * size_of(target_type); }

  friend bool operator==(const sample_layout&, const sample_layout&) = default;
};

/// Where a dataset writes one sample: `input` must hold exactly `layout().input_bytes()` bytes and `target`
/// exactly `layout().target_bytes()`. No alignment is required. The spans are views into memory the caller
/// owns (typically a slot of a pinned staging batch).
struct sample_ref {
  std::span<std::byte> input;
  std::span<std::byte> target;
};

/// A random-access collection of samples of one layout.
///
/// - `d.size()`: the number of samples.
/// - `d.layout()`: the layout every sample has; it does not change over the dataset's lifetime.
/// - `d.fetch(i, dst)` (on a const dataset): writes sample `i` into `dst`, exactly `layout().input_bytes()`
///   and `layout().target_bytes()` bytes, in host byte order. It must be safe to call concurrently from
///   several threads on different indices (the data loader's workers do). It may throw: precondition_error
///   for an index out of range or spans of the wrong size, data_error when the sample cannot be read.
template <class D>
concept dataset = requires(const D& d, std::size_t index, sample_ref dst) {
  { d.size() } -> std::convertible_to<std::size_t>;
  { d.layout() } -> std::convertible_to<sample_layout>;
  d.fetch(index, dst);
};

namespace detail {

/// The preconditions every `fetch` shares: `index < size` and spans of exactly the layout's sizes.
inline void check_fetch(const sample_layout& layout, std::size_t size, std::size_t index, const sample_ref& dst) {
  LOCKSTEP_EXPECTS(index < size, "sample index ", index, " is out of range for a dataset of ", size,
                   " samples (valid indices are 0 to ", size == 0 ? 0 : size - 1, ")");
  LOCKSTEP_EXPECTS(dst.input.size() == layout.input_bytes(), "the input span of sample ", index, " holds ",
                   dst.input.size(), " bytes, but a sample's input is ", layout.input_bytes(), " bytes (",
                   name_of(layout.input_type), " of shape ", format_dims(layout.input_shape), ")");
  LOCKSTEP_EXPECTS(dst.target.size() == layout.target_bytes(), "the target span of sample ", index, " holds ",
                   dst.target.size(), " bytes, but a sample's target is ", layout.target_bytes(), " bytes (",
                   name_of(layout.target_type), " of shape ", format_dims(layout.target_shape), ")");
}

/// Elements per sample of `shape`, checking that every dimension is at least 1 and that the product fits.
inline std::size_t sample_elements(const std::vector<std::size_t>& shape, const char* what) {
  for (std::size_t i = 0; i < shape.size(); ++i) {
    LOCKSTEP_EXPECTS(shape[i] > 0, "in_memory_dataset: dimension ", i, " of the ", what, " shape ",
                     format_dims(shape), " is 0; every dimension must be at least 1");
  }
  std::size_t elements = 0;
  LOCKSTEP_EXPECTS(checked_elements(shape, elements), "in_memory_dataset: the ", what, " shape ",
                   format_dims(shape), " has more elements than a size_t can count");
  return elements;
}

}  // namespace detail

/// A dataset held in host memory as typed vectors, sample-major and row-major: sample `i`'s input is
/// `inputs[i * input_elements, (i + 1) * input_elements)`. For tests, synthetic data and small tables.
/// `fetch` is a bounds-checked memcpy and is safe to call concurrently.
class in_memory_dataset {
 public:
  /// Classification: `inputs` holds n samples of f32 of shape `input_shape`, `labels` one i32 class per sample
  /// (a scalar target; labels are not range-checked here, the loss checks them against its class count).
  /// Throws precondition_error when a dimension is 0, when `inputs` is not a whole number of samples, when
  /// the number of samples in `inputs` and in `labels` differ (the message names both counts), or when there
  /// are no samples.
  in_memory_dataset(std::vector<float> inputs, std::vector<std::size_t> input_shape,
                    std::vector<std::int32_t> labels)
      : layout_{std::move(input_shape), dtype::f32, {}, dtype::i32},
        inputs_(std::move(inputs)),
        labels_(std::move(labels)) {
    const std::size_t per_input = detail::sample_elements(layout_.input_shape, "input");
    LOCKSTEP_EXPECTS(inputs_.size() % per_input == 0, "in_memory_dataset: inputs hold ", inputs_.size(),
                     " floats, which is not a whole number of samples of shape ",
                     detail::format_dims(layout_.input_shape), " (", per_input, " floats each)");
    size_ = inputs_.size() / per_input;
    LOCKSTEP_EXPECTS(size_ == labels_.size(), "in_memory_dataset: inputs hold ", size_, " samples of shape ",
                     detail::format_dims(layout_.input_shape), " but labels hold ", labels_.size(),
                     " labels; the two counts must agree");
    LOCKSTEP_EXPECTS(size_ > 0, "in_memory_dataset: a dataset must hold at least one sample, got none");
  }

  /// Regression (or any f32 target): `inputs` holds n samples of shape `input_shape`, `targets` n samples of
  /// shape `target_shape` (`{}` for a scalar). Throws precondition_error when a dimension is 0, when either
  /// vector is not a whole number of samples, when the two sample counts differ (the message names both), or
  /// when there are no samples.
  in_memory_dataset(std::vector<float> inputs, std::vector<std::size_t> input_shape, std::vector<float> targets,
                    std::vector<std::size_t> target_shape)
      : layout_{std::move(input_shape), dtype::f32, std::move(target_shape), dtype::f32},
        inputs_(std::move(inputs)),
        targets_(std::move(targets)) {
    const std::size_t per_input = detail::sample_elements(layout_.input_shape, "input");
    const std::size_t per_target = detail::sample_elements(layout_.target_shape, "target");
    LOCKSTEP_EXPECTS(inputs_.size() % per_input == 0, "in_memory_dataset: inputs hold ", inputs_.size(),
                     " floats, which is not a whole number of samples of shape ",
                     detail::format_dims(layout_.input_shape), " (", per_input, " floats each)");
    LOCKSTEP_EXPECTS(targets_.size() % per_target == 0, "in_memory_dataset: targets hold ", targets_.size(),
                     " floats, which is not a whole number of samples of shape ",
                     detail::format_dims(layout_.target_shape), " (", per_target, " floats each)");
    size_ = inputs_.size() / per_input;
    LOCKSTEP_EXPECTS(size_ == targets_.size() / per_target, "in_memory_dataset: inputs hold ", size_,
                     " samples of shape ", detail::format_dims(layout_.input_shape), " but targets hold ",
                     targets_.size() / per_target, " samples of shape ", detail::format_dims(layout_.target_shape),
                     "; the two counts must agree");
    LOCKSTEP_EXPECTS(size_ > 0, "in_memory_dataset: a dataset must hold at least one sample, got none");
  }

  /// Number of samples.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Input f32 of `input_shape`; target i32 scalar (classification) or f32 of `target_shape` (regression).
  [[nodiscard]] const sample_layout& layout() const noexcept { return layout_; }

  /// Writes sample `index` into `dst`. Throws precondition_error when `index >= size()` (naming both) or when
  /// a span's size differs from the layout's. Thread-safe.
  void fetch(std::size_t index, sample_ref dst) const {
    detail::check_fetch(layout_, size_, index, dst);
    const std::size_t in_bytes = layout_.input_bytes();
    std::memcpy(dst.input.data(), reinterpret_cast<const std::byte*>(inputs_.data()) + index * in_bytes, in_bytes);
    const std::size_t target_bytes = layout_.target_bytes();
    const std::byte* targets = layout_.target_type == dtype::i32
                                   ? reinterpret_cast<const std::byte*>(labels_.data())
                                   : reinterpret_cast<const std::byte*>(targets_.data());
    std::memcpy(dst.target.data(), targets + index * target_bytes, target_bytes);
  }

 private:
  sample_layout layout_;
  std::size_t size_ = 0;
  std::vector<float> inputs_;          // [size, input_shape...]
  std::vector<std::int32_t> labels_;   // [size] when classifying, else empty
  std::vector<float> targets_;         // [size, target_shape...] when regressing, else empty
};

static_assert(dataset<in_memory_dataset>);

}  // namespace lockstep
