// lockstep/kernels/elementwise.hpp — fill, scale, axpy and casts between f32, f16 and bf16.
//
// Arithmetic is done in f32 whatever the storage type (the GPU does the same: half arithmetic would lose
// the low bits); the result is rounded to the storage type once, to nearest even.
#pragma once

#include <cstddef>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/runtime/device_buffer.hpp"

LOCKSTEP_ABI_BEGIN
namespace kernels {

template <class T>
struct fill_op {
  T* out;
  T value;
  LOCKSTEP_HD void operator()(std::size_t i) const { out[i] = value; }
};

template <class T>
struct scale_op {
  T* x;
  float alpha;
  LOCKSTEP_HD void operator()(std::size_t i) const { x[i] = convert<T>(alpha * to_float(x[i])); }
};

template <class T>
struct axpy_op {
  float alpha;
  const T* x;
  T* y;
  LOCKSTEP_HD void operator()(std::size_t i) const { y[i] = convert<T>(to_float(y[i]) + alpha * to_float(x[i])); }
};

template <class To, class From>
struct cast_op {
  const From* in;
  To* out;
  LOCKSTEP_HD void operator()(std::size_t i) const { out[i] = convert<To>(to_float(in[i])); }
};

}  // namespace kernels

/// Sets every element of `out` to `value`.
template <class T>
void fill(device_span<T> out, std::type_identity_t<T> value, stream_ref s) {
  detail::expect_on_stream_device(out, s, "fill");
  launch_elementwise(out.size(), kernels::fill_op<T>{out.data(), value}, s, "fill");
}

/// x *= alpha, for T in {float, half, bfloat16}.
template <class T>
void scale(device_span<T> x, float alpha, stream_ref s) {
  detail::expect_on_stream_device(x, s, "scale");
  launch_elementwise(x.size(), kernels::scale_op<T>{x.data(), alpha}, s, "scale");
}

/// y += alpha * x (same sizes), for T in {float, half, bfloat16}.
template <class T>
void axpy(float alpha, device_span<const std::type_identity_t<T>> x, device_span<T> y, stream_ref s) {
  LOCKSTEP_EXPECTS(x.size() == y.size(), "axpy: x holds ", x.size(), " elements but y holds ", y.size());
  detail::expect_on_stream_device(x, s, "axpy");
  detail::expect_on_stream_device(y, s, "axpy");
  launch_elementwise(y.size(), kernels::axpy_op<T>{alpha, x.data(), y.data()}, s, "axpy");
}

/// out[i] = in[i] converted (rounded to nearest even when narrowing), between float, half and bfloat16.
template <class To, class From>
void cast(device_span<const From> in, device_span<To> out, stream_ref s) {
  LOCKSTEP_EXPECTS(in.size() == out.size(), "cast: input holds ", in.size(), " elements but output holds ",
                   out.size());
  detail::expect_on_stream_device(in, s, "cast");
  detail::expect_on_stream_device(out, s, "cast");
  launch_elementwise(out.size(), kernels::cast_op<To, From>{in.data(), out.data()}, s, "cast");
}

LOCKSTEP_ABI_END
