// lockstep/core/shape.hpp — the dimensions of a tensor (rank 0 to 4), row-major.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>

#include "lockstep/core/error.hpp"

namespace lockstep {

/// Up to four dimensions, outermost first. Rank 0 is a scalar (one element).
class shape {
 public:
  static constexpr int max_rank = 4;

  constexpr shape() noexcept = default;
  /// `shape{128, 784}`; throws precondition_error for more than four or negative dimensions.
  shape(std::initializer_list<std::int64_t> dims) {
    LOCKSTEP_EXPECTS(dims.size() <= max_rank, "a shape has at most ", max_rank, " dimensions, got ", dims.size());
    for (std::int64_t d : dims) {
      LOCKSTEP_EXPECTS(d >= 0, "a dimension must be >= 0, got ", d);
      dims_[static_cast<std::size_t>(rank_++)] = d;
    }
  }

  [[nodiscard]] constexpr int rank() const noexcept { return rank_; }
  /// Dimension i; precondition 0 <= i < rank().
  [[nodiscard]] std::int64_t operator[](int i) const {
    LOCKSTEP_EXPECTS(i >= 0 && i < rank_, "dimension ", i, " of a rank-", rank_, " shape");
    return dims_[static_cast<std::size_t>(i)];
  }
  /// Number of elements (1 for rank 0).
  [[nodiscard]] constexpr std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= dims_[static_cast<std::size_t>(i)];
    return n;
  }
  /// The outermost dimension (the batch for activations); 1 for rank 0.
  [[nodiscard]] constexpr std::int64_t rows() const noexcept { return rank_ == 0 ? 1 : dims_[0]; }
  /// Elements per row: the product of the inner dimensions.
  [[nodiscard]] constexpr std::int64_t cols() const noexcept {
    std::int64_t n = 1;
    for (int i = 1; i < rank_; ++i) n *= dims_[static_cast<std::size_t>(i)];
    return n;
  }
  /// The same shape with the outermost dimension replaced.
  [[nodiscard]] shape with_rows(std::int64_t rows) const {
    LOCKSTEP_EXPECTS(rank_ >= 1, "a scalar has no rows");
    LOCKSTEP_EXPECTS(rows >= 0, "rows must be >= 0, got ", rows);
    shape s = *this;
    s.dims_[0] = rows;
    return s;
  }

  /// "[128, 784]".
  [[nodiscard]] std::string str() const {
    std::string s = "[";
    for (int i = 0; i < rank_; ++i) s += (i ? ", " : "") + std::to_string(dims_[static_cast<std::size_t>(i)]);
    return s + "]";
  }

  friend constexpr bool operator==(const shape& a, const shape& b) noexcept {
    if (a.rank_ != b.rank_) return false;
    for (int i = 0; i < a.rank_; ++i)
      if (a.dims_[static_cast<std::size_t>(i)] != b.dims_[static_cast<std::size_t>(i)]) return false;
    return true;
  }

 private:
  std::array<std::int64_t, max_rank> dims_{};
  int rank_ = 0;
};

inline std::ostream& operator<<(std::ostream& os, const shape& s) { return os << s.str(); }

}  // namespace lockstep
