// lockstep/kernels/activation.hpp — kernel bodies of the element-wise layers: bias, ReLU, GELU, tanh,
// dropout, and the column sums that give a bias gradient.
//
// Values are loaded from the storage type T, computed in f32, and rounded to T once when stored.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/half_runs.hpp"
#include "lockstep/core/random.hpp"

LOCKSTEP_ABI_BEGIN
namespace kernels {

/// y[r, c] = x[r, c] + b[c] over a [rows, cols] row-major matrix (x and y may be the same memory); a
/// launch_2d functor.
template <class T>
struct add_bias_op {
  const T* x;
  const T* b;
  T* y;
  std::size_t cols;
  LOCKSTEP_HD void operator()(std::size_t r, std::size_t c) const {
    y[r * cols + c] = convert<T>(to_float(x[r * cols + c]) + to_float(b[c]));
  }
  /// The host loop for f16/bf16: the same sums, on blocks widened and rounded with core/half_runs.hpp.
  void for_rows(std::size_t rows, std::size_t) const
    requires(!std::is_same_v<T, float>)
  {
    float bias[detail::run_block], t[detail::run_block];
    detail::for_each_run_block(cols, [&](std::size_t c0, std::size_t count) {
      const auto n = static_cast<std::int64_t>(count);
      detail::widen_run(b + c0, bias, n);
      for (std::size_t r = 0; r < rows; ++r) {
        detail::widen_run(x + r * cols + c0, t, n);
        for (std::int64_t j = 0; j < n; ++j) t[j] += bias[j];
        detail::narrow_run(t, y + r * cols + c0, n);
      }
    });
  }
};

/// db[c] = beta * db[c] + sum over r of g[r, c]: one index per column (launch_elementwise), or a column
/// reduction (launch_columns: on a GPU, blocks of 32 columns that split the rows and add `load`s in a fixed
/// order, then `finish`). On a host stream `for_all` runs the same sums (each column's rows in the same order, so
/// the same results) on many columns at a time, which turns the strided column walk into contiguous row segments
/// the compiler vectorizes: sixteen f32 columns, or blocks of f16/bf16 columns widened with core/half_runs.hpp.
template <class T>
struct column_sum_op {
  const T* g;
  T* db;
  std::size_t rows;
  std::size_t cols;
  float beta;
  /// Element (r, c) as a term of column c's sum (launch_columns).
  LOCKSTEP_HD float load(std::size_t r, std::size_t c) const { return to_float(g[r * cols + c]); }
  LOCKSTEP_HD void finish(std::size_t c, float acc) const {
    db[c] = convert<T>(beta == 0.0f ? acc : beta * to_float(db[c]) + acc);
  }
  LOCKSTEP_HD void operator()(std::size_t c) const {
    float acc = 0.0f;
    for (std::size_t r = 0; r < rows; ++r) acc += to_float(g[r * cols + c]);
    finish(c, acc);
  }
  void for_all(std::size_t n) const {
    if constexpr (!std::is_same_v<T, float>) {
      // row segments widened a block at a time with core/half_runs.hpp
      float acc[detail::run_block], t[detail::run_block];
      detail::for_each_run_block(n, [&](std::size_t c0, std::size_t m) {
        for (std::size_t j = 0; j < m; ++j) acc[j] = 0.0f;
        for (std::size_t r = 0; r < rows; ++r) {
          detail::widen_run(g + r * cols + c0, t, static_cast<std::int64_t>(m));
          for (std::size_t j = 0; j < m; ++j) acc[j] += t[j];
        }
        for (std::size_t j = 0; j < m; ++j) finish(c0 + j, acc[j]);
      });
    } else {
      constexpr std::size_t block = 16;
      std::size_t c0 = 0;
      for (; c0 + block <= n; c0 += block) {
        float acc[block] = {};
        for (std::size_t r = 0; r < rows; ++r) {
          const float* row = g + r * cols + c0;
          for (std::size_t j = 0; j < block; ++j) acc[j] += row[j];
        }
        for (std::size_t j = 0; j < block; ++j) finish(c0 + j, acc[j]);
      }
      for (; c0 < n; ++c0) (*this)(c0);
    }
  }
};

// ReLU selects with masks: a `?:` whose arms then go through a rounding to f16 is turned into a branch by
// compilers, which keeps the host loop scalar.
struct relu_fn {
  /// max(x, 0), with NaN passed through (as PyTorch does) so that a diverging run shows it.
  LOCKSTEP_HD static float forward(float x) {
    return detail::bits_as_float(detail::select_bits(x <= 0.0f, 0u, detail::float_as_bits(x)));
  }
  /// dL/dx from dL/dy and the saved output y (ReLU's derivative is y > 0).
  LOCKSTEP_HD static float backward(float gy, float /*x*/, float y) {
    return detail::bits_as_float(detail::select_bits(y > 0.0f, detail::float_as_bits(gy), 0u));
  }
};

struct tanh_fn {
  LOCKSTEP_HD static float forward(float x) { return ::tanhf(x); }
  LOCKSTEP_HD static float backward(float gy, float /*x*/, float y) { return gy * (1.0f - y * y); }
};

/// GELU with the exact erf form (PyTorch's default): x * Phi(x).
struct gelu_fn {
  LOCKSTEP_HD static float forward(float x) { return 0.5f * x * (1.0f + ::erff(x * 0.70710678118654752f)); }
  LOCKSTEP_HD static float backward(float gy, float x, float /*y*/) {
    const float cdf = 0.5f * (1.0f + ::erff(x * 0.70710678118654752f));
    const float pdf = 0.39894228040143268f * ::expf(-0.5f * x * x);
    return gy * (cdf + x * pdf);
  }
};

template <class Fn, class T>
struct activation_forward_op {
  const T* x;
  T* y;
  LOCKSTEP_HD void operator()(std::size_t i) const { y[i] = convert<T>(Fn::forward(to_float(x[i]))); }
  /// The host loop for f16/bf16: blocks widened and rounded with core/half_runs.hpp (the same results).
  void for_all(std::size_t n) const
    requires(!std::is_same_v<T, float>)
  {
    float t[detail::run_block];
    detail::for_each_run_block(n, [&](std::size_t i0, std::size_t count) {
      const auto m = static_cast<std::int64_t>(count);
      detail::widen_run(x + i0, t, m);
      for (std::int64_t j = 0; j < m; ++j) t[j] = Fn::forward(t[j]);
      detail::narrow_run(t, y + i0, m);
    });
  }
};

template <class Fn, class T>
struct activation_backward_op {
  const T* gy;
  const T* x;
  const T* y;
  T* gx;
  LOCKSTEP_HD void operator()(std::size_t i) const {
    gx[i] = convert<T>(Fn::backward(to_float(gy[i]), to_float(x[i]), to_float(y[i])));
  }
  /// The host loop for f16/bf16: blocks widened and rounded with core/half_runs.hpp (the same results).
  void for_all(std::size_t n) const
    requires(!std::is_same_v<T, float>)
  {
    float g[detail::run_block], a[detail::run_block], b[detail::run_block];
    detail::for_each_run_block(n, [&](std::size_t i0, std::size_t count) {
      const auto m = static_cast<std::int64_t>(count);
      detail::widen_run(gy + i0, g, m);
      detail::widen_run(x + i0, a, m);
      detail::widen_run(y + i0, b, m);
      for (std::int64_t j = 0; j < m; ++j) g[j] = Fn::backward(g[j], a[j], b[j]);
      detail::narrow_run(g, gx + i0, m);
    });
  }
};

/// Dropout's keep decisions: a pure function of (seed, stream, step, global index), so the mask is recomputed in
/// backward instead of stored, and a batch split across devices draws the same mask as on one device.
struct dropout_mask {
  std::uint64_t seed;
  std::uint64_t stream;  // distinguishes dropout layers
  std::uint64_t step;
  float keep_probability;
  [[nodiscard]] LOCKSTEP_HD std::uint64_t offset() const { return stream * 0x9E3779B97F4A7C15ull + step; }
  /// The decision for one element (one Philox call keeps one word of four: for tests and single elements).
  [[nodiscard]] LOCKSTEP_HD bool keep(std::uint64_t global_index) const {
    return philox_uniform(seed, offset(), global_index) < keep_probability;
  }
};

/// y = x * mask / keep (forward) or gx = gy * mask / keep (backward: the same mask). Call q serves the four global
/// indices of Philox block first_index / 4 + q that fall in this slice: one Philox call for four elements, and the
/// decisions of mask.keep(index) exactly.
template <class T>
struct dropout_op {
  const T* in;
  T* out;
  dropout_mask mask;
  std::uint64_t first_index;  // global index of element 0 of this replica's slice
  std::uint64_t count;        // elements of the slice

  /// Calls needed for `count` elements starting at global index `first` (blocks partly outside count too).
  [[nodiscard]] static constexpr std::size_t calls(std::uint64_t first, std::uint64_t count) {
    return count == 0 ? 0 : static_cast<std::size_t>((first + count + 3) / 4 - first / 4);
  }

  LOCKSTEP_HD void operator()(std::size_t q) const {
    const std::uint64_t block = first_index / 4 + q;
    const uint4x32 bits = philox_block(mask.seed, mask.offset(), block);
    for (unsigned w = 0; w < 4; ++w) {
      const std::uint64_t global = block * 4 + w;
      if (global < first_index || global - first_index >= count) continue;
      const std::size_t i = static_cast<std::size_t>(global - first_index);
      const bool keep = uniform_float(bits.v[w]) < mask.keep_probability;
      out[i] = convert<T>(keep ? to_float(in[i]) / mask.keep_probability : 0.0f);
    }
  }
};

}  // namespace kernels
LOCKSTEP_ABI_END
