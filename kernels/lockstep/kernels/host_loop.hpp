// lockstep/kernels/host_loop.hpp — the loops a host stream's worker runs a kernel functor in.
//
// On x86-64 each loop exists twice: compiled for the baseline instruction set (SSE2, what a plain build
// targets) and for AVX2, chosen at run time by what the CPU supports. The functor's code is inlined into both,
// so the AVX2 loop vectorizes 8 floats wide (and the branch-free f16/bf16 conversions with AVX2 integer
// instructions) without the program requiring AVX2. The AVX2 copies are flattened: everything they call with
// a visible body (a functor's own for_all / for_rows / for_all_rows / for_group, the lambdas and block helpers
// inside them) is inlined into them, since code left out of line is compiled for the baseline only. FMA is deliberately
// not enabled: contracting a * b + c would change results between machines. A build that targets AVX2 already
// (-mavx2, -march=native, -march=x86-64-v3) needs no second copy: its baseline loops are the AVX2 ones, and it
// compiles each kernel once.
#pragma once

#include <cstddef>
#include <span>

#include "lockstep/config.hpp"
#include "lockstep/core/cpu_features.hpp"
#include "lockstep/kernels/bind.hpp"

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__CUDA_ARCH__) && !defined(__AVX2__)
#define LOCKSTEP_HOST_AVX2_CLONES 1
#define LOCKSTEP_TARGET_AVX2 __attribute__((target("avx2"), flatten))
#else
#define LOCKSTEP_HOST_AVX2_CLONES 0
#endif

// A third copy, for AVX-512 (F, BW, DQ, VL) with 512-bit vectors, of the loops of the few functors that ask for it
// (`static constexpr bool host_avx512 = true;`): the exact sums of deterministic mode, whose double arithmetic runs
// 1.5 times faster 8 doubles wide. Only functors whose results cannot depend on it ask: AVX-512 implies FMA, and
// GCC contracts a * b + c, so their products are all exact (by powers of two) and contraction changes nothing.
// Other kernels keep two copies, for compile time.
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__CUDA_ARCH__) && !defined(__AVX512F__)
#define LOCKSTEP_HOST_AVX512_CLONES 1
#if defined(__clang__)
#define LOCKSTEP_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c"), flatten))
#else
#define LOCKSTEP_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c,prefer-vector-width=512"), flatten))
#endif
#else
#define LOCKSTEP_HOST_AVX512_CLONES 0
#endif

LOCKSTEP_DETAIL_BEGIN

template <class K>
void host_loop_body(std::size_t n, const K& k) {
  if constexpr (requires { k.for_all(n); }) {
    k.for_all(n);  // the functor's own loop over [0, n): the same per-index results, in a host-friendly order
  } else {
    for (std::size_t i = 0; i < n; ++i) k(i);
  }
}
template <class K>
void host_loop_2d_body(std::size_t rows, std::size_t cols, const K& k) {
  if constexpr (requires { k.for_rows(rows, cols); }) {
    k.for_rows(rows, cols);  // the functor's own loop over the matrix: the same per-element results
  } else {
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < cols; ++c) k(r, c);
  }
}
template <class K>
void host_rows_body(std::size_t rows, const K& k) {
  if constexpr (requires { k.for_all_rows(rows); }) {
    k.for_all_rows(rows);  // the functor's own loop over every row: the same per-row results, in memory order
  } else {
    for (std::size_t r = 0; r < rows; ++r) k.row(r, single_lane{});
  }
}
template <class Group, class K>
void host_groups_body(std::span<const Group> groups, const K& k) {
  for (const auto& g : groups) {
    if constexpr (requires { k.for_group(g); }) {
      k.for_group(g);  // the functor's own loop: the same per-element code with the group's pointers loaded once
    } else {
      for (std::size_t i = 0; i < g.size; ++i) k(g, i);
    }
  }
}

#if LOCKSTEP_HOST_AVX2_CLONES
template <class K>
LOCKSTEP_TARGET_AVX2 void host_loop_avx2(std::size_t n, const K& k) {
  if constexpr (requires { k.for_all(n); }) {
    k.for_all(n);
  } else {
    for (std::size_t i = 0; i < n; ++i) k(i);
  }
}
template <class K>
LOCKSTEP_TARGET_AVX2 void host_loop_2d_avx2(std::size_t rows, std::size_t cols, const K& k) {
  if constexpr (requires { k.for_rows(rows, cols); }) {
    k.for_rows(rows, cols);
  } else {
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < cols; ++c) k(r, c);
  }
}
template <class K>
LOCKSTEP_TARGET_AVX2 void host_rows_avx2(std::size_t rows, const K& k) {
  if constexpr (requires { k.for_all_rows(rows); }) {
    k.for_all_rows(rows);
  } else {
    for (std::size_t r = 0; r < rows; ++r) k.row(r, single_lane{});
  }
}
template <class Group, class K>
LOCKSTEP_TARGET_AVX2 void host_groups_avx2(std::span<const Group> groups, const K& k) {
  for (const auto& g : groups) {
    if constexpr (requires { k.for_group(g); }) {
      k.for_group(g);
    } else {
      for (std::size_t i = 0; i < g.size; ++i) k(g, i);
    }
  }
}

#endif

/// Whether functor K asks for an AVX-512 copy of its loop (see LOCKSTEP_HOST_AVX512_CLONES).
template <class K>
inline constexpr bool wants_host_avx512 = requires { requires K::host_avx512; };

#if LOCKSTEP_HOST_AVX512_CLONES
template <class K>
LOCKSTEP_TARGET_AVX512 void host_loop_avx512(std::size_t n, const K& k) {
  k.for_all(n);
}
#endif

/// k(i) for i in [0, n), k bound from f (see launch.hpp), in the best loop the CPU runs.
template <class F>
void run_host_loop(std::size_t n, const F& f) {
#if LOCKSTEP_HOST_AVX512_CLONES
  if constexpr (wants_host_avx512<F>) {
    static_assert(!requires { f.bind(); }, "a functor with an AVX-512 host loop has nothing to bind");
    // f where it is: a copy, read back by the AVX-512 loop right after this function wrote it, stalled its loads
    if (cpu_has_avx512()) return host_loop_avx512(n, f);
  }
#endif
  const auto k = bind_functor(f);
#if LOCKSTEP_HOST_AVX2_CLONES
  if (cpu_has_avx2()) return host_loop_avx2(n, k);
#endif
  host_loop_body(n, k);
}

/// k(r, c) over a [rows, cols] matrix.
template <class F>
void run_host_loop_2d(std::size_t rows, std::size_t cols, const F& f) {
  const auto k = bind_functor(f);
#if LOCKSTEP_HOST_AVX2_CLONES
  if (cpu_has_avx2()) return host_loop_2d_avx2(rows, cols, k);
#endif
  host_loop_2d_body(rows, cols, k);
}

/// k.row(r, single_lane) for r in [0, rows) (launch_rows: the row-wise reductions' serial loops), or k's own
/// for_all_rows(rows) when it has one.
template <class F>
void run_host_rows(std::size_t rows, const F& f) {
  const auto k = bind_functor(f);
#if LOCKSTEP_HOST_AVX2_CLONES
  if (cpu_has_avx2()) return host_rows_avx2(rows, k);
#endif
  host_rows_body(rows, k);
}

/// k over every element of every group (multi-tensor kernels).
template <class Group, class F>
void run_host_groups(std::span<const Group> groups, const F& f) {
  const auto k = bind_functor(f);
#if LOCKSTEP_HOST_AVX2_CLONES
  if (cpu_has_avx2()) return host_groups_avx2<Group>(groups, k);
#endif
  host_groups_body<Group>(groups, k);
}

LOCKSTEP_DETAIL_END
