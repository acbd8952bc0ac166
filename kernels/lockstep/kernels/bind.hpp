// lockstep/kernels/bind.hpp — the functor a launcher runs per element (see launch.hpp: `bind()`).
#pragma once

#include <cstddef>
#include <cstdint>

#include "lockstep/config.hpp"

LOCKSTEP_DETAIL_BEGIN
/// f.bind() when f has one (its device-resident scalars loaded once), f otherwise.
template <class F>
LOCKSTEP_HD auto bind_functor(const F& f) {
  if constexpr (requires { f.bind(); }) {
    return f.bind();
  } else {
    return f;
  }
}
/// i / d for the flat index of a 2-D kernel: in 32 bits when both fit, several times cheaper than a 64-bit
/// division on a GPU (which has no 64-bit divider), and the same quotient.
LOCKSTEP_HD inline std::size_t index_div(std::size_t i, std::size_t d) {
  if ((i | d) <= 0xffffffffu) return static_cast<std::uint32_t>(i) / static_cast<std::uint32_t>(d);
  return i / d;
}

/// A candidate for the first maximum of a row: its value and column.
struct first_max_candidate {
  float value;
  std::uint32_t index;
};

/// The lanes that share one row under launch_rows, as seen by a host stream: one lane, so the row's reductions
/// are its own serial loops (a GPU has 32, combined by warp shuffles: launch_cuda.cuh's warp_lanes).
struct single_lane {
  unsigned index = 0;  // this lane, 0..count-1: it takes columns index, index + count, ...
  unsigned count = 1;
  LOCKSTEP_HD float sum(float v) const { return v; }
  LOCKSTEP_HD float max(float v) const { return v; }
  LOCKSTEP_HD first_max_candidate first_max(first_max_candidate v) const { return v; }
};

LOCKSTEP_DETAIL_END
