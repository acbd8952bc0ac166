// lockstep/kernels/launch.hpp — the two launchers every kernel goes through.
//
// A kernel body is a functor with a `LOCKSTEP_HD void operator()(std::size_t i) const` call operator that
// does the work of element i and nothing else (it never reads threadIdx). `launch_elementwise` runs it for
// i in [0, n):
//   - on a GPU stream, as a grid-stride kernel (launch_cuda.cuh);
//   - on a host stream, as a loop on the stream's worker thread.
// So the arithmetic tested on the CPU is the arithmetic the GPU runs. `launch_2d` does the same for
// functors of (row, col) over a row-major matrix. `launch_columns` (column sums) and `launch_rows` (row-wise
// reductions) run the functor's own loop on a host stream and a block or warp reduction on a GPU.
//
// A functor whose scalars live in device memory (a loss scale, a skip flag, a step count) may provide
// `LOCKSTEP_HD auto bind() const` returning the functor with those values loaded: launchers call it once per
// GPU thread or once per host loop, so the per-element body works on plain values the compiler can keep in
// registers and vectorize around (a load through a pointer may alias the data being written).
#pragma once

#include <cstddef>
#include <type_traits>

#include "lockstep/config.hpp"
#include "lockstep/kernels/bind.hpp"
#include "lockstep/kernels/host_loop.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/stream.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/kernels/launch_cuda.cuh"
#endif

LOCKSTEP_DETAIL_BEGIN
/// Checks that memory a kernel touches is on the device of the stream that runs it.
template <class Span>
void expect_on_stream_device(const Span& span, stream_ref s, const char* what) {
  LOCKSTEP_EXPECTS(span.empty() || span.get_device() == s.get_device(), what, ": memory on ", span.get_device().str(),
                   " cannot be used by a kernel on a stream of ", s.get_device().str());
}
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Runs `f(i)` for every i in [0, n) in stream order on `s`. `what` names the kernel in errors ("axpy").
/// The functor is copied; everything it points to must stay valid until the stream passes the kernel.
template <class F>
void launch_elementwise(std::size_t n, F f, stream_ref s, const char* what) {
  static_assert(std::is_trivially_copyable_v<F>, "a kernel functor is copied to the device: keep it a plain struct");
  if (n == 0) return;
  if (s.get_device().is_host()) {
    detail::strict_check_functor(f, s.get_device(), what);
    detail::enqueue_host(
        s,
        [n, f] { detail::run_host_loop(n, f); },
        what);
    return;
  }
#if LOCKSTEP_HAS_CUDA
  detail::launch_elementwise_cuda(n, f, s, what);
#endif
}

/// Runs `f(r, c)` for every element of a [rows, cols] matrix in stream order on `s`: on a host stream, a loop
/// over rows around a loop over columns (no division per element); on a GPU, the grid-stride kernel with the
/// row and column computed from the flat index.
template <class F>
void launch_2d(std::size_t rows, std::size_t cols, F f, stream_ref s, const char* what) {
  static_assert(std::is_trivially_copyable_v<F>, "a kernel functor is copied to the device: keep it a plain struct");
  if (rows == 0 || cols == 0) return;
  if (s.get_device().is_host()) {
    detail::strict_check_functor(f, s.get_device(), what);
    detail::enqueue_host(
        s,
        [rows, cols, f] { detail::run_host_loop_2d(rows, cols, f); },
        what);
    return;
  }
#if LOCKSTEP_HAS_CUDA
  // straight to the CUDA launcher: flat_2d is a device-only wrapper, never run by a host loop
  detail::launch_elementwise_cuda(rows * cols, detail::flat_2d<F>{f, cols}, s, what);
#endif
}

/// Runs a column reduction `f` over a [rows, cols] matrix in stream order on `s`: for every column c,
/// f.finish(c, sum over r of f.load(r, c)), as `f(c)` does (bias gradients: kernels::column_sum_op). On a host
/// stream exactly launch_elementwise(cols, f) (the functor's own loop). On a GPU, below 32 rows one thread per
/// column (f(c)); from 32 rows, blocks of 32 columns x 8 row lanes over splits of the rows, each split's sums
/// combined in shared memory, then the splits' partial sums added in split order (launch_cuda.cuh). No atomics: the
/// order depends on `rows` only, so a GPU gives the same bits for the same matrix every time (deterministic mode's
/// chunks of equal shape included), though not the bits of the host's row-by-row sum.
template <class F>
void launch_columns(std::size_t rows, std::size_t cols, F f, stream_ref s, const char* what) {
  static_assert(std::is_trivially_copyable_v<F>, "a kernel functor is copied to the device: keep it a plain struct");
  if (cols == 0) return;
  if (s.get_device().is_host()) {
    launch_elementwise(cols, f, s, what);
    return;
  }
#if LOCKSTEP_HAS_CUDA
  detail::launch_columns_cuda(rows, cols, f, s, what);
#else
  (void)rows;
#endif
}

/// Runs `f.row(r, lanes)` for every row r in [0, rows) in stream order on `s`, for row-wise reductions (a softmax,
/// an argmax): on a GPU a warp per row, whose 32 lanes take columns lanes.index, lanes.index + 32, ... and combine
/// partial results with lanes.sum / max / first_max (coalesced reads, one row per warp instead of per thread); on
/// a host stream one lane per row, so the same code is the row's serial loop (or f.for_all_rows(rows), a host loop
/// over every row that gives each row the bits of its serial loop).
template <class F>
void launch_rows(std::size_t rows, F f, stream_ref s, const char* what) {
  static_assert(std::is_trivially_copyable_v<F>, "a kernel functor is copied to the device: keep it a plain struct");
  if (rows == 0) return;
  if (s.get_device().is_host()) {
    detail::strict_check_functor(f, s.get_device(), what);
    detail::enqueue_host(
        s,
        [rows, f] { detail::run_host_rows(rows, f); },
        what);
    return;
  }
#if LOCKSTEP_HAS_CUDA
  detail::launch_rows_cuda(rows, f, s, what);
#endif
}

LOCKSTEP_ABI_END
