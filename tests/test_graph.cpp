// Tests of nn/graph.hpp on both backends (the CUDA instances skip without a GPU, or with too few): joins
// (exactly, with small integers), a residual and branching net against central finite differences, a residual
// graph against the same computation written by hand, nesting (in sequential, in another graph), every build
// error, the gradients-ready hook, parameter names, clone, steady-state allocations, and f16/bf16 against f32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "lockstep/core/half.hpp"
#include "lockstep/nn/activation.hpp"
#include "lockstep/nn/graph.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/linear.hpp"
#include "lockstep/nn/loss.hpp"
#include "lockstep/nn/sequential.hpp"
#include "lockstep/nn/summary.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/nn/pool.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/memory.hpp"
#include "test_support.hpp"

using namespace lockstep;
using namespace lockstep_test;

namespace {

// The elements of a floating tensor as floats; synchronizes `s`.
std::vector<float> read(const tensor_view& t, stream_ref s) {
  std::vector<float> out;
  dispatch_floating(t.type(), "read", [&]<class T>() {
    const auto v = to_vector(device_span<const T>(t.as<T>(), static_cast<std::size_t>(t.numel()), t.get_device()), s);
    out.resize(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = to_float(v[i]);
  });
  return out;
}

// Writes `values` (rounded to the tensor's type) into `t`; synchronizes `s`.
void write(const tensor_view& t, const std::vector<float>& values, stream_ref s) {
  ASSERT_EQ(values.size(), static_cast<std::size_t>(t.numel()));
  dispatch_floating(t.type(), "write", [&]<class T>() {
    std::vector<T> v(values.size());
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = convert<T>(values[i]);
    copy(t.span<T>(), std::span<const T>(v), s);
    s.synchronize();
  });
}

tensor make_tensor(const std::vector<float>& values, shape dims, dtype type, stream_ref s) {
  tensor t(dims, type, s);
  write(t.view(), values, s);
  return t;
}

// Sets a parameter's fp32 master values and refreshes its working copy.
void set_values(parameter& p, const std::vector<float>& values, stream_ref s) {
  write(p.value(), values, s);
  p.refresh_working_copy(s);
  s.synchronize();
}

// Deterministic values in [-1.5, 1.5], never all zero.
std::vector<float> smooth_values(std::size_t n, int salt) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 1.5f * static_cast<float>(std::sin(0.73 * static_cast<double>(i) + salt));
  return v;
}

// Small integers and halves: exact in f32, f16 and bf16, and never all zero.
std::vector<float> small_values(std::size_t n, int salt) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<int>((i * 5 + salt) % 13) - 6) * 0.5f;
  return v;
}

template <class F>
void expect_precondition_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no precondition_error";
  } catch (const precondition_error& e) {
    const std::string what = e.what();
    for (const auto& part : parts) EXPECT_NE(what.find(part), std::string::npos) << "'" << part << "' not in: " << what;
  }
}

// The residual and branching net of the finite-difference tests (nodes and what they read):
//   fc1 = linear(input)   act1 = tanh(fc1)   fc2 = linear(act1)   proj = linear without bias(input)
//   res = proj + fc2      br = linear(input) bract = gelu(br)     cat = [res, bract]
//   fc3 = linear(cat)     skip = linear(res) out = fc3 + skip
// Every way a gradient reaches a node occurs: the input has three dense consumers (summed); res a
// concatenation's column range and a layer (summed); bract a column range only (gathered); fc2, proj, fc3
// and skip a sum (passed through).
graph make_net(context& ctx, initializer& init) {
  graph g(shape{3});
  g.add("fc1", linear(3, 4, ctx, init), "input")
      .add("act1", tanh_layer(), "fc1")
      .add("fc2", linear(4, 4, ctx, init), "act1")
      .add("proj", linear(3, 4, ctx, init, bias::no), "input")
      .add_sum("res", {"proj", "fc2"})
      .add("br", linear(3, 2, ctx, init), "input")
      .add("bract", gelu(), "br")
      .add_concat("cat", {"res", "bract"})
      .add("fc3", linear(6, 2, ctx, init), "cat")
      .add("skip", linear(4, 2, ctx, init), "res")
      .add_sum("out", {"fc3", "skip"});
  return g;
}

double squared_error(const std::vector<float>& y, const std::vector<float>& target) {
  double l = 0;
  for (std::size_t i = 0; i < y.size(); ++i) l += (static_cast<double>(y[i]) - target[i]) * (static_cast<double>(y[i]) - target[i]);
  return l;
}

// Identity layer with one dummy parameter (so the graph runs its backward) that records what it is given.
class spy {
 public:
  explicit spy(context& ctx) : p_("p", shape{1}, ctx.stream(), ctx.compute_type()) {}
  tensor_view forward(const tensor_view& x, context&) { return x; }
  tensor_view backward(const tensor_view& gy, context&, input_grad need) {
    last_need = need;
    last_gy = gy.data();
    ++backward_calls;
    return need == input_grad::required ? gy : tensor_view();
  }
  void parameters(parameter_list& out) { out.add(p_); }
  [[nodiscard]] spy clone(context& ctx) const { return spy(ctx); }
  [[nodiscard]] shape output_shape(const shape& s) const { return s; }

  input_grad last_need = input_grad::required;
  const void* last_gy = nullptr;
  int backward_calls = 0;

 private:
  parameter p_;
};
static_assert(layer<spy>);

// Every test of the graph runs once per backend.
class graph_test : public backend_test {};

}  // namespace

INSTANTIATE_TEST_SUITE_P(all, graph_test, all_backends(), backend_name);

// Joins alone, with small integers: forward and backward compare exactly, in every floating type, for
// ragged batch sizes that first grow then shrink (buffers reused at a smaller size). "ten" sums ten operands
// and the input gradient sums thirteen contributions (two from "twice", one column range of "cat", ten from
// "ten"): more than one launch of eight operands each.
TEST_P(graph_test, joins_compute_exact_sums_and_concatenations_forward_and_backward) {
  for (const dtype type : {dtype::f32, dtype::f16, dtype::bf16}) {
    SCOPED_TRACE(std::string(name_of(type)));
    context ctx(default_stream(dev()), type);
    graph g(shape{3});
    g.add_sum("twice", {"input", "input"});
    g.add_sum("ten", std::vector<std::string>(10, "input"));
    g.add_concat("cat", {"twice", "input", "ten"});
    for (const std::int64_t rows : {7, 5, 6}) {
      const auto xs = small_values(static_cast<std::size_t>(rows * 3), static_cast<int>(rows));
      const auto gs = small_values(static_cast<std::size_t>(rows * 9), static_cast<int>(rows) + 3);
      tensor x = make_tensor(xs, shape{rows, 3}, type, ctx.stream());
      tensor gy = make_tensor(gs, shape{rows, 9}, type, ctx.stream());
      const tensor_view y = g.forward(x, ctx);
      ASSERT_EQ(y.dims(), (shape{rows, 9}));
      const auto yv = read(y, ctx.stream());
      const tensor_view gx = g.backward(gy, ctx, input_grad::required);
      ASSERT_EQ(gx.dims(), (shape{rows, 3}));
      const auto gxv = read(gx, ctx.stream());
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t c = 0; c < 3; ++c) {
          const float xv = xs[static_cast<std::size_t>(r * 3 + c)];
          const auto at = [&](std::int64_t col) { return static_cast<std::size_t>(r * 9 + col); };
          EXPECT_EQ(yv[at(c)], 2 * xv) << r << "," << c;
          EXPECT_EQ(yv[at(3 + c)], xv) << r << "," << c;
          EXPECT_EQ(yv[at(6 + c)], 10 * xv) << r << "," << c;
          EXPECT_EQ(gxv[static_cast<std::size_t>(r * 3 + c)], 2 * gs[at(c)] + gs[at(3 + c)] + 10 * gs[at(6 + c)])
              << r << "," << c;
        }
      }
      // Nothing upstream needs a gradient: nothing is computed.
      EXPECT_TRUE(g.backward(gy, ctx, input_grad::not_required).empty());
    }
  }
}

// Central differences of the loss, computed in double on the host from the f32 outputs, against the
// gradients backward gives, for every parameter element and every input element.
//
// Tolerance: with h = 1e-2 the truncation error is h^2/6 * |L'''|, ~1e-4 for this net (weights of
// U(-1/sqrt(in), 1/sqrt(in)), smooth tanh/gelu); the f32 rounding of the 10 outputs (|y| ~ 1, a few ulps)
// moves L by ~1e-6, i.e. ~5e-5 in the quotient. The worst error observed is 1.2e-4 on a gradient of 0.43;
// 5e-4 + 5e-3 * |g| leaves a margin of 4x or more, while a lost or misplaced contribution to any node
// changes some gradient by 0.1 or more (checked by breaking the accumulation on purpose).
TEST_P(graph_test, gradients_match_central_finite_differences) {
  context ctx(default_stream(dev()));
  initializer init(7);
  graph g = make_net(ctx, init);
  const std::int64_t rows = 5;
  auto xs = smooth_values(static_cast<std::size_t>(rows * 3), 1);
  const auto ts = smooth_values(static_cast<std::size_t>(rows * 2), 2);
  tensor x = make_tensor(xs, shape{rows, 3}, dtype::f32, ctx.stream());
  tensor target = make_tensor(ts, shape{rows, 2}, dtype::f32, ctx.stream());

  // Analytic gradients.
  zero_grad(g);
  mse loss(reduction::sum);
  const tensor_view y = g.forward(x, ctx);
  (void)loss.forward(y, target, ctx);
  const double host_loss = squared_error(read(y, ctx.stream()), ts);
  EXPECT_NEAR(loss.read_loss(ctx.stream()), host_loss, 1e-5 * host_loss);
  const tensor_view gx = g.backward(loss.backward(ctx), ctx, input_grad::required);
  const auto input_grad_values = read(gx, ctx.stream());
  const parameter_list params = parameters_of(g);
  std::vector<std::vector<float>> grads;
  for (const auto& p : params) grads.push_back(read(p.param->grad(), ctx.stream()));

  const double h = 1e-2;
  auto loss_now = [&] { return squared_error(read(g.forward(x, ctx), ctx.stream()), ts); };
  auto check = [&](const std::string& what, double analytic, double numeric) {
    EXPECT_NEAR(analytic, numeric, 5e-4 + 5e-3 * std::abs(numeric)) << what;
  };
  double largest = 0;
  for (std::size_t k = 0; k < params.size(); ++k) {
    parameter& p = *params[k].param;
    auto values = read(p.value(), ctx.stream());
    for (std::size_t i = 0; i < values.size(); ++i) {
      const float original = values[i];
      const float up = static_cast<float>(original + h), down = static_cast<float>(original - h);
      values[i] = up;
      set_values(p, values, ctx.stream());
      const double lu = loss_now();
      values[i] = down;
      set_values(p, values, ctx.stream());
      const double ld = loss_now();
      values[i] = original;
      set_values(p, values, ctx.stream());
      check(params[k].name + "[" + std::to_string(i) + "]", grads[k][i],
            (lu - ld) / (static_cast<double>(up) - static_cast<double>(down)));
      largest = std::max(largest, std::abs(static_cast<double>(grads[k][i])));
    }
  }
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const float original = xs[i];
    const float up = static_cast<float>(original + h), down = static_cast<float>(original - h);
    xs[i] = up;
    write(x.view(), xs, ctx.stream());
    const double lu = loss_now();
    xs[i] = down;
    write(x.view(), xs, ctx.stream());
    const double ld = loss_now();
    xs[i] = original;
    write(x.view(), xs, ctx.stream());
    check("input[" + std::to_string(i) + "]", input_grad_values[i],
          (lu - ld) / (static_cast<double>(up) - static_cast<double>(down)));
  }
  EXPECT_GT(largest, 0.5) << "gradients too small for the check to mean anything";
}

// x -> fc1 -> relu -> fc2, out = x + fc2: the graph's arithmetic is the hand-written chain's, bit for bit
// (the same GEMMs; a + b summed in f32 and rounded once either way).
TEST_P(graph_test, residual_graph_equals_the_computation_written_by_hand) {
  context ctx(default_stream(dev()));
  initializer init(3);
  linear fc1(4, 8, ctx, init), fc2(8, 4, ctx, init);
  linear hand1 = fc1.clone(ctx), hand2 = fc2.clone(ctx);
  relu hand_act;
  graph g(shape{4});
  g.add("fc1", std::move(fc1), "input").add("act", relu(), "fc1").add("fc2", std::move(fc2), "act");
  g.add_sum("res", {"input", "fc2"});

  const std::int64_t rows = 6;
  tensor x = make_tensor(smooth_values(static_cast<std::size_t>(rows * 4), 5), shape{rows, 4}, dtype::f32, ctx.stream());
  tensor gy = make_tensor(smooth_values(static_cast<std::size_t>(rows * 4), 6), shape{rows, 4}, dtype::f32, ctx.stream());
  zero_grad(g);
  zero_grad(hand1);
  zero_grad(hand2);
  const auto y = read(g.forward(x, ctx), ctx.stream());
  const auto gx = read(g.backward(gy, ctx, input_grad::required), ctx.stream());

  const tensor_view h2 = hand2.forward(hand_act.forward(hand1.forward(x, ctx), ctx), ctx);
  tensor hand_y(h2.dims(), dtype::f32, ctx.stream());
  copy(hand_y.span<float>(), h2.span<const float>(), ctx.stream());
  axpy<float>(1.0f, x.span<const float>(), hand_y.span<float>(), ctx.stream());
  const tensor_view g1 = hand1.backward(hand_act.backward(hand2.backward(gy, ctx, input_grad::required), ctx,
                                                          input_grad::required),
                                        ctx, input_grad::required);
  tensor hand_gx(g1.dims(), dtype::f32, ctx.stream());
  copy(hand_gx.span<float>(), g1.span<const float>(), ctx.stream());
  axpy<float>(1.0f, gy.span<const float>(), hand_gx.span<float>(), ctx.stream());

  EXPECT_EQ(y, read(hand_y, ctx.stream()));
  EXPECT_EQ(gx, read(hand_gx, ctx.stream()));
  EXPECT_EQ(read(g.find<linear>("fc1")->weight().grad(), ctx.stream()), read(hand1.weight().grad(), ctx.stream()));
  EXPECT_EQ(read(g.find<linear>("fc1")->bias_parameter().grad(), ctx.stream()),
            read(hand1.bias_parameter().grad(), ctx.stream()));
  EXPECT_EQ(read(g.find<linear>("fc2")->weight().grad(), ctx.stream()), read(hand2.weight().grad(), ctx.stream()));
  EXPECT_EQ(read(g.find<linear>("fc2")->bias_parameter().grad(), ctx.stream()),
            read(hand2.bias_parameter().grad(), ctx.stream()));
}

namespace {

// A residual block: input -> fc -> tanh, out = input + tanh.
graph make_block(context& ctx, initializer& init) {
  graph b(shape{4});
  b.add("fc", linear(4, 4, ctx, init), "input").add("act", tanh_layer(), "fc").add_sum("res", {"input", "act"});
  return b;
}

// The same computation as pre -> block -> post, flat.
graph make_flat(context& ctx, initializer& init) {
  graph f(shape{3});
  f.add("pre", linear(3, 4, ctx, init), "input")
      .add("fc", linear(4, 4, ctx, init), "pre")
      .add("act", tanh_layer(), "fc")
      .add_sum("res", {"pre", "act"})
      .add("post", linear(4, 2, ctx, init), "res");
  return f;
}

struct run_result {
  std::vector<float> y, gx;
  std::vector<std::string> names;
  std::vector<std::vector<float>> grads;
};

template <layer L>
run_result run(L& model, context& ctx, std::int64_t rows) {
  tensor x = make_tensor(smooth_values(static_cast<std::size_t>(rows * 3), 8), shape{rows, 3}, dtype::f32, ctx.stream());
  tensor gy = make_tensor(smooth_values(static_cast<std::size_t>(rows * 2), 9), shape{rows, 2}, dtype::f32, ctx.stream());
  zero_grad(model);
  run_result r;
  r.y = read(model.forward(x, ctx), ctx.stream());
  r.gx = read(model.backward(gy, ctx, input_grad::required), ctx.stream());
  for (const auto& p : parameters_of(model)) {
    r.names.push_back(p.name);
    r.grads.push_back(read(p.param->grad(), ctx.stream()));
  }
  return r;
}

}  // namespace

// The same layers (same seed, same creation order) as a flat graph, as sequential<linear, graph, linear> and
// as a graph holding a graph: identical results, and parameter names qualified by position or node name.
TEST_P(graph_test, nests_in_sequential_and_in_another_graph) {
  context ctx(default_stream(dev()));
  const std::int64_t rows = 5;
  initializer flat_init(11);
  graph flat = make_flat(ctx, flat_init);
  const run_result expected = run(flat, ctx, rows);

  initializer seq_init(11);
  linear pre(3, 4, ctx, seq_init);
  graph block = make_block(ctx, seq_init);
  linear post(4, 2, ctx, seq_init);
  sequential<linear, graph, linear> seq(std::move(pre), std::move(block), std::move(post));
  EXPECT_EQ(seq.output_shape(shape{3}), (shape{2}));
  const run_result in_seq = run(seq, ctx, rows);
  EXPECT_EQ(in_seq.y, expected.y);
  EXPECT_EQ(in_seq.gx, expected.gx);
  EXPECT_EQ(in_seq.grads, expected.grads);
  EXPECT_EQ(in_seq.names, (std::vector<std::string>{"0.weight", "0.bias", "1.fc.weight", "1.fc.bias", "2.weight",
                                                     "2.bias"}));

  initializer outer_init(11);
  graph outer(shape{3});
  outer.add("pre", linear(3, 4, ctx, outer_init), "input");
  outer.add("block", make_block(ctx, outer_init), "pre");
  outer.add("post", linear(4, 2, ctx, outer_init), "block");
  const run_result in_graph = run(outer, ctx, rows);
  EXPECT_EQ(in_graph.y, expected.y);
  EXPECT_EQ(in_graph.gx, expected.gx);
  EXPECT_EQ(in_graph.grads, expected.grads);
  EXPECT_EQ(in_graph.names, (std::vector<std::string>{"pre.weight", "pre.bias", "block.fc.weight", "block.fc.bias",
                                                       "post.weight", "post.bias"}));
  ASSERT_NE(outer.find<graph>("block"), nullptr);
  EXPECT_NE(outer.find<graph>("block")->find<linear>("fc"), nullptr);

  // And behind any_layer.
  any_layer boxed(std::move(outer));
  const run_result boxed_run = run(boxed, ctx, rows);
  EXPECT_EQ(boxed_run.y, expected.y);
  EXPECT_EQ(boxed_run.names, in_graph.names);
}

TEST_P(graph_test, nodes_may_be_added_in_any_order_and_the_order_breaks_ties_by_insertion) {
  context ctx(default_stream(dev()));
  initializer init(1);
  graph g(shape{3});
  g.add("fc2", linear(4, 2, ctx, init), "s");
  g.add_sum("s", {"b", "a"});
  g.add("b", tanh_layer(), "fc1");
  g.add("a", gelu(), "fc1");
  g.add("fc1", linear(3, 4, ctx, init), "input");
  g.set_output("fc2");
  EXPECT_EQ(g.order(), (std::vector<std::string>{"fc1", "b", "a", "s", "fc2"}));
  EXPECT_EQ(g.output_shape(shape{3}), (shape{2}));
  g.build();
  EXPECT_EQ(g.order(), (std::vector<std::string>{"fc1", "b", "a", "s", "fc2"}));
  tensor x = make_tensor(smooth_values(6, 1), shape{2, 3}, dtype::f32, ctx.stream());
  EXPECT_EQ(g.forward(x, ctx).dims(), (shape{2, 2}));
  EXPECT_NE(g.find<linear>("fc1"), nullptr);
  EXPECT_EQ(g.find<relu>("fc1"), nullptr);
  EXPECT_EQ(g.find<linear>("s"), nullptr);
  expect_precondition_error([&] { (void)g.find<linear>("fc3"); }, {"fc3"});
}

TEST_P(graph_test, build_rejects_malformed_graphs_naming_the_nodes) {
  context ctx(default_stream(dev()));
  initializer init(1);

  expect_precondition_error([] { graph(shape{3}).build(); }, {"no nodes"});
  expect_precondition_error([] { (void)graph(shape{3}).output_shape(shape{3}); }, {"no nodes"});
  expect_precondition_error([] { graph(shape{1, 2, 3, 4}); }, {"[1, 2, 3, 4]"});

  {
    graph g(shape{3});
    g.add("a", tanh_layer(), "input");
    expect_precondition_error([&] { g.add("a", gelu(), "input"); }, {"'a' already exists"});
    expect_precondition_error([&] { g.add("input", gelu(), "a"); }, {"'input' is reserved"});
    expect_precondition_error([&] { g.add_sum("s", {"a"}); }, {"'s'", "at least two"});
    expect_precondition_error([&] { g.add_concat("c", {"a"}); }, {"'c'", "at least two"});
    expect_precondition_error([&] { g.add("e", any_layer(), "a"); }, {"'e'", "empty any_layer"});
    EXPECT_EQ(g.order(), (std::vector<std::string>{"a"}));  // the rejected adds left no trace
  }
  {
    graph g(shape{3});
    g.add("a", tanh_layer(), "input").add("b", tanh_layer(), "nope");
    expect_precondition_error([&] { g.build(); }, {"node 'b' takes input 'nope'", "not a node"});
    g.add("nope", tanh_layer(), "a").set_output("b");  // added later: now it builds
    EXPECT_NO_THROW(g.build());
  }
  {
    graph g(shape{3});
    g.add("a", tanh_layer(), "c").add("b", tanh_layer(), "a").add("c", tanh_layer(), "b");
    g.add("d", tanh_layer(), "input").add_sum("e", {"c", "d"});
    expect_precondition_error([&] { g.build(); }, {"graph has a cycle: a -> b -> c -> a"});
    expect_precondition_error([&] { (void)g.order(); }, {"graph has a cycle: a -> b -> c -> a"});
  }
  {
    graph g(shape{3});
    g.add("d", tanh_layer(), "input").add("self", tanh_layer(), "self").add_sum("e", {"d", "self"});
    expect_precondition_error([&] { g.build(); }, {"graph has a cycle: self -> self"});
  }
  {
    graph g(shape{3});
    g.add("a", linear(3, 256, ctx, init), "input").add("b", linear(3, 128, ctx, init), "input");
    g.add_sum("s", {"a", "b"});
    expect_precondition_error([&] { g.build(); }, {"sum node 's'", "'a' has shape [256]", "'b' has shape [128]"});
  }
  {
    graph g(shape{3});
    g.add("fc1", linear(3, 4, ctx, init), "input").add("fc2", linear(5, 2, ctx, init), "fc1");
    expect_precondition_error([&] { g.build(); },
                              {"node 'fc2' cannot take its input 'fc1' of shape [4]", "expects samples of 5 features"});
  }
  {
    graph g(shape{2, 3});
    g.add("fc", linear(6, 4, ctx, init), "input").add_concat("c", {"input", "fc"});
    expect_precondition_error([&] { g.build(); },
                              {"concat node 'c'", "'input' of shape [2, 3]", "'fc' of shape [4]", "first dimension"});
  }
  {
    graph g(shape{3});
    g.add("fc1", linear(3, 4, ctx, init), "input").add("dead", tanh_layer(), "input").add("t", tanh_layer(), "dead");
    g.add("out", tanh_layer(), "fc1");
    expect_precondition_error([&] { g.build(); }, {"output 'out' does not depend on", "'dead', 't'"});
    g.set_output("nope");
    expect_precondition_error([&] { g.build(); }, {"output 'nope'"});
  }
  {
    graph g(shape{3});
    g.add("fc1", linear(3, 4, ctx, init), "input");
    expect_precondition_error([&] { (void)g.output_shape(shape{4}); }, {"[3]", "[4]"});
    tensor x = make_tensor(smooth_values(8, 1), shape{2, 4}, dtype::f32, ctx.stream());
    expect_precondition_error([&] { (void)g.forward(x, ctx); }, {"[2, 4]", "[3]"});
    expect_precondition_error([&] { (void)g.backward(x, ctx, input_grad::required); }, {"without a forward"});
  }
  {
    // Concatenation of samples of higher rank: along their first dimension.
    graph g(shape{2, 3});
    g.add_concat("c", {"input", "input"});
    EXPECT_EQ(g.output_shape(shape{2, 3}), (shape{4, 3}));
  }
}

TEST_P(graph_test, parameters_are_named_by_node_in_topological_order) {
  context ctx(default_stream(dev()));
  initializer init(7);
  graph g = make_net(ctx, init);
  std::vector<std::string> names;
  for (const auto& p : parameters_of(g)) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "proj.weight",
                                             "br.weight", "br.bias", "fc3.weight", "fc3.bias", "skip.weight",
                                             "skip.bias"}));
  EXPECT_EQ(g.order(), (std::vector<std::string>{"fc1", "act1", "fc2", "proj", "res", "br", "bract", "cat", "fc3",
                                                 "skip", "out"}));
}

TEST_P(graph_test, gradients_ready_hook_fires_per_layer_node_in_reverse_topological_order) {
  context ctx(default_stream(dev()));
  initializer init(7);
  graph g = make_net(ctx, init);
  std::vector<std::vector<parameter*>> reported;
  ctx.set_gradients_ready_hook([&](std::span<parameter* const> ps) { reported.emplace_back(ps.begin(), ps.end()); });
  tensor x = make_tensor(smooth_values(12, 1), shape{4, 3}, dtype::f32, ctx.stream());
  tensor gy = make_tensor(smooth_values(8, 2), shape{4, 2}, dtype::f32, ctx.stream());
  for (const input_grad need : {input_grad::required, input_grad::not_required}) {
    reported.clear();
    (void)g.forward(x, ctx);
    (void)g.backward(gy, ctx, need);
    // act1 and bract have no parameters: the context reports nothing for them.
    const std::vector<std::string> expected_order{"skip", "fc3", "br", "proj", "fc2", "fc1"};
    ASSERT_EQ(reported.size(), expected_order.size());
    for (std::size_t i = 0; i < expected_order.size(); ++i) {
      EXPECT_EQ(reported[i], parameters_of(*g.find<linear>(expected_order[i])).pointers()) << expected_order[i];
    }
  }
}

// A node read once gets its consumer's gradient as it is (no copy); a node read twice gets the sum in the
// graph's memory; the layers fed by the input are told whether their input gradient is needed.
TEST_P(graph_test, gradients_pass_through_single_consumers_and_input_grad_reaches_the_first_layers) {
  context ctx(default_stream(dev()));
  tensor x = make_tensor(small_values(6, 1), shape{2, 3}, dtype::f32, ctx.stream());
  tensor gy = make_tensor(small_values(6, 2), shape{2, 3}, dtype::f32, ctx.stream());
  {
    graph g(shape{3});
    g.add("s1", spy(ctx), "input").add("s2", spy(ctx), "s1");
    (void)g.forward(x, ctx);
    const tensor_view gx = g.backward(gy, ctx, input_grad::required);
    EXPECT_EQ(g.find<spy>("s2")->last_gy, gy.data());
    EXPECT_EQ(g.find<spy>("s1")->last_gy, gy.data());
    EXPECT_EQ(g.find<spy>("s1")->last_need, input_grad::required);
    EXPECT_EQ(gx.data(), gy.data());
    (void)g.forward(x, ctx);
    EXPECT_TRUE(g.backward(gy, ctx, input_grad::not_required).empty());
    EXPECT_EQ(g.find<spy>("s1")->last_need, input_grad::not_required);
    EXPECT_EQ(g.find<spy>("s2")->last_need, input_grad::required);
  }
  {
    graph g(shape{3});
    g.add("s1", spy(ctx), "input").add("s2", spy(ctx), "s1").add("s3", spy(ctx), "s1").add_sum("out", {"s2", "s3"});
    (void)g.forward(x, ctx);
    (void)g.backward(gy, ctx, input_grad::not_required);
    spy& s1 = *g.find<spy>("s1");
    EXPECT_EQ(s1.last_need, input_grad::not_required);
    EXPECT_EQ(g.find<spy>("s2")->last_gy, gy.data());
    EXPECT_NE(s1.last_gy, gy.data());
    const auto g1 = read(tensor_view(const_cast<void*>(s1.last_gy), dtype::f32, shape{2, 3}, dev()), ctx.stream());
    const auto gyv = read(gy, ctx.stream());
    for (std::size_t i = 0; i < g1.size(); ++i) EXPECT_EQ(g1[i], 2 * gyv[i]) << i;
  }
  {
    // A parameter-free layer whose input needs no gradient is not run backward at all.
    graph g(shape{3});
    g.add("t", tanh_layer(), "input").add("s", spy(ctx), "t");
    (void)g.forward(x, ctx);
    EXPECT_TRUE(g.backward(gy, ctx, input_grad::not_required).empty());
    EXPECT_EQ(g.find<spy>("s")->last_need, input_grad::not_required);
  }
}

TEST_P(graph_test, clone_to_another_device_computes_the_same_with_independent_parameters) {
  if (!require_devices(2)) return;
  context ctx0(default_stream(dev(0)));
  context ctx1(default_stream(dev(1)));
  initializer init(5);
  graph g0 = make_net(ctx0, init);
  g0.build();
  ctx0.stream().synchronize();
  graph g1 = g0.clone(ctx1);
  const auto xs = smooth_values(12, 4);
  const auto gs = smooth_values(8, 5);
  tensor x0 = make_tensor(xs, shape{4, 3}, dtype::f32, ctx0.stream());
  tensor x1 = make_tensor(xs, shape{4, 3}, dtype::f32, ctx1.stream());
  tensor gy0 = make_tensor(gs, shape{4, 2}, dtype::f32, ctx0.stream());
  tensor gy1 = make_tensor(gs, shape{4, 2}, dtype::f32, ctx1.stream());
  const tensor_view y1 = g1.forward(x1, ctx1);
  EXPECT_EQ(y1.get_device(), dev(1));
  EXPECT_EQ(read(g0.forward(x0, ctx0), ctx0.stream()), read(y1, ctx1.stream()));
  EXPECT_EQ(read(g0.backward(gy0, ctx0, input_grad::required), ctx0.stream()),
            read(g1.backward(gy1, ctx1, input_grad::required), ctx1.stream()));
  const auto p0 = parameters_of(g0), p1 = parameters_of(g1);
  ASSERT_EQ(p0.size(), p1.size());
  for (std::size_t i = 0; i < p0.size(); ++i) {
    EXPECT_EQ(p0[i].name, p1[i].name);
    EXPECT_NE(p0[i].param, p1[i].param);
    EXPECT_EQ(p1[i].param->get_device(), dev(1));
    EXPECT_EQ(read(p0[i].param->grad(), ctx0.stream()), read(p1[i].param->grad(), ctx1.stream())) << p0[i].name;
  }
  EXPECT_EQ(g1.order(), g0.order());

  // Changing the clone's weights changes neither the original's weights nor its outputs.
  parameter& w1 = g1.find<linear>("fc1")->weight();
  const auto before = read(g0.find<linear>("fc1")->weight().value(), ctx0.stream());
  set_values(w1, std::vector<float>(static_cast<std::size_t>(w1.numel()), 0.25f), ctx1.stream());
  EXPECT_EQ(read(g0.find<linear>("fc1")->weight().value(), ctx0.stream()), before);
  EXPECT_NE(read(g0.forward(x0, ctx0), ctx0.stream()), read(g1.forward(x1, ctx1), ctx1.stream()));
}

TEST_P(graph_test, steady_state_steps_allocate_nothing) {
  context ctx(default_stream(dev()));
  initializer init(2);
  graph g = make_net(ctx, init);
  const std::int64_t rows = 8;
  tensor x = make_tensor(smooth_values(static_cast<std::size_t>(rows * 3), 1), shape{rows, 3}, dtype::f32, ctx.stream());
  tensor target = make_tensor(smooth_values(static_cast<std::size_t>(rows * 2), 2), shape{rows, 2}, dtype::f32,
                              ctx.stream());
  mse loss(reduction::mean);
  auto step = [&](std::int64_t n) {
    zero_grad(g);
    const tensor_view y = g.forward(x.view().slice_rows(0, n), ctx);
    (void)loss.forward(y, target.view().slice_rows(0, n), ctx);
    (void)g.backward(loss.backward(ctx), ctx, input_grad::required);
    ctx.stream().synchronize();
  };
  step(rows);
  const std::uint64_t after_first = get_memory_stats(dev()).allocations;
  step(rows);
  EXPECT_EQ(get_memory_stats(dev()).allocations, after_first) << "a second step of the same batch allocated";
  step(rows - 3);
  EXPECT_EQ(get_memory_stats(dev()).allocations, after_first) << "a smaller batch allocated";
}

// f16 and bf16: the same net from the same seed (the fp32 master values are equal), run in the reduced
// precision, against f32. Errors are measured relative to the largest magnitude of each compared tensor.
// Inputs, weights and every stored activation and gradient are rounded (relative 2^-11 for f16, 2^-8 for
// bf16), about ten roundings along the longest path, with the GEMMs and joins accumulating in f32: the worst
// errors observed are 1.1e-3 (f16) and 1.7e-2 (bf16); the bounds 5e-3 and 4e-2 are loose but still fail
// for a wrong dtype dispatch or a missing contribution.
TEST_P(graph_test, a_summary_lists_each_node_with_its_kind_output_shape_and_parameters) {
  // torchinfo's table: what a PyTorch user prints first.
  context ctx(default_stream(dev()));
  initializer init(1);
  graph g(shape{3});
  g.add("fc1", linear(3, 4, ctx, init), "input").add("act", relu(), "fc1").add("fc2", linear(4, 4, ctx, init), "act");
  g.add_sum("res", {"act", "fc2"}).add("bn", batch_norm(4, ctx), "res");
  const model_summary s = summarize(g, shape{3}, dtype::f16);
  ASSERT_EQ(s.rows.size(), 5u);
  auto expect_row = [&](std::size_t i, const char* name, const char* kind, shape out, std::int64_t params) {
    EXPECT_EQ(s.rows[i].name, name);
    EXPECT_EQ(s.rows[i].kind, kind);
    EXPECT_EQ(s.rows[i].output, out);
    EXPECT_EQ(s.rows[i].parameters, params);
  };
  expect_row(0, "fc1", "linear", shape{4}, 16);
  expect_row(1, "act", "relu", shape{4}, 0);
  expect_row(3, "res", "sum", shape{4}, 0);
  expect_row(4, "bn", "batch_norm", shape{4}, 8);
  EXPECT_EQ(s.parameters, 44);
  EXPECT_EQ(s.buffer_bytes, 40);  // running mean and variance (f32), num_batches_tracked (i64)
  EXPECT_EQ(s.working_bytes(), 88);
  const std::string table = s.str();
  EXPECT_CONTAINS(table, "fc1 (linear)");
  EXPECT_CONTAINS(table, "parameters 44: fp32 values 0.00 MB, f16 working copy 0.00 MB, f16 gradients 0.00 MB");
  // a sequential's rows are its layers by index; any other layer is one row
  sequential seq(linear(3, 2, ctx, init), max_pool2d(2));
  EXPECT_EQ(detail::layer_kind<decltype(seq)>().rfind("sequential<linear, pool2d<", 0), 0u)
      << detail::layer_kind<decltype(seq)>();
  linear alone(3, 2, ctx, init);
  const model_summary one = summarize(alone, shape{3});
  ASSERT_EQ(one.rows.size(), 1u);
  EXPECT_EQ(one.rows[0].kind, "linear");
  EXPECT_EQ(one.rows[0].parameters, 8);
  EXPECT_THROW((void)summarize(g, shape{5}), precondition_error);
}

TEST_P(graph_test, f16_and_bf16_compute_types_run_close_to_f32) {
  const std::int64_t rows = 6;
  const auto xs = smooth_values(static_cast<std::size_t>(rows * 3), 3);
  const auto ts = smooth_values(static_cast<std::size_t>(rows * 2), 4);
  auto run_in = [&](dtype type) {
    context ctx(default_stream(dev()), type);
    initializer init(9);
    graph g = make_net(ctx, init);
    tensor x = make_tensor(xs, shape{rows, 3}, type, ctx.stream());
    tensor target = make_tensor(ts, shape{rows, 2}, dtype::f32, ctx.stream());
    mse loss(reduction::sum);
    zero_grad(g);
    std::vector<std::vector<float>> out;
    const tensor_view y = g.forward(x, ctx);
    EXPECT_EQ(y.type(), type);
    out.push_back(read(y, ctx.stream()));
    if (type != dtype::f32) {  // an f32 batch for an f16 graph: refused with the fix
      tensor f32_input = make_tensor(xs, shape{rows, 3}, dtype::f32, ctx.stream());
      expect_precondition_error([&] { (void)g.forward(f32_input, ctx); },
                                {"graph: input is f32 but the context computes in " + std::string(name_of(type)),
                                 "data_loader_options::input_type = " + std::string(name_of(type))});
    }
    (void)loss.forward(y, target, ctx);
    out.push_back(read(g.backward(loss.backward(ctx), ctx, input_grad::required), ctx.stream()));
    for (const auto& p : parameters_of(g)) {
      EXPECT_EQ(p.param->grad().type(), type);
      out.push_back(read(p.param->grad(), ctx.stream()));
    }
    return out;
  };
  const auto reference = run_in(dtype::f32);
  for (const auto& [type, tolerance] : {std::pair{dtype::f16, 5e-3f}, std::pair{dtype::bf16, 4e-2f}}) {
    SCOPED_TRACE(std::string(name_of(type)));
    const auto got = run_in(type);
    ASSERT_EQ(got.size(), reference.size());
    for (std::size_t t = 0; t < got.size(); ++t) {
      float scale = 0, error = 0;
      for (std::size_t i = 0; i < got[t].size(); ++i) {
        scale = std::max(scale, std::abs(reference[t][i]));
        error = std::max(error, std::abs(got[t][i] - reference[t][i]));
      }
      EXPECT_GT(scale, 0.0f) << "tensor " << t;
      EXPECT_LE(error, tolerance * std::max(scale, 1.0f)) << "tensor " << t << " (0: output, 1: input gradient)";
    }
  }
}
