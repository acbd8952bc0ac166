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

LOCKSTEP_DETAIL_END
