// A user's training file, as the first-hour issue measured its compile time: a graph with a custom layer, DDP on
// host devices (threads), f16 with a loss scaler, AdamW, a data loader and a checkpointer. It is compiled cold by
// bench/compile_time.sh (seconds of CPU and peak memory), and runs: 3 steps on 2 host devices, then a checkpoint.
#include <lockstep/lockstep.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <vector>

using namespace lockstep;

namespace {

// y = x * w (one weight per feature): a user's own layer, dtype-generic.
template <class T>
struct scale_op {
  const T* x;
  const T* w;
  T* y;
  std::size_t cols;
  LOCKSTEP_HD void operator()(std::size_t r, std::size_t c) const {
    y[r * cols + c] = convert<T>(to_float(x[r * cols + c]) * to_float(w[c]));
  }
};

template <class T>
struct scale_grad_op {
  const T* gy;
  const T* x;
  T* dw;
  std::size_t rows, cols;
  float beta;
  LOCKSTEP_HD void operator()(std::size_t c) const {
    float acc = 0.0f;
    for (std::size_t r = 0; r < rows; ++r) acc += to_float(gy[r * cols + c]) * to_float(x[r * cols + c]);
    dw[c] = convert<T>(beta == 0.0f ? acc : beta * to_float(dw[c]) + acc);
  }
};

class feature_scale {
 public:
  feature_scale(std::int64_t features, context& ctx) : features_(features) {
    weight_ = parameter("weight", shape{features}, ctx.stream(), ctx.compute_type());
    fill_values(weight_, 1.0f, ctx.stream());
  }
  tensor_view forward(const tensor_view& x, context& ctx) {
    x_ = x;
    y_.ensure(x.dims(), x.type(), ctx.stream());
    const auto rows = static_cast<std::size_t>(x.rows()), cols = static_cast<std::size_t>(features_);
    dispatch_floating(x.type(), "feature_scale", [&]<class T>() {
      launch_2d(rows, cols, scale_op<T>{x.as<T>(), weight_.compute_value().as<T>(), y_.as<T>(), cols}, ctx.stream(),
                "feature_scale forward");
    });
    return y_.view();
  }
  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    const auto rows = static_cast<std::size_t>(gy.rows()), cols = static_cast<std::size_t>(features_);
    dispatch_floating(gy.type(), "feature_scale", [&]<class T>() {
      const float beta = weight_.begin_accumulate();
      launch_elementwise(cols, scale_grad_op<T>{gy.as<T>(), x_.as<T>(), weight_.grad().as<T>(), rows, cols, beta},
                         ctx.stream(), "feature_scale weight gradient");
      if (need == input_grad::required) {
        gx_.ensure(gy.dims(), gy.type(), ctx.stream());
        launch_2d(rows, cols, scale_op<T>{gy.as<T>(), weight_.compute_value().as<T>(), gx_.as<T>(), cols},
                  ctx.stream(), "feature_scale backward");
      }
    });
    return need == input_grad::required ? gx_.view() : tensor_view();
  }
  void parameters(parameter_list& out) { out.add(weight_); }
  [[nodiscard]] feature_scale clone(context& ctx) const {
    feature_scale c(features_, ctx);
    c.weight_ = weight_.clone(ctx.stream());
    return c;
  }
  [[nodiscard]] shape output_shape(const shape& sample) const { return sample; }

 private:
  std::int64_t features_;
  parameter weight_;
  tensor_view x_;
  tensor y_, gx_;
};

}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path save = argc > 1 ? argv[1] : std::filesystem::temp_directory_path() / "lockstep_compile_time";
  constexpr std::size_t samples = 512, features = 32, classes = 4;
  std::vector<float> x(samples * features);
  std::vector<std::int32_t> y(samples);
  for (std::size_t i = 0; i < samples; ++i) {
    y[i] = static_cast<std::int32_t>(i % classes);
    for (std::size_t j = 0; j < features; ++j) x[i * features + j] = (j % classes == i % classes ? 1.0f : 0.0f);
  }
  const in_memory_dataset train(std::move(x), {features}, std::move(y));
  run_on_devices(device_set("host:0,host:1"), [&](rank_context& rc) {
    context ctx(rc.compute_stream(), dtype::f16);
    ctx.set_seed(1);
    initializer init(/*seed*/ 1);
    graph model(shape{static_cast<std::int64_t>(features)});
    model.add("fc1", linear(static_cast<std::int64_t>(features), 64, ctx, init), "input");
    model.add("act", relu(), "fc1");
    model.add("scale", feature_scale(64, ctx), "act");
    model.add("out", linear(64, static_cast<std::int64_t>(classes), ctx, init), "scale");
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream());
    const auto params = parameters_of(model);
    adamw opt(params.pointers(), {.lr = 1e-2f});
    loss_scaler scaler(ctx);
    softmax_cross_entropy loss(reduction::mean);
    data_loader loader(train, distributed_sampler(train.size(), rc.rank(), rc.size()), ctx.stream(),
                       {.batch_size = 32, .input_type = dtype::f16});
    loader.start_epoch(0);
    for (int step = 0; step < 3; ++step) {
      auto b = loader.next();
      if (!b) break;
      opt.zero_grad();
      loss.forward(ddp.forward(b->input), b->target, ctx);
      ddp.backward(loss.backward(ctx));
      scaler.unscale_and_check(params.pointers(), ctx.stream(), rc.comm());
      opt.step(ctx.stream(), scaler.optimizer_inputs());
      scaler.update(ctx.stream());
    }
    const float global = loss.read_loss(ctx.stream());
    checkpoint_state state(params);
    state.optimizer(opt).scaler(scaler);
    state.position.step = 3;
    checkpointer saver(save, {.overwrite = true});  // each run of this program replaces the previous one's
    const auto where = saver.save(state, ctx.stream(), rc.comm());
    if (rc.rank() == 0) std::printf("loss %.4f, saved %s\n", static_cast<double>(global), where.string().c_str());
  });
  return 0;
}
