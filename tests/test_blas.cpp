// Tests of blas/: gemm against a naive triple loop in double, for f32, f16 and bf16, every transpose
// combination, odd sizes, sizes that cross the host backend's block boundaries, alpha/beta variations and
// padded leading dimensions, on both backends (the CUDA instances skip without a GPU).
//
// Why the comparisons are exact. gemm sums products in fp32 and rounds to T once, at the end. In general its
// error against the exact result is the fp32 accumulation error plus that final rounding (1/2 ulp of T), so
// |got - reference| <= 1 ulp of T for sums whose fp32 error stays below 1/2 ulp of T. The inputs here are
// small integers (exact in f32, f16 and bf16), alpha and beta are -0.5, 0.25 or 1, and every partial sum is
// an integer below 2^24: the fp32 accumulation is exact, in any order and on any hardware. The only rounding
// left is the final one, so the result must EQUAL convert<T>(reference), where the reference is computed in
// double (exact too) and converted to float (exact: a multiple of 0.25 below 2^22). Results are large
// enough (up to ~10^4) that the final rounding to f16 and bf16 really happens. Values are compared as floats:
// the sign of a zero result is not specified (OpenBLAS computes 0 + alpha * AB when beta = 0).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "lockstep/blas/blas_handle.hpp"
#include "lockstep/blas/chunk_products.hpp"
#include "lockstep/blas/gemm.hpp"
#include "lockstep/blas/host_kernels.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/device/query.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/memory.hpp"
#include "test_support.hpp"

using namespace lockstep;
using namespace lockstep_test;

namespace {

template <class T>
std::uint32_t bits_of(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return std::bit_cast<std::uint32_t>(x);
  } else {
    return x.bits;
  }
}

// Small integers in [-4, 4] from a hash of (seed, i): exact in every type, varied, never all zero.
float small_int(std::uint32_t seed, std::int64_t i) {
  std::uint32_t x = seed * 0x9e3779b9u + static_cast<std::uint32_t>(i) * 0x85ebca6bu;
  x ^= x >> 15;
  x *= 0x2c1b3c6du;
  x ^= x >> 12;
  return static_cast<float>(static_cast<int>(x % 9u) - 4);
}

constexpr float nan_value = std::numeric_limits<float>::quiet_NaN();
constexpr float padding_sentinel = 77.0f;  // exact in every type

struct gemm_case {
  transpose ta, tb;
  std::int64_t m, n, k;
  float alpha, beta;
  std::int64_t pad_a = 0, pad_b = 0, pad_c = 0;  // extra columns of the stored matrices

  [[nodiscard]] std::string str() const {
    return detail::concat("ta=", name_of(ta), " tb=", name_of(tb), " m=", m, " n=", n, " k=", k, " alpha=", alpha,
                          " beta=", beta, " pads=", pad_a, ',', pad_b, ',', pad_c);
  }
};

// A row-major stored matrix of floats: `rows` x `cols` values, leading dimension `ld`, padding set to `pad`.
struct stored_matrix {
  std::int64_t rows, cols, ld;
  std::vector<float> values;

  stored_matrix(std::int64_t r, std::int64_t c, std::int64_t extra, float pad)
      : rows(r), cols(c), ld(std::max<std::int64_t>(1, c) + extra),
        values(static_cast<std::size_t>(std::max<std::int64_t>(r, 1) * ld), pad) {}
  float& at(std::int64_t r, std::int64_t c) { return values[static_cast<std::size_t>(r * ld + c)]; }
  [[nodiscard]] float at(std::int64_t r, std::int64_t c) const { return values[static_cast<std::size_t>(r * ld + c)]; }
};

// alpha * op(A) op(B) + beta * C in double, element by element; C is not used when beta == 0 (BLAS
// semantics: it may hold NaN).
class reference {
 public:
  reference(const gemm_case& g, const stored_matrix& a, const stored_matrix& b, const stored_matrix& c)
      : g_(g), c_(c), op_a_(static_cast<std::size_t>(g.m * g.k)), op_bt_(static_cast<std::size_t>(g.n * g.k)) {
    // op(A) as [m, k] and op(B)^T as [n, k], dense, so that a dot product runs over contiguous memory.
    const bool ta = g.ta == transpose::yes, tb = g.tb == transpose::yes;
    for (std::int64_t i = 0; i < g.m; ++i)
      for (std::int64_t p = 0; p < g.k; ++p) op_a_[idx(i * g.k + p)] = ta ? a.at(p, i) : a.at(i, p);
    for (std::int64_t j = 0; j < g.n; ++j)
      for (std::int64_t p = 0; p < g.k; ++p) op_bt_[idx(j * g.k + p)] = tb ? b.at(j, p) : b.at(p, j);
  }

  [[nodiscard]] double at(std::int64_t i, std::int64_t j) const {
    const double* ra = op_a_.data() + i * g_.k;
    const double* rb = op_bt_.data() + j * g_.k;
    double sum = 0;
    for (std::int64_t p = 0; p < g_.k; ++p) sum += ra[p] * rb[p];
    double r = double{g_.alpha} * sum;
    if (g_.beta != 0.0f) r += double{g_.beta} * double{c_.at(i, j)};
    return r;
  }

 private:
  static std::size_t idx(std::int64_t i) { return static_cast<std::size_t>(i); }
  gemm_case g_;
  const stored_matrix& c_;
  std::vector<double> op_a_, op_bt_;
};

// Which elements of a large C are compared with the reference (it costs k operations per element): whole
// rows and whole columns, every 31st and those on both sides of each host block boundary, so that every
// pair of row block and column block is visited. Small products are compared in full.
bool checked_index(std::int64_t i, std::int64_t extent, std::int64_t block) {
  const std::int64_t in_block = i % block;
  return i % 31 == 0 || in_block <= 1 || in_block >= block - 2 || i >= extent - 2;
}

// Runs one GEMM on `h` and checks C against the reference (every element, or rows and columns through
// every block of a large C), and that the padding of C (columns n..ldc-1) kept its bits. A and B carry NaN
// in their padding, C carries NaN where beta == 0, so reading either shows up as a wrong result.
template <class T>
void check_gemm(blas_handle& h, const gemm_case& g, std::uint32_t seed) {
  SCOPED_TRACE(g.str());
  const stream_ref s = h.stream();
  const bool ta = g.ta == transpose::yes, tb = g.tb == transpose::yes;
  stored_matrix a(ta ? g.k : g.m, ta ? g.m : g.k, g.pad_a, nan_value);
  stored_matrix b(tb ? g.n : g.k, tb ? g.k : g.n, g.pad_b, nan_value);
  stored_matrix c(g.m, g.n, g.pad_c, padding_sentinel);
  for (std::int64_t r = 0; r < a.rows; ++r)
    for (std::int64_t col = 0; col < a.cols; ++col) a.at(r, col) = small_int(seed, r * a.cols + col);
  for (std::int64_t r = 0; r < b.rows; ++r)
    for (std::int64_t col = 0; col < b.cols; ++col) b.at(r, col) = small_int(seed + 1, r * b.cols + col);
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t col = 0; col < c.cols; ++col) {
      c.at(r, col) = g.beta == 0.0f ? nan_value : 2.0f * small_int(seed + 2, r * c.cols + col);
    }

  const auto c_initial = from_floats<T>(c.values);
  auto da = to_device(from_floats<T>(a.values), s);
  auto db = to_device(from_floats<T>(b.values), s);
  auto dc = to_device(c_initial, s);
  gemm<T>(h, g.ta, g.tb, g.m, g.n, g.k, g.alpha, da.data(), a.ld, db.data(), b.ld, g.beta, dc.data(), c.ld);
  const auto got = to_vector(device_span<const T>(dc.span()), s);

  const reference ref(g, a, b, c);
  const bool sample = g.m * g.n * g.k > 20'000'000;
  const auto blocks = detail::host_blocking::for_problem(g.m, g.n, g.k);
  std::int64_t wrong = 0, padding_written = 0, compared = 0;
  std::string first;
  for (std::int64_t i = 0; i < g.m; ++i) {
    const bool whole_row = !sample || checked_index(i, g.m, blocks.rows);
    for (std::int64_t j = 0; j < c.ld; ++j) {
      const auto at = static_cast<std::size_t>(i * c.ld + j);
      if (j >= g.n) {
        if (bits_of(got[at]) != bits_of(c_initial[at])) ++padding_written;
        continue;
      }
      if (!whole_row && !checked_index(j, g.n, blocks.cols)) continue;
      ++compared;
      const double r = ref.at(i, j);
      const float expected = to_float(convert<T>(static_cast<float>(r)));
      if (!(to_float(got[at]) == expected)) {
        if (wrong++ == 0) {
          first = detail::concat("C[", i, ", ", j, "] = ", to_float(got[at]), ", expected ", expected,
                                 " (reference ", r, ")");
        }
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "first wrong element: " << first;
  EXPECT_EQ(padding_written, 0) << "elements of C beyond column n were written";
  EXPECT_GE(compared, std::min<std::int64_t>(g.m * g.n, 1000));  // the check checked something
}

constexpr transpose both[] = {transpose::no, transpose::yes};

struct alpha_beta {
  float alpha, beta;
};
constexpr alpha_beta scalings[] = {{1.0f, 0.0f}, {-0.5f, 1.0f}, {1.0f, 0.25f}, {-0.5f, 0.0f}, {1.0f, 1.0f}};

// Parameterized over the backend and a floating dtype; the CUDA instances skip without a GPU.
class blas_test : public backend_and_dtype {};

}  // namespace

INSTANTIATE_TEST_SUITE_P(all, blas_test,
                         ::testing::Combine(::testing::Values(device_kind::host, device_kind::cuda),
                                            ::testing::Values(dtype::f32, dtype::f16, dtype::bf16)),
                         param_name);

namespace {

// Each of 1, 7, 33, 65, 130, 257 as m, as n and as k, every transpose, the alpha/beta scalings, half of the cases
// with leading dimensions above the minimum.
template <class T>
void check_odd_sizes(blas_handle& h) {
  const std::int64_t shapes[][3] = {{1, 1, 1},    {7, 33, 65},   {33, 65, 130}, {65, 130, 257}, {130, 257, 1},
                                    {257, 1, 7},  {1, 257, 33},  {33, 7, 257},  {257, 130, 65}, {130, 65, 7}};
  std::uint32_t seed = 1;
  for (transpose ta : both) {
    for (transpose tb : both) {
      for (const auto& shape : shapes) {
        const alpha_beta ab = scalings[seed % std::size(scalings)];
        gemm_case g{ta, tb, shape[0], shape[1], shape[2], ab.alpha, ab.beta};
        if (seed % 2 == 0) {
          g.pad_a = 3;
          g.pad_b = 1;
          g.pad_c = 2;
        }
        check_gemm<T>(h, g, seed++);
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

// The host fp16/bf16 GEMM works in blocks of at most 1024 rows and 1024 columns; these sizes cross each
// boundary, alone and together (1030 rows are two blocks of 515). Depth blocks need sizes too large for a
// test (the depth gets what 6 MiB of scratch leaves): host_blocking.* below covers them with small blocks.
template <class T>
void check_block_boundaries(blas_handle& h) {
  using blocking = detail::host_blocking;
  static_assert(blocking::max_rows < 1030 && blocking::max_cols < 1030,
                "the sizes below no longer cross the block boundaries");
  struct big_case {
    std::int64_t m, n, k;
    transpose ta, tb;
    alpha_beta ab;
    std::int64_t pad;
  };
  const big_case cases[] = {
      {300, 513, 600, transpose::yes, transpose::yes, {-0.5f, 0.25f}, 5},
      {65, 33, 600, transpose::no, transpose::no, {1.0f, 0.0f}, 0},
      {1030, 33, 65, transpose::no, transpose::yes, {1.0f, 1.0f}, 3},   // rows
      {33, 1030, 65, transpose::yes, transpose::no, {-0.5f, 0.0f}, 1},  // columns
      {1030, 20, 300, transpose::yes, transpose::no, {1.0f, 0.25f}, 0}, // rows (B serves both)
      {20, 1030, 300, transpose::no, transpose::yes, {-0.5f, 1.0f}, 2}, // columns
      {1030, 1030, 8, transpose::no, transpose::no, {1.0f, 0.0f}, 0},   // rows and columns
      {1030, 1030, 260, transpose::yes, transpose::no, {-0.5f, 0.25f}, 1},
  };
  std::uint32_t seed = 100;
  for (const auto& c : cases) {
    check_gemm<T>(h, gemm_case{c.ta, c.tb, c.m, c.n, c.k, c.ab.alpha, c.ab.beta, c.pad, c.pad, c.pad}, seed++);
    if (::testing::Test::HasFailure()) return;
  }
}

}  // namespace

TEST_P(blas_test, gemm_matches_the_reference_for_every_transpose_and_odd_sizes) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    blas_handle h(s);
    check_odd_sizes<T>(h);
  });
}

TEST_P(blas_test, gemm_is_exact_across_the_host_block_boundaries) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    blas_handle h(s);
    check_block_boundaries<T>(h);
  });
}

// ---- host kernels: the table, and every kernel this CPU has, forced -------------------------------------------

namespace {

// Every plan a host handle can be given on this machine: OpenBLAS, and with oneDNN its f32 matmul, its bf16
// matmul where the instruction set oneDNN generates for multiplies bf16, and f16/bf16 through f32 blocks on each
// f32 kernel.
std::vector<host_gemm_plan> plans_this_machine_runs() {
  using k = host_gemm_kernel;
  std::vector<host_gemm_plan> plans{host_gemm_plan{k::openblas, k::via_f32, k::via_f32}};
  if (LOCKSTEP_HAS_ONEDNN) {
    const host_isa isa = host_gemm_plan::linked_isa();
    plans.push_back(host_gemm_plan{k::onednn, k::via_f32, k::via_f32, isa});
    if (isa >= host_isa::avx512_bf16) plans.push_back(host_gemm_plan{k::onednn, k::onednn, k::via_f32, isa});
  }
  return plans;
}

std::string plan_name(const host_gemm_plan& p) {
  return detail::concat("f32 ", name_of(p.f32), ", bf16 ", name_of(p.bf16), ", f16 ", name_of(p.f16));
}

}  // namespace

TEST(host_gemm_kernels, the_table_maps_instruction_sets_to_kernels_and_the_users_choice_wins) {
  using k = host_gemm_kernel;
  using r = host_gemm_request;
  struct row {
    host_isa isa;
    bool onednn;
    r request;
    k f32, bf16, f16;
  };
  const row table[] = {
      {host_isa::amx, true, r::automatic, k::onednn, k::onednn, k::via_f32},
      {host_isa::avx512_bf16, true, r::automatic, k::onednn, k::onednn, k::via_f32},
      {host_isa::avx512, true, r::automatic, k::onednn, k::via_f32, k::via_f32},
      {host_isa::avx2, true, r::automatic, k::onednn, k::via_f32, k::via_f32},
      {host_isa::baseline, true, r::automatic, k::openblas, k::via_f32, k::via_f32},
      {host_isa::baseline, false, r::automatic, k::openblas, k::via_f32, k::via_f32},
      // without oneDNN in the build, every instruction set runs OpenBLAS
      {host_isa::avx2, false, r::automatic, k::openblas, k::via_f32, k::via_f32},
      {host_isa::avx512, false, r::automatic, k::openblas, k::via_f32, k::via_f32},
      {host_isa::amx, false, r::automatic, k::openblas, k::via_f32, k::via_f32},
      {host_isa::amx, false, r::openblas, k::openblas, k::via_f32, k::via_f32},
      {host_isa::amx, true, r::openblas, k::openblas, k::via_f32, k::via_f32},
      {host_isa::baseline, true, r::onednn, k::onednn, k::via_f32, k::via_f32},
      {host_isa::avx512_bf16, true, r::onednn, k::onednn, k::onednn, k::via_f32},
  };
  for (const row& t : table) {
    SCOPED_TRACE(detail::concat(name_of(t.isa), t.onednn ? " with" : " without", " oneDNN, request ",
                                static_cast<int>(t.request)));
    const host_gemm_plan p = host_gemm_plan::choose(t.isa, t.onednn, t.request);
    EXPECT_EQ(p.f32, t.f32);
    EXPECT_EQ(p.bf16, t.bf16);
    EXPECT_EQ(p.f16, t.f16);
    EXPECT_EQ(p.isa, t.isa);
  }
  EXPECT_CONTAINS(message_of<precondition_error>(
                      [] { (void)host_gemm_plan::choose(host_isa::avx2, false, host_gemm_request::onednn); }),
                  "built without oneDNN");
  EXPECT_EQ(host_gemm_plan::parse_request(nullptr), r::automatic);
  EXPECT_EQ(host_gemm_plan::parse_request("auto"), r::automatic);
  EXPECT_EQ(host_gemm_plan::parse_request("openblas"), r::openblas);
  EXPECT_EQ(host_gemm_plan::parse_request("onednn"), r::onednn);
  EXPECT_CONTAINS(message_of<precondition_error>([] { (void)host_gemm_plan::parse_request("mkl"); }),
                  "LOCKSTEP_HOST_GEMM='mkl' is not a host GEMM choice: use auto");
}

TEST(host_gemm_kernels, openblas_kernels_below_the_cpu_are_recognized_and_the_report_warns) {
  EXPECT_TRUE(host_gemm_plan::openblas_below("Prescott", host_isa::amx));
  EXPECT_TRUE(host_gemm_plan::openblas_below("Haswell", host_isa::avx512));
  EXPECT_TRUE(host_gemm_plan::openblas_below("Sandybridge", host_isa::avx2));
  EXPECT_FALSE(host_gemm_plan::openblas_below("SkylakeX", host_isa::avx512_bf16));
  EXPECT_FALSE(host_gemm_plan::openblas_below("Zen", host_isa::avx2));
  EXPECT_FALSE(host_gemm_plan::openblas_below("Prescott", host_isa::baseline));
  // This process's report names the kernels of every dtype and the CPU.
  const std::string line = host_gemm_plan::process().str();
  EXPECT_CONTAINS(line, "f32 ");
  EXPECT_CONTAINS(line, "CPU: ");
  const bool below = host_gemm_plan::openblas_below(host_gemm_plan::openblas_core(),
                                                    host_cpu_features::detect().isa());
  const host_gemm_plan forced{host_gemm_kernel::openblas, host_gemm_kernel::via_f32, host_gemm_kernel::via_f32,
                              host_isa::baseline, host_gemm_request::openblas};
  EXPECT_EQ(forced.str().find("WARNING") != std::string::npos, below) << forced.str();
}

TEST(host_gemm_kernels, the_process_runs_onednn_wherever_it_generates_avx2_or_better) {
  const host_gemm_plan& p = host_gemm_plan::process();
  if (std::getenv("LOCKSTEP_HOST_GEMM")) GTEST_SKIP() << "LOCKSTEP_HOST_GEMM is set: the user's choice, not the table";
  const host_isa cpu = host_cpu_features::detect().isa();
  if (!LOCKSTEP_HAS_ONEDNN) {
    EXPECT_EQ(p.f32, host_gemm_kernel::openblas);
    EXPECT_EQ(p.isa, host_isa::baseline);
    return;
  }
  // oneDNN never generates code beyond the CPU's own instruction sets, and ONEDNN_MAX_CPU_ISA lowers them.
  EXPECT_LE(p.isa, cpu);
  // The caps CTest runs this binary under (tests/CMakeLists.txt), each the highest instruction set of a CPU family.
  const char* max_isa = std::getenv("ONEDNN_MAX_CPU_ISA");
  const std::pair<std::string_view, host_isa> caps[] = {{"AVX2", host_isa::avx2},
                                                        {"AVX512_CORE", host_isa::avx512},
                                                        {"AVX512_CORE_BF16", host_isa::avx512_bf16},
                                                        {"AVX512_CORE_AMX", host_isa::amx}};
  const auto cap = std::find_if(std::begin(caps), std::end(caps),
                                [&](const auto& c) { return max_isa && c.first == max_isa; });
  const bool uncapped = !max_isa || !*max_isa || std::string_view(max_isa) == "ALL";
  // (under another of oneDNN's caps, AVX512_CORE_VNNI say, only the bound above and the kernels below are checked)
  if (cap != std::end(caps)) {
    EXPECT_EQ(p.isa, std::min(cpu, cap->second));
  } else if (uncapped) {
    EXPECT_EQ(p.isa, cpu) << "oneDNN generates " << name_of(p.isa) << " code on a CPU with " << name_of(cpu);
  }
  EXPECT_EQ(p.f32, p.isa >= host_isa::avx2 ? host_gemm_kernel::onednn : host_gemm_kernel::openblas);
  EXPECT_EQ(p.bf16, p.isa >= host_isa::avx512_bf16 ? host_gemm_kernel::onednn : host_gemm_kernel::via_f32);
  EXPECT_EQ(p.f16, host_gemm_kernel::via_f32);
}

TEST(host_gemm_kernels, every_kernel_this_cpu_has_gives_the_exact_product) {
  const device d{device_kind::host, 0};
  for (const host_gemm_plan& plan : plans_this_machine_runs()) {
    SCOPED_TRACE(plan_name(plan));
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
      SCOPED_TRACE(name_of(t));
      with_float_type(t, [&]<class T>() {
        stream s(d);
        blas_handle h(s, plan);
        check_odd_sizes<T>(h);
        check_block_boundaries<T>(h);
      });
      if (::testing::Test::HasFailure()) return;
    }
  }
}

#if LOCKSTEP_HAS_ONEDNN
TEST(host_gemm_kernels, onednn_has_a_kernel_that_is_not_its_reference_loop_for_every_layout_the_layers_use) {
  // A oneDNN that fell back to its reference loop (or had no kernel) for these would make gemm() take the other
  // path silently: the exactness tests would still pass, on the wrong kernel.
  const host_isa isa = host_gemm_plan::linked_isa();
  if (isa < host_isa::avx2) GTEST_SKIP() << "oneDNN generates " << name_of(isa) << " code: the table uses OpenBLAS";
  std::vector<dtype> types{dtype::f32};
  if (isa >= host_isa::avx512_bf16) types.push_back(dtype::bf16);
  const std::int64_t shapes[][3] = {{128, 1024, 784}, {1024, 784, 128}, {64, 10, 1024}, {7, 33, 65}, {1, 1, 1}};
  for (dtype t : types)
    for (const auto& sh : shapes)
      for (bool ta : {false, true})
        for (bool tb : {false, true})
          for (float beta : {0.0f, 1.0f}) {
            const std::int64_t m = sh[0], n = sh[1], k = sh[2];
            const auto key = detail::onednn_matmul_key::make(t, ta, tb, m, n, k, (ta ? m : k) + 3, (tb ? k : n) + 1,
                                                             n + 2, 1.0f, beta);
            const detail::onednn_matmul mm(key);
            EXPECT_TRUE(mm.usable()) << name_of(t) << " ta=" << ta << " tb=" << tb << " " << m << "x" << n << "x" << k
                                     << " beta=" << beta << ": " << mm.implementation();
          }
}

TEST(host_gemm_kernels, a_onednn_handle_keeps_its_matmuls_by_shape_and_their_scratchpad_in_device_memory) {
  const device d{device_kind::host, 0};
  stream s(d);
  const host_isa isa = host_gemm_plan::linked_isa();
  blas_handle h(s, host_gemm_plan{host_gemm_kernel::onednn, isa >= host_isa::avx512_bf16 ? host_gemm_kernel::onednn
                                                                                          : host_gemm_kernel::via_f32,
                                  host_gemm_kernel::via_f32, isa});
  const std::int64_t m = 64, n = 96, k = 80;
  auto a = to_device(std::vector<float>(static_cast<std::size_t>(m * k), 1.0f), s);
  auto b = to_device(std::vector<float>(static_cast<std::size_t>(k * n), 0.5f), s);
  auto c = to_device(std::vector<float>(static_cast<std::size_t>(m * n), 0.0f), s);
  gemm<float>(h, transpose::no, transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
  EXPECT_EQ(h.onednn_cache().size(), 1u);
  gemm<float>(h, transpose::no, transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
  EXPECT_EQ(h.onednn_cache().size(), 1u);  // the same shape: the same matmul
  gemm<float>(h, transpose::no, transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n, 1.0f, c.data(), n);
  EXPECT_EQ(h.onednn_cache().size(), 2u);  // another beta: another matmul
  const auto got = to_vector(device_span<const float>(c.span()), s);
  EXPECT_EQ(got.front(), 80.0f);  // 40 + 40
  EXPECT_EQ(got.back(), 80.0f);
}
#endif

TEST(host_blocking, the_scratch_stays_within_6_MiB_and_the_depth_takes_what_it_leaves) {
  using blocking = detail::host_blocking;
  const std::int64_t sizes[] = {1, 7, 128, 256, 784, 1000, 1024, 1025, 2048, 3000, 100000};
  for (std::int64_t m : sizes)
    for (std::int64_t n : sizes)
      for (std::int64_t k : sizes) {
        const auto b = blocking::for_problem(m, n, k);
        SCOPED_TRACE(detail::concat("m=", m, " n=", n, " k=", k, " -> ", b.rows, " x ", b.cols, " x ", b.depth));
        ASSERT_LE(b.scratch_floats(), static_cast<std::size_t>(blocking::max_scratch_floats));
        ASSERT_TRUE(b.rows >= 1 && b.rows <= std::min(m, blocking::max_rows));
        ASSERT_TRUE(b.cols >= 1 && b.cols <= std::min(n, blocking::max_cols));
        ASSERT_TRUE(b.depth >= 1 && b.depth <= k);
        // whole, or split into equal blocks of at most what the budget leaves (at least 256): never slivers
        ASSERT_TRUE(b.depth == k || b.depth > blocking::min_depth / 2);
      }
  EXPECT_EQ(blocking::max_scratch_floats * 4, 6 << 20);
  // the largest blocks keep a depth of 256; a training step's GEMMs at batch 128 take the whole depth
  EXPECT_EQ(blocking::for_problem(1024, 2048, 2048).depth, 256);
  EXPECT_EQ(blocking::for_problem(128, 1024, 1024).depth, 1024);
  EXPECT_EQ(blocking::for_problem(1024, 784, 128).depth, 128);
}

TEST(host_blocking, blocks_of_every_dimension_and_their_remainders_give_the_exact_product) {
  // The blocked loop with small blocks (7 rows, 9 columns, 5 of depth; the problem sizes leave remainders),
  // every transpose, small integer values (exact sums): C must be the correctly rounded exact product. Where the
  // plan takes oneDNN for f32, twice: the whole blocks on oneDNN matmuls (first and further depth blocks; the
  // remainders on sgemm), then all on sgemm.
  const detail::host_blocking small{7, 9, 5};
  auto check = [&]<class T>(bool matmuls) {
    std::uint32_t seed = 500;
    for (transpose ta : {transpose::no, transpose::yes})
      for (transpose tb : {transpose::no, transpose::yes})
        for (float beta : {0.0f, 0.5f}) {
          detail::host_block_matmuls mms;
#if LOCKSTEP_HAS_ONEDNN
          detail::onednn_matmuls cache;
          if (matmuls) {
            mms = detail::host_block_matmuls::make(cache, ta, tb, small, 17);
            ASSERT_TRUE(mms.first && mms.more) << "oneDNN has no f32 matmul for the blocks";
          }
#else
          (void)matmuls;
#endif
          std::vector<float> scratch(mms.scratch_floats(small));
          mms.use_scratch(scratch.data(), small);
          const gemm_case g{ta, tb, 23, 20, 17, -0.5f, beta, 1, 2, 3};
          SCOPED_TRACE(g.str());
          const bool tra = ta == transpose::yes, trb = tb == transpose::yes;
          stored_matrix a(tra ? g.k : g.m, tra ? g.m : g.k, g.pad_a, nan_value);
          stored_matrix b(trb ? g.n : g.k, trb ? g.k : g.n, g.pad_b, nan_value);
          stored_matrix c(g.m, g.n, g.pad_c, padding_sentinel);
          for (auto* x : {&a, &b, &c})
            for (std::int64_t r = 0; r < x->rows; ++r)
              for (std::int64_t col = 0; col < x->cols; ++col) x->at(r, col) = small_int(seed, r * 1000 + col);
          ++seed;
          const auto ha = from_floats<T>(a.values), hb = from_floats<T>(b.values);
          auto hc = from_floats<T>(c.values);
          const detail::gemm_problem<T> p{ta,     tb,     g.m,  g.n,       g.k,  g.alpha, ha.data(), a.ld,
                                          hb.data(), b.ld, g.beta, hc.data(), c.ld};
          detail::gemm_host_blocked(p, small, scratch.data(), host_gemm_plan::process().f32, mms);
          const reference ref(g, a, b, c);
          for (std::int64_t i = 0; i < g.m; ++i)
            for (std::int64_t j = 0; j < c.ld; ++j) {
              const float got = to_float(hc[static_cast<std::size_t>(i * c.ld + j)]);
              const float want = j < g.n ? to_float(convert<T>(static_cast<float>(ref.at(i, j)))) : padding_sentinel;
              ASSERT_EQ(got, want) << "C[" << i << ", " << j << "]";
            }
        }
  };
  // (matmuls where the process's plan takes oneDNN for f32: an instruction set it generates code for)
  const bool onednn = host_gemm_plan::process().f32 == host_gemm_kernel::onednn;
  for (bool matmuls : {false, onednn}) {
    SCOPED_TRACE(matmuls ? "whole blocks on oneDNN matmuls" : "every block on sgemm");
    check.template operator()<lockstep::half>(matmuls);
    check.template operator()<bfloat16>(matmuls);
  }
}

TEST_P(blas_test, k_zero_or_alpha_zero_scales_c_without_reading_a_or_b) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    blas_handle h(s);
    const std::int64_t m = 5, n = 7, ldc = 9;
    std::vector<float> c0(static_cast<std::size_t>(m * ldc));
    for (std::size_t i = 0; i < c0.size(); ++i) c0[i] = small_int(7, static_cast<std::int64_t>(i)) * 2.0f + 1.0f;
    // A and B full of NaN: reading them would poison C.
    auto nan_a = to_device(from_floats<T>(std::vector<float>(static_cast<std::size_t>(m * 3), nan_value)), s);
    auto nan_b = to_device(from_floats<T>(std::vector<float>(static_cast<std::size_t>(3 * n), nan_value)), s);
    for (float beta : {0.0f, 1.0f, 0.25f, -0.5f}) {
      for (bool k_zero : {true, false}) {
        SCOPED_TRACE(detail::concat("beta=", beta, k_zero ? " k=0 (a = b = nullptr)" : " alpha=0 (A, B NaN)"));
        std::vector<float> start = c0;
        if (beta == 0.0f) {
          for (std::int64_t i = 0; i < m; ++i)
            for (std::int64_t j = 0; j < n; ++j) start[static_cast<std::size_t>(i * ldc + j)] = nan_value;
        }
        auto dc = to_device(from_floats<T>(start), s);
        if (k_zero) {
          gemm<T>(h, transpose::no, transpose::no, m, n, 0, 1.0f, nullptr, 1, nullptr, n, beta, dc.data(), ldc);
        } else {
          gemm<T>(h, transpose::no, transpose::no, m, n, 3, 0.0f, nan_a.data(), 3, nan_b.data(), n, beta, dc.data(),
                  ldc);
        }
        const auto got = to_vector(device_span<const T>(dc.span()), s);
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t j = 0; j < ldc; ++j) {
            const auto idx = static_cast<std::size_t>(i * ldc + j);
            const float expected = j >= n ? c0[idx] : (beta == 0.0f ? 0.0f : beta * c0[idx]);
            ASSERT_EQ(to_float(got[idx]), expected) << "C[" << i << ", " << j << "]";
          }
        }
      }
    }
  });
}

TEST_P(blas_test, an_empty_c_is_left_alone) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    blas_handle h(s);
    const std::vector<float> sentinel(12, padding_sentinel);
    auto a = to_device(from_floats<T>(sentinel), s);
    auto c = to_device(from_floats<T>(sentinel), s);
    gemm<T>(h, transpose::no, transpose::no, 0, 3, 4, 1.0f, a.data(), 4, a.data(), 3, 0.0f, c.data(), 3);  // m = 0
    gemm<T>(h, transpose::no, transpose::no, 3, 0, 4, 1.0f, a.data(), 4, a.data(), 1, 0.0f, c.data(), 1);  // n = 0
    gemm<T>(h, transpose::yes, transpose::yes, 0, 0, 0, 1.0f, nullptr, 1, nullptr, 1, 0.0f, nullptr, 1);
    const auto got = to_vector(device_span<const T>(c.span()), s);
    for (const T& x : got) ASSERT_EQ(to_float(x), padding_sentinel);
  });
}

TEST_P(blas_test, invalid_arguments_are_rejected_with_the_argument_its_value_and_the_valid_range) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    blas_handle h(s);
    auto buf = to_device(from_floats<T>(std::vector<float>(64, 1.0f)), s);
    T* p = buf.data();
    const transpose no = transpose::no, yes = transpose::yes;

    auto msg = message_of<precondition_error>([&] { gemm<T>(h, no, no, -1, 2, 2, 1.0f, p, 2, p, 2, 0.0f, p, 2); });
    EXPECT_CONTAINS(msg, "gemm: invalid m = -1");
    EXPECT_CONTAINS(msg, "must be >= 0");
    msg = message_of<precondition_error>([&] { gemm<T>(h, no, no, 2, 2, -3, 1.0f, p, 2, p, 2, 0.0f, p, 2); });
    EXPECT_CONTAINS(msg, "gemm: invalid k = -3");
    msg = message_of<precondition_error>([&] { gemm<T>(h, no, no, 7, 2, 9, 1.0f, p, 5, p, 2, 0.0f, p, 2); });
    EXPECT_CONTAINS(msg, "gemm: invalid lda = 5");
    EXPECT_CONTAINS(msg, "A is stored row-major as m x k = 7 x 9, so lda must be >= max(1, k) = 9");
    msg = message_of<precondition_error>([&] { gemm<T>(h, yes, no, 7, 2, 3, 1.0f, p, 6, p, 2, 0.0f, p, 2); });
    EXPECT_CONTAINS(msg, "with ta = yes, A is stored row-major as k x m = 3 x 7, so lda must be >= max(1, m) = 7");
    msg = message_of<precondition_error>([&] { gemm<T>(h, no, yes, 2, 4, 3, 1.0f, p, 3, p, 2, 0.0f, p, 4); });
    EXPECT_CONTAINS(msg, "gemm: invalid ldb = 2");
    EXPECT_CONTAINS(msg, "ldb must be >= max(1, k) = 3");
    msg = message_of<precondition_error>([&] { gemm<T>(h, no, no, 2, 4, 3, 1.0f, p, 3, p, 4, 0.0f, p, 3); });
    EXPECT_CONTAINS(msg, "gemm: invalid ldc = 3");
    EXPECT_CONTAINS(msg, "ldc must be >= max(1, n) = 4");
    msg = message_of<precondition_error>([&] { gemm<T>(h, no, no, 0, 4, 3, 1.0f, p, 0, p, 4, 0.0f, p, 4); });
    EXPECT_CONTAINS(msg, "lda must be >= max(1, k) = 3");  // checked even when there is nothing to compute
    msg = message_of<precondition_error>([&] { gemm<T>(h, no, no, 2, 2, 2, 1.0f, nullptr, 2, p, 2, 0.0f, p, 2); });
    EXPECT_CONTAINS(msg, "gemm: a is null but op(A) is m x k = 2 x 2");
    msg = message_of<precondition_error>([&] { gemm<T>(h, no, no, 2, 2, 2, 1.0f, p, 2, p, 2, 0.0f, nullptr, 2); });
    EXPECT_CONTAINS(msg, "gemm: c is null");
    s.synchronize();  // nothing was queued, and nothing failed
  });
}

TEST_P(blas_test, the_steady_state_allocates_nothing) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    blas_handle h(s);
    const std::int64_t m = 300, n = 513, k = 600;
    auto a = to_device(from_floats<T>(std::vector<float>(static_cast<std::size_t>(m * k), 1.0f)), s);
    auto b = to_device(from_floats<T>(std::vector<float>(static_cast<std::size_t>(k * n), 0.5f)), s);
    auto c = to_device(from_floats<T>(std::vector<float>(static_cast<std::size_t>(m * n), 0.0f)), s);
    auto step = [&] {  // what a training step repeats
      gemm<T>(h, transpose::no, transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n, 1.0f, c.data(), n);
      // A smaller product reuses the scratch memory too.
      gemm<T>(h, transpose::yes, transpose::no, 100, n, 64, 1.0f, a.data(), 100, b.data(), n, 0.0f, c.data(), n);
    };
    gemm<T>(h, transpose::no, transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
    step();  // the first step: a oneDNN matmul takes its scratchpad from the scratch memory when first created
    s.synchronize();
    const std::size_t scratch = h.scratch_size();
    if (kind() == device_kind::host && !std::is_same_v<T, float>) {
      EXPECT_GT(scratch, 0u);  // the scratch memory is in use
    }
    const memory_stats before = get_memory_stats(dev());
    for (int i = 0; i < 3; ++i) step();
    s.synchronize();
    const memory_stats after = get_memory_stats(dev());
    EXPECT_EQ(after.allocations, before.allocations);
    EXPECT_EQ(after.system_allocations, before.system_allocations);
    EXPECT_EQ(h.scratch_size(), scratch);
  });
}

TEST_P(blas_test, a_handle_belongs_to_its_stream_and_moves) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    blas_handle first(s);
    EXPECT_TRUE(first.stream() == s.ref());
    EXPECT_EQ(first.get_device(), dev());
    blas_handle h(std::move(first));  // the moved-to handle keeps the stream (and the cuBLAS handle)
    EXPECT_TRUE(h.stream() == s.ref());
    check_gemm<T>(h, gemm_case{transpose::no, transpose::yes, 9, 10, 11, 1.0f, 0.0f}, 3);
    blas_handle other(s);
    other = std::move(h);
    check_gemm<T>(other, gemm_case{transpose::yes, transpose::no, 12, 5, 300, -0.5f, 1.0f}, 4);
  });
}

TEST(blas_host, host_handles_make_openblas_single_threaded) {
  stream s(device{device_kind::host, 0});
  blas_handle h(s);
  EXPECT_EQ(openblas_get_num_threads(), 1);
}

TEST(blas_host, two_host_devices_multiply_at_the_same_time) {
  if (device_count(device_kind::host) < 2) GTEST_SKIP() << "needs two host devices";
  // Each device's worker calls OpenBLAS concurrently, with its own scratch memory.
  stream s0(device{device_kind::host, 0}), s1(device{device_kind::host, 1});
  blas_handle h0(s0), h1(s1);
  std::thread other([&] {
    for (std::uint32_t seed = 0; seed < 4; ++seed)
      check_gemm<lockstep::half>(h1, gemm_case{transpose::no, transpose::no, 200, 150, 300, 1.0f, 0.25f}, 40 + seed);
  });
  for (std::uint32_t seed = 0; seed < 4; ++seed)
    check_gemm<bfloat16>(h0, gemm_case{transpose::yes, transpose::yes, 150, 200, 300, -0.5f, 0.0f}, 50 + seed);
  other.join();
}

TEST(blas_host, vectorized_conversions_give_the_bits_of_core_half) {
  // The host GEMM converts with its own branch-free (or AVX2/F16C) code: it must round exactly like
  // convert<T>. Every 16-bit pattern is widened; floats are narrowed over a sweep of all exponents plus
  // windows around every boundary (the largest half, 65520, the subnormal and zero thresholds, infinities).
  std::vector<lockstep::half> halves(1 << 16);
  std::vector<bfloat16> bfloats(1 << 16);
  for (std::uint32_t i = 0; i < (1u << 16); ++i) {
    halves[i] = lockstep::half::from_bits(static_cast<std::uint16_t>(i));
    bfloats[i] = bfloat16::from_bits(static_cast<std::uint16_t>(i));
  }
  std::vector<float> wide(1 << 16), wide_portable(1 << 16);
  detail::widen_run(halves.data(), wide.data(), 1 << 16);
  detail::widen_run_portable(halves.data(), wide_portable.data(), 1 << 16);
  for (std::uint32_t i = 0; i < (1u << 16); ++i) {
    const float expected = to_float(halves[i]);
    ASSERT_EQ(std::bit_cast<std::uint32_t>(wide_portable[i]), std::bit_cast<std::uint32_t>(expected)) << "half " << i;
    ASSERT_EQ(std::bit_cast<std::uint32_t>(wide[i]), std::bit_cast<std::uint32_t>(expected)) << "half " << i;  // NaNs too
  }
  detail::widen_run(bfloats.data(), wide.data(), 1 << 16);
  detail::widen_run_portable(bfloats.data(), wide_portable.data(), 1 << 16);
  for (std::uint32_t i = 0; i < (1u << 16); ++i) {
    const std::uint32_t expected = std::bit_cast<std::uint32_t>(to_float(bfloats[i]));
    ASSERT_EQ(std::bit_cast<std::uint32_t>(wide[i]), expected) << "bfloat16 " << i;
    ASSERT_EQ(std::bit_cast<std::uint32_t>(wide_portable[i]), expected) << "bfloat16 " << i;
  }

  std::vector<std::uint32_t> patterns;
  for (std::uint64_t x = 0; x <= 0xffffffffu; x += 0x1003) patterns.push_back(static_cast<std::uint32_t>(x));
  for (std::uint32_t center : {0x477fe000u, 0x477ff000u, 0x47800000u, 0x38800000u, 0x38000000u, 0x33000000u,
                               0x33800000u, 0x7f800000u, 0x7f7f8000u, 0x00000000u, 0x3f800000u}) {
    for (std::uint32_t d = 0; d < 0x3000; ++d) {
      patterns.push_back(center + d);
      patterns.push_back(center - d);
      patterns.push_back((center + d) | 0x80000000u);
      patterns.push_back((center - d) | 0x80000000u);
    }
  }
  std::vector<float> floats(patterns.size());
  for (std::size_t i = 0; i < patterns.size(); ++i) floats[i] = std::bit_cast<float>(patterns[i]);
  const auto n = static_cast<std::int64_t>(floats.size());
  std::vector<lockstep::half> h(floats.size()), h_portable(floats.size());
  std::vector<bfloat16> b(floats.size()), b_portable(floats.size());
  detail::store_run(floats.data(), h.data(), n, 1.0f, 0.0f);
  detail::store_run_portable(floats.data(), h_portable.data(), n, 1.0f, 0.0f);
  detail::store_run(floats.data(), b.data(), n, 1.0f, 0.0f);
  detail::store_run_portable(floats.data(), b_portable.data(), n, 1.0f, 0.0f);
  for (std::size_t i = 0; i < floats.size(); ++i) {
    const std::uint16_t eh = to_half(floats[i]).bits, eb = to_bfloat16(floats[i]).bits;
    ASSERT_EQ(h[i].bits, eh) << "float bits 0x" << std::hex << patterns[i];
    ASSERT_EQ(h_portable[i].bits, eh) << "float bits 0x" << std::hex << patterns[i];
    ASSERT_EQ(b[i].bits, eb) << "float bits 0x" << std::hex << patterns[i];
    ASSERT_EQ(b_portable[i].bits, eb) << "float bits 0x" << std::hex << patterns[i];
  }
  // round_run: rounded to T and widened back in one go, the floats of narrowing then widening
  std::vector<float> rh(floats.size()), rb(floats.size());
  detail::round_run<lockstep::half>(floats.data(), rh.data(), n);
  detail::round_run<bfloat16>(floats.data(), rb.data(), n);
  for (std::size_t i = 0; i < floats.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(rh[i]), std::bit_cast<std::uint32_t>(to_float(to_half(floats[i]))))
        << "float bits 0x" << std::hex << patterns[i];
    ASSERT_EQ(std::bit_cast<std::uint32_t>(rb[i]), std::bit_cast<std::uint32_t>(to_float(to_bfloat16(floats[i]))))
        << "float bits 0x" << std::hex << patterns[i];
  }
}

#if LOCKSTEP_HAS_CUDA
TEST(blas_cuda, cublas_errors_are_sentences) {
  // cublasGetStatusName/String need no GPU, so the message can be checked anywhere nvcc compiles.
  auto failing_cublas_call = [](int) { return CUBLAS_STATUS_INVALID_VALUE; };
  const int line = __LINE__ + 2;
  try {
    LOCKSTEP_CUBLAS_CHECK(failing_cublas_call(1), "multiplying ", 3, " matrices on ", device{device_kind::cuda, 1});
    ADD_FAILURE() << "did not throw";
  } catch (const cublas_error& e) {
    EXPECT_EQ(e.code(), static_cast<long>(CUBLAS_STATUS_INVALID_VALUE));
    EXPECT_CONTAINS(e.what(), detail::concat(':', line, " failing_cublas_call: CUBLAS_STATUS_INVALID_VALUE ("));
    EXPECT_CONTAINS(e.what(), ") while multiplying 3 matrices on cuda:1");
  }
}
#endif

// ---- deterministic mode's chunk products (blas/chunk_products.hpp) ------------------------------------------

// Every tile kernel this CPU runs (they must all give the same bits).
std::vector<detail::chunk_products::tile_kernel> tile_kernels_here() {
  std::vector<detail::chunk_products::tile_kernel> kernels{&detail::chunk_products::tile_scalar};
#if LOCKSTEP_CHUNK_PRODUCTS_X86
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) kernels.push_back(&detail::chunk_products::tile_avx2);
  if (__builtin_cpu_supports("avx512f")) kernels.push_back(&detail::chunk_products::tile_avx512);
#endif
  return kernels;
}

// Floats in (-2, 2) with full significands, the same sequence for the same seed.
struct full_floats {
  std::uint32_t state;
  float operator()() {
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(static_cast<std::int32_t>(state)) * 0x1p-30f;
  }
};

// P_c[i][j] is the fma chain over chunk c's rows in order, from zero: with every tile kernel this CPU runs, for
// sizes that leave partial tiles, blocks and chunks (m not a multiple of 8, n not of 32 or 256, a short last
// chunk), in f32 and with f16/bf16 operands (widened exactly). Random floats: the comparison is of bits, as the
// same operations in the same order must give them.
template <class T>
void expect_chunk_products_are_fma_chains() {
  struct size_case {
    std::int64_t rows, m, n, chunk_rows;
  };
  const auto kernels = tile_kernels_here();
  full_floats next{12345};
  for (const size_case sc : {size_case{70, 13, 45, 32}, size_case{64, 8, 256, 32}, size_case{5, 17, 300, 4},
                             size_case{33, 9, 257, 16}, size_case{1, 1, 1, 8}}) {
    const std::int64_t ldg = sc.m + 3, ldx = sc.n + 1;  // padded rows: the leading dimensions are honoured
    std::vector<T> g(static_cast<std::size_t>(sc.rows * ldg)), x(static_cast<std::size_t>(sc.rows * ldx));
    for (auto& v : g) v = convert<T>(next());
    for (auto& v : x) v = convert<T>(next());
    const std::int64_t chunks = (sc.rows + sc.chunk_rows - 1) / sc.chunk_rows;
    std::vector<float> expected(static_cast<std::size_t>(chunks * sc.m * sc.n));
    for (std::int64_t c = 0; c < chunks; ++c) {
      for (std::int64_t i = 0; i < sc.m; ++i) {
        for (std::int64_t j = 0; j < sc.n; ++j) {
          float acc = 0.0f;
          for (std::int64_t r = c * sc.chunk_rows; r < std::min(sc.rows, (c + 1) * sc.chunk_rows); ++r) {
            acc = std::fma(to_float(g[static_cast<std::size_t>(r * ldg + i)]), to_float(x[static_cast<std::size_t>(r * ldx + j)]), acc);
          }
          expected[static_cast<std::size_t>((c * sc.m + i) * sc.n + j)] = acc;
        }
      }
    }
    const detail::chunk_products_problem<T> problem{g.data(), ldg, x.data(), ldx, sc.rows, sc.m, sc.n, sc.chunk_rows};
    std::vector<float> scratch(static_cast<std::size_t>(detail::chunk_products::scratch_floats(sc.rows, sc.m, sc.n, chunks)));
    for (std::size_t k = 0; k < kernels.size(); ++k) {
      std::vector<float> got(expected.size(), std::numeric_limits<float>::quiet_NaN());
      std::int64_t emitted = 0;
      detail::host_chunk_products(
          problem, scratch.data(),
          [&](std::int64_t i0, std::int64_t mb, std::int64_t j0, std::int64_t nb, const float* tiles, std::int64_t stride) {
            for (std::int64_t c = 0; c < chunks; ++c) {
              for (std::int64_t a = 0; a < mb; ++a) {
                for (std::int64_t j = 0; j < nb; ++j) {
                  got[static_cast<std::size_t>((c * sc.m + i0 + a) * sc.n + j0 + j)] =
                      tiles[c * stride + a * detail::chunk_products::block_n + j];
                }
              }
            }
            emitted += mb * nb;
          },
          kernels[k]);
      EXPECT_EQ(emitted, sc.m * sc.n) << "every element once";
      for (std::size_t e = 0; e < expected.size(); ++e) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got[e]), std::bit_cast<std::uint32_t>(expected[e]))
            << "kernel " << k << ", rows " << sc.rows << ", m " << sc.m << ", n " << sc.n << ", chunk rows "
            << sc.chunk_rows << ", element " << e << ": " << got[e] << " != " << expected[e];
      }
      if constexpr (std::is_same_v<T, float>) {  // stored as they are: padded rows and chunks, padding untouched
        const std::int64_t ld = sc.n + 2, stride = sc.m * ld + 5;
        std::vector<float> into(static_cast<std::size_t>(chunks * stride), -7.0f);
        detail::host_chunk_products_into(problem, scratch.data(), into.data(), ld, stride, kernels[k]);
        for (std::int64_t c = 0; c < chunks; ++c) {
          for (std::int64_t e = 0; e < stride; ++e) {
            const std::int64_t i = e / ld, j = e % ld;
            const float want = i < sc.m && j < sc.n ? expected[static_cast<std::size_t>((c * sc.m + i) * sc.n + j)] : -7.0f;
            ASSERT_EQ(std::bit_cast<std::uint32_t>(into[static_cast<std::size_t>(c * stride + e)]),
                      std::bit_cast<std::uint32_t>(want))
                << "host_chunk_products_into, kernel " << k << ", rows " << sc.rows << ", m " << sc.m << ", n " << sc.n
                << ", chunk " << c << ", element (" << i << ", " << j << ")";
          }
        }
      }
    }
  }
  // no rows: nothing emitted
  const detail::chunk_products_problem<T> none{nullptr, 4, nullptr, 4, 0, 4, 4, 32};
  bool called = false;
  detail::host_chunk_products(none, nullptr, [&](auto...) { called = true; });
  EXPECT_FALSE(called);
}

// C = A B with each element the fma chain over the depth in order, from zero, rounded once to T: with every tile
// kernel this CPU runs, B as it is and transposed, sizes that leave partial tiles (and no depth at all), padded
// leading dimensions. And the batch invariance deterministic mode relies on: any range of rows computed alone
// gives the bits those rows get in a larger call.
template <class T>
void expect_row_products_are_fma_chains() {
  const auto kernels = tile_kernels_here();
  full_floats next{777};
  struct size_case {
    std::int64_t rows, n, k;
  };
  for (const size_case sc : {size_case{37, 45, 19}, size_case{16, 64, 33}, size_case{3, 300, 8}, size_case{9, 7, 0},
                             size_case{1, 1, 1}}) {
    for (const bool transposed : {false, true}) {
      const std::int64_t lda = sc.k + 3, ldb = (transposed ? sc.k : sc.n) + 5, ldc = sc.n + 2;
      std::vector<T> a(static_cast<std::size_t>(sc.rows * lda)), b(static_cast<std::size_t>((transposed ? sc.n : sc.k) * ldb));
      for (auto& v : a) v = convert<T>(next());
      for (auto& v : b) v = convert<T>(next());
      auto b_at = [&](std::int64_t kk, std::int64_t j) {
        return to_float(b[static_cast<std::size_t>(transposed ? j * ldb + kk : kk * ldb + j)]);
      };
      std::vector<T> expected(static_cast<std::size_t>(sc.rows * ldc), convert<T>(-3.0f));
      for (std::int64_t r = 0; r < sc.rows; ++r) {
        for (std::int64_t j = 0; j < sc.n; ++j) {
          float acc = 0.0f;
          for (std::int64_t kk = 0; kk < sc.k; ++kk) acc = std::fma(to_float(a[static_cast<std::size_t>(r * lda + kk)]), b_at(kk, j), acc);
          expected[static_cast<std::size_t>(r * ldc + j)] = convert<T>(acc);
        }
      }
      for (std::size_t kernel = 0; kernel < kernels.size(); ++kernel) {
        // the whole batch, then rows [first, rows) alone, into their own rows of the same C
        for (const std::int64_t first : {std::int64_t{0}, sc.rows / 3}) {
          std::vector<T> c(expected.size(), convert<T>(-3.0f));
          const std::int64_t rows = sc.rows - first;
          const detail::row_products_problem<T> p{a.data() + first * lda, lda, b.data(), ldb, transposed,
                                                  c.data() + first * ldc, ldc, rows, sc.n, sc.k};
          std::vector<float> scratch(static_cast<std::size_t>(detail::chunk_products::row_scratch_floats(rows, sc.n, sc.k)));
          detail::host_row_products(p, scratch.data(), kernels[kernel]);
          for (std::int64_t e = first * ldc; e < sc.rows * ldc; ++e) {
            ASSERT_EQ(std::memcmp(&c[static_cast<std::size_t>(e)], &expected[static_cast<std::size_t>(e)], sizeof(T)), 0)
                << "kernel " << kernel << (transposed ? ", B transposed" : "") << ", rows [" << first << ", " << sc.rows
                << "), n " << sc.n << ", k " << sc.k << ", element (" << e / ldc << ", " << e % ldc
                << "): " << to_float(c[static_cast<std::size_t>(e)]) << " != " << to_float(expected[static_cast<std::size_t>(e)]);
          }
        }
      }
    }
  }
}

TEST(row_products, every_tile_kernel_gives_each_element_the_fma_chain_over_its_depth_whatever_the_rows_f32) {
  expect_row_products_are_fma_chains<float>();
}
TEST(row_products, every_tile_kernel_gives_each_element_the_fma_chain_over_its_depth_whatever_the_rows_f16_bf16) {
  expect_row_products_are_fma_chains<lockstep::half>();
  expect_row_products_are_fma_chains<lockstep::bfloat16>();
}

// The transposed packing's two builds move the same floats (panels of 8 and 32, ragged counts and depths), f16 and
// bf16 widened alike (NaNs, subnormals and negative zeros among the values).
TEST(row_products, the_transposed_packing_is_the_same_in_every_build) {
#if LOCKSTEP_CHUNK_PRODUCTS_X86 && LOCKSTEP_BLAS_X86_SIMD
  if (!detail::has_avx2_f16c()) GTEST_SKIP() << "this CPU has no AVX2 and F16C";
  auto bits = [](const std::vector<float>& v) {
    std::vector<std::uint32_t> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = std::bit_cast<std::uint32_t>(v[i]);
    return out;
  };
  auto check = [&]<class T>() {
    for (const std::int64_t width : {std::int64_t{8}, std::int64_t{32}}) {
      for (const auto& [count, depth] : {std::pair<std::int64_t, std::int64_t>{37, 19}, {64, 64}, {5, 3}, {33, 70}}) {
        SCOPED_TRACE(::testing::Message() << name_of(dtype_of_v<T>) << ", width " << width << ", count " << count
                                          << ", depth " << depth);
        const std::int64_t ld = depth + 4;
        std::vector<T> src(static_cast<std::size_t>(count * ld));
        for (std::size_t i = 0; i < src.size(); ++i) {
          const float v = i % 29 == 3 ? std::nanf("") : i % 31 == 5 ? -0.0f : i % 37 == 7 ? 1e-40f * 7.0f
                          : static_cast<float>(i) * 0.5f - 100.0f;
          src[i] = convert<T>(v);
        }
        const std::int64_t floats = (count + width - 1) / width * width * depth;
        std::vector<float> portable(static_cast<std::size_t>(floats), 1.0f), avx2(static_cast<std::size_t>(floats), 2.0f);
        detail::chunk_products::pack_panels_transposed_portable(src.data(), ld, count, depth, width, portable.data());
        detail::chunk_products::pack_panels_transposed_avx2(src.data(), ld, count, depth, width, avx2.data());
        EXPECT_EQ(bits(portable), bits(avx2));
        // and what the packing means: panel t, depth d, lane w holds row t * width + w's element d (zero past count)
        for (std::int64_t e = 0; e < floats; ++e) {
          const std::int64_t t = e / (depth * width), d = e / width % depth, w = e % width, q = t * width + w;
          const float want = q < count ? to_float(src[static_cast<std::size_t>(q * ld + d)]) : 0.0f;
          ASSERT_EQ(std::bit_cast<std::uint32_t>(portable[static_cast<std::size_t>(e)]), std::bit_cast<std::uint32_t>(want))
              << "element " << e;
        }
      }
    }
  };
  check.template operator()<float>();
  check.template operator()<lockstep::half>();
  check.template operator()<lockstep::bfloat16>();
#else
  GTEST_SKIP() << "the AVX2 build of f16 and bf16 exists on x86 with LOCKSTEP_BLAS_X86_SIMD only";
#endif
}

TEST(chunk_products, every_tile_kernel_gives_each_chunk_the_fma_chain_of_its_rows_f32) {
  expect_chunk_products_are_fma_chains<float>();
}
TEST(chunk_products, every_tile_kernel_gives_each_chunk_the_fma_chain_of_its_rows_f16_bf16) {
  expect_chunk_products_are_fma_chains<lockstep::half>();
  expect_chunk_products_are_fma_chains<lockstep::bfloat16>();
}
