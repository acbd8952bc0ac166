// lockstep/blas/gemm.hpp — row-major GEMM in fp32, fp16 and bf16 with fp32 accumulation, on both backends.
//
//   gemm<T>(h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
//     C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C[m, n]      (all row-major, op(X) = X or X^T)
//
// The arithmetic is the same on both backends: products are summed in fp32, alpha and beta are applied in
// fp32, and the result is rounded to T once, at the end (where a GPU rounds). With T = half or bfloat16 the
// only difference to an fp32 GEMM on the same rounded inputs is that final rounding.
//
//   - GPU: cublasGemmEx with compute type CUBLAS_COMPUTE_32F (fp32 without TF32, fp16 and bf16 with fp32
//     accumulation); row-major is the column-major product C^T = op(B)^T op(A)^T.
//   - host device: queued on the handle's stream and run by its worker, with the kernels of the handle's
//     host_gemm_plan (host_kernels.hpp has the table). fp32 is one oneDNN matmul or OpenBLAS's cblas_sgemm;
//     bf16 is one oneDNN matmul in bf16 where the CPU multiplies bf16 (AVX512-BF16, AMX). Otherwise fp16/bf16
//     are converted to fp32 block by block into the handle's scratch memory, multiplied by the f32 kernel
//     into an fp32 accumulator block that sums the whole k dimension, and rounded once (see
//     detail::gemm_host_blocked). The scratch memory is bounded (at most 6 MiB, plus a oneDNN matmul's
//     scratchpad), whatever the problem size (see detail::host_blocking).
//
// BLAS semantics for the corner cases: m == 0 or n == 0 does nothing; k == 0 or alpha == 0 sets
// C = beta * C without reading A or B; beta == 0 sets C without reading it (NaNs in C do not propagate).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string_view>
#include <type_traits>

#include "lockstep/blas/blas_handle.hpp"  // and OpenBLAS's cblas.h
#include "lockstep/blas/host_kernels.hpp"
#include "lockstep/blas/onednn.hpp"
#include "lockstep/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/half_runs.hpp"  // the vectorized fp16/bf16 <-> fp32 runs
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/stream.hpp"

LOCKSTEP_ABI_BEGIN

/// Whether a GEMM operand is used as stored or transposed.
enum class transpose : std::uint8_t { no, yes };

/// "no" or "yes".
constexpr std::string_view name_of(transpose t) noexcept { return t == transpose::yes ? "yes" : "no"; }

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

/// The arguments of one GEMM, as checked by gemm() (trivially copyable: host work captures it).
template <class T>
struct gemm_problem {
  transpose ta, tb;
  std::int64_t m, n, k;
  float alpha;
  const T* a;
  std::int64_t lda;
  const T* b;
  std::int64_t ldb;
  float beta;
  T* c;
  std::int64_t ldc;
};

/// Rows x cols of a row-major matrix (leading dimension ld) into a dense fp32 block (leading dimension cols).
template <class T>
void widen_block(const T* src, std::int64_t ld, std::int64_t rows, std::int64_t cols, float* dst) noexcept {
  for (std::int64_t r = 0; r < rows; ++r) widen_run(src + r * ld, dst + r * cols, cols);
}

// ---- the host backend ----------------------------------------------------------------------------------------

/// Block sizes of the host fp16/bf16 GEMM. Each dimension is split into equal blocks of at most the maximum
/// (1100 rows are 2 x 550, not 1024 + 76, so that no sgemm call gets a sliver).
///
/// What costs time besides the multiply-adds is the traffic per element: converting an operand block to fp32,
/// and OpenBLAS packing it again inside each sgemm call. op(A) is converted and packed once per block of
/// columns and op(B) once per block of rows, so that traffic is about m n k (1 / rows + 1 / cols) elements:
/// rows and columns get large blocks. Measured on one core (AVX-512 Xeon, OpenBLAS 0.3.21), the f16 GEMM takes
/// 0.99x, 1.07x and 1.17x the time of the fp32 sgemm for square sizes 512, 1024 and 2048, against 1.09x, 1.15x
/// and 1.30x with 256 x 512 x 2048 blocks.
///
/// The depth gets what the scratch budget leaves: every sgemm call over a part of the depth reads and writes
/// the fp32 accumulator again, which costs most when the rows are few (an f16 training step of
/// 784-1024-1024-10 at batch 128 took 1.3x longer with the depth cut at 256 than whole). The budget is that of
/// the largest blocks with a depth of 256: at most 1024 x 256 + 256 x 1024 + 1024 x 1024 floats (6 MiB),
/// whatever the problem size.
struct host_blocking {
  static constexpr std::int64_t max_rows = 1024;
  static constexpr std::int64_t max_cols = 1024;
  static constexpr std::int64_t min_depth = 256;  // the depth of a block when rows and columns are largest
  static constexpr std::int64_t max_scratch_floats = max_rows * min_depth + min_depth * max_cols + max_rows * max_cols;

  std::int64_t rows, cols, depth;

  static constexpr std::int64_t split(std::int64_t extent, std::int64_t max_block) noexcept {
    if (extent <= max_block) return extent;
    const std::int64_t blocks = (extent + max_block - 1) / max_block;
    return (extent + blocks - 1) / blocks;
  }
  static constexpr host_blocking for_problem(std::int64_t m, std::int64_t n, std::int64_t k) noexcept {
    const std::int64_t rows = split(m, max_rows), cols = split(n, max_cols);
    const std::int64_t depth_budget = std::max(min_depth, (max_scratch_floats - rows * cols) / (rows + cols));
    return {rows, cols, split(k, depth_budget)};
  }
  /// Floats of scratch memory: a block of op(A) [rows, depth], of op(B) [depth, cols], of C [rows, cols].
  [[nodiscard]] constexpr std::size_t scratch_floats() const noexcept {
    return static_cast<std::size_t>(rows * depth + depth * cols + rows * cols);
  }
};

/// C = beta * C (k == 0 or alpha == 0), rounding once; C is not read when beta == 0.
template <class T>
void scale_host(std::int64_t m, std::int64_t n, float beta, T* c, std::int64_t ldc) noexcept {
  if (beta == 1.0f) return;
  for (std::int64_t i = 0; i < m; ++i) {
    T* row = c + i * ldc;
    if (beta == 0.0f) {
      std::memset(static_cast<void*>(row), 0, static_cast<std::size_t>(n) * sizeof(T));  // +0 in every type
      continue;
    }
    for (std::int64_t j = 0; j < n; ++j) row[j] = convert<T>(beta * to_float(row[j]));
  }
}

inline CBLAS_TRANSPOSE cblas_op(transpose t) noexcept { return t == transpose::yes ? CblasTrans : CblasNoTrans; }

/// C = alpha op(A) op(B) + beta C in fp32 (row-major, dense dimensions that fit an int) with the f32 kernel
/// `kernel` (OpenBLAS's cblas_sgemm, or oneDNN's dnnl_sgemm), on the calling thread.
inline void sgemm_host(host_gemm_kernel kernel, transpose ta, transpose tb, std::int64_t m, std::int64_t n,
                       std::int64_t k, const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta,
                       float* c, std::int64_t ldc, float alpha = 1.0f) {
#if LOCKSTEP_HAS_ONEDNN
  if (kernel == host_gemm_kernel::onednn) {
    onednn_one_thread_here();
    LOCKSTEP_ONEDNN_CHECK(dnnl_sgemm(ta == transpose::yes ? 'T' : 'N', tb == transpose::yes ? 'T' : 'N', m, n, k,
                                     alpha, a, lda, b, ldb, beta, c, ldc),
                          "multiplying f32 blocks (m = ", m, ", n = ", n, ", k = ", k, ")");
    return;
  }
#endif
  (void)kernel;
  cblas_sgemm(CblasRowMajor, cblas_op(ta), cblas_op(tb), static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

#if LOCKSTEP_HAS_ONEDNN
/// Queues the GEMM as one oneDNN matmul in T (see onednn.hpp), created or found in the handle's cache on this
/// thread, its scratchpad taken from the handle's scratch memory. Returns false, queuing nothing, when oneDNN
/// has no kernel for the GEMM, or only its reference loop (the caller then takes another kernel).
template <class T>
bool gemm_host_onednn(blas_handle& h, const gemm_problem<T>& p) {
  const auto key = onednn_matmul_key::make(dtype_of_v<T>, p.ta == transpose::yes, p.tb == transpose::yes, p.m, p.n,
                                           p.k, p.lda, p.ldb, p.ldc, p.alpha, p.beta);
  std::shared_ptr<const onednn_matmul> mm = h.onednn_cache().get(key);
  if (!mm->usable()) return false;
  void* scratchpad = mm->scratchpad_floats() == 0 ? nullptr : h.scratch(mm->scratchpad_floats());
  detail::enqueue_host(h.stream(), [p, mm, scratchpad] { mm->run(p.a, p.b, p.c, scratchpad); },
                       std::is_same_v<T, float> ? "gemm (f32, oneDNN)" : "gemm (bf16, oneDNN)");
  return true;
}
#endif

/// The oneDNN f32 matmuls of gemm_host_blocked's whole blocks (every block but the last of a dimension split
/// unevenly): `first` for a block's first depth block (acc = op(A) op(B)), `more` for the others (acc += ...).
/// Null where oneDNN is not the f32 kernel or has only its reference loop for the shape: those blocks, and the
/// smaller last blocks, take sgemm_host. On Zen 5 the f16 GEMMs of a 784-1024-1024-10 step ran at 173 GFLOP/s
/// on the matmuls against 164 on dnnl_sgemm (docs/blas.md).
struct host_block_matmuls {
#if LOCKSTEP_HAS_ONEDNN
  std::shared_ptr<const onednn_matmul> first, more;
#endif
  float* scratchpad = nullptr;        ///< their scratchpad, of scratchpad_floats floats: set by use_scratch
  std::size_t scratchpad_floats = 0;

  /// Floats of scratch gemm_host_blocked needs for `bl` with these matmuls: the blocks, then the scratchpad.
  [[nodiscard]] std::size_t scratch_floats(const host_blocking& bl) const noexcept {
    return bl.scratch_floats() + scratchpad_floats;
  }
  /// Places the scratchpad in `scratch` (scratch_floats(bl) floats), after the blocks.
  void use_scratch(float* scratch, const host_blocking& bl) noexcept {
    scratchpad = scratchpad_floats > 0 ? scratch + bl.scratch_floats() : nullptr;
  }

#if LOCKSTEP_HAS_ONEDNN
  /// The matmuls of `bl`'s whole blocks for op(A) op(B) of depth k, created or found in `cache`.
  static host_block_matmuls make(onednn_matmuls& cache, transpose ta, transpose tb, const host_blocking& bl,
                                 std::int64_t k) {
    host_block_matmuls mms;
    const bool tra = ta == transpose::yes, trb = tb == transpose::yes;
    // the operand blocks as gemm_host_blocked stores them: op(A) [rows, depth], op(B) [depth, cols], each in its
    // stored layout; acc [rows, cols]
    auto block_matmul = [&](float beta) -> std::shared_ptr<const onednn_matmul> {
      auto mm = cache.get(onednn_matmul_key::make(dtype::f32, tra, trb, bl.rows, bl.cols, bl.depth,
                                                  tra ? bl.rows : bl.depth, trb ? bl.depth : bl.cols, bl.cols, 1.0f,
                                                  beta));
      if (!mm->usable()) return nullptr;
      mms.scratchpad_floats = std::max(mms.scratchpad_floats, mm->scratchpad_floats());
      return mm;
    };
    mms.first = block_matmul(0.0f);
    if (k >= 2 * bl.depth) mms.more = block_matmul(1.0f);  // a further whole depth block exists
    return mms;
  }
#endif
};

/// The fp16/bf16 GEMM on the host, in blocks of C: for each block of columns and each block of rows, the
/// products over the whole depth are accumulated in an fp32 block `acc` (one or more f32 products: a matmul of
/// `mms` for a whole block, sgemm_host otherwise) before the block is rounded into C, once. Operand blocks are
/// converted in their stored layout (rows of the stored matrix stay contiguous) and the f32 product transposes
/// them as the caller asked. `scratch` holds `bl.scratch_floats()` floats; `f32` is the kernel of the fp32
/// products, `mms` the matmuls that replace it for whole blocks. Runs on the stream's worker.
template <class T>
void gemm_host_blocked(const gemm_problem<T>& p, const host_blocking& bl, float* scratch, host_gemm_kernel f32,
                       const host_block_matmuls& mms = {}) {
  float* a_block = scratch;                        // op(A) block [rows, depth], stored as A is
  float* b_block = a_block + bl.rows * bl.depth;   // op(B) block [depth, cols], stored as B is
  float* acc = b_block + bl.depth * bl.cols;       // [rows, cols]
  const bool ta = p.ta == transpose::yes, tb = p.tb == transpose::yes;
  const bool one_depth_block = p.k <= bl.depth;
#if !LOCKSTEP_HAS_ONEDNN
  (void)mms;
#endif

  // Converts op(B)[p0 : p0 + kb, j0 : j0 + nb] into b_block; returns its leading dimension.
  auto convert_b = [&](std::int64_t p0, std::int64_t kb, std::int64_t j0, std::int64_t nb) {
    if (!tb) {
      widen_block(p.b + p0 * p.ldb + j0, p.ldb, kb, nb, b_block);  // stored [k, n]
      return nb;
    }
    widen_block(p.b + j0 * p.ldb + p0, p.ldb, nb, kb, b_block);  // stored [n, k]
    return kb;
  };
  // Converts op(A)[i0 : i0 + mb, p0 : p0 + kb] into a_block; returns its leading dimension.
  auto convert_a = [&](std::int64_t i0, std::int64_t mb, std::int64_t p0, std::int64_t kb) {
    if (!ta) {
      widen_block(p.a + i0 * p.lda + p0, p.lda, mb, kb, a_block);  // stored [m, k]
      return kb;
    }
    widen_block(p.a + p0 * p.lda + i0, p.lda, kb, mb, a_block);  // stored [k, m]
    return mb;
  };

  for (std::int64_t j0 = 0; j0 < p.n; j0 += bl.cols) {
    const std::int64_t nb = std::min(bl.cols, p.n - j0);
    std::int64_t ldb_block = 0;
    if (one_depth_block) ldb_block = convert_b(0, p.k, j0, nb);  // serves every block of rows
    for (std::int64_t i0 = 0; i0 < p.m; i0 += bl.rows) {
      const std::int64_t mb = std::min(bl.rows, p.m - i0);
      for (std::int64_t p0 = 0; p0 < p.k; p0 += bl.depth) {
        const std::int64_t kb = std::min(bl.depth, p.k - p0);
        if (!one_depth_block) ldb_block = convert_b(p0, kb, j0, nb);
        const std::int64_t lda_block = convert_a(i0, mb, p0, kb);
#if LOCKSTEP_HAS_ONEDNN
        const auto& mm = p0 == 0 ? mms.first : mms.more;
        if (mm && mb == bl.rows && nb == bl.cols && kb == bl.depth) {
          mm->run(a_block, b_block, acc, mms.scratchpad);
          continue;
        }
#endif
        sgemm_host(f32, p.ta, p.tb, mb, nb, kb, a_block, lda_block, b_block, ldb_block, p0 == 0 ? 0.0f : 1.0f, acc,
                   nb);
      }
      for (std::int64_t r = 0; r < mb; ++r) {
        store_run(acc + r * nb, p.c + (i0 + r) * p.ldc + j0, nb, p.alpha, p.beta);
      }
    }
  }
}

template <class T>
void gemm_host(blas_handle& h, const gemm_problem<T>& p) {
  const stream_ref s = h.stream();
  detail::strict_check_functor(p, s.get_device(), "gemm");  // a, b and c are memory of the handle's device
  if (p.k == 0 || p.alpha == 0.0f) {
    if (p.beta == 1.0f) return;
    detail::enqueue_host(s, [p] { scale_host(p.m, p.n, p.beta, p.c, p.ldc); }, "gemm (C = beta * C)");
    return;
  }
  const host_gemm_plan& plan = h.host_plan();
#if LOCKSTEP_HAS_ONEDNN
  if (plan.for_dtype(dtype_of_v<T>) == host_gemm_kernel::onednn && gemm_host_onednn(h, p)) return;
#endif
  if constexpr (std::is_same_v<T, float>) {
    // OpenBLAS takes blasint (int in the LP64 build Debian ships) dimensions.
    constexpr auto blas_max = static_cast<std::int64_t>(std::numeric_limits<blasint>::max());
    LOCKSTEP_EXPECTS(p.m <= blas_max && p.n <= blas_max && p.k <= blas_max && p.lda <= blas_max &&
                         p.ldb <= blas_max && p.ldc <= blas_max,
                     "gemm: m = ", p.m, ", n = ", p.n, ", k = ", p.k, ", lda = ", p.lda, ", ldb = ", p.ldb,
                     ", ldc = ", p.ldc, " exceed OpenBLAS's integer range (", blas_max,
                     "); split the product into smaller GEMMs");
    // Here only when the plan says OpenBLAS, or oneDNN has no kernel but its reference loop for the shape.
    detail::enqueue_host(
        s,
        [p] {
          sgemm_host(host_gemm_kernel::openblas, p.ta, p.tb, p.m, p.n, p.k, p.a, p.lda, p.b, p.ldb, p.beta, p.c,
                     p.ldc, p.alpha);
        },
        "gemm (f32, OpenBLAS)");
  } else {
    const host_blocking bl = host_blocking::for_problem(p.m, p.n, p.k);
    const host_gemm_kernel f32 = plan.f32;
    host_block_matmuls mms;
#if LOCKSTEP_HAS_ONEDNN
    if (f32 == host_gemm_kernel::onednn) mms = host_block_matmuls::make(h.onednn_cache(), p.ta, p.tb, bl, p.k);
#endif
    // in stream order, before the work that uses it
    float* scratch = h.scratch(mms.scratch_floats(bl));
    mms.use_scratch(scratch, bl);
    detail::enqueue_host(s, [p, bl, scratch, f32, mms] { gemm_host_blocked(p, bl, scratch, f32, mms); },
                         std::is_same_v<T, half> ? "gemm (f16 via f32 blocks)" : "gemm (bf16 via f32 blocks)");
  }
}

// ---- the CUDA backend ----------------------------------------------------------------------------------------

#if LOCKSTEP_HAS_CUDA
template <class T>
constexpr cudaDataType_t cuda_data_type() noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return CUDA_R_32F;
  } else if constexpr (std::is_same_v<T, half>) {
    return CUDA_R_16F;
  } else {
    return CUDA_R_16BF;
  }
}

inline cublasOperation_t cublas_op(transpose t) noexcept { return t == transpose::yes ? CUBLAS_OP_T : CUBLAS_OP_N; }

template <class T>
void gemm_cuda(blas_handle& h, const gemm_problem<T>& p) {
  const device d = h.get_device();
  constexpr auto int_max = static_cast<std::int64_t>(std::numeric_limits<int>::max());
  LOCKSTEP_EXPECTS(p.m <= int_max && p.n <= int_max && p.k <= int_max && p.lda <= int_max && p.ldb <= int_max &&
                       p.ldc <= int_max,
                   "gemm: m = ", p.m, ", n = ", p.n, ", k = ", p.k, ", lda = ", p.lda, ", ldb = ", p.ldb,
                   ", ldc = ", p.ldc, " exceed cuBLAS's 32-bit range (", int_max,
                   "); split the product into smaller GEMMs");
  device_guard guard(d);
  const cudaDataType_t type = cuda_data_type<T>();
  const auto m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  const auto ldc = static_cast<int>(p.ldc);
  if (p.k == 0 || p.alpha == 0.0f) {
    // C = beta * C without reading A or B. Done here rather than by cuBLAS, which has not always applied
    // beta when k == 0 (pytorch/pytorch#31421) and does not promise to skip A and B when alpha == 0.
    if (p.beta == 1.0f) return;
    if (p.beta == 0.0f) {
      LOCKSTEP_CUDA_CHECK(cudaMemset2DAsync(p.c, static_cast<std::size_t>(p.ldc) * sizeof(T), 0,
                                            static_cast<std::size_t>(p.n) * sizeof(T), static_cast<std::size_t>(p.m),
                                            h.stream().cuda_stream()),
                          "zeroing C of a ", p.m, " x ", p.n, " GEMM (k = ", p.k, ", beta = 0) on ", d.str());
      return;
    }
    // Scale the rows (dense C: all of it at once) or the columns, whichever takes fewer calls.
    const float beta = p.beta;
    if ((p.ldc == p.n || p.m == 1) && p.m * p.n <= int_max) {
      LOCKSTEP_CUBLAS_CHECK(cublasScalEx(h.cublas(), m * n, &beta, CUDA_R_32F, p.c, type, 1, CUDA_R_32F),
                            "scaling C of a ", p.m, " x ", p.n, " GEMM by beta = ", beta, " on ", d.str());
    } else if (p.m <= p.n) {
      for (std::int64_t i = 0; i < p.m; ++i) {
        LOCKSTEP_CUBLAS_CHECK(cublasScalEx(h.cublas(), n, &beta, CUDA_R_32F, p.c + i * p.ldc, type, 1, CUDA_R_32F),
                              "scaling row ", i, " of C of a ", p.m, " x ", p.n, " GEMM by beta on ", d.str());
      }
    } else {
      for (std::int64_t j = 0; j < p.n; ++j) {
        LOCKSTEP_CUBLAS_CHECK(cublasScalEx(h.cublas(), m, &beta, CUDA_R_32F, p.c + j, type, ldc, CUDA_R_32F),
                              "scaling column ", j, " of C of a ", p.m, " x ", p.n, " GEMM by beta on ", d.str());
      }
    }
    return;
  }
  // Row-major C [m, n] is column-major C^T [n, m] = op(B)^T op(A)^T: a row-major matrix read as column-major
  // is its transpose, so B and A are passed as they are, in swapped order, with their own transpose flags.
  LOCKSTEP_CUBLAS_CHECK(cublasGemmEx(h.cublas(), cublas_op(p.tb), cublas_op(p.ta), n, m, k, &p.alpha, p.b, type,
                                     static_cast<int>(p.ldb), p.a, type, static_cast<int>(p.lda), &p.beta, p.c, type,
                                     ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                        "computing a GEMM in ", name_of(dtype_of_v<T>), " (m = ", p.m, ", n = ", p.n, ", k = ", p.k,
                        ", ta = ", name_of(p.ta), ", tb = ", name_of(p.tb), ") on ", d.str());
}
#endif

/// Checks the arguments of gemm() with NCCL's care: the argument, its value, and the valid range.
template <class T>
void check_gemm_arguments(const gemm_problem<T>& p, device d) {
  LOCKSTEP_EXPECTS(p.m >= 0, "gemm: invalid m = ", p.m, " (the number of rows of C must be >= 0)");
  LOCKSTEP_EXPECTS(p.n >= 0, "gemm: invalid n = ", p.n, " (the number of columns of C must be >= 0)");
  LOCKSTEP_EXPECTS(p.k >= 0, "gemm: invalid k = ", p.k, " (the inner dimension must be >= 0)");
  const bool ta = p.ta == transpose::yes, tb = p.tb == transpose::yes;
  const std::int64_t a_cols = ta ? p.m : p.k, b_cols = tb ? p.k : p.n;
  LOCKSTEP_EXPECTS(p.lda >= std::max<std::int64_t>(1, a_cols), "gemm: invalid lda = ", p.lda, " (with ta = ",
                   name_of(p.ta), ", A is stored row-major as ", ta ? "k x m = " : "m x k = ", ta ? p.k : p.m,
                   " x ", a_cols, ", so lda must be >= max(1, ", ta ? "m" : "k", ") = ",
                   std::max<std::int64_t>(1, a_cols), ")");
  LOCKSTEP_EXPECTS(p.ldb >= std::max<std::int64_t>(1, b_cols), "gemm: invalid ldb = ", p.ldb, " (with tb = ",
                   name_of(p.tb), ", B is stored row-major as ", tb ? "n x k = " : "k x n = ", tb ? p.n : p.k,
                   " x ", b_cols, ", so ldb must be >= max(1, ", tb ? "k" : "n", ") = ",
                   std::max<std::int64_t>(1, b_cols), ")");
  LOCKSTEP_EXPECTS(p.ldc >= std::max<std::int64_t>(1, p.n), "gemm: invalid ldc = ", p.ldc,
                   " (C is stored row-major as m x n = ", p.m, " x ", p.n, ", so ldc must be >= max(1, n) = ",
                   std::max<std::int64_t>(1, p.n), ")");
  LOCKSTEP_EXPECTS(p.a != nullptr || p.m == 0 || p.k == 0, "gemm: a is null but op(A) is m x k = ", p.m, " x ",
                   p.k, " (expected memory of ", d.str(), ")");
  LOCKSTEP_EXPECTS(p.b != nullptr || p.k == 0 || p.n == 0, "gemm: b is null but op(B) is k x n = ", p.k, " x ",
                   p.n, " (expected memory of ", d.str(), ")");
  LOCKSTEP_EXPECTS(p.c != nullptr || p.m == 0 || p.n == 0, "gemm: c is null but C is m x n = ", p.m, " x ", p.n,
                   " (expected memory of ", d.str(), ")");
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C, row-major, queued on h.stream().
///
/// Layout: every matrix is row-major with a leading dimension in elements. With ta == transpose::no, A is
/// stored m x k and lda >= max(1, k); with ta == transpose::yes, A is stored k x m (op(A) = A^T) and
/// lda >= max(1, m). Likewise B is stored k x n (ldb >= max(1, n)) or n x k (ldb >= max(1, k)), and C is
/// m x n with ldc >= max(1, n). Elements of C beyond column n of a row are neither read nor written.
///
/// Arithmetic: T is float, half or bfloat16; products are summed in fp32 and the result is rounded to T
/// once (see the file comment). k == 0 or alpha == 0 gives C = beta * C without reading A and B; beta == 0
/// does not read C; m == 0 or n == 0 does nothing.
///
/// Preconditions, checked (throws precondition_error naming the argument, its value and the valid range):
/// m, n, k >= 0; the leading dimensions above; a, b, c not null where the matrix is not empty. Not
/// checkable, and the caller's duty: a, b and c point to memory of h.get_device() that holds the matrices
/// and stays valid until the stream has passed the GEMM; C does not overlap A or B.
///
/// Asynchronous: returns once the work is queued on h.stream(). A failure of the queued host work is
/// reported by the next synchronization of the stream; cuBLAS errors at launch throw cublas_error. On a host
/// device, a GEMM may grow the handle's scratch memory (out_of_memory_error when the device is full): an
/// fp16/bf16 GEMM through f32 blocks, and a oneDNN matmul the first time its shape is seen (its scratchpad);
/// repeated shapes allocate nothing. A GEMM on a GPU never allocates.
template <class T>
void gemm(blas_handle& h, transpose ta, transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const T* a, std::int64_t lda, const T* b, std::int64_t ldb, float beta, T* c, std::int64_t ldc) {
  static_assert(is_storage_float_v<T>, "lockstep::gemm<T>: T must be float, lockstep::half or lockstep::bfloat16");
  const detail::gemm_problem<T> p{ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc};
  detail::check_gemm_arguments(p, h.get_device());
  if (m == 0 || n == 0) return;
  if (h.get_device().is_host()) return detail::gemm_host(h, p);
#if LOCKSTEP_HAS_CUDA
  detail::gemm_cuda(h, p);
#else
  throw device_error("unreachable: a blas_handle of a GPU in a host-only translation unit");
#endif
}

LOCKSTEP_ABI_END
