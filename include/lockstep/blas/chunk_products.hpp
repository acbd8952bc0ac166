// lockstep/blas/chunk_products.hpp — deterministic mode's weight gradients on a host device: the products
// P_c = G_c^T X_c of the chunks c of a batch, computed tile by tile and handed over while they are in cache.
//
//   host_chunk_products(problem, scratch, emit)
//     G [rows, m] and X [rows, n] (row-major, leading dimensions ldg and ldx); chunk c is rows
//     [c * chunk_rows, min((c + 1) * chunk_rows, rows)). P_c[i][j] is a chain of fused multiply-adds over the
//     chunk's rows in order, from zero: fma(G[r][i], X[r][j], acc). That arithmetic is the whole definition,
//     so an element's bits depend on its chunk's rows only: not on m, n, the number of chunks, the tile an
//     element falls in or the instruction set (AVX-512, AVX2 + FMA or scalar std::fma: the same chain).
//
// Why not a GEMM per chunk, as a GPU does (cuBLAS, one algorithm per shape): OpenBLAS spends about twice as
// long on four products of depth 32 as on one of depth 128 (it re-packs and re-reads C for every call), and
// the partials then travel through memory to be summed. Here a tile of every chunk's product (8 rows of P,
// 256 columns) is summed, accumulated or copied by `emit` right after it is computed; the operands are packed
// once per call (G in panels of 8 columns, X in panels of 32), so the inner loop reads both contiguously.
// Runs on the calling thread (a host stream's worker); rows, m and n are those of one replica.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/half_runs.hpp"
#include "lockstep/core/transpose.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define LOCKSTEP_CHUNK_PRODUCTS_X86 1
#include <immintrin.h>
#else
#define LOCKSTEP_CHUNK_PRODUCTS_X86 0
#endif

LOCKSTEP_DETAIL_BEGIN

/// The operands of host_chunk_products (trivially copyable: host work captures it, strict mode scans it).
template <class T>
struct chunk_products_problem {
  const T* g;  // [rows, m]
  std::int64_t ldg;
  const T* x;  // [rows, n]
  std::int64_t ldx;
  std::int64_t rows, m, n, chunk_rows;
};

/// The operands of host_row_products: C [rows, n] (leading dimension ldc) = A [rows, k] (lda) times B, where
/// B(kk, j) is b[kk * ldb + j] (B [k, n] row-major) or, with b_transposed, b[j * ldb + kk] (b [n, k] used as
/// its transpose: a linear layer's weight in its forward).
template <class T>
struct row_products_problem {
  const T* a;
  std::int64_t lda;
  const T* b;
  std::int64_t ldb;
  bool b_transposed;
  T* c;
  std::int64_t ldc;
  std::int64_t rows, n, k;
};

namespace chunk_products {
inline constexpr std::int64_t tile_m = 8;      // rows of P per tile (columns of G per panel)
inline constexpr std::int64_t tile_n = 32;     // columns of P per tile (columns of X per panel)
inline constexpr std::int64_t block_n = 256;   // columns of P per emitted block (a multiple of tile_n)

/// Floats of scratch host_chunk_products needs.
constexpr std::int64_t scratch_floats(std::int64_t rows, std::int64_t m, std::int64_t n, std::int64_t chunks) {
  const std::int64_t mp = (m + tile_m - 1) / tile_m * tile_m, np = (n + tile_n - 1) / tile_n * tile_n;
  return rows * (mp + np) + chunks * tile_m * block_n;
}

/// The rows' slices of one whole panel of W floats. A copy of a size the compiler knows is a few vector moves;
/// std::copy_n of a run-time width was a call to memmove per slice, and a weight gradient's operands are hundreds
/// of thousands of slices of 32 or 128 bytes (those calls took 7-9% of a deterministic CNN step's samples on Zen 5).
template <std::int64_t W>
void copy_slices(const float* src, std::int64_t ld, std::int64_t rows, float* dst) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * ld;
    float* d = dst + r * W;
    __builtin_memcpy(d, s, W * sizeof(float));
  }
}

#if LOCKSTEP_CHUNK_PRODUCTS_X86 && LOCKSTEP_BLAS_X86_SIMD
/// copy_slices for f16 and bf16: each slice widened 8 values at a time (widen_run's floats), without a call per
/// slice.
template <std::int64_t W, class T>
__attribute__((target("avx2,f16c"))) void widen_slices(const T* src, std::int64_t ld, std::int64_t rows, float* dst) {
  static_assert(W % 8 == 0);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t b = 0; b < W; b += 8) _mm256_storeu_ps(dst + r * W + b, widen8(src + r * ld + b));
  }
}
#endif

/// A whole panel of `width` columns (tile_m or tile_n) copied or widened with a width the compiler knows
/// (copy_slices, widen_slices); false, and nothing done, for another width or where T has no such copy here.
template <class T>
bool pack_whole_panel(const T* src, std::int64_t ld, std::int64_t rows, std::int64_t width, float* dst) {
  const auto with_width = [width](auto copy) {  // copy(W) for the compile-time width W
    if (width == tile_m) {
      copy(std::integral_constant<std::int64_t, tile_m>{});
      return true;
    }
    if (width == tile_n) {
      copy(std::integral_constant<std::int64_t, tile_n>{});
      return true;
    }
    return false;
  };
  if constexpr (std::is_same_v<T, float>) {
    return with_width([&](auto w) { copy_slices<decltype(w)::value>(src, ld, rows, dst); });
  } else {
#if LOCKSTEP_CHUNK_PRODUCTS_X86 && LOCKSTEP_BLAS_X86_SIMD
    if (has_avx2_f16c()) return with_width([&](auto w) { widen_slices<decltype(w)::value>(src, ld, rows, dst); });
#else
    (void)src, (void)ld, (void)rows, (void)dst, (void)with_width;
#endif
    return false;
  }
}

/// dst[(t * rows + r) * width + b] = src[r][t * width + b] as floats, zero past `cols`: panels of `width`
/// columns, each row's slice contiguous, the panel's rows one after another.
template <class T>
void pack_panels(const T* src, std::int64_t ld, std::int64_t rows, std::int64_t cols, std::int64_t width, float* dst) {
  const std::int64_t panels = (cols + width - 1) / width;
  for (std::int64_t t = 0; t < panels; ++t) {
    const std::int64_t c0 = t * width, w = std::min(width, cols - c0);
    if (w == width && pack_whole_panel(src + c0, ld, rows, width, dst + t * rows * width)) continue;
    for (std::int64_t r = 0; r < rows; ++r) {
      float* d = dst + (t * rows + r) * width;
      if constexpr (std::is_same_v<T, float>) {
        std::copy_n(src + r * ld + c0, w, d);
      } else {
        widen_run(src + r * ld + c0, d, w);
      }
      std::fill(d + w, d + width, 0.0f);
    }
  }
}

/// Floats of scratch host_row_products needs (A packed whole, B one panel at a time).
constexpr std::int64_t row_scratch_floats(std::int64_t rows, std::int64_t n, std::int64_t k) {
  (void)n;
  const std::int64_t mp = (rows + tile_m - 1) / tile_m * tile_m;
  return k * (mp + tile_n) + tile_m * tile_n;
}

/// dst[(t * depth + d) * width + w] = src[(t * width + w) * ld + d] as floats, zero for w past `count`: the
/// panels of pack_panels for the transpose of src [count, depth] (each of its rows becomes a panel's column).
/// Blocks of 64 depth steps, so that the block's part of the panel stays in L1 while its rows are read.
template <class T>
void pack_panels_transposed_portable(const T* src, std::int64_t ld, std::int64_t count, std::int64_t depth,
                                     std::int64_t width, float* dst) {
  constexpr std::int64_t block = 64;
  float wide[block];
  const std::int64_t panels = (count + width - 1) / width;
  for (std::int64_t t = 0; t < panels; ++t) {
    float* panel = dst + t * depth * width;
    for (std::int64_t d0 = 0; d0 < depth; d0 += block) {
      const std::int64_t len = std::min(block, depth - d0);
      for (std::int64_t w = 0; w < width; ++w) {
        const std::int64_t q = t * width + w;
        float* out = panel + d0 * width + w;
        if (q >= count) {
          for (std::int64_t d = 0; d < len; ++d) out[d * width] = 0.0f;
          continue;
        }
        const T* row = src + q * ld + d0;
        if constexpr (std::is_same_v<T, float>) {
          for (std::int64_t d = 0; d < len; ++d) out[d * width] = row[d];
        } else {
          widen_run(row, wide, len);
          for (std::int64_t d = 0; d < len; ++d) out[d * width] = wide[d];
        }
      }
    }
  }
}

#if LOCKSTEP_CHUNK_PRODUCTS_X86
/// Eight values of src as floats (f16 and bf16 widened as widen_run widens them: the same floats).
__attribute__((target("avx2"))) inline __m256 load8_as_floats(const float* src) { return _mm256_loadu_ps(src); }
#if LOCKSTEP_BLAS_X86_SIMD
template <class T>
__attribute__((target("avx2,f16c"))) inline __m256 load8_as_floats(const T* src) {
  return widen8(src);
}
#endif

/// pack_panels_transposed for a width that is a multiple of 8: 8 x 8 blocks transposed in registers (f16 and bf16
/// widened on the way in; floats use no F16C instruction, so they run on any AVX2 CPU).
template <class T>
__attribute__((target("avx2,f16c"))) void pack_panels_transposed_avx2(const T* src, std::int64_t ld, std::int64_t count,
                                                                      std::int64_t depth, std::int64_t width,
                                                                      float* dst) {
  const std::int64_t panels = (count + width - 1) / width, d8 = depth / 8 * 8;
  for (std::int64_t t = 0; t < panels; ++t) {
    float* panel = dst + t * depth * width;
    for (std::int64_t w0 = 0; w0 < width; w0 += 8) {
      const std::int64_t q0 = t * width + w0;
      const T* rows[8];
      for (std::int64_t i = 0; i < 8; ++i) rows[i] = q0 + i < count ? src + (q0 + i) * ld : nullptr;
      for (std::int64_t d = 0; d < d8; d += 8) {
        __m256 r[8], columns[8];
        for (int i = 0; i < 8; ++i) r[i] = rows[i] != nullptr ? load8_as_floats(rows[i] + d) : _mm256_setzero_ps();
        transpose_8x8(r, columns);
        float* out = panel + d * width + w0;
        for (std::int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(out + i * width, columns[i]);
      }
      for (std::int64_t d = d8; d < depth; ++d) {
        for (std::int64_t i = 0; i < 8; ++i) {
          panel[d * width + w0 + i] = rows[i] != nullptr ? widen_value(rows[i][d]) : 0.0f;
        }
      }
    }
  }
}
#endif

/// pack_panels_transposed in the best build the CPU runs (data movement and exact widening only: the same floats
/// either way).
template <class T>
void pack_panels_transposed(const T* src, std::int64_t ld, std::int64_t count, std::int64_t depth, std::int64_t width,
                            float* dst) {
#if LOCKSTEP_CHUNK_PRODUCTS_X86
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2() && width % 8 == 0) return pack_panels_transposed_avx2(src, ld, count, depth, width, dst);
  } else {
#if LOCKSTEP_BLAS_X86_SIMD
    if (has_avx2_f16c() && width % 8 == 0) return pack_panels_transposed_avx2(src, ld, count, depth, width, dst);
#endif
  }
#endif
  pack_panels_transposed_portable(src, ld, count, depth, width, dst);
}

/// The tile kernel: out[a * ld + b] = the fma chain over rows r < k of gp[r * tile_m + a] * xp[r * tile_n + b],
/// for a < tile_m and b < tile_n. Three builds of one arithmetic.
using tile_kernel = void (*)(const float* gp, const float* xp, std::int64_t k, float* out, std::int64_t ld);

inline void tile_scalar(const float* gp, const float* xp, std::int64_t k, float* out, std::int64_t ld) {
  for (std::int64_t a = 0; a < tile_m; ++a) {
    for (std::int64_t b = 0; b < tile_n; ++b) {
      float acc = 0.0f;
      for (std::int64_t r = 0; r < k; ++r) acc = std::fma(gp[r * tile_m + a], xp[r * tile_n + b], acc);
      out[a * ld + b] = acc;
    }
  }
}

#if LOCKSTEP_CHUNK_PRODUCTS_X86
// The rows of a tile as folds over an index sequence: the accumulators stay registers at -O2 (a loop over an
// array of vectors would need unrolling pragmas to leave memory).

// rows [a0, a0 + 4) and columns [b0, b0 + 16) of a tile: 8 accumulators of AVX2's 16 registers
template <std::size_t... A>
__attribute__((target("avx2,fma"))) inline void tile_avx2_part(const float* gp, const float* xp, std::int64_t k,
                                                               float* out, std::int64_t ld, std::int64_t a0,
                                                               std::int64_t b0, std::index_sequence<A...>) {
  __m256 lo[sizeof...(A)] = {((void)A, _mm256_setzero_ps())...}, hi[sizeof...(A)] = {((void)A, _mm256_setzero_ps())...};
  for (std::int64_t r = 0; r < k; ++r) {
    const __m256 x0 = _mm256_loadu_ps(xp + r * tile_n + b0), x1 = _mm256_loadu_ps(xp + r * tile_n + b0 + 8);
    ((lo[A] = _mm256_fmadd_ps(_mm256_broadcast_ss(gp + r * tile_m + a0 + A), x0, lo[A]),
      hi[A] = _mm256_fmadd_ps(_mm256_broadcast_ss(gp + r * tile_m + a0 + A), x1, hi[A])),
     ...);
  }
  ((_mm256_storeu_ps(out + (a0 + A) * ld + b0, lo[A]), _mm256_storeu_ps(out + (a0 + A) * ld + b0 + 8, hi[A])), ...);
}

__attribute__((target("avx2,fma"))) inline void tile_avx2(const float* gp, const float* xp, std::int64_t k,
                                                          float* out, std::int64_t ld) {
  for (std::int64_t a0 = 0; a0 < tile_m; a0 += 4) {
    for (std::int64_t b0 = 0; b0 < tile_n; b0 += 16) tile_avx2_part(gp, xp, k, out, ld, a0, b0, std::make_index_sequence<4>{});
  }
}

// the whole tile at once: 16 accumulators of AVX-512's 32 registers
template <std::size_t... A>
__attribute__((target("avx512f"))) inline void tile_avx512_rows(const float* gp, const float* xp, std::int64_t k,
                                                                float* out, std::int64_t ld, std::index_sequence<A...>) {
  __m512 lo[sizeof...(A)] = {((void)A, _mm512_setzero_ps())...}, hi[sizeof...(A)] = {((void)A, _mm512_setzero_ps())...};
  for (std::int64_t r = 0; r < k; ++r) {
    const __m512 x0 = _mm512_loadu_ps(xp + r * tile_n), x1 = _mm512_loadu_ps(xp + r * tile_n + 16);
    ((lo[A] = _mm512_fmadd_ps(_mm512_set1_ps(gp[r * tile_m + A]), x0, lo[A]),
      hi[A] = _mm512_fmadd_ps(_mm512_set1_ps(gp[r * tile_m + A]), x1, hi[A])),
     ...);
  }
  ((_mm512_storeu_ps(out + A * ld, lo[A]), _mm512_storeu_ps(out + A * ld + 16, hi[A])), ...);
}

__attribute__((target("avx512f"))) inline void tile_avx512(const float* gp, const float* xp, std::int64_t k,
                                                           float* out, std::int64_t ld) {
  tile_avx512_rows(gp, xp, k, out, ld, std::make_index_sequence<tile_m>{});
}
#endif

/// The tile kernel this CPU runs (asked once).
inline tile_kernel pick_tile_kernel() noexcept {
#if LOCKSTEP_CHUNK_PRODUCTS_X86
  static const tile_kernel k = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return &tile_avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &tile_avx2;
    return &tile_scalar;
  }();
  return k;
#else
  return &tile_scalar;
#endif
}
}  // namespace chunk_products

namespace chunk_products {
/// The loops of host_chunk_products: packs p's operands into `scratch`, then for each block (8 rows of P,
/// block_n columns) calls tile(i0, j, c, gp, xp, k) for each of its tiles (columns [j, j + tile_n)) and chunk c
/// (gp and xp the chunk's packed rows, k of them), then block_done(i0, mb, j0, nb, tiles).
template <class T, class Tile, class BlockDone>
void visit_tiles(const chunk_products_problem<T>& p, float* scratch, Tile&& tile, BlockDone&& block_done) {
  if (p.rows == 0 || p.m == 0 || p.n == 0) return;
  const std::int64_t chunks = (p.rows + p.chunk_rows - 1) / p.chunk_rows;
  const std::int64_t mp = (p.m + tile_m - 1) / tile_m * tile_m;
  float* gp = scratch;                 // [m / tile_m][rows][tile_m]
  float* xp = gp + p.rows * mp;        // [n / tile_n][rows][tile_n]
  float* tiles = xp + p.rows * ((p.n + tile_n - 1) / tile_n * tile_n);  // [chunks][tile_m][block_n]
  pack_panels(p.g, p.ldg, p.rows, p.m, tile_m, gp);
  pack_panels(p.x, p.ldx, p.rows, p.n, tile_n, xp);
  for (std::int64_t i0 = 0; i0 < p.m; i0 += tile_m) {
    const float* g_panel = gp + i0 * p.rows;  // panel i0 / tile_m: rows * tile_m floats
    for (std::int64_t j0 = 0; j0 < p.n; j0 += block_n) {
      const std::int64_t nb = std::min(block_n, p.n - j0);
      for (std::int64_t jt = 0; jt < nb; jt += tile_n) {
        const float* x_panel = xp + (j0 + jt) * p.rows;
        for (std::int64_t c = 0; c < chunks; ++c) {
          const std::int64_t r0 = c * p.chunk_rows, k = std::min(p.chunk_rows, p.rows - r0);
          tile(i0, j0 + jt, c, g_panel + r0 * tile_m, x_panel + r0 * tile_n, k, tiles);
        }
      }
      block_done(i0, std::min(tile_m, p.m - i0), j0, nb, static_cast<const float*>(tiles));
    }
  }
}
}  // namespace chunk_products

/// Computes the chunks' products of `p` block by block and calls emit(i0, mb, j0, nb, tiles, chunk_stride) for
/// each: rows [i0, i0 + mb) and columns [j0, j0 + nb) of every P_c, element (i0 + a, j0 + j) of P_c at
/// tiles[c * chunk_stride + a * chunk_products::block_n + j]. `scratch` holds
/// chunk_products::scratch_floats(rows, m, n, chunks) floats. Nothing is emitted without rows. `kernel` is the
/// CPU's (tests pass each one the CPU can run: all give the same bits).
template <class T, class Emit>
void host_chunk_products(const chunk_products_problem<T>& p, float* scratch, Emit&& emit,
                         chunk_products::tile_kernel kernel = chunk_products::pick_tile_kernel()) {
  namespace cp = chunk_products;
  constexpr std::int64_t chunk_stride = cp::tile_m * cp::block_n;
  cp::visit_tiles(
      p, scratch,
      [&](std::int64_t, std::int64_t j, std::int64_t c, const float* gp, const float* xp, std::int64_t k, float* tiles) {
        kernel(gp, xp, k, tiles + c * chunk_stride + j % cp::block_n, cp::block_n);
      },
      [&](std::int64_t i0, std::int64_t mb, std::int64_t j0, std::int64_t nb, const float* tiles) {
        emit(i0, mb, j0, nb, tiles, chunk_stride);
      });
}

/// host_chunk_products for float partials stored as they are: P_c[i][j] into out[c * chunk_stride + i * ld + j]
/// (whole tiles straight from the kernel's registers, the edges through the tile buffer).
inline void host_chunk_products_into(const chunk_products_problem<float>& p, float* scratch, float* out, std::int64_t ld,
                                     std::int64_t chunk_stride,
                                     chunk_products::tile_kernel kernel = chunk_products::pick_tile_kernel()) {
  namespace cp = chunk_products;
  cp::visit_tiles(
      p, scratch,
      [&](std::int64_t i0, std::int64_t j, std::int64_t c, const float* gp, const float* xp, std::int64_t k,
          float* tiles) {
        float* dst = out + c * chunk_stride + i0 * ld + j;
        if (i0 + cp::tile_m <= p.m && j + cp::tile_n <= p.n) {
          kernel(gp, xp, k, dst, ld);
          return;
        }
        kernel(gp, xp, k, tiles, cp::tile_n);
        const std::int64_t mb = std::min(cp::tile_m, p.m - i0), nb = std::min(cp::tile_n, p.n - j);
        for (std::int64_t a = 0; a < mb; ++a) std::copy_n(tiles + a * cp::tile_n, nb, dst + a * ld);
      },
      [](std::int64_t, std::int64_t, std::int64_t, std::int64_t, const float*) {});
}

/// C = A B for row_products_problem p: C[r][j] the chain of fused multiply-adds over kk < k in order, from zero,
/// of A[r][kk] * B(kk, j), rounded once to T. An element's bits depend on its own row of A and its column of B
/// only: not on how many rows share the call (the batch invariance deterministic mode needs for outputs and
/// input gradients), nor on the tile it falls in or the instruction set. A is packed once per call, B one
/// column panel (32 columns, all of the depth) at a time, in the outer loop, so that the panel stays in cache
/// while every row panel of A (8 rows) passes by; `scratch` holds chunk_products::row_scratch_floats(rows, n, k)
/// floats.
template <class T>
void host_row_products(const row_products_problem<T>& p, float* scratch,
                       chunk_products::tile_kernel kernel = chunk_products::pick_tile_kernel()) {
  namespace cp = chunk_products;
  if (p.rows == 0 || p.n == 0) return;
  const std::int64_t mp = (p.rows + cp::tile_m - 1) / cp::tile_m * cp::tile_m;
  float* ap = scratch;                 // [rows / tile_m][k][tile_m]: A's rows as panel columns
  float* b_panel = ap + p.k * mp;      // [k][tile_n]: B's columns [j0, j0 + tile_n)
  float* stage = b_panel + p.k * cp::tile_n;  // one tile, for the edges and for f16/bf16
  cp::pack_panels_transposed(p.a, p.lda, p.rows, p.k, cp::tile_m, ap);
  for (std::int64_t j0 = 0; j0 < p.n; j0 += cp::tile_n) {
    const std::int64_t nb = std::min(cp::tile_n, p.n - j0);
    if (p.b_transposed) {
      cp::pack_panels_transposed(p.b + j0 * p.ldb, p.ldb, nb, p.k, cp::tile_n, b_panel);
    } else {
      cp::pack_panels(p.b + j0, p.ldb, p.k, nb, cp::tile_n, b_panel);
    }
    for (std::int64_t i0 = 0; i0 < p.rows; i0 += cp::tile_m) {
      const float* a_panel = ap + i0 * p.k;
      const std::int64_t mb = std::min(cp::tile_m, p.rows - i0);
      T* c = p.c + i0 * p.ldc + j0;
      if constexpr (std::is_same_v<T, float>) {
        if (mb == cp::tile_m && nb == cp::tile_n) {
          kernel(a_panel, b_panel, p.k, c, p.ldc);  // a whole tile: straight into C
          continue;
        }
      }
      kernel(a_panel, b_panel, p.k, stage, cp::tile_n);
      for (std::int64_t a = 0; a < mb; ++a) {
        if constexpr (std::is_same_v<T, float>) {
          std::copy_n(stage + a * cp::tile_n, nb, c + a * p.ldc);
        } else {
          narrow_run(stage + a * cp::tile_n, c + a * p.ldc, nb);
        }
      }
    }
  }
}

LOCKSTEP_DETAIL_END
