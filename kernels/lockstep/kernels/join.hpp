// lockstep/kernels/join.hpp — kernel bodies of a graph's joins: the sum of several operands and the column
// copies of a concatenation.
//
// Operands are read as column blocks of row-major matrices, so the same sum serves three purposes in
// nn/graph.hpp: the forward of a sum join (dense operands), the gradient of a node read by several
// consumers (the consumers' gradients, some of them column ranges of a concatenation's gradient), and the
// gradient of a node read by one concatenation only (one operand, a column range: a gather).
//
// Values are loaded from the storage type T, summed in f32 in operand order, and rounded to T once.
#pragma once

#include <cstddef>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/kernels/bind.hpp"

LOCKSTEP_ABI_BEGIN
namespace kernels {

/// A [rows, cols] operand inside a row-major matrix of row stride `ld`: element (r, c) is
/// data[r * ld + offset + c]. A dense tensor has ld = cols and offset = 0; input k of a concatenation
/// occupies the columns [offset, offset + cols) of the concatenation's rows.
template <class T>
struct column_block {
  const T* data;
  std::size_t ld;
  std::size_t offset;
  LOCKSTEP_HD float load(std::size_t r, std::size_t c) const { return to_float(data[r * ld + offset + c]); }
};

/// out[r, c] = (accumulate ? out[r, c] : 0) + sum over k < count of in[k](r, c), over a dense [rows, cols]
/// output, one index per output element. Precondition: 1 <= count <= max_operands. Without `accumulate`
/// the output is not read (a buffer of garbage or NaNs needs no zero-fill first). More operands than
/// max_operands take several launches, the later ones with `accumulate`.
template <class T>
struct sum_op {
  static constexpr int max_operands = 8;
  column_block<T> in[max_operands];
  int count;
  T* out;
  std::size_t cols;
  bool accumulate;
  LOCKSTEP_HD void operator()(std::size_t i) const {
    const std::size_t r = detail::index_div(i, cols);
    const std::size_t c = i - r * cols;
    float acc = in[0].load(r, c);
    if (accumulate) acc = to_float(out[i]) + acc;
    for (int k = 1; k < count; ++k) acc += in[k].load(r, c);
    out[i] = convert<T>(acc);
  }
};

/// out[r, offset + c] = in[r, c]: copies a dense [rows, cols] input into the columns [offset, offset + cols)
/// of a [rows, out_cols] output, one index per input element (consecutive indices read consecutive input
/// elements and write consecutive output elements within a row).
template <class T>
struct copy_columns_op {
  const T* in;
  T* out;
  std::size_t cols;
  std::size_t out_cols;
  std::size_t offset;
  LOCKSTEP_HD void operator()(std::size_t i) const {
    const std::size_t r = detail::index_div(i, cols);
    const std::size_t c = i - r * cols;
    out[r * out_cols + offset + c] = in[i];
  }
};

}  // namespace kernels
LOCKSTEP_ABI_END
