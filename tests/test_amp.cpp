// Tests of amp/: the loss scaler's dynamics (backoff, growth, ceiling, floor), skipped steps that leave
// weights and optimizer state bit-identical on every rank, unscaling against a CPU reference, f16/bf16 GEMMs
// against fp32 within the error of their input rounding, and precision policies end to end. Every test runs
// once per backend: on host devices (this program runs with LOCKSTEP_HOST_DEVICES=4) and on GPUs (skipped
// without a GPU, or with fewer than a test needs).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "lockstep/amp/loss_scaler.hpp"
#include "lockstep/amp/precision.hpp"
#include "lockstep/blas/gemm.hpp"
#include "lockstep/optim/clip.hpp"
#include "lockstep/comm/run_on_devices.hpp"
#include "lockstep/parallel/distributed_data_parallel.hpp"
#include "parallel_common.hpp"
#include "test_support.hpp"

using namespace lockstep;
using namespace lockstep_test;
using namespace parallel_test;

namespace {

std::vector<std::uint8_t> raw_bytes(const tensor_view& t, stream_ref s) {
  return to_vector(device_span<const std::uint8_t>(t.bytes()), s);
}

// Every byte of a model's fp32 values, working copies and optimizer momentum.
template <class Model>
std::vector<std::uint8_t> state_bytes(Model& m, const sgd& opt, stream_ref s) {
  std::vector<std::uint8_t> out;
  const auto params = parameters_of(m);
  for (std::size_t i = 0; i < params.size(); ++i) {
    for (const tensor_view& t : {params[i].param->value(), params[i].param->working(), opt.momentum_buffer(0, i)}) {
      if (t.empty()) continue;
      const auto b = raw_bytes(t, s);
      out.insert(out.end(), b.begin(), b.end());
    }
  }
  return out;
}

// Every suite runs once per backend.
class loss_scaler_test : public backend_test {};
class mixed_precision_test : public backend_test {};
class clip_test : public backend_test {};

}  // namespace

INSTANTIATE_TEST_SUITE_P(all, loss_scaler_test, all_backends(), backend_name);
INSTANTIATE_TEST_SUITE_P(all, mixed_precision_test, all_backends(), backend_name);
INSTANTIATE_TEST_SUITE_P(all, clip_test, all_backends(), backend_name);

// ---- the scaler's dynamics --------------------------------------------------------------------------------------

TEST_P(loss_scaler_test, backs_off_on_overflow_and_grows_after_the_interval) {
  stream s(dev());
  parameter p("w", shape{4}, s, dtype::f16);
  parameter* ps[] = {&p};
  context scaled(s);  // the gradients set below stand for a backward that read the scale
  loss_scaler scaler(scaled, loss_scaler_options{.initial_scale = 1024.0f, .growth_interval = 3});
  auto set_grad = [&](float v) {
    const std::vector<lockstep::half> g(4, to_half(v));
    auto staged = to_device(g, s);
    copy(p.grad().span<lockstep::half>(), device_span<const lockstep::half>(staged.span()), s);
    (void)p.begin_accumulate();
  };
  auto step = [&](float grad) {
    set_grad(grad);
    scaler.unscale_and_check(ps, s);
    scaler.update(s);
    return scaler.read(s);
  };
  EXPECT_EQ(step(1.0f).scale, 1024.0f);
  EXPECT_EQ(step(1.0f).scale, 1024.0f);
  auto t = step(1.0f);  // third clean step: grows
  EXPECT_EQ(t.scale, 2048.0f);
  EXPECT_EQ(t.growth_tracker, 0);
  t = step(std::numeric_limits<float>::infinity());
  EXPECT_EQ(t.scale, 1024.0f);
  EXPECT_EQ(t.skipped_steps, 1);
  EXPECT_EQ(t.last_overflow_step, 3);
  EXPECT_EQ(t.non_finite_values, 4u);
  t = step(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(t.scale, 512.0f);
  EXPECT_EQ(t.skipped_steps, 2);
  EXPECT_EQ(t.steps, 5);
}

TEST_P(loss_scaler_test, the_ceiling_and_the_floor_hold) {
  stream s(dev());
  parameter p("w", shape{2}, s, dtype::f16);
  parameter* ps[] = {&p};
  context scaled(s);  // the gradients set below stand for a backward that read the scale
  loss_scaler scaler(scaled, loss_scaler_options{.initial_scale = 8.0f, .growth_interval = 1, .max_scale = 16.0f,
                                            .min_scale = 2.0f});
  auto step = [&](float v) {
    const std::vector<lockstep::half> g(2, to_half(v));
    auto staged = to_device(g, s);
    copy(p.grad().span<lockstep::half>(), device_span<const lockstep::half>(staged.span()), s);
    (void)p.begin_accumulate();
    scaler.unscale_and_check(ps, s);
    scaler.update(s);
    return scaler.read(s).scale;
  };
  EXPECT_EQ(step(1), 16.0f);
  EXPECT_EQ(step(1), 16.0f);  // ceiling
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(step(inf), 8.0f);
  EXPECT_EQ(step(inf), 4.0f);
  EXPECT_EQ(step(inf), 2.0f);
  EXPECT_EQ(step(inf), 2.0f);  // floor
  EXPECT_THROW(loss_scaler(s, loss_scaler_options{.initial_scale = 0.0f}), precondition_error);
}

TEST_P(loss_scaler_test, bf16_defaults_to_no_scaling_but_still_skips_non_finite_steps) {
  const auto o = loss_scaler_options::for_precision(dtype::bf16);
  EXPECT_FALSE(o.dynamic);
  EXPECT_EQ(o.initial_scale, 1.0f);
  stream s(dev());
  parameter p("w", shape{2}, s, dtype::bf16);
  parameter* ps[] = {&p};
  context scaled(s);  // the gradients set below stand for a backward that read the scale
  loss_scaler scaler(scaled, o);
  const std::vector<bfloat16> g{to_bfloat16(1.0f), to_bfloat16(std::numeric_limits<float>::infinity())};
  auto staged = to_device(g, s);
  copy(p.grad().span<bfloat16>(), device_span<const bfloat16>(staged.span()), s);
  (void)p.begin_accumulate();
  scaler.unscale_and_check(ps, s);
  scaler.update(s);
  const auto t = scaler.read(s);
  EXPECT_EQ(t.scale, 1.0f);
  EXPECT_EQ(t.skipped_steps, 1);
}

TEST_P(loss_scaler_test, attaches_only_to_a_context_on_its_device) {
  if (!require_devices(2)) return;
  stream s0(dev(0)), s1(dev(1));
  loss_scaler scaler(s0);
  context here(s0), elsewhere(s1);
  scaler.attach(here);
  EXPECT_EQ(here.loss_scale(), scaler.scale());
  try {
    scaler.attach(elsewhere);
    ADD_FAILURE() << "expected precondition_error";
  } catch (const precondition_error& e) {
    EXPECT_CONTAINS(e.what(), "the scaler's state is on " + dev(0).str() + " but the context computes on " +
                                  dev(1).str());
  }
  EXPECT_EQ(elsewhere.loss_scale(), nullptr);
}

TEST_P(loss_scaler_test, a_scaler_whose_scale_no_loss_was_given_is_refused_before_the_first_step) {
  // The mistake: a scaler made and used, never attached. The loss starts backward unscaled and the optimizer would
  // divide the gradients by 65536: every update 65536 times too small, silently. Refused, naming the fix.
  stream s(dev());
  context ctx(s, dtype::f16);
  parameter p("w", shape{4}, s, dtype::f16);
  parameter* ps[] = {&p};
  loss_scaler forgotten(s);
  try {
    forgotten.unscale_and_check(ps, s);
    ADD_FAILURE() << "expected precondition_error";
  } catch (const precondition_error& e) {
    EXPECT_CONTAINS(e.what(), "every update would be 65536 times too small");
    EXPECT_CONTAINS(e.what(), "loss_scaler(ctx, options)");
  }
  // A scale that stays 1 (bf16's default) scales nothing: unattached, it is harmless and allowed.
  loss_scaler unscaled(s, loss_scaler_options::for_precision(dtype::bf16));
  EXPECT_NO_THROW(unscaled.unscale_and_check(ps, s));
  // The usual way makes it impossible: a scaler made with the context is attached to it.
  loss_scaler scaler(ctx);
  EXPECT_EQ(ctx.loss_scale(), scaler.scale());
  scaler.unscale_and_check(ps, s);
  EXPECT_EQ(scaler.read(s).skipped_steps, 0);
}

TEST_P(loss_scaler_test, a_scaler_on_another_device_than_the_parameters_is_refused_before_a_kernel_reads_it) {
  // data_parallel with output_device other than device_ids[0]: the loss lives on the output device, the model and
  // its optimizer on device_ids[0]. A scaler made on the output device and read by the optimizer's kernels is an
  // illegal address on a GPU (the process's CUDA context is lost); both misuses are refused, with the fix.
  if (!require_devices(2)) return;
  stream s0(dev(0)), s1(dev(1));
  parameter w("w", shape{5}, s0, dtype::f32);
  parameter* ps[] = {&w};
  sgd opt(std::vector<parameter*>{&w}, {.lr = 0.5f});
  loss_scaler on_output(s1);
  EXPECT_CONTAINS(message_of<precondition_error>([&] { on_output.unscale_and_check(ps, s1); }),
                  "parameter w is on " + dev(0).str() + ", the scaler on " + dev(1).str());
  EXPECT_CONTAINS(message_of<precondition_error>([&] { on_output.unscale_and_check(ps, s0); }),
                  "the scaler's state is on " + dev(1).str() + " but the stream is of " + dev(0).str());
  // The step's inputs are two raw pointers: asked of the CUDA runtime on GPUs, of the address registry on strict
  // host devices (lenient ones share one address space and cannot tell).
  if (kind() == device_kind::cuda || host_platform_configuration().strictness == host_strictness::strict) {
    const auto message = message_of<precondition_error>([&] { opt.step(s0, on_output.optimizer_inputs()); });
    EXPECT_CONTAINS(message, "the optimizer step's inverse loss scale (step_inputs) on " + dev(0).str());
    EXPECT_CONTAINS(message, dev(1).str());
  }
  // The fix: the scaler of the parameters' device. Gradients of 2 with a scale of 4 step w by -0.5 * 2 / 4.
  context model_ctx(s0);
  loss_scaler here(model_ctx, loss_scaler_options{.initial_scale = 4.0f});
  w.materialize_grad(s0);
  fill(w.grad().span<float>(), 2.0f, s0);
  fill(w.value().span<float>(), 1.0f, s0);
  here.unscale_and_check(ps, s0);
  opt.step(s0, here.optimizer_inputs());
  here.update(s0);
  EXPECT_EQ(to_vector(device_span<const float>(w.value().span<float>()), s0), std::vector<float>(5, 0.75f));
}

// ---- unscaling, exactly -----------------------------------------------------------------------------------------

TEST_P(loss_scaler_test, unscaling_matches_a_cpu_reference_exactly) {
  stream s(dev());
  // f32 gradients unscaled in place (unscale_) and f16 gradients unscaled as the optimizer reads them
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> dist(-100.0f, 100.0f);
  std::vector<float> g32(257);
  for (auto& v : g32) v = dist(gen);
  parameter p32("a", shape{257}, s, dtype::f32);
  copy(p32.grad().span<float>(), std::span<const float>(g32), s);
  (void)p32.begin_accumulate();
  context scaled(s);  // the gradients set below stand for a backward that read the scale
  loss_scaler scaler(scaled, loss_scaler_options{.initial_scale = 3072.0f});  // 1/3072 is not a power of two
  parameter* ps[] = {&p32};
  scaler.unscale_(ps, s);
  const auto got = to_vector(p32.grad().span<const float>(), s);
  const float inv = 1.0f / 3072.0f;
  for (std::size_t i = 0; i < g32.size(); ++i) ASSERT_EQ(got[i], g32[i] * inv) << i;
  // f16: SGD without momentum, lr 1, reading g * inv_scale
  parameter p16("b", shape{257}, s, dtype::f16);
  std::vector<float> start(257, 0.5f);
  copy(p16.value().span<float>(), std::span<const float>(start), s);
  p16.refresh_working_copy(s);
  std::vector<lockstep::half> g16(257);
  for (std::size_t i = 0; i < g16.size(); ++i) g16[i] = to_half(g32[i]);
  auto staged = to_device(g16, s);
  copy(p16.grad().span<lockstep::half>(), device_span<const lockstep::half>(staged.span()), s);
  (void)p16.begin_accumulate();
  parameter* qs[] = {&p16};
  sgd opt(qs, sgd_options{.lr = 1.0f});
  scaler.unscale_and_check(qs, s);
  opt.step(s, scaler.optimizer_inputs());
  const auto values = to_vector(p16.value().span<const float>(), s);
  const auto working = to_vector(p16.working().span<const lockstep::half>(), s);
  for (std::size_t i = 0; i < values.size(); ++i) {
    const float expected = 0.5f - to_float(g16[i]) * inv;
    ASSERT_EQ(values[i], expected) << i;
    ASSERT_EQ(working[i].bits, to_half(expected).bits) << i;
  }
  EXPECT_THROW(scaler.unscale_(qs, s), precondition_error);  // f16 gradients are not unscaled in place
}

// ---- a skipped step changes nothing, on every rank ----------------------------------------------------------------

TEST_P(mixed_precision_test, an_overflow_on_one_rank_skips_the_step_on_every_rank) {
  if (!require_devices(3)) return;
  for (int bad_rank : {0, 2}) {
    std::vector<std::vector<std::uint8_t>> before(3), after(3);
    std::vector<loss_scaler_telemetry> telemetry(3);
    run_on_devices(devices(3), [&](rank_context& rc) {
      context ctx(rc.compute_stream(), dtype::f16);
      graph model = make_model(ctx);
      // no DDP here: each rank checks its own gradients, so that only one rank sees the overflow and the
      // flag's reduction over ranks is what makes the others skip
      auto params = parameters_of(model).pointers();
      sgd opt(params, optimizer_options);
      loss_scaler scaler(rc.compute_stream(), loss_scaler_options::for_precision(dtype::f16));
      scaler.attach(ctx);
      softmax_cross_entropy loss;
      const auto x = inputs();
      const auto y = labels();
      const stream_ref s = rc.compute_stream();
      for (int step = 0; step < 4; ++step) {
        tensor xb = device_tensor(slice(x, 8 * step, 8, features), shape{8, features}, s);
        tensor x16(shape{8, features}, dtype::f16, s);
        cast<lockstep::half, float>(xb.span<const float>(), x16.span<lockstep::half>(), s);
        tensor yb = device_labels(slice(y, 8 * step, 8, 1), s);
        opt.zero_grad();
        loss.forward(model.forward(x16, ctx), yb, ctx);
        model.backward(loss.backward(ctx), ctx, input_grad::not_required);
        if (step == 3) {
          before[static_cast<std::size_t>(rc.rank())] = state_bytes(model, opt, s);
          if (rc.rank() == bad_rank) {  // one infinity in one gradient of one rank
            const std::vector<lockstep::half> inf{to_half(std::numeric_limits<float>::infinity())};
            auto staged = to_device(inf, s);
            copy(device_span<lockstep::half>(params[3]->grad().as<lockstep::half>() + 5, 1, rc.get_device()),
                 device_span<const lockstep::half>(staged.span()), s);
          }
        }
        scaler.unscale_and_check(params, s, rc.comm());
        opt.step(s, scaler.optimizer_inputs());
        scaler.update(s);
      }
      after[static_cast<std::size_t>(rc.rank())] = state_bytes(model, opt, s);
      telemetry[static_cast<std::size_t>(rc.rank())] = scaler.read(s);
    });
    for (int r = 0; r < 3; ++r) {
      const auto i = static_cast<std::size_t>(r);
      EXPECT_EQ(after[i], before[i]) << "rank " << r << ": weights or optimizer state changed on a skipped step";
      EXPECT_EQ(telemetry[i].skipped_steps, 1) << "rank " << r;
      EXPECT_EQ(telemetry[i].last_overflow_step, 3) << "rank " << r;
      EXPECT_EQ(telemetry[i].scale, 32768.0f) << "rank " << r << ": the scale halves";
      EXPECT_EQ(telemetry[i].non_finite_values, r == bad_rank ? 1u : 0u) << "rank " << r;
    }
  }
}

TEST_P(mixed_precision_test, set_precision_gives_every_parameter_a_rounded_working_copy_and_a_low_precision_gradient) {
  if (!require_devices(2)) return;
  stream s(dev());
  context ctx(s);
  graph model = make_model(ctx);
  const auto masters = parameter_values(model, s);
  for (dtype t : {dtype::f16, dtype::bf16, dtype::f32}) {
    SCOPED_TRACE(name_of(t));
    set_precision(model, ctx, t);
    EXPECT_EQ(ctx.compute_type(), t);
    std::size_t at = 0;
    for (const auto& p : parameters_of(model)) {
      const parameter& q = *p.param;
      EXPECT_EQ(q.compute_type(), t) << p.name;
      EXPECT_EQ(q.grad().type(), t) << p.name;
      EXPECT_EQ(q.value().type(), dtype::f32) << p.name;  // the master values stay fp32
      if (t == dtype::f32) {
        EXPECT_TRUE(q.working().empty()) << p.name;
        at += static_cast<std::size_t>(q.numel());
        continue;
      }
      ASSERT_EQ(q.working().type(), t) << p.name;
      const auto bits = raw_bytes(q.working(), s);
      for (std::int64_t i = 0; i < q.numel(); ++i, ++at) {  // each the master value rounded to nearest even
        std::uint16_t got = 0;
        std::memcpy(&got, bits.data() + 2 * i, 2);
        const std::uint16_t want = t == dtype::f16 ? convert<lockstep::half>(masters[at]).bits
                                                   : convert<bfloat16>(masters[at]).bits;
        ASSERT_EQ(got, want) << p.name << "[" << i << "]";
      }
    }
    EXPECT_EQ(at, masters.size());
  }
  EXPECT_EQ(parameter_values(model, s), masters);  // switching precision never touches the master values
  // a model on another device, and a type that is not floating, are refused with what is wrong
  stream other(dev(1));
  context elsewhere(other);
  EXPECT_THROW(set_precision(model, elsewhere, dtype::f16), precondition_error);
  EXPECT_THROW(set_precision(model, ctx, dtype::i32), precondition_error);
}

TEST_P(mixed_precision_test, f16_and_bf16_training_stays_close_to_f32) {
  if (!require_devices(2)) return;
  const auto x = inputs();
  const auto y = labels();
  auto train = [&](dtype t) {
    stream s(dev(1));
    context ctx(s, t);
    graph model = make_model(ctx);
    auto params = parameters_of(model).pointers();
    sgd opt(params, optimizer_options);
    std::optional<loss_scaler> scaler;
    if (t != dtype::f32) {
      scaler.emplace(s, loss_scaler_options::for_precision(t));
      scaler->attach(ctx);
    }
    softmax_cross_entropy loss;
    for (int step = 0; step < steps; ++step) {
      const std::int64_t first = first_row(step, 64);
      tensor xb = device_tensor(slice(x, first, 64, features), shape{64, features}, s);
      tensor xt(shape{64, features}, t, s);
      dispatch_floating(t, "test", [&]<class T>() { cast<T, float>(xb.span<const float>(), xt.span<T>(), s); });
      tensor yb = device_labels(slice(y, first, 64, 1), s);  // the loss keeps a view until backward
      opt.zero_grad();
      loss.forward(model.forward(xt, ctx), yb, ctx);
      model.backward(loss.backward(ctx), ctx, input_grad::not_required);
      if (scaler) {
        scaler->unscale_and_check(params, s);
        opt.step(s, scaler->optimizer_inputs());
        scaler->update(s);
      } else {
        opt.step(s);
      }
    }
    return parameter_values(model, s);
  };
  const auto f32 = train(dtype::f32);
  EXPECT_LE(relative_difference(train(dtype::f16), f32), 2e-2);
  EXPECT_LE(relative_difference(train(dtype::bf16), f32), 6e-2);
}

// ---- low-precision GEMMs against fp32 ------------------------------------------------------------------------------

TEST_P(mixed_precision_test, f16_and_bf16_gemms_are_within_the_error_of_their_input_rounding) {
  stream s(dev());
  blas_handle h(s);
  const std::int64_t m = 37, n = 29, k = 300;
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> a(static_cast<std::size_t>(m * k)), b(static_cast<std::size_t>(k * n));
  for (auto& v : a) v = dist(gen);
  for (auto& v : b) v = dist(gen);
  auto run = [&]<class T>(double unit_roundoff) {
    std::vector<T> at(a.size()), bt(b.size());
    for (std::size_t i = 0; i < a.size(); ++i) at[i] = convert<T>(a[i]);
    for (std::size_t i = 0; i < b.size(); ++i) bt[i] = convert<T>(b[i]);
    auto da = to_device(at, s), db = to_device(bt, s);
    device_buffer<T> dc(static_cast<std::size_t>(m * n), s);
    gemm<T>(h, transpose::no, transpose::no, m, n, k, 1.0f, da.data(), k, db.data(), n, 0.0f, dc.data(), n);
    const auto c = to_vector(device_span<const T>(dc.span()), s);
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        double exact = 0, magnitude = 0;
        for (std::int64_t l = 0; l < k; ++l) {
          const double x = a[static_cast<std::size_t>(i * k + l)], yv = b[static_cast<std::size_t>(l * n + j)];
          exact += x * yv;
          magnitude += std::abs(x * yv);
        }
        // inputs rounded (each product off by at most 2u + u^2 relative), fp32 accumulation (k * 2^-24),
        // and the result rounded once (u relative)
        const double bound = magnitude * (2 * unit_roundoff + unit_roundoff * unit_roundoff + k * 0x1p-24) +
                             std::abs(exact) * unit_roundoff + 1e-30;
        ASSERT_LE(std::abs(to_float(c[static_cast<std::size_t>(i * n + j)]) - exact), bound) << i << "," << j;
      }
    }
  };
  run.operator()<lockstep::half>(0x1p-11);
  run.operator()<bfloat16>(0x1p-8);
}

// ---- clipping gradients by their total norm ------------------------------------------------------------------

namespace {

// A parameter of `n` elements whose fp32 values and gradient (stored in `type`) are given.
std::unique_ptr<parameter> make_param(const std::string& name, const std::vector<float>& values,
                                      const std::vector<float>& grad, dtype type, stream_ref s) {
  auto p = std::make_unique<parameter>(name, shape{static_cast<std::int64_t>(values.size())}, s, type);
  copy(p->value().span<float>(), std::span<const float>(values), s);
  p->refresh_working_copy(s);
  p->materialize_grad(s);
  with_float_type(type, [&]<class T>() {
    const auto stored = from_floats<T>(grad);
    auto staged = to_device(stored, s);
    copy(p->grad().span<T>(), device_span<const T>(staged.span()), s);
    s.synchronize();
  });
  return p;
}

std::vector<float> values_of(const parameter& p, stream_ref s) { return to_vector(p.value().span<const float>(), s); }

}  // namespace

TEST_P(clip_test, the_clipped_sgd_step_is_pytorchs_clip_grad_norm_then_step) {
  // PyTorch 1.13: a = [0.25, -1, 2], b = [1, 0.5, -0.75, 3] with gradients [1, -2, 3] and [0.5, 4, -1, 2];
  // clip_grad_norm_([a, b], max_norm=2, norm_type=2 or inf), then SGD(lr=0.5, momentum=0.9, weight_decay=0.01).
  struct expected_case {
    grad_norm norm;
    float total;
    std::vector<float> a, b;
  };
  const expected_case cases[] = {
      {grad_norm::l2, 5.93717098236084f, {0.08031964302062988f, -0.6581392884254456f, 1.4847089052200317f},
       {0.9107848405838013f, -0.17622143030166626f, -0.5778196454048157f, 2.648139238357544f}},
      {grad_norm::inf, 4.0f, {-0.001249939203262329f, -0.49500012397766113f, 1.2400002479553223f},
       {0.8700000047683716f, -0.5024998188018799f, -0.49625006318092346f, 2.4850001335144043f}},
  };
  stream s(dev());
  for (const auto& c : cases) {
    auto a = make_param("a", {0.25f, -1.0f, 2.0f}, {1.0f, -2.0f, 3.0f}, dtype::f32, s);
    auto b = make_param("b", {1.0f, 0.5f, -0.75f, 3.0f}, {0.5f, 4.0f, -1.0f, 2.0f}, dtype::f32, s);
    parameter* ps[] = {a.get(), b.get()};
    sgd opt(ps, {.lr = 0.5f, .momentum = 0.9f, .weight_decay = 0.01f});
    gradient_clipper clip(s);
    opt.step(s, clip.clip_grad_norm(ps, {.max_norm = 2.0f, .norm = c.norm}, s));
    EXPECT_NEAR(clip.total_norm(s), c.total, 1e-6 * c.total);
    const auto va = values_of(*a, s), vb = values_of(*b, s);
    for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(va[i], c.a[i], 1e-6 * std::fabs(c.a[i]) + 1e-7) << i;
    for (std::size_t i = 0; i < 4; ++i) EXPECT_NEAR(vb[i], c.b[i], 1e-6 * std::fabs(c.b[i]) + 1e-7) << i;
  }
}

TEST_P(clip_test, the_norm_of_scaled_low_precision_gradients_matches_a_double_reference_for_ragged_sizes) {
  stream s(dev());
  for (dtype type : {dtype::f32, dtype::f16, dtype::bf16}) {
    for (std::size_t n : {255u, 256u, 257u}) {  // around the host reduction's block of 256
      SCOPED_TRACE(::testing::Message() << name_of(type) << ", n = " << n);
      std::vector<std::unique_ptr<parameter>> owned;
      std::vector<parameter*> ps;
      double sum = 0.0, largest = 0.0;
      for (std::size_t k = 0; k < 3; ++k) {  // sizes n, n + 1, n + 2, gradients scaled by 1024 as the scaler does
        std::vector<float> grad(n + k);
        for (std::size_t i = 0; i < grad.size(); ++i) {
          grad[i] = static_cast<float>(static_cast<int>((i * 37 + k * 11) % 61) - 30) * 1024.0f / 64.0f;
        }
        owned.push_back(make_param(detail::concat("p", k), std::vector<float>(grad.size(), 0.0f), grad, type, s));
        ps.push_back(owned.back().get());
        for (float g : to_floats(from_floats<float>(grad))) {  // the values as stored (exact in every type here)
          sum += static_cast<double>(g) * g / (1024.0 * 1024.0);
          largest = std::max(largest, std::fabs(static_cast<double>(g)) / 1024.0);
        }
      }
      context scaled(s);  // the gradients set below stand for a backward that read the scale
      loss_scaler scaler(scaled, loss_scaler_options{.initial_scale = 1024.0f});
      scaler.unscale_and_check(ps, s);
      gradient_clipper clip(s);
      (void)clip.clip_grad_norm(ps, {.max_norm = 1.0f}, s, scaler.optimizer_inputs());
      EXPECT_NEAR(clip.total_norm(s), std::sqrt(sum), 1e-6 * std::sqrt(sum));
      (void)clip.clip_grad_norm(ps, {.max_norm = 1.0f, .norm = grad_norm::inf}, s, scaler.optimizer_inputs());
      EXPECT_EQ(clip.total_norm(s), static_cast<float>(largest));
    }
  }
}

TEST_P(clip_test, below_the_maximum_the_step_is_unclipped_and_a_non_finite_norm_skips_it) {
  stream s(dev());
  auto w = make_param("w", {1.0f, 2.0f}, {0.3f, -0.4f}, dtype::f32, s);  // norm 0.5
  parameter* ps[] = {w.get()};
  sgd opt(ps, {.lr = 1.0f});
  gradient_clipper clip(s);
  opt.step(s, clip.clip_grad_norm(ps, {.max_norm = 0.6f}, s));
  EXPECT_EQ(values_of(*w, s), (std::vector<float>{1.0f - 0.3f, 2.0f + 0.4f}));
  // a NaN gradient: the step is skipped (own flag without a scaler)
  auto bad = make_param("bad", {1.0f, 2.0f}, {std::nanf(""), 1.0f}, dtype::f32, s);
  parameter* bad_ps[] = {bad.get()};
  sgd bad_opt(bad_ps, {.lr = 1.0f});
  bad_opt.step(s, clip.clip_grad_norm(bad_ps, {.max_norm = 1.0f}, s));
  EXPECT_EQ(values_of(*bad, s), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_TRUE(std::isnan(clip.total_norm(s)));
  EXPECT_EQ(bad_opt.steps_taken(s), 0);
  // finite gradients whose squares overflow fp32: the loss scaler's flag is set, so it backs off and skips too
  auto huge = make_param("huge", {1.0f}, {1e30f}, dtype::f32, s);
  parameter* huge_ps[] = {huge.get()};
  sgd huge_opt(huge_ps, {.lr = 1.0f});
  context scaled(s);  // the gradients set below stand for a backward that read the scale
  loss_scaler scaler(scaled, loss_scaler_options{.initial_scale = 1.0f, .min_scale = 0.25f});
  scaler.unscale_and_check(huge_ps, s);
  huge_opt.step(s, clip.clip_grad_norm(huge_ps, {.max_norm = 1.0f}, s, scaler.optimizer_inputs()));
  scaler.update(s);
  EXPECT_EQ(values_of(*huge, s), std::vector<float>{1.0f});
  const auto t = scaler.read(s);
  EXPECT_EQ(t.skipped_steps, 1);
  EXPECT_LT(t.scale, 1.0f);
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)clip.clip_grad_norm(ps, {.max_norm = 0.0f}, s); }),
                  "max_norm must be positive and finite, got 0");
}

TEST_P(clip_test, shards_on_one_to_four_ranks_give_the_norm_of_all_the_gradients) {
  if (!require_devices(4)) return;
  // Nine gradients of ragged sizes; of k ranks, rank r holds gradients r, r + k, r + 2k, ... (as ZeRO shards would).
  std::vector<std::vector<float>> grads;
  double sum = 0.0;
  for (std::size_t g = 0; g < 9; ++g) {
    grads.emplace_back(100 + 7 * g);
    for (std::size_t i = 0; i < grads[g].size(); ++i) {
      grads[g][i] = static_cast<float>(static_cast<int>((i * 13 + g) % 41) - 20) / 8.0f;
      sum += static_cast<double>(grads[g][i]) * grads[g][i];
    }
  }
  for (int k = 1; k <= 4; ++k) {
    std::vector<float> norms(static_cast<std::size_t>(k)), inf_norms(norms), nan_norms(norms);
    run_on_devices(devices(k), [&](rank_context& rc) {
      const stream_ref s = rc.compute_stream();
      std::vector<std::unique_ptr<parameter>> owned;
      std::vector<parameter*> ps;
      for (std::size_t g = static_cast<std::size_t>(rc.rank()); g < 9; g += static_cast<std::size_t>(k)) {
        owned.push_back(make_param(detail::concat("g", g), std::vector<float>(grads[g].size(), 0.0f), grads[g],
                                   dtype::f32, s));
        ps.push_back(owned.back().get());
      }
      gradient_clipper clip(s);
      (void)clip.clip_grad_norm(ps, {.max_norm = 1.0f}, s, {}, rc.comm());
      norms[static_cast<std::size_t>(rc.rank())] = clip.total_norm(s);
      (void)clip.clip_grad_norm(ps, {.max_norm = 1.0f, .norm = grad_norm::inf}, s, {}, rc.comm());
      inf_norms[static_cast<std::size_t>(rc.rank())] = clip.total_norm(s);
      // a NaN on the last rank makes every rank's max-norm infinite (NCCL's max would drop a NaN), so all skip
      if (rc.rank() == k - 1) {
        auto nan = to_device(std::vector<float>{std::nanf("")}, s);
        copy(ps[0]->grad().span<float>().subspan(3, 1), device_span<const float>(nan.span()), s);
      }
      (void)clip.clip_grad_norm(ps, {.max_norm = 1.0f, .norm = grad_norm::inf}, s, {}, rc.comm());
      nan_norms[static_cast<std::size_t>(rc.rank())] = clip.total_norm(s);
    });
    for (int r = 0; r < k; ++r) {
      const auto i = static_cast<std::size_t>(r);
      EXPECT_NEAR(norms[i], std::sqrt(sum), 1e-6 * std::sqrt(sum)) << "rank " << r << " of " << k;
      EXPECT_EQ(inf_norms[i], 20.0f / 8.0f) << "rank " << r << " of " << k;
      EXPECT_TRUE(std::isinf(nan_norms[i])) << "rank " << r << " of " << k;
    }
  }
}
