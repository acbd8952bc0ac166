// Tests of nn/ and optim/ on both backends (the CUDA instances skip without a GPU, or with too few): every layer
// and loss by finite differences, a user's own layer written against the `layer` concept, sequential chains,
// cloning, steady-state memory, and the optimizers against hand-computed steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "lockstep/io/checkpoint.hpp"
#include "lockstep/io/safetensors.hpp"
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/nn/activation.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/nn/conv2d.hpp"
#include "lockstep/nn/dropout.hpp"
#include "lockstep/nn/flatten.hpp"
#include "lockstep/nn/gradient_check.hpp"
#include "lockstep/nn/graph.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/nn/layer_norm.hpp"
#include "lockstep/nn/linear.hpp"
#include "lockstep/nn/loss.hpp"
#include "lockstep/nn/pool.hpp"
#include "lockstep/nn/sequential.hpp"
#include "lockstep/nn/state_dict.hpp"
#include "lockstep/optim/adamw.hpp"
#include "lockstep/optim/lr_schedule.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/runtime/copy.hpp"
#include "test_support.hpp"

using namespace lockstep;
using namespace lockstep_test;

namespace {

std::vector<float> random_values(std::size_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// Values away from 0 by at least `gap` (for ReLU's kink).
std::vector<float> values_off_zero(std::size_t n, std::uint32_t seed, float gap) {
  auto v = random_values(n, seed);
  for (auto& x : v) x = x < 0 ? x - gap : x + gap;
  return v;
}

std::vector<float> read(const tensor_view& t, stream_ref s) { return to_vector(t.span<const float>(), s); }

void write(const tensor_view& t, const std::vector<float>& v, stream_ref s) {
  auto staged = to_device(v, s);
  copy(t.span<float>(), device_span<const float>(staged.span()), s);
  s.synchronize();
}

// A device tensor holding host values.
tensor make_tensor(const std::vector<float>& v, shape dims, stream_ref s) {
  tensor t(dims, dtype::f32, s);
  write(t.view(), v, s);
  return t;
}

tensor make_labels(const std::vector<std::int32_t>& v, stream_ref s) {
  tensor t(shape{static_cast<std::int64_t>(v.size())}, dtype::i32, s);
  auto staged = to_device(v, s);
  copy(t.span<std::int32_t>(), device_span<const std::int32_t>(staged.span()), s);
  s.synchronize();
  return t;
}

// Checks a layer's backward against central differences of L(x, params) = sum(G * layer(x)), with the public
// checker (nn/gradient_check.hpp).
template <layer L>
void check_layer_gradients(L& l, context& ctx, const std::vector<float>& x_values, shape x_shape, double eps = 1e-2,
                           double tolerance = 2e-3) {
  const gradient_check_report r = check_gradients(l, ctx, x_values, x_shape, gradient_check_options{.step = eps});
  ASSERT_FALSE(r.tensors.empty());
  for (const auto& t : r.tensors) {
    EXPECT_LE(t.worst_error, tolerance) << r.str();
    EXPECT_GT(t.checked, 0) << t.name;
  }
}

// A user's own layer, written against the concept: y = x + alpha * fc(x), with fc square.
class scaled_residual {
 public:
  scaled_residual(std::int64_t width, float alpha, context& ctx, initializer& init)
      : fc_(width, width, ctx, init), alpha_(alpha) {}

  tensor_view forward(const tensor_view& x, context& ctx) {
    const tensor_view h = fc_.forward(x, ctx);
    y_.ensure(x.dims(), x.type(), ctx.stream());
    copy(y_.span<float>(), x.span<const float>(), ctx.stream());
    axpy<float>(alpha_, h.span<const float>(), y_.span<float>(), ctx.stream());
    return y_.view();
  }
  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    scaled_.ensure(gy.dims(), gy.type(), ctx.stream());
    copy(scaled_.span<float>(), gy.span<const float>(), ctx.stream());
    scale<float>(scaled_.span<float>(), alpha_, ctx.stream());
    const tensor_view g_fc = fc_.backward(scaled_, ctx, need);
    if (need == input_grad::not_required) return {};
    gx_.ensure(gy.dims(), gy.type(), ctx.stream());
    copy(gx_.span<float>(), gy.span<const float>(), ctx.stream());
    axpy<float>(1.0f, g_fc.span<const float>(), gx_.span<float>(), ctx.stream());
    return gx_.view();
  }
  void parameters(parameter_list& out) {
    auto scope = out.scope("fc");
    fc_.parameters(out);
  }
  [[nodiscard]] scaled_residual clone(context& ctx) const { return scaled_residual(fc_.clone(ctx), alpha_); }
  [[nodiscard]] shape output_shape(const shape& s) const { return fc_.output_shape(s); }

 private:
  scaled_residual(linear fc, float alpha) : fc_(std::move(fc)), alpha_(alpha) {}
  linear fc_;
  float alpha_;
  tensor y_, scaled_, gx_;
};
static_assert(layer<scaled_residual>);

// Every suite below runs once per backend.
class finite_differences_test : public backend_test {};
class loss_test : public backend_test {};
class dropout_test : public backend_test {};
class clone_test : public backend_test {};
class memory_test : public backend_test {};
class sgd_test : public backend_test {};
class adamw_test : public backend_test {};
class optimizer_test : public backend_test {};
class lr_schedule_test : public backend_test {};

}  // namespace

INSTANTIATE_TEST_SUITE_P(all, finite_differences_test, all_backends(), backend_name);
INSTANTIATE_TEST_SUITE_P(all, loss_test, all_backends(), backend_name);
INSTANTIATE_TEST_SUITE_P(all, dropout_test, all_backends(), backend_name);
INSTANTIATE_TEST_SUITE_P(all, clone_test, all_backends(), backend_name);
INSTANTIATE_TEST_SUITE_P(all, memory_test, all_backends(), backend_name);
INSTANTIATE_TEST_SUITE_P(all, sgd_test, all_backends(), backend_name);
INSTANTIATE_TEST_SUITE_P(all, adamw_test, all_backends(), backend_name);
INSTANTIATE_TEST_SUITE_P(all, optimizer_test, all_backends(), backend_name);
INSTANTIATE_TEST_SUITE_P(all, lr_schedule_test, all_backends(), backend_name);

// ---- layers by finite differences ------------------------------------------------------------------------------

TEST_P(finite_differences_test, linear) {
  context ctx(default_stream(dev()));
  initializer init(1);
  linear l(5, 4, ctx, init);
  check_layer_gradients(l, ctx, random_values(15, 2), shape{3, 5});
}

TEST_P(finite_differences_test, linear_without_bias) {
  context ctx(default_stream(dev()));
  initializer init(1);
  linear l(4, 3, ctx, init, bias::no);
  EXPECT_EQ(parameters_of(l).size(), 1u);
  check_layer_gradients(l, ctx, random_values(8, 3), shape{2, 4});
}

TEST_P(finite_differences_test, relu_gelu_tanh) {
  context ctx(default_stream(dev()));
  relu r;
  check_layer_gradients(r, ctx, values_off_zero(12, 4, 0.05f), shape{3, 4});
  gelu g;
  check_layer_gradients(g, ctx, random_values(12, 5, -3.0f, 3.0f), shape{3, 4});
  tanh_layer t;
  check_layer_gradients(t, ctx, random_values(12, 6, -2.0f, 2.0f), shape{3, 4});
}

TEST_P(finite_differences_test, dropout_in_training) {
  context ctx(default_stream(dev()));
  ctx.set_seed(7);
  initializer init(0);
  dropout d(0.3f, init);
  check_layer_gradients(d, ctx, random_values(40, 8), shape{4, 10});
}

TEST_P(finite_differences_test, a_users_own_layer) {
  context ctx(default_stream(dev()));
  initializer init(3);
  scaled_residual r(4, 0.5f, ctx, init);
  check_layer_gradients(r, ctx, random_values(12, 9), shape{3, 4});
  const auto names = parameters_of(r);
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[0].name, "fc.weight");
}

TEST_P(finite_differences_test, sequential_chain_with_a_users_layer) {
  context ctx(default_stream(dev()));
  initializer init(4);
  sequential net(linear(6, 5, ctx, init), tanh_layer(), scaled_residual(5, 0.25f, ctx, init), linear(5, 3, ctx, init));
  check_layer_gradients(net, ctx, random_values(12, 10), shape{2, 6});
  const auto ps = parameters_of(net);
  ASSERT_EQ(ps.size(), 6u);
  EXPECT_EQ(ps[0].name, "0.weight");
  EXPECT_EQ(ps[2].name, "2.fc.weight");
  EXPECT_EQ(ps[5].name, "3.bias");
  EXPECT_EQ(net.output_shape(shape{6}), shape{3});
  EXPECT_THROW((void)net.output_shape(shape{7}), precondition_error);
}

// ---- the public gradient check, layer_norm, flatten --------------------------------------------------------------

// (A named namespace: nvcc warns about a layer's members that a test never calls in an unnamed one.)
namespace nn_test_layers {
// y = 3x with a backward that forgets the 3: what check_gradients exists to catch.
class wrong_backward {
 public:
  tensor_view forward(const tensor_view& x, context& ctx) {
    y_.ensure(x.dims(), x.type(), ctx.stream());
    copy(y_.span<float>(), x.span<const float>(), ctx.stream());
    scale<float>(y_.span<float>(), 3.0f, ctx.stream());
    return y_.view();
  }
  tensor_view backward(const tensor_view& gy, context&, input_grad) { return gy; }
  void parameters(parameter_list&) {}
  [[nodiscard]] wrong_backward clone(context&) const { return {}; }
  [[nodiscard]] shape output_shape(const shape& s) const { return s; }

 private:
  tensor y_;
};
}  // namespace nn_test_layers
using nn_test_layers::wrong_backward;

namespace {
// The relative norm of the difference, ||a - b|| / ||b||.
double relative_norm(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    n += static_cast<double>(b[i]) * b[i];
  }
  return a.size() == b.size() ? std::sqrt(d / n) : 1.0;
}

// A tensor of type `type` holding `v` (rounded), and a tensor read back as floats.
tensor typed_tensor(const std::vector<float>& v, shape dims, dtype type, stream_ref s) {
  tensor f = make_tensor(v, dims, s);
  tensor t(dims, type, s);
  dispatch_floating(type, "test", [&]<class T>() {
    if constexpr (std::is_same_v<T, float>) {
      copy(t.span<float>(), f.span<const float>(), s);
    } else {
      cast<T, float>(f.span<const float>(), t.span<T>(), s);
    }
  });
  s.synchronize();
  return t;
}
std::vector<float> read_as_float(const tensor_view& t, stream_ref s) {
  tensor f(t.dims(), dtype::f32, s);
  dispatch_floating(t.type(), "test", [&]<class T>() {
    if constexpr (std::is_same_v<T, float>) {
      copy(f.span<float>(), t.span<const float>(), s);
    } else {
      cast<float, T>(t.span<const T>(), f.span<float>(), s);
    }
  });
  return read(f, s);
}
}  // namespace

TEST_P(finite_differences_test, the_public_check_names_a_wrong_backward_and_a_context_not_in_f32) {
  context ctx(default_stream(dev()));
  wrong_backward w;
  const gradient_check_report r = check_gradients(w, ctx, shape{2, 3});
  ASSERT_EQ(r.tensors.size(), 1u);
  EXPECT_EQ(r.tensors[0].name, "input");
  EXPECT_EQ(r.tensors[0].checked, 6);
  EXPECT_NEAR(r.at("input").worst_error, 2.0 / 3.0, 1e-3) << r.str();  // analytic 1 where 3 is right
  EXPECT_CONTAINS(r.str(), "input: worst error");
  // max_elements: evenly spaced elements only
  initializer init(5);
  linear l(8, 4, ctx, init);
  const auto some = check_gradients(l, ctx, shape{3, 8}, gradient_check_options{.max_elements = 5});
  EXPECT_EQ(some.at("weight").checked, 5);
  EXPECT_EQ(some.at("bias").checked, 4);
  EXPECT_LE(some.worst(), 2e-3) << some.str();
  context half(default_stream(dev()), dtype::f16);
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)check_gradients(w, half, shape{2, 3}); }),
                  "check_gradients runs the layer in f32, but the context computes in f16");
}

TEST_P(finite_differences_test, layer_norm_with_and_without_affine_over_the_last_dimension) {
  context ctx(default_stream(dev()));
  layer_norm ln(5, ctx);
  const auto ps = parameters_of(ln);
  ASSERT_EQ(ps.size(), 2u);
  EXPECT_EQ(ps[0].name, "weight");
  EXPECT_EQ(ps[1].name, "bias");
  EXPECT_EQ(read(ln.weight().value(), ctx.stream()), std::vector<float>(5, 1.0f));
  EXPECT_EQ(read(ln.bias_parameter().value(), ctx.stream()), std::vector<float>(5, 0.0f));
  // scale and shift away from 1 and 0, so that their gradients matter in the input's
  write_values(ln.weight(), random_values(5, 21, 0.5f, 1.5f), ctx.stream());
  write_values(ln.bias_parameter(), random_values(5, 22), ctx.stream());
  check_layer_gradients(ln, ctx, random_values(15, 23, -2.0f, 2.0f), shape{3, 5});
  check_layer_gradients(ln, ctx, random_values(30, 24, -2.0f, 2.0f), shape{2, 3, 5});  // [batch, tokens, features]
  layer_norm plain(6, ctx, layer_norm_options{.eps = 1e-3f, .elementwise_affine = false});
  EXPECT_TRUE(parameters_of(plain).empty());
  check_layer_gradients(plain, ctx, random_values(24, 25, -2.0f, 2.0f), shape{4, 6});
}

TEST_P(finite_differences_test, layer_norm_rows_have_mean_0_and_variance_1_and_bad_shapes_are_named) {
  context ctx(default_stream(dev()));
  layer_norm ln(64, ctx);
  auto x = random_values(3 * 64, 26, -5.0f, 9.0f);
  for (std::size_t c = 0; c < 64; ++c) x[128 + c] = 1000.0f + 0.001f * static_cast<float>(c);  // large offset
  tensor xt = make_tensor(x, shape{3, 64}, ctx.stream());
  const auto y = read(ln.forward(xt, ctx), ctx.stream());
  auto moments = [](const float* v) {  // mean and biased variance, in double
    double mean = 0, var = 0;
    for (int c = 0; c < 64; ++c) mean += v[c];
    mean /= 64;
    for (int c = 0; c < 64; ++c) var += (v[c] - mean) * (v[c] - mean);
    return std::pair{mean, var / 64};
  };
  for (int r = 0; r < 3; ++r) {
    const auto [mean, var] = moments(y.data() + r * 64);
    const double var_x = moments(x.data() + r * 64).second;
    EXPECT_NEAR(mean, 0.0, 1e-5) << "row " << r;
    // var_x / (var_x + eps): the third row's variance (about 3.4e-4) is not far above eps = 1e-5
    EXPECT_NEAR(var, var_x / (var_x + 1e-5), 2e-4) << "row " << r;
  }
  EXPECT_EQ(ln.output_shape(shape{7, 64}), (shape{7, 64}));
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)ln.output_shape(shape{63}); }),
                  "layer_norm(64) normalizes a last dimension of 64 features, got samples of shape [63]");
  tensor wrong = make_tensor(random_values(12, 27), shape{2, 6}, ctx.stream());
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)ln.forward(wrong, ctx); }),
                  "layer_norm(64): input of shape [2, 6] does not end in a dimension of 64 features");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { layer_norm bad(0, ctx); }), "feature count must be positive");
  initializer init(1);
  graph g(shape{10});
  g.add("fc", linear(10, 8, ctx, init), "input").add("norm", layer_norm(9, ctx), "fc");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)parameters_of(g); }), "layer_norm(9)");
}

TEST_P(finite_differences_test, layer_norm_in_f16_and_bf16_follows_f32_within_the_types_precision) {
  const stream_ref s = default_stream(dev());
  const shape dims{6, 40};
  const auto x = random_values(240, 28, -3.0f, 3.0f), g = random_values(240, 29), w = random_values(40, 30, 0.5f, 1.5f),
             b = random_values(40, 31);
  struct outcome {
    std::vector<float> y, gx, gw, gb;
  };
  auto run = [&](dtype type) {
    context ctx(s, type);
    layer_norm ln(40, ctx);
    write_values(ln.weight(), w, s);
    write_values(ln.bias_parameter(), b, s);
    tensor xt = typed_tensor(x, dims, type, s), gt = typed_tensor(g, dims, type, s);
    outcome o;
    o.y = read_as_float(ln.forward(xt, ctx), s);
    o.gx = read_as_float(ln.backward(gt, ctx, input_grad::required), s);
    o.gw = read_as_float(ln.weight().grad(), s);
    o.gb = read_as_float(ln.bias_parameter().grad(), s);
    return o;
  };
  const outcome ref = run(dtype::f32);
  for (const dtype type : {dtype::f16, dtype::bf16}) {
    const outcome o = run(type);
    const double tol = type == dtype::f16 ? 4e-3 : 3e-2;  // a few units of the type's rounding (2^-11, 2^-8)
    EXPECT_LE(relative_norm(o.y, ref.y), tol) << name_of(type);
    EXPECT_LE(relative_norm(o.gx, ref.gx), tol) << name_of(type);
    EXPECT_LE(relative_norm(o.gw, ref.gw), tol) << name_of(type);
    EXPECT_LE(relative_norm(o.gb, ref.gb), tol) << name_of(type);
  }
}

TEST_P(finite_differences_test, flatten_joins_the_inner_dimensions_and_gives_gradients_their_shape_back) {
  context ctx(default_stream(dev()));
  initializer init(6);
  sequential net(flatten(), linear(12, 3, ctx, init));
  EXPECT_EQ(net.output_shape(shape{3, 2, 2}), shape{3});
  check_layer_gradients(net, ctx, random_values(24, 32), shape{2, 3, 2, 2});
  flatten f;
  tensor x = make_tensor(random_values(24, 33), shape{2, 3, 4}, ctx.stream());
  const tensor_view y = f.forward(x, ctx);
  EXPECT_EQ(y.dims(), (shape{2, 12}));
  EXPECT_EQ(y.data(), x.view().data());  // a view, no copy
  EXPECT_EQ(f.backward(y, ctx, input_grad::required).dims(), (shape{2, 3, 4}));
  tensor none(shape{0, 3, 4}, dtype::f32, ctx.stream());
  EXPECT_EQ(f.forward(none, ctx).dims(), (shape{0, 12}));
}

TEST_P(finite_differences_test, batch_norm_in_training_and_evaluation_over_features_and_channels) {
  context ctx(default_stream(dev()));
  const stream_ref s = ctx.stream();
  batch_norm bn(3, ctx);
  write_values(bn.weight(), random_values(3, 40, 0.5f, 1.5f), s);
  write_values(bn.bias_parameter(), random_values(3, 41), s);
  check_layer_gradients(bn, ctx, random_values(15, 42, -2.0f, 2.0f), shape{5, 3});          // [N, F]
  check_layer_gradients(bn, ctx, random_values(36, 43, -2.0f, 2.0f), shape{3, 3, 2, 2});    // [N, C, H, W]
  batch_norm plain(2, ctx, batch_norm_options{.affine = false});
  check_layer_gradients(plain, ctx, random_values(24, 44, -2.0f, 2.0f), shape{2, 2, 6});    // [N, C, L]
  ctx.set_mode(run_mode::eval);  // the running statistics: constants
  check_layer_gradients(bn, ctx, random_values(36, 45, -2.0f, 2.0f), shape{3, 3, 2, 2});
  batch_norm untracked(3, ctx, batch_norm_options{.track_running_stats = false});  // batch statistics in eval too
  check_layer_gradients(untracked, ctx, random_values(15, 46, -2.0f, 2.0f), shape{5, 3});
}

TEST_P(finite_differences_test, batch_norm_running_statistics_follow_pytorchs_momentum_and_are_named_buffers) {
  context ctx(default_stream(dev()));
  const stream_ref s = ctx.stream();
  initializer init(7);
  sequential net(linear(4, 2, ctx, init), batch_norm(2, ctx, batch_norm_options{.momentum = 0.25f}));
  const parameter_list ps = parameters_of(net);
  ASSERT_EQ(ps.size(), 4u);
  EXPECT_EQ(ps[2].name, "1.weight");
  ASSERT_EQ(ps.buffers().size(), 3u);
  EXPECT_EQ(ps.buffers()[0].name, "1.running_mean");
  EXPECT_EQ(ps.buffers()[1].name, "1.running_var");
  EXPECT_EQ(ps.buffers()[2].name, "1.num_batches_tracked");
  EXPECT_EQ(ps.buffers()[2].buffer->type(), dtype::i64);
  batch_norm& bn = net.get<1>();
  // three training steps: the statistics of each batch, by hand in double
  std::vector<double> rm(2, 0.0), rv(2, 1.0);
  for (int step = 0; step < 3; ++step) {
    const auto x = random_values(12, 50 + static_cast<std::uint32_t>(step), -3.0f, 5.0f);
    tensor xt = make_tensor(x, shape{6, 2}, s);
    (void)bn.forward(xt, ctx);
    for (int c = 0; c < 2; ++c) {
      double mean = 0, var = 0;
      for (int r = 0; r < 6; ++r) mean += x[static_cast<std::size_t>(r * 2 + c)];
      mean /= 6;
      for (int r = 0; r < 6; ++r) var += std::pow(x[static_cast<std::size_t>(r * 2 + c)] - mean, 2);
      rm[static_cast<std::size_t>(c)] = 0.75 * rm[static_cast<std::size_t>(c)] + 0.25 * mean;
      rv[static_cast<std::size_t>(c)] = 0.75 * rv[static_cast<std::size_t>(c)] + 0.25 * var / 5;  // unbiased
    }
  }
  const auto got_mean = read(bn.running_mean(), s), got_var = read(bn.running_var(), s);
  for (int c = 0; c < 2; ++c) {
    EXPECT_NEAR(got_mean[static_cast<std::size_t>(c)], rm[static_cast<std::size_t>(c)], 1e-6);
    EXPECT_NEAR(got_var[static_cast<std::size_t>(c)], rv[static_cast<std::size_t>(c)], 1e-5);
  }
  EXPECT_EQ(to_vector(bn.num_batches_tracked().span<const std::int64_t>(), s), std::vector<std::int64_t>{3});
  // evaluation normalizes with them and leaves them alone
  ctx.set_mode(run_mode::eval);
  tensor xt = make_tensor({1.0f, -2.0f}, shape{1, 2}, s);
  const auto y = read(bn.forward(xt, ctx), s);
  EXPECT_NEAR(y[0], (1.0 - rm[0]) / std::sqrt(rv[0] + 1e-5), 1e-5);
  EXPECT_NEAR(y[1], (-2.0 - rm[1]) / std::sqrt(rv[1] + 1e-5), 1e-5);
  EXPECT_EQ(to_vector(bn.num_batches_tracked().span<const std::int64_t>(), s), std::vector<std::int64_t>{3});
  // a clone carries the buffers
  batch_norm copy_of = bn.clone(ctx);
  EXPECT_EQ(read(copy_of.running_var(), s), got_var);
}

TEST_P(finite_differences_test, batch_norm_refuses_one_value_per_channel_in_training_and_wrong_channels) {
  context ctx(default_stream(dev()));
  batch_norm bn(4, ctx);
  tensor one = make_tensor(random_values(4, 60), shape{1, 4}, ctx.stream());
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)bn.forward(one, ctx); }),
                  "batch_norm(4): training needs more than 1 value per channel, got an input of shape [1, 4]");
  ctx.set_mode(run_mode::eval);
  EXPECT_NO_THROW((void)bn.forward(one, ctx));  // evaluation: the running statistics
  tensor wrong = make_tensor(random_values(12, 61), shape{2, 3, 2}, ctx.stream());
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)bn.forward(wrong, ctx); }),
                  "batch_norm(4): input of shape [2, 3, 2] does not have 4 channels in its second dimension");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)bn.output_shape(shape{3, 5, 5}); }),
                  "batch_norm(4) expects samples of 4 channels");
  EXPECT_EQ(bn.output_shape(shape{4, 7, 7}), (shape{4, 7, 7}));
}

TEST_P(finite_differences_test, batch_norm_in_f16_and_bf16_follows_f32_within_the_types_precision) {
  const stream_ref s = default_stream(dev());
  const shape dims{6, 5, 3, 3};
  const auto x = random_values(270, 62, -3.0f, 3.0f), g = random_values(270, 63), w = random_values(5, 64, 0.5f, 1.5f),
             b = random_values(5, 65);
  auto run = [&](dtype type) {
    context ctx(s, type);
    batch_norm bn(5, ctx);
    write_values(bn.weight(), w, s);
    write_values(bn.bias_parameter(), b, s);
    tensor xt = typed_tensor(x, dims, type, s), gt = typed_tensor(g, dims, type, s);
    std::vector<std::vector<float>> o;
    o.push_back(read_as_float(bn.forward(xt, ctx), s));
    o.push_back(read_as_float(bn.backward(gt, ctx, input_grad::required), s));
    o.push_back(read_as_float(bn.weight().grad(), s));
    o.push_back(read_as_float(bn.bias_parameter().grad(), s));
    o.push_back(read(bn.running_var(), s));
    return o;
  };
  const auto ref = run(dtype::f32);
  for (const dtype type : {dtype::f16, dtype::bf16}) {
    const auto o = run(type);
    const double tol = type == dtype::f16 ? 4e-3 : 3e-2;
    for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_LE(relative_norm(o[i], ref[i]), tol) << name_of(type) << " " << i;
  }
}

// batch_norm_options::relu is batch_norm then relu in one layer: the same bits in every type, in training (also in
// deterministic mode, and a second backward adding to the gradients) and evaluation, for [N, C, H, W] and [N, F].
TEST_P(finite_differences_test, batch_norm_with_a_fused_relu_gives_the_bits_of_batch_norm_then_relu) {
  const stream_ref s = default_stream(dev());
  for (const shape dims : {shape{6, 5, 3, 3}, shape{9, 4}}) {
    const auto count = static_cast<std::size_t>(dims.numel()), channels = static_cast<std::size_t>(dims[1]);
    const auto x = random_values(count, 66, -3.0f, 3.0f), g = random_values(count, 67);
    const auto w = random_values(channels, 68, 0.5f, 1.5f), b = random_values(channels, 69);
    for (const dtype type : {dtype::f32, dtype::f16, dtype::bf16}) {
      for (const bool deterministic : {false, true}) {
        SCOPED_TRACE(::testing::Message() << dims.str() << " " << name_of(type)
                                          << (deterministic ? " deterministic" : ""));
        auto run = [&](bool fused) {
          context ctx(s, type);
          if (deterministic) {
            ctx.set_deterministic(deterministic_options{
                .chunk_rows = 2, .gradients = deterministic_options::accumulation::across_backward_calls});
          }
          batch_norm bn(dims[1], ctx, batch_norm_options{.relu = fused});
          relu act;  // after the layer without the fused relu
          auto forward = [&](const tensor_view& in) {
            const tensor_view y = bn.forward(in, ctx);
            return fused ? y : act.forward(y, ctx);
          };
          auto backward = [&](const tensor_view& gin) {
            return bn.backward(fused ? gin : act.backward(gin, ctx, input_grad::required), ctx, input_grad::required);
          };
          write_values(bn.weight(), w, s);
          write_values(bn.bias_parameter(), b, s);
          tensor xt = typed_tensor(x, dims, type, s), gt = typed_tensor(g, dims, type, s);
          std::vector<std::vector<float>> o;
          for (int pass = 0; pass < 2; ++pass) {  // the second adds to the parameters' gradients
            o.push_back(read_as_float(forward(xt), s));
            o.push_back(read_as_float(backward(gt), s));
            o.push_back(read_as_float(bn.weight().grad(), s));
            o.push_back(read_as_float(bn.bias_parameter().grad(), s));
          }
          o.push_back(read(bn.running_mean(), s));
          o.push_back(read(bn.running_var(), s));
          ctx.set_mode(run_mode::eval);
          o.push_back(read_as_float(forward(xt), s));
          o.push_back(read_as_float(backward(gt), s));
          o.push_back(read_as_float(bn.weight().grad(), s));  // (added to by the masked sums of evaluation)
          o.push_back(read_as_float(bn.bias_parameter().grad(), s));
          return o;
        };
        const auto fused = run(true), apart = run(false);
        ASSERT_EQ(fused.size(), apart.size());
        for (std::size_t i = 0; i < fused.size(); ++i) {
          ASSERT_EQ(fused[i].size(), apart[i].size());
          EXPECT_EQ(std::memcmp(fused[i].data(), apart[i].data(), fused[i].size() * sizeof(float)), 0)
              << "output " << i;
        }
        EXPECT_TRUE(std::ranges::any_of(fused[0], [](float v) { return v == 0.0f; }) &&
                    std::ranges::any_of(fused[0], [](float v) { return v > 0.0f; }));  // the relu had work to do
      }
    }
  }
  // the gradients, away from relu's kink: each channel's 12 values are 1, -2, 3, -4, 5, -6 twice (shifted by half
  // the channel's index), their deviations at least 1.5 from the mean, so none is normalized near 0
  std::vector<float> kinkless(36);
  for (std::size_t i = 0; i < 36; ++i) {
    const std::size_t c = (i / 4) % 3, k = (i / 12) * 4 + i % 4;  // the k-th of channel c's values
    kinkless[i] = 0.5f * static_cast<float>(c) + static_cast<float>(k % 6 + 1) * (k % 2 == 0 ? 1.0f : -1.0f);
  }
  context ctx(s);
  batch_norm bn(3, ctx, batch_norm_options{.relu = true});
  check_layer_gradients(bn, ctx, kinkless, shape{3, 3, 2, 2});
}

namespace {
// n distinct values in [-1, 1), at least 2 / n apart, in a shuffled order: no two tie within a finite difference's
// step (max pooling's kink).
std::vector<float> distinct_values(std::size_t n, std::uint32_t seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = -1.0f + 2.0f * static_cast<float>(i) / static_cast<float>(n);
  std::shuffle(v.begin(), v.end(), std::mt19937(seed));
  return v;
}
}  // namespace

TEST_P(finite_differences_test, conv2d_with_padding_strides_and_without_bias) {
  context ctx(default_stream(dev()));
  initializer init(12);
  conv2d same(2, 3, 3, ctx, init, conv2d_options{.padding = 1});
  EXPECT_EQ(same.output_shape(shape{2, 5, 5}), (shape{3, 5, 5}));
  EXPECT_EQ(parameters_of(same)[0].param->dims(), (shape{3, 2, 3, 3}));
  check_layer_gradients(same, ctx, random_values(100, 80), shape{2, 2, 5, 5});
  conv2d strided(2, 2, 3, ctx, init, conv2d_options{.stride = 2, .bias = false});
  EXPECT_EQ(strided.output_shape(shape{2, 6, 7}), (shape{2, 2, 3}));
  EXPECT_EQ(parameters_of(strided).size(), 1u);
  check_layer_gradients(strided, ctx, random_values(84, 81), shape{1, 2, 6, 7});
  conv2d wide(1, 2, 2, ctx, init, conv2d_options{.stride = 2, .padding = 1});
  check_layer_gradients(wide, ctx, random_values(30, 82), shape{2, 1, 3, 5});
}

// Outside deterministic mode a host device whose GEMMs run on oneDNN convolves with oneDNN's convolutions
// (blas/convolution.hpp); deterministic mode keeps im2col and per-row products. Both give the same outputs and
// gradients to within f32 rounding, in shapes with several images, channels, padding, strides and a bias, and a second
// backward without zero_grad adds to the gradients (the reorder's sum on oneDNN) instead of replacing them.
TEST_P(finite_differences_test, conv2d_kernels_agree_and_a_second_backward_adds_to_the_gradients) {
  struct conv_case {
    std::int64_t in, out, k, h, w, stride, padding;
    bool bias;
  };
  for (const conv_case c : {conv_case{3, 8, 3, 9, 9, 1, 1, true}, conv_case{4, 16, 3, 8, 10, 2, 0, false},
                            conv_case{1, 5, 5, 12, 11, 1, 2, true}}) {
    SCOPED_TRACE(::testing::Message() << "conv " << c.in << "->" << c.out << " k" << c.k << " " << c.h << "x" << c.w
                                      << " stride " << c.stride << " padding " << c.padding);
    const std::int64_t n = 6;
    const auto x_values = random_values(static_cast<std::size_t>(n * c.in * c.h * c.w), 91);
    struct result {
      std::vector<float> y, gx, gw, gb, gw2, gb2;
    };
    auto run = [&](bool deterministic) {
      context ctx(default_stream(dev()));
      if (deterministic) ctx.set_deterministic(deterministic_options{.chunk_rows = 2});
      initializer init(14);
      conv2d conv(c.in, c.out, c.k, ctx, init, conv2d_options{.stride = c.stride, .padding = c.padding, .bias = c.bias});
      tensor x = make_tensor(x_values, shape{n, c.in, c.h, c.w}, ctx.stream());
      result r;
      const tensor_view y = conv.forward(x, ctx);
      r.y = read(y, ctx.stream());
      tensor gy = make_tensor(random_values(r.y.size(), 92), y.dims(), ctx.stream());
      r.gx = read(conv.backward(gy, ctx, input_grad::required), ctx.stream());
      parameter_list params = parameters_of(conv);
      r.gw = read(params[0].param->grad(), ctx.stream());
      if (c.bias) r.gb = read(params[1].param->grad(), ctx.stream());
      if (!deterministic) {  // the same backward again, adding
        (void)conv.forward(x, ctx);
        (void)conv.backward(gy, ctx, input_grad::not_required);
        r.gw2 = read(params[0].param->grad(), ctx.stream());
        if (c.bias) r.gb2 = read(params[1].param->grad(), ctx.stream());
#if LOCKSTEP_HAS_ONEDNN
        if (dev().is_host() && ctx.blas().host_plan().f32 == host_gemm_kernel::onednn) {  // the comparison's point
          for (const auto pass : {detail::onednn_conv_pass::forward, detail::onednn_conv_pass::backward_data,
                                  detail::onednn_conv_pass::backward_weights}) {
            const detail::onednn_conv_key key{n, c.in, c.h, c.w, c.out, c.k, c.stride, c.padding, dtype::f32, c.bias,
                                              pass};
            EXPECT_NE(detail::host_convolution(ctx.blas(), key), nullptr) << "the ordinary run did not use oneDNN";
          }
          // backward's data pass reads the weights pass's copy of the output gradient where both passes copy it
          // into one layout (convolution.hpp): the input gradient above then came through that copy. Which cases
          // share depends on the kernels oneDNN picks for the CPU (on AVX-512, 3->8 stride 1 does; 4->16 stride 2
          // takes an AVX2 weights kernel in another layout), so the test records it rather than requiring it.
          using slot = detail::onednn_convolution::slot;
          const auto data = detail::host_convolution(
              ctx.blas(), {n, c.in, c.h, c.w, c.out, c.k, c.stride, c.padding, dtype::f32, c.bias,
                           detail::onednn_conv_pass::backward_data});
          const auto weights = detail::host_convolution(
              ctx.blas(), {n, c.in, c.h, c.w, c.out, c.k, c.stride, c.padding, dtype::f32, c.bias,
                           detail::onednn_conv_pass::backward_weights});
          const bool shared = data && weights && data->reads_like(slot::a, *weights, slot::b);
          ::testing::Test::RecordProperty("conv_" + std::to_string(c.in) + "_" + std::to_string(c.out) + "_shares_dy",
                                          shared ? "yes" : "no");
        }
#endif
      }
      return r;
    };
    const result fast = run(false), exact = run(true);
    auto expect_close = [](const std::vector<float>& a, const std::vector<float>& b, float scale, const char* what) {
      ASSERT_EQ(a.size(), b.size()) << what;
      double diff = 0.0, norm = 0.0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        diff += (static_cast<double>(a[i]) - scale * b[i]) * (static_cast<double>(a[i]) - scale * b[i]);
        norm += static_cast<double>(scale * b[i]) * (scale * b[i]);
      }
      EXPECT_LE(std::sqrt(diff), 1e-6 * std::sqrt(norm) + 1e-12) << what;
    };
    expect_close(fast.y, exact.y, 1.0f, "y");
    expect_close(fast.gx, exact.gx, 1.0f, "input gradient");
    expect_close(fast.gw, exact.gw, 1.0f, "weight gradient");
    expect_close(fast.gb, exact.gb, 1.0f, "bias gradient");
    expect_close(fast.gw2, fast.gw, 2.0f, "weight gradient after a second backward");
    expect_close(fast.gb2, fast.gb, 2.0f, "bias gradient after a second backward");
  }
}

#if LOCKSTEP_HAS_ONEDNN
// A convolution with one input channel runs in plain layouts on oneDNN's AVX2 code (convolution.hpp: its blocked
// kernels are 2-4 times slower there) and in oneDNN's layouts on AVX-512, but for its backward data pass (plain
// there too). The table is pure, host_convolution follows it, and both layouts give the same outputs and gradients
// to within f32 rounding on whichever CPU runs the test (the CPU's own oneDNN code: both are forced here), the
// plain one with no reorder, the weights pass adding to its gradients (beta 1) too.
TEST(onednn_convolution_layouts, one_input_channel_runs_plain_below_avx512_and_both_layouts_agree) {
  using detail::onednn_conv_key;
  using detail::onednn_conv_layouts;
  using detail::onednn_conv_pass;
  using slot = detail::onednn_convolution::slot;
  const onednn_conv_key one{.n = 4, .c = 1, .h = 12, .w = 11, .oc = 5, .k = 5, .stride = 1, .padding = 2};
  onednn_conv_key three = one;
  three.c = 3;
  onednn_conv_key one_data = one;
  one_data.pass = onednn_conv_pass::backward_data;
  EXPECT_EQ(detail::onednn_conv_layouts_for(host_isa::avx2, one), onednn_conv_layouts::plain);
  EXPECT_EQ(detail::onednn_conv_layouts_for(host_isa::avx512, one), onednn_conv_layouts::chosen_by_onednn);
  EXPECT_EQ(detail::onednn_conv_layouts_for(host_isa::amx, one), onednn_conv_layouts::chosen_by_onednn);
  EXPECT_EQ(detail::onednn_conv_layouts_for(host_isa::avx512, one_data), onednn_conv_layouts::plain);
  EXPECT_EQ(detail::onednn_conv_layouts_for(host_isa::avx2, three), onednn_conv_layouts::chosen_by_onednn);
  three.pass = onednn_conv_pass::backward_data;
  EXPECT_EQ(detail::onednn_conv_layouts_for(host_isa::avx512, three), onednn_conv_layouts::chosen_by_onednn);

  // conv2d's way in, host_convolution, runs the primitive of the table's layouts for the handle's plan
  context ctx(default_stream(device{device_kind::host, 0}));
  if (ctx.blas().host_plan().f32 == host_gemm_kernel::onednn) {
    for (const auto pass :
         {onednn_conv_pass::forward, onednn_conv_pass::backward_data, onednn_conv_pass::backward_weights}) {
      onednn_conv_key key = one;
      key.pass = pass;
      const auto conv = detail::host_convolution(ctx.blas(), key);
      key.layouts = detail::onednn_conv_layouts_for(ctx.blas().host_plan().isa, key);
      EXPECT_EQ(conv.get(), ctx.blas().onednn_conv_cache().get(key).get()) << "pass " << static_cast<int>(pass);
    }
  }

  struct conv_case {
    std::int64_t h, w, oc, k, stride, padding;
    bool bias;
  };
  for (const conv_case c : {conv_case{12, 11, 5, 5, 1, 2, true}, conv_case{9, 10, 4, 3, 2, 1, false}}) {
    for (const auto pass :
         {onednn_conv_pass::forward, onednn_conv_pass::backward_data, onednn_conv_pass::backward_weights}) {
      for (const float beta : {0.0f, 1.0f}) {
        if (beta != 0.0f && pass != onednn_conv_pass::backward_weights) continue;
        SCOPED_TRACE(::testing::Message() << "1->" << c.oc << " k" << c.k << " " << c.h << "x" << c.w << " stride "
                                          << c.stride << " pass " << static_cast<int>(pass) << " beta " << beta);
        onednn_conv_key key{.n = 4, .c = 1, .h = c.h, .w = c.w, .oc = c.oc, .k = c.k, .stride = c.stride,
                            .padding = c.padding, .bias = c.bias, .pass = pass, .beta = beta, .bias_beta = beta};
        const std::size_t xs = static_cast<std::size_t>(key.n * c.h * c.w);
        const std::size_t ys = static_cast<std::size_t>(key.n * c.oc * key.out_h() * key.out_w());
        const std::size_t ws = static_cast<std::size_t>(c.oc * c.k * c.k);
        const std::size_t bs = static_cast<std::size_t>(c.oc);
        auto run = [&](onednn_conv_layouts layouts) {
          key.layouts = layouts;
          const detail::onednn_convolution conv(key);
          if (!conv.usable()) {
            ADD_FAILURE() << "no oneDNN kernel but " << conv.implementation();
            return std::vector<float>{};
          }
          if (layouts == onednn_conv_layouts::plain && beta == 0.0f) {
            for (const slot s : {slot::a, slot::b, slot::c, slot::out, slot::out2}) EXPECT_FALSE(conv.reorders(s));
          }
          std::vector<float> a, b, bias, out, out2;
          if (pass == onednn_conv_pass::forward) {
            a = random_values(xs, 1), b = random_values(ws, 2), bias = random_values(bs, 3), out.resize(ys);
          } else if (pass == onednn_conv_pass::backward_data) {
            a = random_values(ys, 4), b = random_values(ws, 2), out.resize(xs);
          } else {
            a = random_values(xs, 1), b = random_values(ys, 4), out = random_values(ws, 5), out2 = random_values(bs, 6);
          }
          // (run() on this thread, as a stream's worker would: it sets this thread's OpenMP threads to one)
          std::vector<std::byte> workspace(conv.workspace_bytes() + 64);
          std::byte* aligned = workspace.data() + (64 - reinterpret_cast<std::uintptr_t>(workspace.data()) % 64) % 64;
          conv.run(a.data(), b.data(), c.bias && pass == onednn_conv_pass::forward ? bias.data() : nullptr,
                   out.data(), c.bias && pass == onednn_conv_pass::backward_weights ? out2.data() : nullptr, aligned);
          out.insert(out.end(), out2.begin(), out2.end());
          return out;
        };
        const std::vector<float> blocked = run(onednn_conv_layouts::chosen_by_onednn);
        const std::vector<float> plain = run(onednn_conv_layouts::plain);
        ASSERT_FALSE(plain.empty());
        ASSERT_EQ(blocked.size(), plain.size());
        double diff = 0.0, norm = 0.0;
        for (std::size_t i = 0; i < plain.size(); ++i) {
          diff += (static_cast<double>(plain[i]) - blocked[i]) * (static_cast<double>(plain[i]) - blocked[i]);
          norm += static_cast<double>(blocked[i]) * blocked[i];
        }
        EXPECT_GT(norm, 0.0);
        EXPECT_LE(std::sqrt(diff), 1e-6 * std::sqrt(norm));
      }
    }
  }
}
#endif

// A program that returns from main while a host stream still runs its first convolutions and matmuls (nothing
// synchronized) exits cleanly, as it would with GPUs: oneDNN's primitives run once where they are made, and an exit
// handler waits for the host streams (blas/onednn.hpp). Without both, oneDNN could make a kernel's code under the
// exit that destroys its state (a crash at exit, seen with matmuls on an AVX2 CPU).
TEST(host_exit_DeathTest, a_program_that_returns_while_convolutions_and_matmuls_run_exits_cleanly) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: its first primitives are made in the child
  EXPECT_EXIT(
      {
        context ctx(default_stream(device{device_kind::host, 0}));
        initializer init(3);
        conv2d conv(8, 16, 3, ctx, init, conv2d_options{.padding = 1});
        linear fc(256, 64, ctx, init);
        tensor x = make_tensor(random_values(16 * 8 * 12 * 12, 5), shape{16, 8, 12, 12}, ctx.stream());
        tensor rows = make_tensor(random_values(64 * 256, 6), shape{64, 256}, ctx.stream());
        const tensor_view y = conv.forward(x, ctx);
        (void)conv.backward(y, ctx, input_grad::required);
        (void)fc.forward(rows, ctx);
        std::exit(0);  // with the work still queued
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_P(finite_differences_test, max_avg_and_global_pooling) {
  context ctx(default_stream(dev()));
  max_pool2d mp(2);
  EXPECT_EQ(mp.output_shape(shape{3, 5, 4}), (shape{3, 2, 2}));
  check_layer_gradients(mp, ctx, distinct_values(2 * 2 * 4 * 5, 83), shape{2, 2, 4, 5});
  max_pool2d overlapping(3, 1, 1);
  check_layer_gradients(overlapping, ctx, distinct_values(2 * 4 * 4, 84), shape{1, 2, 4, 4});
  avg_pool2d ap(3, 2, 1);
  EXPECT_EQ(ap.output_shape(shape{1, 5, 5}), (shape{1, 3, 3}));
  check_layer_gradients(ap, ctx, random_values(50, 85), shape{2, 1, 5, 5});
  global_avg_pool2d gp;
  EXPECT_EQ(gp.output_shape(shape{3, 4, 6}), (shape{3, 1, 1}));
  check_layer_gradients(gp, ctx, random_values(72, 86), shape{1, 3, 4, 6});
  // the first of equal maxima takes the gradient; a NaN wins its window
  tensor x = make_tensor({1.0f, 1.0f, 0.0f, 1.0f, 2.0f, std::nanf(""), 0.0f, 1.0f}, shape{1, 2, 2, 2}, ctx.stream());
  const auto y = read(mp.forward(x, ctx), ctx.stream());
  EXPECT_EQ(y[0], 1.0f);
  EXPECT_TRUE(std::isnan(y[1]));
  tensor g = make_tensor({1.0f, 1.0f}, shape{1, 2, 1, 1}, ctx.stream());
  EXPECT_EQ(read(mp.backward(g, ctx, input_grad::required), ctx.stream()),
            (std::vector<float>{1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f, 0.0f}));
}

TEST_P(finite_differences_test, convolution_and_pooling_name_bad_shapes_and_unflatten_gives_rows_a_shape) {
  context ctx(default_stream(dev()));
  initializer init(13);
  conv2d c(3, 4, 5, ctx, init);
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)c.output_shape(shape{2, 9, 9}); }),
                  "conv2d(3, 4, 5, stride 1, padding 0) expects samples of shape [3, height, width], got [2, 9, 9]");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)c.output_shape(shape{3, 4, 9}); }),
                  "images of 4x9 with padding 0 are smaller than the kernel");
  tensor flat = make_tensor(random_values(12, 87), shape{2, 6}, ctx.stream());
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)c.forward(flat, ctx); }), "is not [rows, 3, height, width]");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { max_pool2d bad(2, 1, 2); }), "padding in [0, kernel / 2]");
  // Max pooling's indices are 32-bit pixel numbers: an image of 2^31 pixels or more is refused by shape, before any
  // work; 46340^2 is the largest square under 2^31 and average pooling, which keeps no indices, has no such bound.
  EXPECT_EQ(max_pool2d(2).output_shape(shape{1, 46340, 46340}), (shape{1, 23170, 23170}));
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)max_pool2d(2).output_shape(shape{1, 46341, 46341}); }),
                  "images of 46341x46341 pixels; max pooling records each window's maximum as a 32-bit pixel index");
  EXPECT_EQ(avg_pool2d(2).output_shape(shape{1, 46341, 46341}), (shape{1, 23170, 23170}));
  unflatten u(shape{1, 2, 3});
  EXPECT_EQ(u.output_shape(shape{6}), (shape{1, 2, 3}));
  EXPECT_EQ(u.forward(flat, ctx).dims(), (shape{2, 1, 2, 3}));
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)u.output_shape(shape{7}); }),
                  "unflatten([1, 2, 3]) expects samples of 6 elements, got shape [7]");
  // a graph of the CNN sample's kind, smooth (tanh, average pooling) for central differences: shapes checked before
  // any work
  graph g(shape{1 * 8 * 8});
  g.add("shape", unflatten(shape{1, 8, 8}), "input")
      .add("conv1", conv2d(1, 4, 3, ctx, init, conv2d_options{.padding = 1}), "shape")
      .add("bn1", batch_norm(4, ctx), "conv1")
      .add("act1", tanh_layer(), "bn1")
      .add("pool1", avg_pool2d(2), "act1")
      .add("flat", flatten(), "pool1")
      .add("fc", linear(4 * 4 * 4, 3, ctx, init), "flat");
  EXPECT_EQ(g.output_shape(shape{64}), shape{3});
  check_layer_gradients(g, ctx, random_values(2 * 64, 88), shape{2, 64});
}

// ---- against PyTorch: tests/torch_layers.py writes PyTorch's results and runs these (CTest nn.layers_against_pytorch) --

namespace {
// The reference file LOCKSTEP_TORCH_REFERENCE names: f32 tensors "<case>.<what>", the cases' options in metadata.
struct torch_reference {
  std::string path;
  std::vector<std::byte> bytes;
  safetensors_header header;

  [[nodiscard]] const safetensors_tensor& find(const std::string& name) const {
    const safetensors_tensor* t = header.find(name);
    if (t == nullptr) throw std::runtime_error(path + ": no tensor " + name);
    return *t;
  }
  [[nodiscard]] std::vector<float> values(const std::string& name) const {
    const safetensors_tensor& t = find(name);
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    std::memcpy(v.data(), bytes.data() + header.data_offset + t.begin, t.size_bytes());
    return v;
  }
  [[nodiscard]] shape dims(const std::string& name) const {
    const auto& d = find(name).shape;
    switch (d.size()) {
      case 1: return shape{d[0]};
      case 2: return shape{d[0], d[1]};
      case 3: return shape{d[0], d[1], d[2]};
      default: return shape{d.at(0), d.at(1), d.at(2), d.at(3)};
    }
  }
  [[nodiscard]] std::string option(const std::string& key) const { return header.metadata.at(key); }
  [[nodiscard]] std::vector<std::string> cases() const {
    std::vector<std::string> out;
    for (const auto& [key, value] : header.metadata)
      if (key.ends_with(".layer")) out.push_back(key.substr(0, key.size() - 6));
    return out;
  }
};

std::optional<torch_reference> load_torch_reference() {
  const char* path = std::getenv("LOCKSTEP_TORCH_REFERENCE");
  if (path == nullptr || *path == 0) return std::nullopt;
  torch_reference r{path, {}, {}};
  r.bytes.resize(static_cast<std::size_t>(std::filesystem::file_size(path)));
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(r.bytes.data()), static_cast<std::streamsize>(r.bytes.size()));
  if (!in) throw std::runtime_error(std::string("cannot read ") + path);
  r.header = parse_safetensors_header(r.bytes, r.bytes.size(), path);
  return r;
}

// A case's tolerance on the relative norm of a difference from PyTorch's result: f32 1e-5; f16 and bf16 four units of
// their rounding (2^-11, 2^-8), their inputs being rounded too.
double torch_tolerance(dtype type) { return type == dtype::f32 ? 1e-5 : type == dtype::f16 ? 2e-3 : 1.6e-2; }

class torch_reference_test : public backend_test {};
}  // namespace

INSTANTIATE_TEST_SUITE_P(all, torch_reference_test, all_backends(), backend_name);

TEST_P(torch_reference_test, layers_match_pytorch_in_f32_f16_and_bf16) {
  const auto ref = load_torch_reference();
  if (!ref) {
    GTEST_SKIP() << "LOCKSTEP_TORCH_REFERENCE is not set: CTest's nn.layers_against_pytorch runs this test with the "
                    "file tests/torch_layers.py writes (PyTorch's results)";
  }
  const stream_ref s = default_stream(dev());
  ASSERT_FALSE(ref->cases().empty()) << ref->path;
  for (const std::string& c : ref->cases()) {
    for (const dtype type : {dtype::f32, dtype::f16, dtype::bf16}) {
      if (type != dtype::f32 && ref->option(c + ".f32_only") == "1") continue;
      context ctx(s, type);
      auto compare = [&](const char* what, const tensor_view& got) {
        const double d = relative_norm(read_as_float(got, s), ref->values(c + "." + what));
        std::cout << "  " << c << " " << name_of(type) << " " << what << ": relative difference " << d << "\n";
        EXPECT_LE(d, torch_tolerance(type)) << c << " " << name_of(type) << " " << what;
      };
      const std::string layer_name = ref->option(c + ".layer");
      const bool affine = ref->option(c + ".affine") == "1";
      const float eps = ref->header.metadata.contains(c + ".eps") ? std::stof(ref->option(c + ".eps")) : 0.0f;
      auto input = [&](const std::string& what) {
        return typed_tensor(ref->values(c + "." + what), ref->dims(c + "." + what), type, s);
      };
      auto set_affine = [&](auto& l) {
        if (!affine) return;
        write_values(l.weight(), ref->values(c + ".weight"), s);
        write_values(l.bias_parameter(), ref->values(c + ".bias"), s);
      };
      auto compare_affine = [&](auto& l, const std::string& suffix) {
        if (!affine) return;
        compare(("gweight" + suffix).c_str(), l.weight().grad());
        compare(("gbias" + suffix).c_str(), l.bias_parameter().grad());
      };
      if (layer_name == "layer_norm") {
        const shape dims = ref->dims(c + ".x");
        layer_norm l(dims[dims.rank() - 1], ctx, layer_norm_options{.eps = eps, .elementwise_affine = affine});
        set_affine(l);
        tensor x = input("x"), gy = input("gy");
        compare("y", l.forward(x, ctx));
        compare("gx", l.backward(gy, ctx, input_grad::required));
        compare_affine(l, "");
      } else if (layer_name == "batch_norm") {
        // three training steps, the last one backward; the running statistics; then evaluation
        batch_norm l(ref->dims(c + ".x0")[1], ctx,
                     batch_norm_options{.eps = eps, .momentum = std::stof(ref->option(c + ".momentum")), .affine = affine});
        set_affine(l);
        std::vector<tensor> xs;
        tensor_view y;
        for (int step = 0; step < 3; ++step) {
          xs.push_back(input("x" + std::to_string(step)));
          y = l.forward(xs.back(), ctx);
        }
        compare("y", y);
        tensor gy = input("gy");
        compare("gx", l.backward(gy, ctx, input_grad::required));
        compare_affine(l, "");
        compare("running_mean", l.running_mean());
        compare("running_var", l.running_var());
        ctx.set_mode(run_mode::eval);
        if (affine) zero_grad(l);
        tensor xe = input("xe"), gye = input("gye");
        compare("ye", l.forward(xe, ctx));
        compare("gxe", l.backward(gye, ctx, input_grad::required));
        compare_affine(l, "_e");
      } else if (layer_name == "conv2d" || layer_name.ends_with("pool2d")) {
        auto number = [&](const char* key) { return std::stoll(ref->option(c + "." + key)); };
        tensor x = input("x"), gy = input("gy");
        auto run = [&](auto& l) {
          compare("y", l.forward(x, ctx));
          compare("gx", l.backward(gy, ctx, input_grad::required));
        };
        if (layer_name == "conv2d") {
          initializer init(0);
          conv2d l(x.dims()[1], number("out_channels"), number("kernel"), ctx, init,
                   conv2d_options{.stride = number("stride"), .padding = number("padding"), .bias = affine});
          write_values(l.weight(), ref->values(c + ".weight"), s);
          if (affine) write_values(l.bias_parameter(), ref->values(c + ".bias"), s);
          run(l);
          compare("gweight", l.weight().grad());
          if (affine) compare("gbias", l.bias_parameter().grad());
        } else if (layer_name == "max_pool2d") {
          max_pool2d l(number("kernel"), number("stride"), number("padding"));
          run(l);
        } else if (layer_name == "avg_pool2d") {
          avg_pool2d l(number("kernel"), number("stride"), number("padding"));
          run(l);
        } else {
          global_avg_pool2d l;
          run(l);
        }
      } else {
        FAIL() << c << ": unknown layer " << layer_name;
      }
    }
  }
}

// A model with a batch norm, trained two steps and saved with save_model for tests/torch_layers.py, which loads it into
// the same torch.nn.Sequential with load_state_dict(strict=True) and compares its evaluation output with lockstep's
// (written beside it, with the input).
TEST_P(torch_reference_test, a_model_with_batch_norm_is_saved_for_pytorchs_strict_load) {
  const auto ref = load_torch_reference();
  if (!ref) GTEST_SKIP() << "LOCKSTEP_TORCH_REFERENCE is not set (CTest's nn.layers_against_pytorch sets it)";
  const std::filesystem::path dir = std::filesystem::path(ref->path).parent_path();
  const std::string tag = std::string(name_of(kind()));
  context ctx(default_stream(dev()));
  const stream_ref s = ctx.stream();
  initializer init(11);
  sequential model(flatten(), linear(12, 6, ctx, init), batch_norm(6, ctx), relu(), linear(6, 3, ctx, init));
  for (std::uint32_t step = 0; step < 2; ++step) {  // the running statistics move away from 0 and 1
    tensor x = make_tensor(random_values(8 * 12, 70 + step, -2.0f, 3.0f), shape{8, 3, 4}, s);
    (void)model.forward(x, ctx);
  }
  save_model(dir / ("bn_model." + tag + ".safetensors"), parameters_of(model), s);
  ctx.set_mode(run_mode::eval);
  const auto input = random_values(5 * 12, 72);
  tensor x = make_tensor(input, shape{5, 3, 4}, s);
  const auto output = read(model.forward(x, ctx), s);
  const std::vector<safetensors_source> io{{"input", dtype::f32, {5, 3, 4}, reinterpret_cast<const std::byte*>(input.data())},
                                           {"output", dtype::f32, {5, 3}, reinterpret_cast<const std::byte*>(output.data())}};
  const std::string header = safetensors_header_bytes(io);
  std::ofstream out(dir / ("bn_model_io." + tag + ".safetensors"), std::ios::binary | std::ios::trunc);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(input.data()), static_cast<std::streamsize>(input.size() * sizeof(float)));
  out.write(reinterpret_cast<const char*>(output.data()), static_cast<std::streamsize>(output.size() * sizeof(float)));
  ASSERT_TRUE(out.good());
}

namespace {
// Central differences of a loss w.r.t. its input, against the loss's backward.
template <class Loss>
void check_loss_gradients(Loss& loss, context& ctx, const std::vector<float>& y_values, shape y_shape,
                          const tensor_view& target, std::int64_t mean_over, double tolerance = 2e-3) {
  const stream_ref s = ctx.stream();
  tensor y = make_tensor(y_values, y_shape, s);
  loss.forward(y, target, ctx, mean_over);
  const auto analytic = read(loss.backward(ctx), s);
  auto yv = y_values;
  const double eps = 1e-2;
  for (std::size_t i = 0; i < yv.size(); ++i) {
    const float orig = yv[i];
    yv[i] = static_cast<float>(orig + eps);
    write(y, yv, s);
    loss.forward(y, target, ctx, mean_over);
    const double p = read(loss.loss(), s)[0];
    yv[i] = static_cast<float>(orig - eps);
    write(y, yv, s);
    loss.forward(y, target, ctx, mean_over);
    const double m = read(loss.loss(), s)[0];
    yv[i] = orig;
    write(y, yv, s);
    EXPECT_NEAR(analytic[i], (p - m) / (2 * eps), tolerance * (1 + std::abs(analytic[i]))) << "element " << i;
  }
}
}  // namespace

TEST_P(finite_differences_test, softmax_cross_entropy_sum_and_mean) {
  context ctx(default_stream(dev()));
  const stream_ref s = ctx.stream();
  const tensor labels = make_labels({2, 0, 3}, s);
  softmax_cross_entropy sum_loss(reduction::sum), mean_loss(reduction::mean);
  const auto logits = random_values(12, 11, -3.0f, 3.0f);
  check_loss_gradients(sum_loss, ctx, logits, shape{3, 4}, labels, 0);
  check_loss_gradients(mean_loss, ctx, logits, shape{3, 4}, labels, 0);
  check_loss_gradients(mean_loss, ctx, logits, shape{3, 4}, labels, 12);  // mean over a global batch of 12
}

TEST_P(loss_test, softmax_cross_entropy_values_and_stability) {
  context ctx(default_stream(dev()));
  const stream_ref s = ctx.stream();
  softmax_cross_entropy loss(reduction::mean);
  // uniform logits over 4 classes: loss log(4); huge logits must not overflow
  tensor logits = make_tensor({0, 0, 0, 0, 1000, 0, 0, -1000}, shape{2, 4}, s);
  const tensor labels = make_labels({1, 0}, s);
  loss.forward(logits, labels, ctx);
  EXPECT_NEAR(loss.read_loss(s), (std::log(4.0) + 0.0) / 2, 1e-6);
  const auto g = read(loss.backward(ctx), s);
  EXPECT_NEAR(g[1], (0.25 - 1.0) / 2, 1e-6);
  EXPECT_NEAR(g[4], 0.0, 1e-6);
  // a label outside [0, classes) shows as a NaN loss
  const tensor bad = make_labels({1, 7}, s);
  loss.forward(logits, bad, ctx);
  EXPECT_TRUE(std::isnan(loss.read_loss(s)));
  EXPECT_THROW(loss.forward(logits, make_labels({1}, s), ctx), precondition_error);
}

TEST_P(finite_differences_test, mse) {
  context ctx(default_stream(dev()));
  const stream_ref s = ctx.stream();
  const tensor target = make_tensor(random_values(6, 12), shape{2, 3}, s);
  mse loss(reduction::mean);
  check_loss_gradients(loss, ctx, random_values(6, 13), shape{2, 3}, target, 0);
  mse total(reduction::sum);
  check_loss_gradients(total, ctx, random_values(6, 14), shape{2, 3}, target, 0);
}

TEST_P(loss_test, accuracy_counts_argmax_hits_across_batches) {
  context ctx(default_stream(dev()));
  const stream_ref s = ctx.stream();
  accuracy_counter acc;
  tensor logits = make_tensor({0.1f, 0.9f, 0.0f, 2.0f, 1.0f, 0.0f, 0.0f, 0.0f, 3.0f}, shape{3, 3}, s);
  acc.add(logits, make_labels({1, 1, 2}, s), ctx);
  acc.add(logits, make_labels({1, 0, 2}, s), ctx);
  EXPECT_EQ(acc.rows(), 6);
  EXPECT_EQ(acc.correct(s), 5);
  acc.reset(s);
  EXPECT_EQ(acc.correct(s), 0);
}

TEST_P(loss_test, wide_rows_match_a_cpu_reference_with_ties_across_lanes) {
  // On a GPU a warp shares each row (launch_rows): columns c, c + 32, ... per lane, then shuffles. Widths around
  // the warp, a first maximum tied 32 columns later (another lane), and more rows than a grid has warps.
  context ctx(default_stream(dev()));
  const stream_ref s = ctx.stream();
  const std::pair<std::int64_t, std::int64_t> cases[] = {{37, 31}, {37, 32}, {37, 33}, {37, 65}, {37, 1000}, {20000, 33}};
  for (const auto& [rows, classes] : cases) {
    SCOPED_TRACE(::testing::Message() << rows << " rows of " << classes << " classes");
    std::vector<float> x(static_cast<std::size_t>(rows * classes));
    std::vector<std::int32_t> labels(static_cast<std::size_t>(rows));
    std::int64_t hits = 0;
    double loss_sum = 0.0;
    std::vector<double> grad(x.size());
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = x.data() + r * classes;
      for (std::int64_t c = 0; c < classes; ++c) row[c] = static_cast<float>((r * 7 + c * 13) % 29) / 4.0f - 3.0f;
      const std::int64_t first = r % classes, tie = first + 32 < classes ? first + 32 : first;
      row[first] = row[tie] = 10.0f;  // the first maximum is `first`, whatever lane holds `tie`
      const std::int64_t label = r % 2 == 0 ? first : tie;
      labels[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(label);
      hits += label == first ? 1 : 0;
      double sum = 0.0;
      for (std::int64_t c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(row[c]) - 10.0);
      loss_sum += std::log(sum) + 10.0 - row[label];
      for (std::int64_t c = 0; c < classes; ++c) {
        grad[static_cast<std::size_t>(r * classes + c)] =
            (std::exp(static_cast<double>(row[c]) - 10.0) / sum - (c == label ? 1.0 : 0.0)) / static_cast<double>(rows);
      }
    }
    const tensor logits = make_tensor(x, shape{rows, classes}, s);
    const tensor y = make_labels(labels, s);
    softmax_cross_entropy loss(reduction::mean);
    loss.forward(logits, y, ctx);
    const double expected = loss_sum / static_cast<double>(rows);
    // per row, log(sum) + 10 - x[label] is rounded at 10's scale (half an ulp: 4.8e-7) whatever the row's loss, and
    // a sum of 1000 exponentials in f32 carries a few 1e-6 of relative error
    EXPECT_NEAR(loss.read_loss(s), expected, 2e-6 + 1e-5 * expected);
    const auto g = read(loss.backward(ctx), s);
    double worst = 0.0;
    for (std::size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::fabs(g[i] - grad[i]));
    EXPECT_LT(worst, 5e-7) << "largest gradient error";
    accuracy_counter acc;
    acc.add(logits, y, ctx);
    EXPECT_EQ(acc.correct(s), hits);
  }
}

// ---- dropout -----------------------------------------------------------------------------------------------------

TEST_P(dropout_test, masks_depend_on_seed_step_and_global_row_only) {
  context ctx(default_stream(dev()));
  initializer init(0);
  dropout d(0.5f, init);
  const stream_ref s = ctx.stream();
  tensor x = make_tensor(std::vector<float>(400, 1.0f), shape{40, 10}, s);
  ctx.set_seed(1);
  ctx.set_step(5);
  const auto whole = read(d.forward(x, ctx), s);
  std::size_t kept = 0;
  for (float v : whole) {
    EXPECT_TRUE(v == 0.0f || v == 2.0f);
    kept += v != 0.0f;
  }
  EXPECT_GT(kept, 150u);
  EXPECT_LT(kept, 250u);
  // the second half of the batch on another replica (row offset 20) draws the same mask
  dropout replica = d.clone(ctx);
  tensor half_batch = make_tensor(std::vector<float>(200, 1.0f), shape{20, 10}, s);
  ctx.set_row_offset(20);
  const auto second = read(replica.forward(half_batch, ctx), s);
  EXPECT_EQ(second, std::vector<float>(whole.begin() + 200, whole.end()));
  ctx.set_row_offset(0);
  ctx.set_step(6);
  EXPECT_NE(read(d.forward(x, ctx), s), whole);
  ctx.set_mode(run_mode::eval);
  EXPECT_EQ(d.forward(x, ctx).data(), x.data());  // identity, no copy
}

TEST_P(dropout_test, each_training_step_draws_a_new_mask_without_set_step) {
  // The mistake: never calling set_step. A loss's backward in training advances the step, so the next forward
  // draws a new mask; evaluation does not advance it; set_step still sets it.
  context ctx(default_stream(dev()));
  initializer init(0);
  dropout d(0.5f, init);
  const stream_ref s = ctx.stream();
  tensor x = make_tensor(std::vector<float>(400, 1.0f), shape{40, 10}, s);
  tensor zeros = make_tensor(std::vector<float>(400, 0.0f), shape{40, 10}, s);
  mse loss;
  auto step = [&] {
    const tensor_view y = d.forward(x, ctx);
    const auto mask = read(y, s);
    loss.forward(y, zeros, ctx);
    (void)loss.backward(ctx);
    return mask;
  };
  const auto first = step();
  EXPECT_EQ(ctx.step(), 1u);
  const auto second = step();
  EXPECT_NE(first, second);
  ctx.set_mode(run_mode::eval);
  loss.forward(x, zeros, ctx);
  (void)loss.backward(ctx);
  EXPECT_EQ(ctx.step(), 2u);
  ctx.set_mode(run_mode::train);
  ctx.set_step(0);
  EXPECT_EQ(step(), first);
}

TEST_P(dropout_test, one_philox_call_serves_four_elements_with_the_per_element_decisions) {
  // dropout_op draws one Philox block per four global indices; slices that start and end inside a block (ragged
  // offsets and sizes) must still make exactly the decisions of dropout_mask::keep(index).
  stream s(dev());
  const kernels::dropout_mask mask{7, 3, 11, 0.6f};
  for (std::uint64_t first : {0u, 1u, 2u, 3u, 5u, 402u}) {
    for (std::uint64_t n : {1u, 2u, 3u, 4u, 5u, 13u, 14u, 15u}) {
      const auto in = make_tensor(std::vector<float>(n, 3.0f), shape{static_cast<std::int64_t>(n)}, s);
      tensor out(shape{static_cast<std::int64_t>(n)}, dtype::f32, s);
      launch_elementwise(kernels::dropout_op<float>::calls(first, n),
                         kernels::dropout_op<float>{in.view().as<float>(), out.view().as<float>(), mask, first, n}, s,
                         "dropout");
      const auto got = read(out.view(), s);
      for (std::uint64_t i = 0; i < n; ++i) {
        EXPECT_EQ(got[i], mask.keep(first + i) ? 3.0f / 0.6f : 0.0f) << "first " << first << ", n " << n << ", i " << i;
      }
    }
  }
}

// ---- cloning and memory -----------------------------------------------------------------------------------------

TEST_P(clone_test, state_dict_copies_a_model_into_another_on_another_device_and_refuses_mismatches_whole) {
  if (!require_devices(2)) return;
  // PyTorch's student.load_state_dict(teacher.state_dict()): parameters and buffers, by name, across devices.
  stream s0(dev(0)), s1(dev(1));
  context c0(s0), c1(s1);
  initializer init_a(1), init_b(2);
  sequential teacher(linear(4, 3, c0, init_a), batch_norm(3, c0));
  sequential student(linear(4, 3, c1, init_b), batch_norm(3, c1));
  const auto x = random_values(24, 5, -1.0f, 1.0f);
  tensor x0 = make_tensor(x, shape{6, 4}, s0);
  (void)teacher.forward(x0, c0);  // training: the running statistics move
  const std::vector<named_tensor> weights = state_dict(teacher);
  ASSERT_EQ(weights.size(), 7u);  // 4 parameters, 3 buffers
  EXPECT_EQ(weights[0].name, "0.weight");
  EXPECT_EQ(weights[4].name, "1.running_mean");
  s0.synchronize();
  load_state_dict(student, weights, s1);
  c0.set_mode(run_mode::eval);
  c1.set_mode(run_mode::eval);  // the running statistics normalize: they were copied too
  tensor x1 = make_tensor(x, shape{6, 4}, s1);
  EXPECT_EQ(read(student.forward(x1, c1), s1), read(teacher.forward(x0, c0), s0));
  // strict: a missing, a reshaped and an extra tensor are named, and nothing is loaded
  sequential other(linear(4, 3, c1, init_b), batch_norm(3, c1));
  const auto before = read(parameters_of(other)[0].param->value(), s1);
  std::vector<named_tensor> wrong(weights.begin() + 1, weights.end());
  wrong[0].value = wrong[0].value.reshaped(shape{1, 3});
  wrong.push_back(named_tensor{"2.weight", weights[0].value});
  const std::string m = message_of<precondition_error>([&] { load_state_dict(other, wrong, s1); });
  EXPECT_CONTAINS(m, "missing 0.weight");
  EXPECT_CONTAINS(m, "of another shape or dtype 0.bias (given [1, 3] f32, the model's [3] f32)");
  EXPECT_CONTAINS(m, "not in the model 2.weight");
  EXPECT_EQ(read(parameters_of(other)[0].param->value(), s1), before);
}

TEST_P(clone_test, a_replica_on_another_device_computes_the_same_and_owns_its_parameters) {
  if (!require_devices(2)) return;
  context c0(default_stream(dev(0))), c1(default_stream(dev(1)));
  initializer init(5);
  // with a user's own layer: sequential::clone clones it through its clone(ctx)
  sequential net(linear(4, 8, c0, init), relu(), scaled_residual(8, 0.5f, c0, init), linear(8, 2, c0, init));
  c0.stream().synchronize();  // clone's precondition: the source values are ready (replicate() uses an event)
  auto replica = net.clone(c1);
  const auto xv = random_values(12, 15);
  tensor x0 = make_tensor(xv, shape{3, 4}, c0.stream()), x1 = make_tensor(xv, shape{3, 4}, c1.stream());
  EXPECT_EQ(read(net.forward(x0, c0), c0.stream()), read(replica.forward(x1, c1), c1.stream()));
  const auto rp = parameters_of(replica);
  ASSERT_EQ(rp.size(), 6u);
  for (const auto& p : rp) EXPECT_EQ(p.param->get_device(), dev(1)) << p.name;
  write(rp[0].param->value(), std::vector<float>(32, 0.0f), c1.stream());
  EXPECT_NE(read(parameters_of(net)[0].param->value(), c0.stream()), std::vector<float>(32, 0.0f));
}

TEST_P(memory_test, the_steady_state_training_step_allocates_nothing) {
  if (!require_devices(2)) return;
  stream s(dev(1));
  context ctx(s);
  initializer init(6);
  sequential net(linear(20, 32, ctx, init), relu(), linear(32, 10, ctx, init));
  auto params = parameters_of(net).pointers();
  sgd opt(params, sgd_options{.lr = 0.1f, .momentum = 0.9f});
  softmax_cross_entropy loss;
  tensor x = make_tensor(random_values(16 * 20, 16), shape{16, 20}, s);
  tensor y = make_labels({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5}, s);
  auto train_step = [&](const tensor_view& xb, const tensor_view& yb) {
    opt.zero_grad();
    loss.forward(net.forward(xb, ctx), yb, ctx);
    net.backward(loss.backward(ctx), ctx, input_grad::not_required);
    opt.step(s);
  };
  train_step(x, y);
  s.synchronize();
  const auto before = get_memory_stats(dev(1));
  for (int i = 0; i < 10; ++i) train_step(x, y);
  train_step(x.view().slice_rows(0, 7), y.view().slice_rows(0, 7));  // a smaller last batch
  s.synchronize();
  const auto after = get_memory_stats(dev(1));
  EXPECT_EQ(after.allocations, before.allocations);
  EXPECT_EQ(after.system_allocations, before.system_allocations);
}

// ---- optimizers against hand-computed steps ------------------------------------------------------------------------

namespace {
struct optim_fixture {
  stream s;
  parameter p{"w", shape{3}, s};
  optim_fixture(device d, const std::vector<float>& values) : s(d) { write(p.value(), values, s); }
  void set_grad(const std::vector<float>& g) {
    write(p.grad(), g, s);
    (void)p.begin_accumulate();
  }
  std::vector<float> values() { return read(p.value(), s); }
};
}  // namespace

TEST_P(sgd_test, momentum_weight_decay_and_nesterov_match_pytorch_formulas) {
  for (nesterov n : {nesterov::no, nesterov::yes}) {
    optim_fixture f(dev(), {1.0f, 2.0f, -3.0f});
    parameter* ps[] = {&f.p};
    const sgd_options o{.lr = 0.1f, .momentum = 0.9f, .dampening = 0.0f, .weight_decay = 0.01f, .nesterov = n};
    sgd opt(ps, o);
    const std::vector<std::vector<float>> grads = {{0.5f, -1.0f, 2.0f}, {0.25f, 0.5f, -1.0f}, {1.0f, 1.0f, 1.0f}};
    std::vector<double> p = {1.0, 2.0, -3.0}, buf(3, 0.0);
    for (std::size_t step = 0; step < grads.size(); ++step) {
      f.set_grad(grads[step]);
      opt.step(f.s);
      for (std::size_t i = 0; i < 3; ++i) {
        double d = grads[step][i] + 0.01 * p[i];
        buf[i] = step == 0 ? d : 0.9 * buf[i] + d;
        d = n == nesterov::yes ? d + 0.9 * buf[i] : buf[i];
        p[i] -= 0.1 * d;
      }
      const auto got = f.values();
      for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(got[i], p[i], 1e-6) << "step " << step << " i " << i;
    }
    EXPECT_EQ(opt.steps_taken(f.s), 3);
  }
}

TEST_P(sgd_test, dampening_and_plain_sgd) {
  optim_fixture f(dev(), {1.0f, 1.0f, 1.0f});
  parameter* ps[] = {&f.p};
  sgd plain(ps, sgd_options{.lr = 0.5f});
  f.set_grad({1.0f, -2.0f, 0.0f});
  plain.step(f.s);
  EXPECT_EQ(f.values(), (std::vector<float>{0.5f, 2.0f, 1.0f}));
  EXPECT_TRUE(plain.momentum_buffer(0, 0).empty());  // no momentum, no state
  EXPECT_THROW(sgd(ps, sgd_options{.lr = 0.1f, .momentum = 0.9f, .dampening = 0.1f, .nesterov = nesterov::yes}),
               precondition_error);
  EXPECT_THROW(sgd(ps, sgd_options{.lr = -1.0f}), precondition_error);
}

TEST_P(adamw_test, matches_pytorch_formulas) {
  optim_fixture f(dev(), {1.0f, -0.5f, 0.25f});
  parameter* ps[] = {&f.p};
  const adamw_options o{.lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.1f};
  adamw opt(ps, o);
  const std::vector<std::vector<float>> grads = {{0.5f, -1.0f, 2.0f}, {0.1f, 0.2f, -0.3f}, {-1.0f, 0.0f, 1.0f}};
  std::vector<double> p = {1.0, -0.5, 0.25}, m(3, 0), v(3, 0);
  for (std::size_t step = 0; step < grads.size(); ++step) {
    f.set_grad(grads[step]);
    opt.step(f.s);
    const double t = static_cast<double>(step + 1);
    for (std::size_t i = 0; i < 3; ++i) {
      const double g = grads[step][i];
      p[i] *= 1 - 0.01 * 0.1;
      m[i] = 0.9 * m[i] + 0.1 * g;
      v[i] = 0.99 * v[i] + 0.01 * g * g;
      const double bc1 = 1 - std::pow(0.9, t), bc2 = 1 - std::pow(0.99, t);
      p[i] -= (0.01 / bc1) * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + 1e-8);
    }
    const auto got = f.values();
    for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(got[i], p[i], 2e-6) << "step " << step << " i " << i;
  }
}

TEST_P(optimizer_test, a_skipped_step_changes_nothing_and_the_multiplier_scales_gradients) {
  optim_fixture f(dev(), {1.0f, 2.0f, 3.0f});
  parameter* ps[] = {&f.p};
  sgd opt(ps, sgd_options{.lr = 1.0f, .momentum = 0.5f});
  auto skip = to_device(std::vector<float>{1.0f}, f.s);
  auto half_scale = to_device(std::vector<float>{0.5f}, f.s);
  f.set_grad({2.0f, 2.0f, 2.0f});
  opt.step(f.s, step_inputs{half_scale.data(), skip.data()});
  EXPECT_EQ(f.values(), (std::vector<float>{1.0f, 2.0f, 3.0f}));
  EXPECT_EQ(opt.steps_taken(f.s), 0);
  fill_zero(skip.span(), f.s);
  opt.step(f.s, step_inputs{half_scale.data(), skip.data()});  // gradient 2 * 0.5
  EXPECT_EQ(f.values(), (std::vector<float>{0.0f, 1.0f, 2.0f}));
  EXPECT_EQ(opt.steps_taken(f.s), 1);
}

TEST_P(optimizer_test, one_launch_updates_many_tensors_of_odd_sizes) {
  stream s(dev());
  std::vector<parameter> params;
  params.reserve(30);
  for (int i = 0; i < 30; ++i) {
    std::string name = "p";  // not "p" + to_string(i): GCC 12 -O3 reports a false -Wrestrict on that
    name += std::to_string(i);
    params.emplace_back(name, shape{i * 37 + 1}, s);
    write(params.back().value(), std::vector<float>(static_cast<std::size_t>(i * 37 + 1), 1.0f), s);
    write(params.back().grad(), std::vector<float>(static_cast<std::size_t>(i * 37 + 1), static_cast<float>(i)), s);
    (void)params.back().begin_accumulate();
  }
  std::vector<parameter*> ptrs;
  for (auto& p : params) ptrs.push_back(&p);
  sgd opt(ptrs, sgd_options{.lr = 0.5f});
  opt.step(s);
  for (int i = 0; i < 30; ++i) {
    const auto v = read(params[static_cast<std::size_t>(i)].value(), s);
    for (float x : v) ASSERT_EQ(x, 1.0f - 0.5f * static_cast<float>(i)) << "tensor " << i;
  }
}

TEST_P(optimizer_test, unused_parameters_see_a_zero_gradient_and_groups_are_checked) {
  if (!require_devices(2)) return;
  optim_fixture f(dev(), {1.0f, 2.0f, 3.0f});
  write(f.p.grad(), {9.0f, 9.0f, 9.0f}, f.s);  // stale memory, but the gradient is logically zero
  f.p.zero_grad();
  parameter* ps[] = {&f.p};
  sgd opt(ps, sgd_options{.lr = 1.0f});
  EXPECT_THROW(opt.add_param_group(ps, sgd_options{}), precondition_error);  // already in a group
  stream other(dev(1));
  parameter q("q", shape{2}, other);
  parameter* qs[] = {&q};
  EXPECT_THROW(opt.add_param_group(qs, sgd_options{}), precondition_error);  // another device
  parameter r("r", shape{2}, f.s);
  parameter* rs[] = {&r};
  opt.add_param_group(rs, sgd_options{.lr = 1.0f});  // before the first step: fine
  EXPECT_EQ(opt.group_count(), 2u);
  opt.step(f.s);
  EXPECT_EQ(f.values(), (std::vector<float>{1.0f, 2.0f, 3.0f}));
  EXPECT_EQ(opt.steps_taken(f.s, 1), 1);
}

TEST(lr_schedule, cosine_and_step_factors_match_pytorch) {
  // torch.optim.lr_scheduler.CosineAnnealingLR(T_max=4) from lr 1: 1, 0.85355339, 0.5, 0.14644661, 0 (and then
  // back up, 0.1464...: PyTorch's cosine is periodic; this one stays at its end value).
  const cosine_schedule cosine{.total_steps = 4};
  const double expected[] = {1.0, 0.8535533905932737, 0.5, 0.14644660940672627, 0.0, 0.0, 0.0};
  for (std::int64_t t = 0; t < 7; ++t) EXPECT_NEAR(cosine(t), expected[t], 1e-15) << "step " << t;
  // eta_min = 0.1 x lr: halfway is 0.1 + 0.9 x 0.5.
  EXPECT_NEAR((cosine_schedule{.total_steps = 4, .final_factor = 0.1})(2), 0.55, 1e-15);
  // Warm-up 2 of 6: 1/3, 2/3, then the cosine over the remaining 4 steps.
  const cosine_schedule warm{.total_steps = 6, .warmup_steps = 2};
  EXPECT_NEAR(warm(0), 1.0 / 3, 1e-15);
  EXPECT_NEAR(warm(1), 2.0 / 3, 1e-15);
  for (std::int64_t t = 2; t < 9; ++t) EXPECT_NEAR(warm(t), expected[t - 2], 1e-15) << "step " << t;
  // StepLR(step_size=2, gamma=0.5).
  const step_schedule halving{.step_size = 2, .gamma = 0.5};
  const double steps[] = {1.0, 1.0, 0.5, 0.5, 0.25};
  for (std::int64_t t = 0; t < 5; ++t) EXPECT_EQ(halving(t), steps[t]) << "step " << t;
  EXPECT_EQ(constant_schedule{}(12345), 1.0);
}

TEST_P(lr_schedule_test, invalid_schedules_are_rejected_when_the_scheduler_is_made) {
  optim_fixture f(dev(), {1.0f, 1.0f, 1.0f});
  parameter* ps[] = {&f.p};
  sgd opt(ps, sgd_options{.lr = 0.1f});
  EXPECT_THROW(lr_scheduler(opt, cosine_schedule{}), precondition_error);  // total_steps 0
  EXPECT_THROW(lr_scheduler(opt, cosine_schedule{.total_steps = 4, .warmup_steps = 4}), precondition_error);
  EXPECT_THROW(lr_scheduler(opt, cosine_schedule{.total_steps = 4, .final_factor = 2.0}), precondition_error);
  EXPECT_THROW(lr_scheduler(opt, step_schedule{.step_size = 0}), precondition_error);
  EXPECT_THROW(lr_scheduler(opt, step_schedule{.step_size = 3, .gamma = 0.0}), precondition_error);
  EXPECT_EQ(opt.options().lr, 0.1f);  // a rejected scheduler changed nothing
}

TEST_P(lr_schedule_test, queued_steps_use_the_rate_they_were_queued_with_in_every_group) {
  // Plain SGD (p -= lr g) on two groups with base rates 0.5 and 0.25, halved every step; the gradients are
  // written once and the three steps queued without waiting for the device: each update must use its own
  // step's rate. A group added later keeps its own base rate.
  stream s{dev()};
  parameter a{"a", shape{3}, s}, b{"b", shape{3}, s}, c{"c", shape{3}, s};
  const std::vector<float> start = {1.0f, 2.0f, 3.0f}, g = {1.0f, -2.0f, 4.0f};
  for (parameter* p : {&a, &b}) {
    write(p->value(), start, s);
    write(p->grad(), g, s);
    (void)p->begin_accumulate();
  }
  parameter* pa[] = {&a};
  parameter* pb[] = {&b};
  parameter* pc[] = {&c};
  sgd opt(pa, sgd_options{.lr = 0.5f});
  opt.add_param_group(pb, sgd_options{.lr = 0.25f});
  lr_scheduler sched(opt, step_schedule{.step_size = 1, .gamma = 0.5});
  EXPECT_EQ(sched.last_step(), 0);
  std::vector<double> ea(start.begin(), start.end()), eb = ea;
  for (int step = 0; step < 3; ++step) {
    opt.step(s);
    sched.step();
    for (std::size_t i = 0; i < 3; ++i) {
      ea[i] -= 0.5 * std::pow(0.5, step) * g[i];
      eb[i] -= 0.25 * std::pow(0.5, step) * g[i];
    }
  }
  EXPECT_EQ(sched.last_step(), 3);
  EXPECT_EQ(opt.options(0).lr, 0.5f / 8);
  EXPECT_EQ(opt.options(1).lr, 0.25f / 8);
  const auto got_a = read(a.value(), s), got_b = read(b.value(), s);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(got_a[i], static_cast<float>(ea[i])) << i;  // every rate and value is an exact binary fraction
    EXPECT_EQ(got_b[i], static_cast<float>(eb[i])) << i;
  }
  opt.add_param_group(pc, sgd_options{.lr = 2.0f});
  sched.step();
  EXPECT_EQ(sched.base_lr(2), 2.0f);
  EXPECT_EQ(opt.options(2).lr, 2.0f / 16);
  EXPECT_EQ(opt.options(0).lr, 0.5f / 16);
}

TEST_P(optimizer_test, a_group_added_after_some_steps_starts_at_its_own_first_step) {
  // PyTorch counts steps per parameter: a group added later (unfreezing layers) gets step 1's bias corrections
  // (AdamW) and a momentum buffer started at its first gradient (SGD, visible with dampening). Its updates must
  // be those of a fresh optimizer, bit for bit, while the first group keeps counting.
  const std::vector<float> start = {0.5f, -1.25f, 2.0f};
  const std::vector<std::vector<float>> grads = {{0.5f, -1.0f, 2.0f}, {0.25f, 0.5f, -1.0f}, {1.0f, 1.0f, 1.0f}};
  auto check = [&]<class Optimizer, class Options>(const Options& o) {
    optim_fixture early(dev(), {1.0f, 2.0f, 3.0f}), late(dev(), start), alone(dev(), start);
    parameter* e[] = {&early.p};
    parameter* l[] = {&late.p};
    parameter* a[] = {&alone.p};
    Optimizer opt(e, o), fresh(a, o);
    for (int i = 0; i < 3; ++i) {
      early.set_grad(grads[static_cast<std::size_t>(i)]);
      opt.step(early.s);
    }
    opt.add_param_group(l, o);
    for (const auto& g : grads) {
      early.set_grad(g);
      late.set_grad(g);
      alone.set_grad(g);
      opt.step(early.s);
      early.s.synchronize();  // the late parameter is read on its own stream
      fresh.step(alone.s);
      EXPECT_EQ(late.values(), alone.values());
    }
    EXPECT_EQ(opt.steps_taken(early.s, 0), 6);
    EXPECT_EQ(opt.steps_taken(early.s, 1), 3);
  };
  check.template operator()<adamw>(adamw_options{.lr = 0.1f, .weight_decay = 0.01f});
  check.template operator()<sgd>(sgd_options{.lr = 0.1f, .momentum = 0.9f, .dampening = 0.5f});
}
