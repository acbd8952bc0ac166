// lockstep/blas/gemm_rate.hpp — how fast a device multiplies: the measured rate of one GEMM shape.
//
//   gemm_rate(h, dtype::bf16, {transpose::no, transpose::yes, 128, 1024, 1024}, 0.05)  // GFLOP/s
//
// Used by lockstep-info and the samples (the rate of the kernels this machine runs, next to their names) and by
// bench/bench_roofline (the best rate of a training step's own GEMM shapes: the step's roofline).
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "lockstep/blas/blas_handle.hpp"
#include "lockstep/blas/gemm.hpp"
#include "lockstep/config.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/tensor.hpp"  // dispatch_floating

LOCKSTEP_ABI_BEGIN

/// One GEMM's shape: C[m, n] = op(A)[m, k] op(B)[k, n], dense (leading dimensions the minimum).
struct gemm_shape {
  transpose ta = transpose::no, tb = transpose::no;
  std::int64_t m = 0, n = 0, k = 0;

  /// Floating-point operations of one product: 2 m n k.
  [[nodiscard]] double flops() const noexcept { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
};

/// The rate, in GFLOP/s, of `shape` in dtype `t` (f32, f16 or bf16) on h's device with h's kernels: one warm-up
/// product, then products queued back to back until at least `min_seconds` have passed (measured from the host
/// around the stream's completion, in rounds of doubling length). Operands hold small values (no denormals,
/// no overflow). Allocates the operands on the device for the call. Synchronizes h.stream().
inline double gemm_rate(blas_handle& h, dtype t, const gemm_shape& shape, double min_seconds) {
  double rate = 0.0;
  dispatch_floating(t, "gemm_rate", [&]<class T>() {
    const stream_ref s = h.stream();
    const bool ta = shape.ta == transpose::yes, tb = shape.tb == transpose::yes;
    const std::int64_t lda = ta ? shape.m : shape.k, ldb = tb ? shape.k : shape.n;
    auto operand = [&](std::int64_t count, float value) {
      return to_device(std::vector<T>(static_cast<std::size_t>(count), convert<T>(value)), s);
    };
    auto a = operand(shape.m * shape.k, 0.5f);
    auto b = operand(shape.k * shape.n, 0.25f);
    auto c = operand(shape.m * shape.n, 0.0f);
    auto run = [&](int times) {
      for (int i = 0; i < times; ++i) {
        gemm<T>(h, shape.ta, shape.tb, shape.m, shape.n, shape.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(),
                shape.n);
      }
      s.synchronize();
    };
    run(1);  // creates what the kernel keeps (oneDNN's matmul, scratch memory)
    using clock = std::chrono::steady_clock;
    int times = 1, total = 0;
    const auto t0 = clock::now();
    double elapsed = 0.0;
    while (elapsed < min_seconds) {
      run(times);
      total += times;
      times *= 2;
      elapsed = std::chrono::duration<double>(clock::now() - t0).count();
    }
    rate = shape.flops() * total / elapsed / 1e9;
  });
  return rate;
}

LOCKSTEP_ABI_END
