// lockstep/kernels/bind.hpp — the functor a launcher runs per element (see launch.hpp: `bind()`).
#pragma once

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
LOCKSTEP_DETAIL_END
