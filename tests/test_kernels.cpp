// Tests of kernels/: every kernel against a CPU reference, for f32, f16 and bf16, with ragged sizes n, n+1,
// n+2, on both backends (the CUDA instances skip without a GPU). Inputs are small integers or crafted values
// so that results compare exactly where the arithmetic allows.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "lockstep/core/half.hpp"
#include "lockstep/kernels/bind.hpp"
#include "lockstep/kernels/conv.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/core/random.hpp"
#include "lockstep/kernels/activation.hpp"
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/kernels/exact.hpp"
#include "lockstep/kernels/optim.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/kernels/multi_tensor.hpp"
#include "lockstep/kernels/norm.hpp"
#include "lockstep/kernels/reduce.hpp"
#include "lockstep/runtime/copy.hpp"
#include "test_support.hpp"

using namespace lockstep;
using namespace lockstep_test;

namespace {

// Small integers and halves: exact in f32, f16 and bf16, and never all zero.
std::vector<float> small_values(std::size_t n, int salt) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<int>((i * 5 + salt) % 13) - 6) * 0.5f;
  return v;
}

// Parameterized over the backend and a floating dtype; the CUDA instances skip without a GPU.
class kernel_test : public backend_and_dtype {};

constexpr std::size_t sizes[] = {1000, 1001, 1002, 1, 70001};

}  // namespace

INSTANTIATE_TEST_SUITE_P(all, kernel_test,
                         ::testing::Combine(::testing::Values(device_kind::host, device_kind::cuda),
                                            ::testing::Values(dtype::f32, dtype::f16, dtype::bf16)),
                         param_name);

TEST_P(kernel_test, fill_sets_every_element_and_nothing_else) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    for (std::size_t n : sizes) {
      auto buf = to_device(from_floats<T>(std::vector<float>(n + 2, -1.0f)), s);
      fill<T>(buf.span().subspan(1, n), convert<T>(2.5f), s);
      const auto out = to_floats(to_vector(device_span<const T>(buf.span()), s));
      EXPECT_EQ(out.front(), -1.0f);
      EXPECT_EQ(out.back(), -1.0f);
      for (std::size_t i = 1; i <= n; ++i) ASSERT_EQ(out[i], 2.5f) << "n=" << n << " i=" << i;
    }
  });
}

TEST_P(kernel_test, scale_matches_the_cpu_reference) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    for (std::size_t n : sizes) {
      const auto x = small_values(n, 3);
      auto buf = to_device(from_floats<T>(x), s);
      scale<T>(buf.span(), -0.25f, s);
      const auto out = to_floats(to_vector(device_span<const T>(buf.span()), s));
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], static_cast<float>(x[i] * -0.25)) << "n=" << n << " i=" << i;
    }
  });
}

TEST_P(kernel_test, axpy_matches_the_cpu_reference) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    for (std::size_t n : sizes) {
      const auto x = small_values(n, 1), y = small_values(n, 7);
      auto dx = to_device(from_floats<T>(x), s);
      auto dy = to_device(from_floats<T>(y), s);
      axpy<T>(1.5f, dx.span(), dy.span(), s);
      const auto out = to_floats(to_vector(device_span<const T>(dy.span()), s));
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(out[i], static_cast<float>(y[i] + 1.5 * x[i])) << "n=" << n << " i=" << i;
      }
    }
  });
}

TEST_P(kernel_test, reductions_match_the_cpu_reference) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    for (std::size_t n : sizes) {
      auto values = small_values(n, 2);
      values[n / 2] = -7.5f;  // the largest magnitude, planted in the middle
      double expected_sum = 0;
      for (float v : values) expected_sum += v;
      auto d = to_device(from_floats<T>(values), s);
      device_buffer<float> result(2, s);
      sum<T>(d.span(), result.span().subspan(0, 1), s);
      max_abs<T>(d.span(), result.span().subspan(1, 1), s);
      device_buffer<std::uint64_t> count(1, s);
      count_non_finite<T>(d.span(), count.span(), s);
      const auto r = to_vector(device_span<const float>(result.span()), s);
      EXPECT_EQ(r[0], static_cast<float>(expected_sum)) << "n=" << n;
      EXPECT_EQ(r[1], 7.5f) << "n=" << n;
      EXPECT_EQ(to_vector(device_span<const std::uint64_t>(count.span()), s)[0], 0u);
    }
  });
}

TEST_P(kernel_test, non_finite_values_are_counted_and_propagate_through_max_abs) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    for (std::size_t n : {std::size_t{1000}, std::size_t{1001}, std::size_t{1002}}) {
      auto values = small_values(n, 4);
      const float inf = std::numeric_limits<float>::infinity();
      values[0] = inf;
      values[n - 1] = -inf;
      values[n / 3] = std::numeric_limits<float>::quiet_NaN();
      auto d = to_device(from_floats<T>(values), s);
      device_buffer<std::uint64_t> count(1, s);
      count_non_finite<T>(d.span(), count.span(), s);
      device_buffer<float> m(1, s);
      max_abs<T>(d.span(), m.span(), s);
      EXPECT_EQ(to_vector(device_span<const std::uint64_t>(count.span()), s)[0], 3u) << "n=" << n;
      EXPECT_TRUE(std::isnan(to_vector(device_span<const float>(m.span()), s)[0])) << "n=" << n;
    }
  });
}

TEST_P(kernel_test, empty_ranges_reduce_to_the_identity) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    device_buffer<T> empty(0, s);
    auto out = to_device(std::vector<float>{42.0f, 42.0f}, s);
    sum<T>(empty.span(), out.span().subspan(0, 1), s);
    max_abs<T>(empty.span(), out.span().subspan(1, 1), s);
    EXPECT_EQ(to_vector(device_span<const float>(out.span()), s), (std::vector<float>{0.0f, 0.0f}));
  });
}

TEST_P(kernel_test, casts_round_to_nearest_even_like_the_scalar_conversions) {
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    for (std::size_t n : sizes) {
      // Values that need rounding in f16 and bf16, including exact ties and out-of-range ones.
      std::vector<float> v(n);
      for (std::size_t i = 0; i < n; ++i) {
        const float base = static_cast<float>(i % 977) * 1.0009765625f - 400.0f;  // 1 + 2^-10: ties in f16
        v[i] = (i % 5 == 0) ? base * 1e-6f : (i % 7 == 0 ? base * 300.0f : base);
      }
      auto src = to_device(v, s);
      device_buffer<T> narrowed(n, s);
      cast<T, float>(src.span(), narrowed.span(), s);
      device_buffer<float> widened(n, s);
      cast<float, T>(narrowed.span(), widened.span(), s);
      const auto got = to_vector(device_span<const T>(narrowed.span()), s);
      const auto back = to_vector(device_span<const float>(widened.span()), s);
      for (std::size_t i = 0; i < n; ++i) {
        const T expected = convert<T>(v[i]);
        ASSERT_EQ(std::memcmp(&got[i], &expected, sizeof(T)), 0) << "n=" << n << " i=" << i << " v=" << v[i];
        ASSERT_EQ(back[i], to_float(expected)) << "n=" << n << " i=" << i;
      }
    }
  });
}

TEST_P(kernel_test, casts_between_the_two_half_precisions_go_through_f32) {
  stream s(dev());
  const std::vector<float> v{1.0f, 1.00390625f, 65504.0f, 1e-7f, -3.140625f, 70000.0f};
  auto h = to_device(from_floats<lockstep::half>(v), s);
  device_buffer<bfloat16> b(v.size(), s);
  cast<bfloat16, lockstep::half>(h.span(), b.span(), s);
  const auto got = to_vector(device_span<const bfloat16>(b.span()), s);
  for (std::size_t i = 0; i < v.size(); ++i) EXPECT_EQ(got[i].bits, to_bfloat16(to_float(to_half(v[i]))).bits) << i;
}

TEST_P(kernel_test, kernels_refuse_memory_of_another_device) {
  if (!require_devices(2)) return;
  stream s0(dev()), s1(dev(1));
  device_buffer<float> x(10, s0), y(10, s1);
  EXPECT_THROW(scale<float>(y.span(), 2.0f, s0), precondition_error);
  EXPECT_THROW(axpy<float>(1.0f, x.span(), y.span(), s0), precondition_error);
  EXPECT_THROW(axpy<float>(1.0f, x.span(), x.span().first(9), s0), precondition_error);
  s0.synchronize();
  s1.synchronize();
}

TEST_P(kernel_test, column_sums_match_the_cpu_reference_for_any_number_of_rows) {
  // bias gradients (launch_columns): on a GPU one thread per column below 32 rows, else blocks over splits of the
  // rows; small integers and halves sum exactly in f32 in any order, so every path gives the reference's bits
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    for (const std::size_t rows : {std::size_t{0}, std::size_t{1}, std::size_t{31}, std::size_t{32}, std::size_t{257},
                                   std::size_t{5000}, std::size_t{40000}}) {
      for (const std::size_t cols : {std::size_t{1}, std::size_t{10}, std::size_t{33}, std::size_t{1000}}) {
        if (rows * cols > (std::size_t{1} << 21)) continue;  // 40000 rows: 128 splits; 5000: 20
        const auto g = small_values(rows * cols, 4);  // (none for 0 rows: finish(c, 0))
        const auto old = small_values(cols, 9);
        auto dg = to_device(from_floats<T>(g), s);
        for (const float beta : {0.0f, 0.5f}) {
          auto db = to_device(from_floats<T>(old), s);
          launch_columns(rows, cols, kernels::column_sum_op<T>{dg.data(), db.data(), rows, cols, beta}, s, "column sums");
          const auto out = to_floats(to_vector(device_span<const T>(db.span()), s));
          for (std::size_t c = 0; c < cols; ++c) {
            double sum = 0;
            for (std::size_t r = 0; r < rows; ++r) sum += g[r * cols + c];
            const float acc = static_cast<float>(sum);
            const float expected = to_float(convert<T>(beta == 0.0f ? acc : beta * to_float(convert<T>(old[c])) + acc));
            ASSERT_EQ(out[c], expected) << "rows=" << rows << " cols=" << cols << " beta=" << beta << " c=" << c;
          }
        }
      }
    }
  });
}

namespace {
// Column c's sum in the order the backend documents for launch_columns, on floats: a host stream adds the rows in
// order; a GPU (launch_cuda.cuh), from 32 rows, splits the rows into at most 128 splits of at least 256 rows, adds
// rows lane, lane + 8, ... of a split in each of 8 lanes, the lanes in order, then the splits in order.
float column_sum_in_order(const std::vector<float>& g, std::size_t rows, std::size_t cols, std::size_t c, bool gpu) {
  float acc = 0.0f;
  if (!gpu || rows < 32) {
    for (std::size_t r = 0; r < rows; ++r) acc += g[r * cols + c];
    return acc;
  }
  const std::size_t split_rows = std::max<std::size_t>((rows + 127) / 128, 256);
  for (std::size_t begin = 0; begin < rows; begin += split_rows) {
    const std::size_t end = std::min(rows, begin + split_rows);
    float lanes[8] = {};
    for (std::size_t lane = 0; lane < 8; ++lane) {
      for (std::size_t r = begin + lane; r < end; r += 8) lanes[lane] += g[r * cols + c];
    }
    float split = lanes[0];
    for (std::size_t lane = 1; lane < 8; ++lane) split += lanes[lane];
    acc = begin == 0 ? split : acc + split;
  }
  return acc;
}
}  // namespace

TEST_P(kernel_test, column_sums_add_in_the_documented_order) {
  // No atomics, and an order that depends on the number of rows only (deterministic mode's chunks of one shape give
  // one result): random terms, where another order would round differently, give the emulated order's bits.
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    for (const std::size_t rows : {std::size_t{31}, std::size_t{300}, std::size_t{40000}}) {
      const std::size_t cols = 70;
      std::vector<float> g(rows * cols);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = to_float(convert<T>(2.0f * philox_uniform(5, 0, i) - 1.0f));
      auto dg = to_device(from_floats<T>(g), s);
      auto db = to_device(from_floats<T>(std::vector<float>(cols, 0.0f)), s);
      launch_columns(rows, cols, kernels::column_sum_op<T>{dg.data(), db.data(), rows, cols, 0.0f}, s, "column sums");
      const auto out = to_floats(to_vector(device_span<const T>(db.span()), s));
      for (std::size_t c = 0; c < cols; ++c) {
        const float expected = to_float(convert<T>(column_sum_in_order(g, rows, cols, c, dev().is_cuda())));
        ASSERT_EQ(out[c], expected) << "rows=" << rows << " c=" << c;
      }
    }
  });
}

TEST(launch, the_32_bit_index_division_gives_the_64_bit_quotient) {
  const std::uint64_t big = std::uint64_t{1} << 32;
  for (std::uint64_t i : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{12345}, big - 1, big, big + 7, big * 5 + 3}) {
    for (std::uint64_t d : {std::uint64_t{1}, std::uint64_t{3}, std::uint64_t{784}, big - 1, big, big + 1}) {
      EXPECT_EQ(detail::index_div(static_cast<std::size_t>(i), static_cast<std::size_t>(d)), i / d) << i << " / " << d;
    }
  }
}

namespace {
// A user's own kernel body: the launcher runs any plain functor.
struct iota_squares {
  std::int64_t* out;
  LOCKSTEP_HD void operator()(std::size_t i) const { out[i] = static_cast<std::int64_t>(i) * static_cast<std::int64_t>(i); }
};

// Parameterized over the backend; the CUDA instance skips without a GPU.
class launch_test : public backend_test {};
}  // namespace

INSTANTIATE_TEST_SUITE_P(all, launch_test, all_backends(), backend_name);

TEST_P(launch_test, runs_a_user_functor_over_every_index) {
  stream s(dev());
  for (std::size_t n : sizes) {
    device_buffer<std::int64_t> out(n, s);
    launch_elementwise(n, iota_squares{out.data()}, s, "iota_squares");
    const auto v = to_vector(device_span<const std::int64_t>(out.span()), s);
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(v[i], static_cast<std::int64_t>(i * i)) << "n=" << n;
  }
}

// ---- the host loops that widen and round whole blocks (core/half_runs.hpp) -------------------------------------
//
// On a host stream the f16/bf16 activation, bias, bias-gradient and optimizer kernels run their own loops over
// blocks (for_all, for_rows, for_group); these must give the bits of the per-element operator() on every element,
// including across block boundaries (512), at special values (subnormals, infinities, NaN, the largest values)
// and ties.
namespace {

template <class T>
std::vector<T> awkward_values(std::size_t n, int salt) {
  const float specials[] = {0.0f, -0.0f, 1e-7f, -6e-8f, 65504.0f, 65520.0f, -70000.0f,
                            std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                            1.0009765625f, 3e38f, -1.5f};
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = i % 7 == 3 ? specials[(i / 7 + static_cast<std::size_t>(salt)) % std::size(specials)]
                               : 2.0f * philox_uniform(11, static_cast<std::uint64_t>(salt), i) - 1.0f;
    v[i] = convert<T>(x);
  }
  return v;
}

template <class T>
std::vector<std::uint16_t> bits_of(const std::vector<T>& v) {
  std::vector<std::uint16_t> b;
  for (const T& x : v) b.push_back(x.bits);
  return b;
}
std::vector<std::uint32_t> bits_of(const std::vector<float>& v) {  // NaNs compare by their bits
  std::vector<std::uint32_t> b;
  for (float x : v) b.push_back(std::bit_cast<std::uint32_t>(x));
  return b;
}

}  // namespace

static_assert(detail::run_block == 512, "the sizes below (511, 512, 1500) no longer straddle the block boundary");

TEST(host_block_loops, activations_and_bias_match_the_per_element_code) {
  stream s(device{device_kind::host, 0});
  auto check = [&]<class T>() {
    for (std::size_t n : {std::size_t{1}, std::size_t{511}, std::size_t{512}, std::size_t{1500}}) {
      const auto x = awkward_values<T>(n, 1), y = awkward_values<T>(n, 2), gy = awkward_values<T>(n, 3);
      auto dx = to_device(x, s), dy = to_device(y, s), dgy = to_device(gy, s);
      device_buffer<T> out(n, s);
      auto expect = [&](auto op, const char* what) {
        launch_elementwise(n, op, s, what);
        return to_vector(device_span<const T>(out.span()), s);
      };
      using relu_fwd = kernels::activation_forward_op<kernels::relu_fn, T>;
      using gelu_bwd = kernels::activation_backward_op<kernels::gelu_fn, T>;
      using relu_bwd = kernels::activation_backward_op<kernels::relu_fn, T>;
      std::vector<T> ref(n);
      // forward
      relu_fwd f_ref{x.data(), ref.data()};
      for (std::size_t i = 0; i < n; ++i) f_ref(i);
      EXPECT_EQ(bits_of(expect(relu_fwd{dx.data(), out.data()}, "relu")), bits_of(ref)) << "relu n=" << n;
      // backward, two derivatives (one reads y, one reads x)
      relu_bwd rb_ref{gy.data(), x.data(), y.data(), ref.data()};
      for (std::size_t i = 0; i < n; ++i) rb_ref(i);
      EXPECT_EQ(bits_of(expect(relu_bwd{dgy.data(), dx.data(), dy.data(), out.data()}, "relu bwd")), bits_of(ref))
          << "relu backward n=" << n;
      gelu_bwd gb_ref{gy.data(), x.data(), y.data(), ref.data()};
      for (std::size_t i = 0; i < n; ++i) gb_ref(i);
      EXPECT_EQ(bits_of(expect(gelu_bwd{dgy.data(), dx.data(), dy.data(), out.data()}, "gelu bwd")), bits_of(ref))
          << "gelu backward n=" << n;
      // bias over a [rows, n] matrix, in place
      const std::size_t rows = 3;
      auto m = awkward_values<T>(rows * n, 4);
      auto dm = to_device(m, s);
      kernels::add_bias_op<T> b_ref{m.data(), gy.data(), m.data(), n};
      for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t c = 0; c < n; ++c) b_ref(r, c);
      launch_2d(rows, n, kernels::add_bias_op<T>{dm.data(), dgy.data(), dm.data(), n}, s, "bias");
      EXPECT_EQ(bits_of(to_vector(device_span<const T>(dm.span()), s)), bits_of(m)) << "bias n=" << n;
      // column sums of a [rows, n] matrix (bias gradients), overwritten and accumulated
      for (float beta : {0.0f, 0.5f}) {
        std::vector<T> sums = y;
        kernels::column_sum_op<T> c_ref{m.data(), sums.data(), rows, n, beta};
        for (std::size_t c = 0; c < n; ++c) c_ref(c);
        auto dsums = to_device(y, s);
        launch_elementwise(n, kernels::column_sum_op<T>{dm.data(), dsums.data(), rows, n, beta}, s, "column sum");
        EXPECT_EQ(bits_of(to_vector(device_span<const T>(dsums.span()), s)), bits_of(sums))
            << "column sum n=" << n << " beta=" << beta;
      }
    }
  };
  check.template operator()<lockstep::half>();
  check.template operator()<bfloat16>();
}

// Batch norm's host loops (for_all_rows: memory order, a sum per channel) give every channel the bits of its
// per-channel row() with one lane, in every type, with and without the fused relu's mask, for runs of 1 value
// ([N, F]) and of many ([N, C, H, W]).
TEST(host_block_loops, batch_norm_kernels_match_their_per_channel_rows) {
  stream s(device{device_kind::host, 0});
  auto check = [&]<class T>() {
    using geometry = std::tuple<std::size_t, std::size_t, std::size_t>;  // rows, channels, values per channel and row
    for (const geometry& dims : {geometry{5, 3, 11}, geometry{4, 6, 1}, geometry{3, 2, 37}}) {
      // (not a structured binding: clang before 16 cannot capture one in the lambdas below)
      const std::size_t n = std::get<0>(dims), c = std::get<1>(dims), inner = std::get<2>(dims);
      SCOPED_TRACE(::testing::Message() << name_of(dtype_of_v<T>) << " [" << n << ", " << c << ", " << inner << "]");
      const std::size_t count = n * c * inner;
      auto values = [](std::size_t size, int salt, float lo, float hi) {
        std::vector<T> v(size);
        for (std::size_t i = 0; i < size; ++i) {
          v[i] = convert<T>(lo + (hi - lo) * philox_uniform(12, static_cast<std::uint64_t>(salt), i));
        }
        return v;
      };
      const auto x = values(count, 1, -2.0f, 3.0f), gy = values(count, 2, -1.0f, 1.0f);
      const auto y = values(count, 3, -1.0f, 1.0f);  // a fused relu's output: its sign is the mask
      const auto gamma = values(c, 4, 0.5f, 1.5f), beta = values(c, 5, -0.5f, 0.5f);
      auto dx = to_device(x, s), dgy = to_device(gy, s), dy = to_device(y, s), dgamma = to_device(gamma, s),
           dbeta = to_device(beta, s);
      // the forward's sums and squares, and the statistics normalize writes, as floats of each side
      std::vector<float> sums(c + 1), squares(c), mean(c), rstd(c), rm(c, 0.25f), rv(c, 2.0f), sg(c), sgx(c);
      std::vector<std::int64_t> tracked{7};
      auto dsums = to_device(sums, s), dsquares = to_device(squares, s), dmean = to_device(mean, s),
           drstd = to_device(rstd, s), drm = to_device(rm, s), drv = to_device(rv, s), dsg = to_device(sg, s),
           dsgx = to_device(sgx, s);
      auto dtracked = to_device(tracked, s);
      auto rows_of = [&](const auto& op) {
        for (std::size_t ch = 0; ch < c; ++ch) op.row(ch, detail::single_lane{});
      };
      auto same = [&](const auto& host, auto& dev, const char* what) {
        EXPECT_EQ(bits_of(host), bits_of(to_vector(dev.span(), s))) << what;
      };
      rows_of(kernels::batch_norm_sum_op<T>{x.data(), sums.data(), n, c, inner});
      launch_rows(c, kernels::batch_norm_sum_op<T>{dx.data(), dsums.data(), n, c, inner}, s, "sums");
      same(sums, dsums, "sums");
      rows_of(kernels::batch_norm_square_op<T>{x.data(), sums.data(), squares.data(), n, c, inner});
      launch_rows(c, kernels::batch_norm_square_op<T>{dx.data(), dsums.data(), dsquares.data(), n, c, inner}, s, "sq");
      same(squares, dsquares, "squares");
      for (const bool relu : {false, true}) {
        SCOPED_TRACE(relu ? "fused relu" : "no relu");
        std::vector<T> out(count);
        auto dout = to_device(out, s);
        rows_of(kernels::batch_norm_normalize_op<T>{x.data(), gamma.data(), beta.data(), out.data(), sums.data(),
                                                    squares.data(), mean.data(), rstd.data(), rm.data(), rv.data(),
                                                    tracked.data(), n, c, inner, 1e-5f, 0.1f, relu});
        launch_rows(c,
                    kernels::batch_norm_normalize_op<T>{dx.data(), dgamma.data(), dbeta.data(), dout.data(),
                                                        dsums.data(), dsquares.data(), dmean.data(), drstd.data(),
                                                        drm.data(), drv.data(), dtracked.data(), n, c, inner, 1e-5f,
                                                        0.1f, relu},
                    s, "normalize");
        same(out, dout, "normalize");
        same(mean, dmean, "mean");
        same(rstd, drstd, "rstd");
        same(rm, drm, "running mean");
        same(rv, drv, "running var");
        EXPECT_EQ(to_vector(device_span<const std::int64_t>(dtracked.span()), s), tracked);
        const T* mask = relu ? y.data() : nullptr;
        const T* dmask = relu ? dy.data() : nullptr;
        rows_of(kernels::batch_norm_grad_sums_op<T>{gy.data(), x.data(), mean.data(), rstd.data(), sg.data(),
                                                    sgx.data(), n, c, inner, mask});
        launch_rows(c,
                    kernels::batch_norm_grad_sums_op<T>{dgy.data(), dx.data(), dmean.data(), drstd.data(), dsg.data(),
                                                        dsgx.data(), n, c, inner, dmask},
                    s, "gradient sums");
        same(sg, dsg, "sum of gy");
        same(sgx, dsgx, "sum of gy xhat");
        for (const bool batch : {true, false}) {  // batch statistics, or the running ones
          rows_of(kernels::batch_norm_input_grad_op<T>{gy.data(), x.data(), gamma.data(), mean.data(), rstd.data(),
                                                       batch ? sg.data() : nullptr, sgx.data(), sums.data(),
                                                       out.data(), n, c, inner, mask});
          launch_rows(c,
                      kernels::batch_norm_input_grad_op<T>{dgy.data(), dx.data(), dgamma.data(), dmean.data(),
                                                           drstd.data(), batch ? dsg.data() : nullptr, dsgx.data(),
                                                           dsums.data(), dout.data(), n, c, inner, dmask},
                      s, "input gradient");
          same(out, dout, batch ? "input gradient" : "input gradient, running statistics");
        }
      }
    }
  };
  check.template operator()<float>();
  check.template operator()<lockstep::half>();
  check.template operator()<bfloat16>();
}

// 2x2 max pooling's host loop (eight windows at a time on an AVX2 CPU, four in rows of 4 to 7, the last step
// overlapping the one before; the scalar loop in rows of 1 to 3) gives the per-window code's values and indices bit for bit:
// the first of equal maxima, the last NaN of a window; on widths with and without a tail, odd ones (the last column
// unused), ReLU-like inputs (many zeros: ties), NaNs and negative zeros. Its backward gives the per-pixel gather's.
TEST(host_block_loops, max_pool_2x2_matches_the_per_window_code) {
  auto check = [&]<class T>() {
    for (const std::size_t w : {2u, 3u, 4u, 6u, 8u, 9u, 10u, 11u, 14u, 15u, 16u, 17u, 18u, 28u, 33u}) {
      for (const std::size_t h : {2u, 5u}) {
        SCOPED_TRACE(::testing::Message() << name_of(dtype_of_v<T>) << " " << h << "x" << w);
        const std::size_t planes = 3, plane = h * w;
        std::vector<T> x(planes * plane);
        for (std::size_t i = 0; i < x.size(); ++i) {
          const float u = philox_uniform(5, w * 16 + h, i);
          const float v = u < 0.4f ? 0.0f : u < 0.5f ? 1.0f : u < 0.55f ? -0.0f : u < 0.6f ? std::nanf("") : 4.0f * u - 2.0f;
          x[i] = convert<T>(v);
        }
        const kernels::conv_geometry g{.n = planes, .c = 1, .h = h, .w = w, .kh = 2, .kw = 2, .stride = 2, .padding = 0,
                                       .oh = h / 2, .ow = w / 2};
        std::vector<T> y(planes * g.pixels()), y_ref(y.size());
        std::vector<std::int32_t> at(y.size(), -7), at_ref(y.size(), -7);
        kernels::max_pool_forward_op<T>{x.data(), y.data(), at.data(), g}.for_rows(planes, g.pixels());
        const kernels::max_pool_forward_op<T> ref{x.data(), y_ref.data(), at_ref.data(), g};
        for (std::size_t r = 0; r < planes; ++r) {
          for (std::size_t p = 0; p < g.pixels(); ++p) ref(r, p);
        }
        EXPECT_EQ(at, at_ref);
        for (std::size_t i = 0; i < y.size(); ++i) {
          EXPECT_EQ(std::bit_cast<std::uint32_t>(to_float(y[i])), std::bit_cast<std::uint32_t>(to_float(y_ref[i])))
              << "output " << i;
        }
        // the backward's host loop (windows that do not overlap: each gradient written straight to its maximum)
        // against the per-pixel gather, with -0 gradients (+0 from both) and NaNs
        std::vector<T> gy(y.size()), dx(x.size(), convert<T>(7.0f)), dx_ref(x.size());
        for (std::size_t i = 0; i < gy.size(); ++i) {
          const float u = philox_uniform(6, w * 16 + h, i);
          gy[i] = convert<T>(u < 0.2f ? -0.0f : u < 0.25f ? std::nanf("") : 2.0f * u - 1.0f);
        }
        kernels::max_pool_backward_op<T>{gy.data(), at.data(), dx.data(), g}.for_rows(planes, plane);
        const kernels::max_pool_backward_op<T> back{gy.data(), at.data(), dx_ref.data(), g};
        for (std::size_t r = 0; r < planes; ++r) {
          for (std::size_t p = 0; p < plane; ++p) back(r, p);
        }
        for (std::size_t i = 0; i < dx.size(); ++i) {
          EXPECT_EQ(std::bit_cast<std::uint32_t>(to_float(dx[i])), std::bit_cast<std::uint32_t>(to_float(dx_ref[i])))
              << "input gradient " << i;
        }
      }
    }
  };
  check.template operator()<float>();
  check.template operator()<lockstep::half>();  // (qualified: CUDA's headers declare a global half)
  check.template operator()<lockstep::bfloat16>();
}

// The backward's host loop on other geometries, from the forward's own indices: each window's gradient added to its
// maximum in window order, from zero, rounded once; where windows do not overlap (stride >= kernel, with and
// without padding: each gradient written straight to its maximum) that is also the per-pixel gather's value.
TEST(host_block_loops, max_pool_backward_matches_the_gather_on_every_geometry) {
  struct pooling_case {
    std::size_t k, stride, padding;
  };
  for (const pooling_case pc : {pooling_case{3, 3, 1}, pooling_case{2, 3, 0}, pooling_case{2, 2, 1},
                                pooling_case{3, 2, 1}, pooling_case{3, 1, 1}}) {
    const std::size_t h = 7, w = 9, planes = 2;
    SCOPED_TRACE(::testing::Message() << "kernel " << pc.k << ", stride " << pc.stride << ", padding " << pc.padding);
    const kernels::conv_geometry g{.n = planes, .c = 1, .h = h, .w = w, .kh = pc.k, .kw = pc.k, .stride = pc.stride,
                                   .padding = pc.padding, .oh = (h + 2 * pc.padding - pc.k) / pc.stride + 1,
                                   .ow = (w + 2 * pc.padding - pc.k) / pc.stride + 1};
    std::vector<float> x(planes * h * w), y(planes * g.pixels()), gy(y.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float u = philox_uniform(8, pc.k * 16 + pc.stride * 4 + pc.padding, i);
      x[i] = u < 0.3f ? 0.0f : 4.0f * u - 2.0f;
    }
    for (std::size_t i = 0; i < gy.size(); ++i) {
      const float u = philox_uniform(9, pc.k, i);
      gy[i] = u < 0.2f ? -0.0f : 2.0f * u - 1.0f;
    }
    std::vector<std::int32_t> at(y.size(), -7);
    kernels::max_pool_forward_op<float>{x.data(), y.data(), at.data(), g}.for_rows(planes, g.pixels());
    std::vector<float> dx(x.size(), 7.0f), in_order(x.size(), 0.0f), gathered(x.size());
    kernels::max_pool_backward_op<float>{gy.data(), at.data(), dx.data(), g}.for_rows(planes, h * w);
    for (std::size_t r = 0; r < planes; ++r) {
      for (std::size_t o = 0; o < g.pixels(); ++o) in_order[r * h * w + at[r * g.pixels() + o]] += gy[r * g.pixels() + o];
    }
    const kernels::max_pool_backward_op<float> back{gy.data(), at.data(), gathered.data(), g};
    for (std::size_t r = 0; r < planes; ++r) {
      for (std::size_t p = 0; p < h * w; ++p) back(r, p);
    }
    const bool overlapping = pc.stride < pc.k;
    for (std::size_t i = 0; i < dx.size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(dx[i]), std::bit_cast<std::uint32_t>(in_order[i])) << "input gradient " << i;
      if (!overlapping) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(dx[i]), std::bit_cast<std::uint32_t>(gathered[i])) << "input gradient " << i;
      }
    }
  }
}

TEST(host_block_loops, optimizer_updates_match_the_per_element_code) {
  auto check = [&]<class T>() {
    for (std::size_t n : {std::size_t{1}, std::size_t{511}, std::size_t{1500}}) {
      const auto grad = awkward_values<T>(n, 5);
      std::vector<float> value(n), state(n), state2(n);
      for (std::size_t i = 0; i < n; ++i) {
        value[i] = philox_uniform(3, 0, i) - 0.5f;
        state[i] = philox_uniform(3, 1, i) - 0.5f;
        state2[i] = philox_uniform(3, 2, i);
      }
      for (bool first : {true, false}) {
        // SGD with momentum and Nesterov (group: value, grad, momentum, working copy)
        using sgd = typename kernels::sgd_update_op<T>::bound;
        const sgd op{0.05f, 0.9f, 0.1f, 1e-4f, 1.0f / 1024, 1.0f, first ? 1.0f : 0.0f, false};
        auto v1 = value, b1 = state, v2 = value, b2 = state;
        std::vector<T> w1(n), w2(n);
        op.for_group(tensor_group<4>{{v1.data(), const_cast<T*>(grad.data()), b1.data(), w1.data()}, n});
        for (std::size_t i = 0; i < n; ++i)
          op(tensor_group<4>{{v2.data(), const_cast<T*>(grad.data()), b2.data(), w2.data()}, n}, i);
        EXPECT_EQ(bits_of(v1), bits_of(v2)) << "sgd n=" << n;
        EXPECT_EQ(bits_of(b1), bits_of(b2)) << "sgd n=" << n;
        EXPECT_EQ(bits_of(w1), bits_of(w2)) << "sgd n=" << n;
      }
      // AdamW (group: value, grad, m, v, working copy)
      using adamw = typename kernels::adamw_update_op<T>::bound;
      const adamw op{0.9f, 0.999f, 1e-8f, 0.99f, 0.01f, 1.2f, 1.0f / 512, false};
      auto v1 = value, m1 = state, s1 = state2, v2 = value, m2 = state, s2 = state2;
      std::vector<T> w1(n), w2(n);
      op.for_group(tensor_group<5>{{v1.data(), const_cast<T*>(grad.data()), m1.data(), s1.data(), w1.data()}, n});
      for (std::size_t i = 0; i < n; ++i)
        op(tensor_group<5>{{v2.data(), const_cast<T*>(grad.data()), m2.data(), s2.data(), w2.data()}, n}, i);
      EXPECT_EQ(bits_of(v1), bits_of(v2)) << "adamw n=" << n;
      EXPECT_EQ(bits_of(m1), bits_of(m2)) << "adamw n=" << n;
      EXPECT_EQ(bits_of(s1), bits_of(s2)) << "adamw n=" << n;
      EXPECT_EQ(bits_of(w1), bits_of(w2)) << "adamw n=" << n;
    }
  };
  check.template operator()<lockstep::half>();
  check.template operator()<bfloat16>();
}

// ---- multi-tensor launches that do not fit one launch --------------------------------------------------------

namespace {
class multi_tensor_test : public backend_test {};

struct twice_plus_one_op {  // x = 2 x + 1 over every tensor of the list
  LOCKSTEP_HD void operator()(const tensor_group<1>& g, std::size_t i) const {
    float* x = static_cast<float*>(g.ptr[0]);
    x[i] = 2.0f * x[i] + 1.0f;
  }
};
}  // namespace

INSTANTIATE_TEST_SUITE_P(all, multi_tensor_test, all_backends(), backend_name);

TEST_P(multi_tensor_test, more_tensors_and_blocks_than_one_launch_holds_are_each_updated_once) {
  // 150 small tensors (more groups than a launch's table holds: 96 with CUDA 12.1+, 24 before) of sizes around the
  // 16K-element chunk, then two of 33.5M elements (together more than the 4096 blocks of one launch), so that
  // launches split between groups and inside a group. Tensor k holds k: a mixed-up group shows as a wrong value.
  stream s(dev());
  std::vector<std::size_t> sizes_of;
  for (std::size_t k = 0; k < 150; ++k) sizes_of.push_back(16384 + (k % 5) - 2 + (k % 7) * 1000);
  sizes_of.push_back(std::size_t{2048} * 16384 + 5);
  sizes_of.push_back(std::size_t{2048} * 16384 + 16383);
  std::vector<device_buffer<float>> tensors;
  std::vector<tensor_group<1>> groups;
  for (std::size_t k = 0; k < sizes_of.size(); ++k) {
    tensors.emplace_back(sizes_of[k], s);
    fill(tensors.back().span(), static_cast<float>(k), s);
    groups.push_back(tensor_group<1>{{tensors.back().data()}, sizes_of[k]});
  }
  launch_multi_tensor<1>(groups, twice_plus_one_op{}, s, "twice plus one");
  auto expect_each = [&](auto expected_of, const char* what) {
    for (std::size_t k = 0; k < sizes_of.size(); ++k) {
      const auto values = to_vector(device_span<const float>(tensors[k].span()), s);
      const float expected = expected_of(static_cast<float>(k));
      std::size_t wrong = 0;
      for (float v : values) wrong += v != expected ? 1 : 0;
      EXPECT_EQ(wrong, 0u) << what << ": tensor " << k << " of " << sizes_of[k] << " elements";
    }
  };
  expect_each([](float k) { return 2.0f * k + 1.0f; }, "launch_multi_tensor");
#if LOCKSTEP_HAS_CUDA
  if (dev().is_cuda()) {
    // The 4 KiB tables a driver older than CUDA 12.1 gets (issue 28, defect 9): 24 groups and 320 blocks per launch.
    detail::launch_multi_tensor_tables<detail::multi_tensor_small_table<1>>(std::span<const tensor_group<1>>(groups),
                                                                             twice_plus_one_op{}, s, "small tables");
    expect_each([](float k) { return 2.0f * (2.0f * k + 1.0f) + 1.0f; }, "the small tables");
  }
#endif
}

// ---- exact sums (deterministic mode) --------------------------------------------------------------------------

namespace {
// A float of random sign and mantissa with exponent in [lo, hi] (a power of two times 1.xxx).
float random_term(std::uint64_t i, int lo, int hi) {
  const float u = philox_uniform(11, 1, i), w = philox_uniform(11, 2, i), sgn = philox_uniform(11, 3, i);
  const int e = lo + static_cast<int>(w * static_cast<float>(hi - lo + 1)) % (hi - lo + 1);
  return std::ldexp(1.0f + u, e) * (sgn < 0.5f ? -1.0f : 1.0f);
}

struct limbs {
  std::int64_t hi = 0, lo = 0, outside = 0;
  void add(float v) { kernels::exact_add(v, hi, lo, outside); }
  void add(const limbs& o) {
    hi += o.hi;
    lo += o.lo;
    outside += o.outside;
  }
  [[nodiscard]] float round() const { return kernels::exact_round(hi, lo, outside); }
};

float sum_of(const std::vector<float>& terms) {
  limbs l;
  for (float v : terms) l.add(v);
  return l.round();
}
}  // namespace

TEST(exact_sum, rounds_the_exact_sum_once_to_nearest_even) {
  // Terms whose exponents span at most 30 bits, 20 at a time: their sum is exact in a long double (64 bits).
  for (std::uint64_t trial = 0; trial < 2000; ++trial) {
    const int base = static_cast<int>(trial % 50) - 30;  // 2^-30 .. 2^19
    std::vector<float> terms;
    long double exact = 0;
    for (std::uint64_t k = 0; k < 20; ++k) {
      terms.push_back(random_term(trial * 64 + k, base, base + 6));
      exact += terms.back();
    }
    ASSERT_EQ(std::bit_cast<std::uint32_t>(sum_of(terms)), std::bit_cast<std::uint32_t>(static_cast<float>(exact)))
        << "trial " << trial;
  }
  // Ties: 1 + 2^-24 is halfway between 1 and 1 + 2^-23 (to even: 1); the smallest fixed-point step above it
  // (2^-60, beyond a double's 53 bits) tips it up, as one rounding of the exact sum must.
  EXPECT_EQ(sum_of({1.0f, 0x1p-24f}), 1.0f);
  EXPECT_EQ(sum_of({1.0f, 0x1p-24f, 0x1p-60f}), 1.0f + 0x1p-23f);
  EXPECT_EQ(sum_of({1.0f + 0x1p-23f, 0x1p-24f}), 1.0f + 0x1p-22f);
  EXPECT_EQ(sum_of({-1.0f, -0x1p-24f, -0x1p-60f}), -1.0f - 0x1p-23f);
  // the same above 2^4, where the tipping bit lies below the 64 bits the rounding looks at first
  EXPECT_EQ(sum_of({32.0f, 0x1p-19f}), 32.0f);
  EXPECT_EQ(sum_of({32.0f, 0x1p-19f, 0x1p-60f}), 32.0f + 0x1p-18f);
  EXPECT_EQ(sum_of({-0x1p30f, -0x1p6f, -0x1p-60f}), -0x1p30f - 0x1p7f);
  // Cancellation to exactly zero, and to the smallest step.
  EXPECT_EQ(sum_of({0x1p31f, 3.0f, -0x1p31f, -3.0f}), 0.0f);
  EXPECT_EQ(sum_of({0x1p31f, 0x1p-60f, -0x1p31f}), 0x1p-60f);
}

TEST(exact_sum, terms_below_the_fixed_point_round_each_on_their_own) {
  EXPECT_EQ(sum_of({3.0f * 0x1p-62f}), 0x1p-60f);  // 0.75 steps -> 1
  EXPECT_EQ(sum_of({0x1p-61f}), 0.0f);             // 0.5 steps: a tie, to even 0
  EXPECT_EQ(sum_of({3.0f * 0x1p-61f}), 0x1p-59f);  // 1.5 steps -> 2
  EXPECT_EQ(sum_of({0x1p-61f, 0x1p-61f}), 0.0f);   // per term, not of the sum: the same wherever a term goes
  EXPECT_EQ(sum_of({0x1p-37f + 0x1p-60f}), 0x1p-37f + 0x1p-60f);  // from 2^-37 on, every bit is kept
}

TEST(exact_sum, any_order_and_any_split_over_accumulators_gives_the_same_bits) {
  // 1000 terms spanning 2^-45 .. 2^30, of both signs: a float sum depends on the order, the exact one does not.
  std::vector<float> terms;
  for (std::uint64_t k = 0; k < 1000; ++k) terms.push_back(random_term(k, -45, 30));
  const float reference = sum_of(terms);
  float forward_float = 0, backward_float = 0;
  for (float v : terms) forward_float += v;
  for (auto it = terms.rbegin(); it != terms.rend(); ++it) backward_float += *it;
  EXPECT_NE(forward_float, backward_float) << "the terms must be ones whose float sum depends on the order";
  for (int parts : {2, 3, 7, 64}) {
    std::vector<limbs> acc(static_cast<std::size_t>(parts));
    for (std::size_t k = 0; k < terms.size(); ++k) acc[(k * 31 + 7) % acc.size()].add(terms[terms.size() - 1 - k]);
    limbs total;
    for (auto it = acc.rbegin(); it != acc.rend(); ++it) total.add(*it);
    EXPECT_EQ(std::bit_cast<std::uint32_t>(total.round()), std::bit_cast<std::uint32_t>(reference)) << parts << " parts";
  }
}

TEST(exact_sum, non_finite_and_oversized_terms_make_the_tensor_nan) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity(), 0x1p32f, -0x1p40f, -6e11f, 3e38f}) {
    limbs l;
    l.add(1.0f);
    l.add(bad);
    EXPECT_TRUE(std::isnan(l.round())) << bad;
  }
  limbs fine;
  fine.add(0x1p31f * 1.9f);  // just inside the window
  EXPECT_EQ(fine.outside, 0);
  EXPECT_EQ(fine.round(), 0x1p31f * 1.9f);
}

TEST(exact_sum, a_term_outside_the_window_makes_nan_whichever_path_and_split_it_takes) {
  // {5e9, 1, 1e-20}: alone, 5e9 would pass the double path's exactness test (one term); with the tiny term it
  // goes term by term. Either way it is outside the window: NaN, on the host loops and on the per-element
  // (GPU) code, in one accumulation or two.
  const std::vector<float> partials = {5e9f, 1.0f, 1e-20f};
  auto round = [](const std::vector<std::int64_t>& acc) { return kernels::exact_round(acc[0], acc[1], acc[2]); };
  for (bool host_loop : {true, false}) {
    auto run = [&](const kernels::exact_accumulate_op<float>& op) { host_loop ? op.for_all(1) : op(0); };
    std::vector<std::int64_t> one(kernels::exact_words(1), 0), two(kernels::exact_words(1), 0);
    run({partials.data(), 3, 1, one.data(), one.data() + 1, one.data() + 2, true});
    run({partials.data(), 1, 1, two.data(), two.data() + 1, two.data() + 2, true});
    run({partials.data() + 1, 2, 1, two.data(), two.data() + 1, two.data() + 2, false});
    EXPECT_TRUE(std::isnan(round(one))) << (host_loop ? "host loop" : "per element") << ", one accumulation";
    EXPECT_TRUE(std::isnan(round(two))) << (host_loop ? "host loop" : "per element") << ", two accumulations";
    float out = 0;
    std::int64_t outside = 0;
    const kernels::exact_sum_op<float> sum{partials.data(), 1, 1, &out, &outside};
    host_loop ? sum.for_all(1) : sum(0);
    EXPECT_EQ(outside, 1) << "the one-pass sum of 5e9 alone counts it";
  }
}

TEST(exact_sum, the_double_path_and_the_integer_path_agree) {
  // Limbs of every size, including sums of many terms (beyond the double path's 2^51) and long carries.
  std::size_t fast = 0;
  for (std::uint64_t i = 0; i < 200000; ++i) {
    const int hb = static_cast<int>(i % 62), lb = static_cast<int>((i / 62) % 62);
    const auto hi = static_cast<std::int64_t>(static_cast<double>(philox_uniform(5, 1, i) - 0.5f) * std::ldexp(1.0, hb));
    const auto lo = static_cast<std::int64_t>(static_cast<double>(philox_uniform(5, 2, i) - 0.5f) * std::ldexp(1.0, lb));
    float viad = 0;
    if (kernels::exact_detail::round_limbs_double(hi, lo, viad)) {
      ++fast;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(viad),
                std::bit_cast<std::uint32_t>(kernels::exact_detail::round_limbs_integer(hi, lo)))
          << "hi " << hi << " lo " << lo;
    }
  }
  EXPECT_GT(fast, 10000u) << "the double path must be taken for ordinary limbs";
}

TEST(host_block_loops, exact_sums_give_the_same_bits_in_every_loop_this_cpu_runs) {
  // The float exact sums have a third host copy, AVX-512 with 8 doubles a vector (host_loop.hpp), on their default
  // paths (one pass, the communicators' sums; accumulated and rounded have two): the baseline, AVX2 and AVX-512 loops
  // (each this CPU runs) against the term-by-term limbs, bit for bit, for 1 to 9 chunks of terms that take the double
  // path, terms that need the integer path, zeros and negative zeros.
  constexpr std::size_t n = 1031, most = 9;
  std::vector<float> terms(n * most);
  for (std::size_t c = 0; c < most; ++c) {
    for (std::size_t i = 0; i < n; ++i) {
      float v = i % 5 == 2 ? random_term(c * n + i + 3, -40, 20) : random_term(c * n + i + 3, -9, -1);
      if (i % 17 == 4) v = -0.0f;
      if (i % 19 == 7 && c % 2 == 0) v = 0.0f;
      terms[c * n + i] = v;
    }
  }
  using sum_op = kernels::exact_sum_op<float>;
  using accumulate_op = kernels::exact_accumulate_op<float>;
  using round_op = kernels::exact_round_op<float>;
  static_assert(detail::wants_host_avx512<sum_op> && !detail::wants_host_avx512<kernels::exact_sum_op<lockstep::half>>);
  // (a CPU without AVX-512, or AVX2, checks the loops it has)
  const auto bits = [](float v) { return std::bit_cast<std::uint32_t>(v); };
  // each loop that runs here: f(loop) calls loop(count, functor)
  const auto each_loop = [&](auto&& f) {
    f("baseline", [](std::size_t count, const auto& k) { detail::host_loop_body(count, k); });
#if LOCKSTEP_HOST_AVX2_CLONES
    if (detail::cpu_has_avx2()) f("AVX2", [](std::size_t count, const auto& k) { detail::host_loop_avx2(count, k); });
#endif
#if LOCKSTEP_HOST_AVX512_CLONES
    if (detail::cpu_has_avx512()) {
      f("AVX-512", [](std::size_t count, const auto& k) { detail::host_loop_avx512(count, k); });
    }
#endif
  };
  for (std::size_t k = 1; k <= most; ++k) {
    std::vector<float> want(n);
    for (std::size_t i = 0; i < n; ++i) {
      limbs l;
      for (std::size_t c = 0; c < k; ++c) l.add(terms[c * n + i]);
      want[i] = l.round();
    }
    each_loop([&](const char* loop, auto&& run) {
      SCOPED_TRACE(::testing::Message() << loop << ", " << k << " chunks");
      std::vector<float> one_pass(n, 7.0f), rounded(n, 7.0f);
      std::vector<std::int64_t> acc(kernels::exact_words(n), 0);
      std::int64_t outside = 0;
      run(n, sum_op{terms.data(), k, n, one_pass.data(), &outside});
      run(n, accumulate_op{terms.data(), k, n, acc.data(), acc.data() + n, acc.data() + 2 * n, true});
      run(n, round_op{acc.data(), acc.data() + n, acc.data() + 2 * n, rounded.data()});
      // the communicators' sums, into two outputs
      std::vector<float> first(n, 7.0f), second(n, 7.0f);
      float* const outs[2] = {first.data(), second.data()};
      const auto term = [&](std::size_t c) -> const float* { return terms.data() + c * n; };
      run(n, kernels::exact_sums_host_op<float, decltype(term)>{term, k, outs, 2, &outside});
      EXPECT_EQ(outside, 0);
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(bits(one_pass[i]), bits(want[i])) << "one pass, element " << i;
        ASSERT_EQ(bits(rounded[i]), bits(want[i])) << "accumulated, element " << i;
        ASSERT_EQ(bits(first[i]), bits(want[i])) << "communicators' sum, element " << i;
        ASSERT_EQ(bits(second[i]), bits(want[i])) << "communicators' sum, second output, element " << i;
      }
    });
  }
  // f16 and bf16: floats rounded to T (round_run) summed into T outputs give the sums of the T terms themselves
  // (exact_sum_op<T>, which deterministic mode's one-pass weight gradients ran before), NaNs, infinities and terms
  // outside the window (counted alike) included
  auto rounded_terms = [&]<class T>() {
    std::vector<float> special(terms);
    for (std::size_t i = 0; i < n; i += 97) special[i] = std::nanf("");
    for (std::size_t i = 13; i < n; i += 101) special[n + i] = 1e30f;  // bf16: finite, past 2^32; f16: infinite
    for (std::size_t i = 29; i < n; i += 89) special[2 * n + i] = -std::numeric_limits<float>::infinity();
    const auto all = static_cast<std::int64_t>(special.size());
    std::vector<T> narrow(special.size());
    std::vector<float> wide(special.size());
    detail::narrow_run(special.data(), narrow.data(), all);
    detail::round_run<T>(special.data(), wide.data(), all);
    for (const std::size_t k : {std::size_t{1}, std::size_t{3}, most}) {
      SCOPED_TRACE(::testing::Message() << name_of(dtype_of_v<T>) << ", " << k << " chunks");
      std::vector<T> want(n), got(n);
      std::int64_t outside_want = 0, outside_got = 0;
      detail::run_host_loop(n, kernels::exact_sum_op<T>{narrow.data(), k, n, want.data(), &outside_want});
      T* const outs[1] = {got.data()};
      const auto term = [&](std::size_t c) -> const float* { return wide.data() + c * n; };
      detail::run_host_loop(n, kernels::exact_sums_host_op<float, decltype(term), T>{term, k, outs, 1, &outside_got});
      EXPECT_EQ(outside_got, outside_want);
      EXPECT_NE(outside_want, 0);
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(got[i].bits, want[i].bits) << "element " << i;
    }
  };
  rounded_terms.template operator()<lockstep::half>();
  rounded_terms.template operator()<lockstep::bfloat16>();
}

namespace {
class exact_kernel_test : public backend_and_dtype {};
}  // namespace

INSTANTIATE_TEST_SUITE_P(all, exact_kernel_test,
                         ::testing::Combine(::testing::Values(device_kind::host, device_kind::cuda),
                                            ::testing::Values(dtype::f32, dtype::f16, dtype::bf16)),
                         param_name);

TEST_P(exact_kernel_test, accumulate_round_and_one_pass_sum_match_the_term_by_term_reference) {
  // 5 chunks of partial sums over 1501 elements: ordinary ones (the double path), some spanning 2^-30 .. 2^14
  // (the term-by-term path), zeros; accumulated 2 + 3 chunks, and summed in one pass.
  with_float_type(type(), [&]<class T>() {
    stream s(dev());
    constexpr std::size_t n = 1501, chunks = 5;
    std::vector<float> partial(n * chunks);
    for (std::size_t c = 0; c < chunks; ++c) {
      for (std::size_t i = 0; i < n; ++i) {
        float v = i % 7 == 3 ? random_term(c * n + i, -30, 14) : random_term(c * n + i, -8, -2);
        if (i % 11 == 5) v = 0.0f;
        partial[c * n + i] = to_float(convert<T>(v));  // what the storage type holds
      }
    }
    std::vector<float> expected(n);
    for (std::size_t i = 0; i < n; ++i) {
      limbs l;
      for (std::size_t c = 0; c < chunks; ++c) l.add(partial[c * n + i]);
      expected[i] = to_float(convert<T>(l.round()));
    }
    auto partials = to_device(from_floats<T>(partial), s);
    device_buffer<std::int64_t> acc(kernels::exact_words(n), s);
    fill_zero(acc.span(), s);
    launch_elementwise(n, kernels::exact_accumulate_op<T>{partials.data(), 2, n, acc.data(), acc.data() + n, acc.data() + 2 * n, true}, s, "accumulate");
    launch_elementwise(n, kernels::exact_accumulate_op<T>{partials.data() + 2 * n, 3, n, acc.data(), acc.data() + n, acc.data() + 2 * n, false}, s,
                       "accumulate");
    device_buffer<T> rounded(n, s), one_pass(n, s);
    launch_elementwise(n, kernels::exact_round_op<T>{acc.data(), acc.data() + n, acc.data() + 2 * n, rounded.data()}, s,
                       "round");
    // a range of the elements alone (a ZeRO shard): [n/3, n - n/4)
    const std::size_t from = n / 3, to = n - n / 4;
    device_buffer<T> range(to - from, s);
    launch_elementwise(to - from,
                       kernels::exact_round_op<T>{acc.data() + from, acc.data() + n + from, acc.data() + 2 * n, range.data()},
                       s, "round a range");
    device_buffer<std::int64_t> outside(1, s);
    fill_zero(outside.span(), s);
    launch_elementwise(n, kernels::exact_sum_op<T>{partials.data(), chunks, n, one_pass.data(), outside.data()}, s,
                       "sum");
    launch_elementwise(n, kernels::exact_poison_op<T>{outside.data(), one_pass.data()}, s, "poison");
    const auto a = to_floats(to_vector(device_span<const T>(rounded.span()), s));
    const auto b = to_floats(to_vector(device_span<const T>(one_pass.span()), s));
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(a[i], expected[i]) << "accumulated, element " << i;
      ASSERT_EQ(b[i], expected[i]) << "one pass, element " << i;
    }
    const auto ranged = to_floats(to_vector(device_span<const T>(range.span()), s));
    for (std::size_t i = from; i < to; ++i) ASSERT_EQ(ranged[i - from], expected[i]) << "range, element " << i;
    // one pass over the first k chunks, k = 1 .. 9 (the host loop takes terms four at a time: every remainder, one
    // and more groups), bit for bit: elements whose terms are all -0 sum to +0, as the exact sum
    constexpr std::size_t more = 9;
    std::vector<float> terms(n * more);
    for (std::size_t c = 0; c < more; ++c) {
      for (std::size_t i = 0; i < n; ++i) {
        float v = i % 7 == 3 ? random_term(c * n + i + 7, -30, 14) : random_term(c * n + i + 7, -8, -2);
        if (i % 13 == 6) v = -0.0f;
        terms[c * n + i] = to_float(convert<T>(v));
      }
    }
    auto terms_on_device = to_device(from_floats<T>(terms), s);
    for (std::size_t k = 1; k <= more; ++k) {
      fill_zero(outside.span(), s);
      launch_elementwise(n, kernels::exact_sum_op<T>{terms_on_device.data(), k, n, one_pass.data(), outside.data()}, s,
                         "sum of k chunks");
      const auto got = to_floats(to_vector(device_span<const T>(one_pass.span()), s));
      for (std::size_t i = 0; i < n; ++i) {
        limbs l;
        for (std::size_t c = 0; c < k; ++c) l.add(terms[c * n + i]);
        const float want = to_float(convert<T>(l.round()));
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want))
            << k << " chunks, element " << i << ": " << got[i] << " against " << want;
      }
    }
    // one term outside the window: every element of the tensor is NaN, on both paths
    std::vector<float> with_inf(partial);
    with_inf[3 * n + 17] = std::numeric_limits<float>::infinity();
    auto bad = to_device(from_floats<T>(with_inf), s);
    fill_zero(acc.span(), s);
    fill_zero(outside.span(), s);
    launch_elementwise(n, kernels::exact_accumulate_op<T>{bad.data(), chunks, n, acc.data(), acc.data() + n, acc.data() + 2 * n, true}, s, "accumulate");
    launch_elementwise(n, kernels::exact_round_op<T>{acc.data(), acc.data() + n, acc.data() + 2 * n, rounded.data()}, s,
                       "round");
    launch_elementwise(n, kernels::exact_sum_op<T>{bad.data(), chunks, n, one_pass.data(), outside.data()}, s, "sum");
    launch_elementwise(n, kernels::exact_poison_op<T>{outside.data(), one_pass.data()}, s, "poison");
    const auto c = to_floats(to_vector(device_span<const T>(rounded.span()), s));
    const auto d = to_floats(to_vector(device_span<const T>(one_pass.span()), s));
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(std::isnan(c[i]) && std::isnan(d[i])) << "element " << i;
    }
  });
}
