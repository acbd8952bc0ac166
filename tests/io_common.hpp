// test_io's (and its fault child's): a small training run whose every byte of state can be compared.
#pragma once

#include <optional>
#include <vector>

#include "lockstep/amp/loss_scaler.hpp"
#include "lockstep/io/checkpoint.hpp"
#include "parallel_common.hpp"

namespace io_test {

using namespace lockstep;
using namespace parallel_test;

// A small training run: the parallel tests' model and data, an optimizer (sgd or adamw), a cosine schedule,
// and under f16/bf16 a loss scaler.
struct run {
  run(device d, dtype precision, bool adam)
      : s(d), ctx(s, precision), model(make_model(ctx)), params(parameters_of(model).pointers()) {
    if (adam) {
      adam_.emplace(params, adamw_options{.lr = 0.01f});
      adam_sched_.emplace(*adam_, cosine_schedule{.total_steps = 12, .warmup_steps = 2});
    } else {
      sgd_.emplace(params, optimizer_options);
      sgd_sched_.emplace(*sgd_, cosine_schedule{.total_steps = 12, .warmup_steps = 2});
    }
    if (precision != dtype::f32) {
      scaler.emplace(s, loss_scaler_options{.initial_scale = 1024.0f, .growth_interval = 3});
      scaler->attach(ctx);
    }
    ctx.set_seed(3);
  }

  checkpoint_state state() {
    checkpoint_state st(parameters_of(model));
    if (sgd_) st.optimizer(*sgd_).schedule(*sgd_sched_);
    if (adam_) st.optimizer(*adam_).schedule(*adam_sched_);
    if (scaler) st.scaler(*scaler);
    st.position.step = step;
    st.position.precision = ctx.compute_type();
    st.run_id = run_id;  // every state of this run saves as the same run
    return st;
  }

  std::string run_id = detail::new_run_id();

  void train(int n) {
    const auto x = inputs();
    const auto y = labels();
    for (int i = 0; i < n; ++i, ++step) {
      const std::int64_t batch = 24, first = first_row(static_cast<int>(step), batch);
      tensor xb = device_tensor(slice(x, first, batch, features), shape{batch, features}, s);
      if (ctx.compute_type() != dtype::f32) {
        tensor cast_in(xb.dims(), ctx.compute_type(), s);
        dispatch_floating(ctx.compute_type(), "input", [&]<class T>() { cast<T, float>(xb.span<const float>(), cast_in.span<T>(), s); });
        xb = std::move(cast_in);
      }
      tensor yb = device_labels(slice(y, first, batch, 1), s);
      ctx.set_step(static_cast<std::uint64_t>(step));
      sgd_ ? sgd_->zero_grad() : adam_->zero_grad();
      loss.forward(model.forward(xb, ctx), yb, ctx, batch);
      model.backward(loss.backward(ctx), ctx, input_grad::not_required);
      step_inputs in{};
      if (scaler) {
        scaler->unscale_and_check(params, s);
        in = scaler->optimizer_inputs();
      }
      if (sgd_) {
        sgd_->step(s, in);
        sgd_sched_->step();
      } else {
        adam_->step(s, in);
        adam_sched_->step();
      }
      if (scaler) scaler->update(s);
    }
  }

  // Every byte of state a resume must restore: master values, working copies, optimizer state and counters,
  // the scaler's state, and the learning rates.
  std::vector<std::uint8_t> fingerprint() {
    std::vector<std::uint8_t> out;
    auto add = [&](device_span<std::uint8_t> b) {
      const auto v = to_vector(device_span<const std::uint8_t>(b), s);
      out.insert(out.end(), v.begin(), v.end());
    };
    for (parameter* p : params) {
      add(p->value().bytes());
      if (!p->working().empty()) add(p->working().bytes());
    }
    auto add_optimizer = [&](auto& opt) {
      for (std::size_t i = 0; i < params.size(); ++i)
        for (int k = 0; k < (std::is_same_v<std::remove_cvref_t<decltype(opt)>, adamw> ? 2 : 1); ++k)
          if (!opt.state(0, i, k).empty()) add(opt.state(0, i, k).bytes());
      add(opt.step_counters());
      const float lr = opt.options(0).lr;
      out.insert(out.end(), reinterpret_cast<const std::uint8_t*>(&lr), reinterpret_cast<const std::uint8_t*>(&lr) + 4);
    };
    if (sgd_) add_optimizer(*sgd_);
    if (adam_) add_optimizer(*adam_);
    if (scaler) add(scaler->state_bytes());
    return out;
  }

  stream s;
  context ctx;
  graph model;
  std::vector<parameter*> params;
  std::optional<sgd> sgd_;
  std::optional<adamw> adam_;
  std::optional<lr_scheduler<sgd, cosine_schedule>> sgd_sched_;
  std::optional<lr_scheduler<adamw, cosine_schedule>> adam_sched_;
  std::optional<loss_scaler> scaler;
  softmax_cross_entropy loss{reduction::mean};
  std::int64_t step = 0;
};

}  // namespace io_test
