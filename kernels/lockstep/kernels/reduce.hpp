// lockstep/kernels/reduce.hpp — sum, max-abs and non-finite count of a device range, result on the device.
//
// The result is written to device memory (`out[0]`) in stream order, so nothing waits for the device: a
// training step can use it (a loss, an overflow flag) without a host synchronization. On a GPU these are
// CUB's DeviceReduce::TransformReduce; on a host device, the same transform and combine functors in a loop.
// Sums accumulate in f32 in blocks (a tree, like the GPU), so the result is accurate but its last bits depend
// on the order; inputs of small integers give exact results on both.
#pragma once

#include <cstddef>
#include <cstdint>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN
namespace kernels {

struct plus_op {
  template <class V>
  LOCKSTEP_HD V operator()(V a, V b) const {
    return a + b;
  }
};

/// max that propagates NaN from either side.
struct max_nan_op {
  LOCKSTEP_HD float operator()(float a, float b) const { return (a != a || a > b) ? a : b; }
};

template <class T>
struct to_float_op {
  LOCKSTEP_HD float operator()(T x) const { return to_float(x); }
};

template <class T>
struct square_op {
  LOCKSTEP_HD float operator()(T x) const {
    const float v = to_float(x);
    return v * v;
  }
};

template <class T>
struct abs_op {
  LOCKSTEP_HD float operator()(T x) const {
    const float v = to_float(x);
    return v < 0.0f ? -v : v;
  }
};

struct identity_op {
  template <class V>
  LOCKSTEP_HD V operator()(V v) const {
    return v;
  }
};

template <class T>
struct non_finite_op {
  LOCKSTEP_HD std::uint64_t operator()(T x) const { return is_finite(x) ? 0u : 1u; }
};

}  // namespace kernels
LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

/// out[0] = reduce over i of transform(in[i]), starting from init. On a GPU, CUB needs temporary memory:
/// from `workspace` when given (grown as needed and kept, so a caller that reduces every step allocates
/// nothing in the steady state), else from the device's pool for this call.
template <class In, class Out, class Reduce, class Transform>
void transform_reduce(device_span<const In> in, device_span<Out> out, Reduce reduce, Transform transform, Out init,
                      stream_ref s, const char* what, tensor* workspace = nullptr) {
  LOCKSTEP_EXPECTS(!out.empty(), what, ": the output range is empty; it needs one element");
  expect_on_stream_device(in, s, what);
  expect_on_stream_device(out, s, what);
  if (s.get_device().is_host()) {
    const In* p = in.data();
    const std::size_t n = in.size();
    Out* result = out.data();
    strict_expect_memory_of(s.get_device(), p, in.size_bytes(), what);
    strict_expect_memory_of(s.get_device(), result, sizeof(Out), what);
    enqueue_host(
        s,
        [p, n, result, reduce, transform, init] {
          // Blocks of 256 reduced separately, then combined: the shape of a GPU reduction, and far less
          // rounding error than one running f32 sum.
          constexpr std::size_t block = 256;
          Out total = init;
          for (std::size_t b = 0; b < n; b += block) {
            Out partial = init;
            const std::size_t end = b + block < n ? b + block : n;
            for (std::size_t i = b; i < end; ++i) partial = reduce(partial, transform(p[i]));
            total = reduce(total, partial);
          }
          *result = total;
        },
        what);
    return;
  }
#if LOCKSTEP_HAS_CUDA
  transform_reduce_cuda(in.data(), in.size(), out.data(), reduce, transform, init, s, what, workspace);
#else
  (void)workspace;
#endif
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// out[0] = sum of in (accumulated in f32), for T in {float, half, bfloat16}. `workspace`: see
/// detail::transform_reduce (pass one to reduce every step without allocating).
template <class T>
void sum(device_span<const T> in, device_span<float> out, stream_ref s, tensor* workspace = nullptr) {
  detail::transform_reduce(in, out, kernels::plus_op{}, kernels::to_float_op<T>{}, 0.0f, s, "sum", workspace);
}

/// out[0] = max |in[i]| (NaN if any element is NaN; 0 for an empty range).
template <class T>
void max_abs(device_span<const T> in, device_span<float> out, stream_ref s, tensor* workspace = nullptr) {
  detail::transform_reduce(in, out, kernels::max_nan_op{}, kernels::abs_op<T>{}, 0.0f, s, "max_abs", workspace);
}

/// out[0] = number of elements that are inf or NaN.
template <class T>
void count_non_finite(device_span<const T> in, device_span<std::uint64_t> out, stream_ref s,
                      tensor* workspace = nullptr) {
  detail::transform_reduce(in, out, kernels::plus_op{}, kernels::non_finite_op<T>{}, std::uint64_t{0}, s,
                           "count_non_finite", workspace);
}

LOCKSTEP_ABI_END
