// lockstep/nn/deterministic.hpp — what a layer does in deterministic mode (context::set_deterministic).
//
// The global batch is cut into chunks of chunk_rows rows, counted from its first row (a replica's rows start
// at context::row_offset(), a multiple of chunk_rows). Two rules make a layer's results independent of how
// the batch is split over devices:
//   1. work per row (outputs, input gradients) runs one chunk at a time: a GEMM over a chunk has the same
//      shape wherever the chunk is, so each row gets the same bits (a GEMM's rows can depend on the row count:
//      OpenBLAS picks other kernels for other shapes);
//   2. sums over rows (parameter gradients) are computed per chunk, in floats, and the chunks' partial sums
//      are added exactly (kernels/exact.hpp) into the parameter's accumulator, which integer all-reduces can
//      combine in any order; the sum is rounded into the gradient once, by the layer on one device, or by
//      data_parallel / distributed_data_parallel after they added every device's accumulator.
// `linear` follows both rules; a user's own layer with row sums uses for_each_row_chunk and exact_gradient.
#pragma once

#include <algorithm>
#include <cstdint>

#include "lockstep/blas/chunk_products.hpp"
#include "lockstep/blas/gemm.hpp"
#include "lockstep/config.hpp"
#include "lockstep/kernels/exact.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN

/// Throws precondition_error when the replica's first row (ctx.row_offset()) is not at a chunk boundary of
/// deterministic mode's chunks.
inline void expect_chunk_aligned(const context& ctx, const char* who) {
  const std::int64_t cr = ctx.deterministic()->chunk_rows;
  LOCKSTEP_EXPECTS(ctx.row_offset() % cr == 0, who, ": in deterministic mode a replica's rows start at a multiple of ",
                   "chunk_rows (", cr, "), but they start at row ", ctx.row_offset(),
                   " of the global batch; split batches with deterministic_shard()");
}

/// Calls f(begin, rows) for the chunks of a replica's `rows` rows: one call for all of them outside
/// deterministic mode, else one per chunk of chunk_rows rows (the last may be shorter; none for no rows). Throws
/// precondition_error when the replica's first row (ctx.row_offset()) is not at a chunk boundary.
template <class F>
void for_each_row_chunk(std::int64_t rows, const context& ctx, const char* who, F&& f) {
  if (!ctx.deterministic()) {
    f(std::int64_t{0}, rows);
    return;
  }
  const std::int64_t cr = ctx.deterministic()->chunk_rows;
  if (rows == 0) return;  // a replica without rows this step (its offset may be the batch's end)
  expect_chunk_aligned(ctx, who);
  for (std::int64_t b = 0; b < rows; b += cr) f(b, std::min(cr, rows - b));
}

/// Deterministic mode's products over rows (rule 1): c[r][j] = the sum over kk < k of a[r][kk] * B(kk, j) for the
/// replica's `rows` rows (a [rows, k], c [rows, n]; B is b [k, n], or with tb == transpose::yes b [n, k] used as
/// its transpose), each row's bits independent of how many rows share the call. On a host device one pass over
/// every row: blas/chunk_products.hpp's host_row_products (an element the chain of fused multiply-adds over kk in
/// order), in one piece of work on the stream, with `scratch` (kept by the caller: its packed operands). On a GPU
/// a GEMM per chunk of rows (cuBLAS: one algorithm for one shape on one GPU model). Requires deterministic mode.
/// `rows_per_sample`: each batch row is that many consecutive rows of a and c (a convolution's output pixels), and a
/// GPU's chunks are chunk_rows batch rows (the same bits, fewer GEMMs).
template <class T>
void row_products(context& ctx, const char* who, transpose tb, std::int64_t rows, std::int64_t n, std::int64_t k,
                  const T* a, std::int64_t lda, const T* b, std::int64_t ldb, T* c, std::int64_t ldc, tensor& scratch,
                  std::int64_t rows_per_sample = 1) {
  LOCKSTEP_EXPECTS(ctx.deterministic().has_value(), who, ": row_products needs deterministic mode");
  const stream_ref s = ctx.stream();
  if (!s.get_device().is_host()) {
    const std::int64_t per = rows_per_sample;
    for_each_row_chunk(rows / per, ctx, who, [&](std::int64_t b0, std::int64_t r) {
      const std::int64_t r0 = b0 * per;
      gemm<T>(ctx.blas(), transpose::no, tb, r * per, n, k, 1.0f, a + r0 * lda, lda, b, ldb, 0.0f, c + r0 * ldc, ldc);
    });
    return;
  }
  if (rows == 0 || n == 0) return;
  expect_chunk_aligned(ctx, who);  // (not needed by the products: the sums over rows that follow need it)
  scratch.ensure(shape{detail::chunk_products::row_scratch_floats(rows, n, k)}, dtype::f32, s);
  struct work {
    detail::row_products_problem<T> problem;
    float* scratch;
    void run() const { detail::host_row_products(problem, scratch); }
  };
  const work w{{a, lda, b, ldb, tb == transpose::yes, c, ldc, rows, n, k}, scratch.as<float>()};
  detail::strict_check_functor(w, s.get_device(), who);
  detail::enqueue_host(s, [w] { w.run(); }, "deterministic row products");
}

/// Throws precondition_error unless p's exact gradient sum (or its partial gradients, when a wrapper gathers
/// them) is where the wrapper expects it: a layer that ignores deterministic mode wrote its gradient directly.
inline void expect_exact_gradient(const parameter& p) {
  LOCKSTEP_EXPECTS(p.exact_grad_holds_sum(), "deterministic mode: parameter ", p.name(),
                   " has no exact gradient sum to round: its layer wrote the gradient without exact_gradient "
                   "(a layer of your own follows nn/deterministic.hpp's two rules, as linear does)");
}

/// Queues out[i] = the exact sum held by limbs hi[i] and lo[i], rounded once to `type` (NaN when the tensor's count
/// of terms outside the window, *outside, is not 0), for i < n, in stream order on `s`.
inline void round_exact_limbs(dtype type, const std::int64_t* hi, const std::int64_t* lo, const std::int64_t* outside,
                              void* out, std::size_t n, stream_ref s) {
  dispatch_floating(type, "exact gradient", [&]<class T>() {
    launch_elementwise(n, kernels::exact_round_op<T>{hi, lo, outside, static_cast<T*>(out)}, s, "exact gradient rounding");
  });
}

/// Queues out[i] = the exact sum of partials[c * stride + i] over c < terms, rounded once, for i < n (a whole
/// tensor: NaN everywhere when a term is outside the window, counted in *outside, which must be zero before), in
/// stream order on `s`.
template <class T>
void sum_exact_terms(const T* partials, std::size_t terms, std::size_t stride, std::size_t n, T* out,
                     std::int64_t* outside, stream_ref s) {
  launch_elementwise(n, kernels::exact_sum_op<T>{partials, terms, stride, out, outside}, s, "exact gradient sum");
  launch_elementwise(n, kernels::exact_poison_op<T>{outside, out}, s, "exact gradient sum");
}

/// Writes zeros into slots [from, slots) of p's partial gradients target (parameter::exact_partials_target), in
/// stream order on `s`.
inline void zero_partials_slots(const parameter& p, std::int64_t from, stream_ref s) {
  const parameter::exact_partials& t = p.exact_partials_target();
  const std::size_t es = size_of(p.compute_type()), bytes = static_cast<std::size_t>(p.numel()) * es;
  for (std::int64_t j = from; j < t.slots; ++j) {
    fill_zero(device_span<std::uint8_t>(static_cast<std::uint8_t*>(t.first) + static_cast<std::size_t>(j * t.stride) * es,
                                        bytes, p.get_device()),
              s);
  }
}

/// Rounds elements [r.begin, r.end) of p's exact accumulator into `out` (r.size() values of p's compute type on
/// p's device), in stream order on `s`.
inline void round_exact_gradient(parameter& p, element_range r, const tensor_view& out, stream_ref s) {
  if (r.empty()) return;
  expect_exact_gradient(p);
  const tensor_view acc = p.exact_grad();
  LOCKSTEP_EXPECTS(!acc.empty(), "deterministic mode: parameter ", p.name(), " has no exact accumulator");
  const std::int64_t* words = acc.as<std::int64_t>();
  const auto n = static_cast<std::size_t>(p.numel()), first = static_cast<std::size_t>(r.begin);
  round_exact_limbs(p.compute_type(), words + first, words + n + first, words + 2 * n, out.data(),
                    static_cast<std::size_t>(r.size()), s);
}

/// Rounds p's exact accumulator into its gradient, in stream order on `s`.
inline void round_exact_gradient(parameter& p, stream_ref s) {
  if (p.numel() == 0) return;
  round_exact_gradient(p, element_range{0, p.numel()}, p.grad(), s);
}

/// The per-chunk partial gradients of a layer's parameters, added exactly (rule 2 above). One per layer; it
/// keeps a scratch buffer of at most about 16 MiB (or one chunk's partial, when that is larger).
class exact_gradient {
 public:
  /// For parameter p (gradients of type T): calls partial(begin, rows, destination) for each chunk of the
  /// replica's `rows` rows, which queues on ctx.stream() the chunk's gradient of p (p.numel() values of T,
  /// overwritten) into `destination`; adds the chunks exactly into p's accumulator (over its old contents
  /// unless the gradient is logically zero) and, when ctx.gradient_rounding() is by_layer, rounds the sum into
  /// p's gradient. Requires deterministic mode.
  template <class T, class Partial>
  void accumulate(parameter& p, std::int64_t rows, context& ctx, Partial&& partial) {
    const std::int64_t cr = ctx.deterministic() ? ctx.deterministic()->chunk_rows : 1;
    const auto n = static_cast<std::size_t>(p.numel());
    const std::int64_t chunks = (rows + cr - 1) / cr;
    const std::int64_t budget = std::int64_t{16} << 20;
    const std::int64_t group =
        n == 0 ? 1
               : std::clamp<std::int64_t>(budget / static_cast<std::int64_t>(n * sizeof(T)), 1,
                                          std::max<std::int64_t>(chunks, 1));
    const stream_ref s = ctx.stream();
    const plan pl = begin(p, rows, ctx, group == chunks);
    switch (pl.path) {
      case sum_path::gather:
        for (std::int64_t j = 0; j < chunks; ++j) {
          partial(j * cr, std::min(cr, rows - j * cr),
                  static_cast<T*>(pl.target.first) + static_cast<std::size_t>(j * pl.target.stride));
        }
        zero_partials_slots(p, chunks, s);
        return;
      case sum_path::empty:
        return;
      case sum_path::one_pass:
      case sum_path::accumulate:
        break;
    }
    if (chunks > 0) scratch_.ensure(shape{group * static_cast<std::int64_t>(n)}, dtype_of_v<T>, s);
    // the partial gradients of chunks [c0, c0 + g) into the scratch, side by side
    auto partials = [&](std::int64_t c0, std::int64_t g) {
      for (std::int64_t j = 0; j < g; ++j) {
        const std::int64_t begin = (c0 + j) * cr;
        partial(begin, std::min(cr, rows - begin), scratch_.as<T>() + static_cast<std::size_t>(j) * n);
      }
    };
    if (pl.path == sum_path::one_pass) {  // the whole sum in one pass, straight into the gradient
      partials(0, chunks);
      sum_exact_terms<T>(scratch_.as<T>(), static_cast<std::size_t>(chunks), n, n, p.grad().as<T>(),
                         outside_.as<std::int64_t>(), s);
      return;
    }
    const tensor_view acc = p.exact_grad(s);
    bool overwrite = pl.overwrite;
    for (std::int64_t c0 = 0; c0 < chunks; c0 += group) {
      const std::int64_t g = std::min(group, chunks - c0);
      partials(c0, g);
      launch_elementwise(n,
                         kernels::exact_accumulate_op<T>{scratch_.as<T>(), static_cast<std::size_t>(g), n,
                                                         acc.as<std::int64_t>(), acc.as<std::int64_t>() + n,
                                                         acc.as<std::int64_t>() + 2 * n, overwrite},
                         s, "exact gradient sum");
      overwrite = false;
    }
    if (ctx.gradient_rounding() == exact_rounding::by_layer) round_exact_gradient(p, s);
  }

  /// accumulate() for a parameter p of shape [m, n] whose gradient is the sum over the rows r of the products
  /// g[r][i] * x[r][j] (g [rows, m] with leading dimension ldg, x [rows, n] with ldx, both of type T, on p's
  /// device): a linear layer's weight, G^T X. A chunk's partial is G_c^T X_c. On a host device the chunks'
  /// products are blas/chunk_products.hpp's (an element a chain of fused multiply-adds over its chunk's rows),
  /// each tile summed, accumulated or copied while it is in cache, all in one piece of work on the stream; on a
  /// GPU, a GEMM per chunk (cuBLAS: one algorithm for one shape on one GPU model).
  ///
  /// `rows_per_sample` (a convolution's output pixels per image): each of the replica's `rows` batch rows is that
  /// many consecutive rows of g and x, a chunk's partial then the products over its rows_per_sample * rows.
  template <class T>
  void accumulate_products(parameter& p, std::int64_t rows, context& ctx, const T* g, std::int64_t ldg, const T* x,
                           std::int64_t ldx, std::int64_t rows_per_sample = 1) {
    LOCKSTEP_EXPECTS(p.dims().numel() > 0 && p.dims().rank() >= 2, "exact_gradient::accumulate_products: parameter ",
                     p.name(), " has shape ", p.dims().str(), ", not [m, n, ...]");
    const std::int64_t m = p.dims()[0], n = p.numel() / m, per = rows_per_sample;
    const stream_ref s = ctx.stream();
    if (!s.get_device().is_host()) {
      accumulate<T>(p, rows, ctx, [&](std::int64_t b, std::int64_t r, T* out) {
        gemm<T>(ctx.blas(), transpose::yes, transpose::no, m, n, r * per, 1.0f, g + b * per * ldg, ldg,
                x + b * per * ldx, ldx, 0.0f, out, n);
      });
      return;
    }
    const plan pl = begin(p, rows, ctx, true);
    if (pl.path == sum_path::empty) return;
    const std::int64_t cr = ctx.deterministic()->chunk_rows, chunks = (rows + cr - 1) / cr;
    const detail::chunk_products_problem<T> problem{g, ldg, x, ldx, rows * per, m, n, cr * per};
    const std::int64_t floats = detail::chunk_products::scratch_floats(rows * per, m, n, chunks) +
                                (std::is_same_v<T, float> ? 0 : chunks * detail::chunk_products::block_n);
    scratch_.ensure(shape{floats}, dtype::f32, s);
    float* scratch = scratch_.as<float>();
    const std::size_t total = static_cast<std::size_t>(m * n);
    products_work<T> work{problem, scratch, pl.path, nullptr, 0, nullptr, nullptr, nullptr, pl.overwrite};
    switch (pl.path) {
      case sum_path::gather:
        work.out = static_cast<T*>(pl.target.first);
        work.slot_stride = pl.target.stride;
        break;
      case sum_path::one_pass:
        work.out = p.grad().as<T>();
        work.outside = outside_.as<std::int64_t>();
        break;
      case sum_path::accumulate: {
        const tensor_view acc = p.exact_grad(s);
        work.hi = acc.as<std::int64_t>();
        work.lo = work.hi + total;
        work.outside = work.hi + 2 * total;
        break;
      }
      case sum_path::empty:
        break;
    }
    detail::strict_check_functor(work, s.get_device(), "exact gradient of a product");
    detail::enqueue_host(s, [work] { work.run(); }, "exact gradient of a product (chunk products)");
    if (pl.path == sum_path::gather) {
      zero_partials_slots(p, chunks, s);
    } else if (pl.path == sum_path::one_pass) {
      launch_elementwise(total, kernels::exact_poison_op<T>{outside_.as<std::int64_t>(), p.grad().as<T>()}, s,
                         "exact gradient sum");
    } else if (ctx.gradient_rounding() == exact_rounding::by_layer) {
      round_exact_gradient(p, s);
    }
  }

 private:
  enum class sum_path : std::uint8_t {
    gather,      // distributed_data_parallel gathers the partials: each chunk's into its slot, zeros in the rest
    empty,       // no elements: the accumulator is the count word alone
    one_pass,    // every chunk of the sum here and now: summed straight into the gradient, no accumulator
    accumulate,  // added into the exact accumulator (over it unless `overwrite`)
  };
  struct plan {
    sum_path path;
    bool overwrite;
    parameter::exact_partials target;
  };

  // The checks both entry points make, and which path p's gradient takes; sets what p's exact state will hold,
  // and zeroes what the path adds into (the accumulator's count word, the one-pass sum's count). `whole` says
  // whether every chunk fits one pass (the scratch budget).
  plan begin(parameter& p, std::int64_t rows, context& ctx, bool whole) {
    LOCKSTEP_EXPECTS(ctx.deterministic().has_value(), "exact_gradient: the context is not in deterministic mode");
    const std::int64_t cr = ctx.deterministic()->chunk_rows;
    const std::int64_t last_chunk = (ctx.row_offset() + rows + cr - 1) / cr;
    LOCKSTEP_EXPECTS(last_chunk <= kernels::exact_max_terms, "deterministic mode: the global batch reaches row ",
                     ctx.row_offset() + rows, ", more than ", kernels::exact_max_terms, " chunks of ", cr,
                     " rows (the exact sums take at most that many terms); use a larger chunk_rows");
    const stream_ref s = ctx.stream();
    const std::int64_t chunks = (rows + cr - 1) / cr;
    if (const parameter::exact_partials& target = p.exact_partials_target(); target.slots > 0) {
      const bool first = p.begin_accumulate() == 0.0f;
      LOCKSTEP_EXPECTS(first, "deterministic mode: parameter ", p.name(),
                       " receives a second gradient in one backward, but distributed_data_parallel gathers one partial "
                       "gradient per chunk and parameter when the context knows the global batch; leave "
                       "context::set_global_rows at 0 for this model (the wrapper then adds exact sums)");
      LOCKSTEP_EXPECTS(chunks <= target.slots, "deterministic mode: this rank has ", chunks, " chunks of ", cr,
                       " rows, but a global batch of ", ctx.global_rows(), " rows (context::set_global_rows) gives a "
                       "rank at most ", target.slots, "; split batches with deterministic_shard()");
      // (Both checks fail on the ranks with rows only: the others then fail at the all-gather, by its timeout.)
      p.set_exact_grad_holds_sum(true);  // its partials are in place: the wrapper sums the slots
      return {sum_path::gather, true, target};
    }
    if (p.numel() == 0) {
      (void)p.begin_accumulate();
      fill_zero(p.exact_grad(s).bytes(), s);
      p.set_exact_grad_holds_sum(true);
      return {sum_path::empty, true, {}};
    }
    const bool overwrite = p.begin_accumulate() == 0.0f;
    const bool keep_sums = ctx.gradient_rounding() == exact_rounding::by_wrapper ||
                           ctx.deterministic()->gradients == deterministic_options::accumulation::across_backward_calls;
    LOCKSTEP_EXPECTS(overwrite || p.exact_grad_holds_sum(), "deterministic mode: parameter ", p.name(),
                     " receives a second backward before zero_grad, but the first one rounded its sum without keeping "
                     "it; ",
                     ctx.gradient_rounding() == exact_rounding::by_wrapper
                         ? "call zero_grad before each step's first backward (distributed_data_parallel gathered the "
                           "last step's partial gradients, context::set_global_rows), and no_sync() for micro-batches"
                         : "to accumulate micro-batches exactly, set deterministic_options::gradients to "
                           "accumulation::across_backward_calls");
    if (chunks > 0 && whole && overwrite && !keep_sums) {
      outside_.ensure(shape{1}, dtype::i64, s);
      fill_zero(outside_.view().bytes(), s);
      p.set_exact_grad_holds_sum(false);
      return {sum_path::one_pass, true, {}};
    }
    p.set_exact_grad_holds_sum(true);
    if (overwrite) {
      // the count of terms outside the window (the last word; the kernel adds to it), or all of it without rows
      const tensor_view acc = p.exact_grad(s);
      const std::size_t zeroed = chunks == 0 ? acc.size_bytes() : sizeof(std::int64_t);
      fill_zero(acc.bytes().subspan(acc.size_bytes() - zeroed, zeroed), s);
    }
    return {sum_path::accumulate, overwrite, {}};
  }

  // The host work of accumulate_products: the chunks' products, block by block, into where `where` says.
  template <class T>
  struct products_work {
    detail::chunk_products_problem<T> problem;
    float* scratch;
    sum_path where;
    T* out;                  // gather: the first slot; one_pass: the gradient
    std::int64_t slot_stride;
    std::int64_t* hi;        // accumulate: the accumulator's limbs
    std::int64_t* lo;
    std::int64_t* outside;   // one_pass and accumulate: the count of terms outside the window
    bool overwrite;

    void run() const {
      namespace cp = detail::chunk_products;
      const std::int64_t rows = problem.rows, cr = problem.chunk_rows, chunks = (rows + cr - 1) / cr;
      const std::int64_t n = problem.n;
      if constexpr (std::is_same_v<T, float>) {
        if (where == sum_path::gather) {  // the tiles straight into the slots
          detail::host_chunk_products_into(problem, scratch, out, n, slot_stride);
          return;
        }
      }
      // the terms of the exact sums: the tile itself for floats; for f16 and bf16, a row's chunks rounded to T and
      // kept as floats (the values T partials hold, summed on the floats' vectorized path)
      float* rounded = scratch + cp::scratch_floats(rows, problem.m, n, chunks);
      std::int64_t outside_terms = 0;
      detail::host_chunk_products(problem, scratch, [&](std::int64_t i0, std::int64_t mb, std::int64_t j0,
                                                        std::int64_t nb, const float* tiles, std::int64_t chunk_stride) {
        for (std::int64_t a = 0; a < mb; ++a) {
          const std::int64_t first = (i0 + a) * n + j0;  // the row's first element in the parameter
          const float* row = tiles + a * cp::block_n;     // its chunks' terms, chunk_stride apart
          if (where == sum_path::gather) {
            for (std::int64_t c = 0; c < chunks; ++c) {
              T* dst = out + c * slot_stride + first;
              if constexpr (std::is_same_v<T, float>) {
                std::copy_n(row + c * chunk_stride, nb, dst);
              } else {
                detail::narrow_run(row + c * chunk_stride, dst, nb);
              }
            }
            continue;
          }
          const float* terms = row;
          auto stride = static_cast<std::size_t>(chunk_stride);
          if constexpr (!std::is_same_v<T, float>) {
            for (std::int64_t c = 0; c < chunks; ++c) detail::round_run<T>(row + c * chunk_stride, rounded + c * nb, nb);
            terms = rounded;
            stride = static_cast<std::size_t>(nb);
          }
          if (where == sum_path::one_pass) {
            const auto term = [terms, stride](std::size_t c) { return terms + c * stride; };
            T* const outs[1] = {out + first};
            detail::run_host_loop(static_cast<std::size_t>(nb),
                                  kernels::exact_sums_host_op<float, decltype(term), T>{
                                      term, static_cast<std::size_t>(chunks), outs, 1, &outside_terms});
          } else {
            detail::run_host_loop(static_cast<std::size_t>(nb),
                                  kernels::exact_accumulate_op<float>{terms, static_cast<std::size_t>(chunks), stride,
                                                                      hi + first, lo + first, &outside_terms, overwrite});
          }
        }
      });
      if (outside_terms != 0) *outside += outside_terms;
    }
  };

  tensor scratch_;   // [group, numel] partial gradients; accumulate_products: its packed operands and tiles
  tensor outside_;   // [1] the one-pass sum's count of terms outside the window
};

LOCKSTEP_ABI_END
