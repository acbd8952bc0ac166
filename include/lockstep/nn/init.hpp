// lockstep/nn/init.hpp — deterministic parameter initialization.
//
// `initializer` hands out a new random stream to every parameter it initializes, in creation order, so that a
// model built the same way from the same seed has the same weights on any device and either backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/random.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/runtime/copy.hpp"

LOCKSTEP_ABI_BEGIN

/// Sets `p`'s fp32 values (p.numel() of them), copied to the device in stream order on `s`, and refreshes its
/// working copy (with deferred master values: writes the working copy and keeps a copy of `values` as the recipe).
inline void write_values(parameter& p, const std::vector<float>& values, stream_ref s) {
  LOCKSTEP_EXPECTS(values.size() == static_cast<std::size_t>(p.numel()), "write_values: ", values.size(),
                   " values for parameter ", p.name(), " of shape ", p.dims().str());
  if (p.masters_deferred()) {
    auto kept = std::make_shared<const std::vector<float>>(values);
    p.set_initial_values([kept](std::int64_t first, std::span<float> out) {
      std::copy_n(kept->begin() + first, out.size(), out.begin());
    }, s);
    return;
  }
  auto staged = to_device(values, s);
  copy(p.value().span<float>(), device_span<const float>(staged.span()), s);
  p.refresh_working_copy(s);
}

/// Sets every value of `p` to `value` (a normalization layer's ones and zeros), in stream order on `s`.
inline void fill_values(parameter& p, float value, stream_ref s) {
  p.set_initial_values([value](std::int64_t, std::span<float> out) { std::fill(out.begin(), out.end(), value); }, s);
}

class initializer {
 public:
  explicit initializer(std::uint64_t seed = 0) noexcept : seed_(seed) {}

  /// Fills `p`'s values with U(-bound, bound) (PyTorch's Linear default uses bound = 1/sqrt(fan_in)), copied to
  /// the device in stream order on `s`, and refreshes its working copy.
  void uniform(parameter& p, float bound, stream_ref s) {
    p.set_initial_values([seed = seed_, stream_id = next_stream(), bound](std::int64_t first, std::span<float> out) {
      for (std::size_t i = 0; i < out.size(); ++i) {
        out[i] = (2.0f * philox_uniform(seed, stream_id, static_cast<std::uint64_t>(first) + i) - 1.0f) * bound;
      }
    }, s);
  }

  /// Fills `p`'s values with a constant (and uses up a random stream, so later parameters keep theirs).
  void constant(parameter& p, float value, stream_ref s) {
    (void)next_stream();
    fill_values(p, value, s);
  }

  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }

  /// A random stream id of its own for a layer that draws numbers while training (dropout).
  [[nodiscard]] std::uint64_t next_stream() noexcept { return next_stream_++; }

 private:
  std::uint64_t seed_;
  std::uint64_t next_stream_ = 0;
};

LOCKSTEP_ABI_END
