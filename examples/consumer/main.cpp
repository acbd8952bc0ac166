// A user's program: finds the installed lockstep, picks the default devices (GPUs, or host devices when there
// is none), and runs one DataParallel training step of a small MLP on all of them: the model is built on the
// first device, replicated, the batch scattered, the gradients reduced onto the first device and the optimizer
// steps there. It checks that the step lowered the loss on the same batch.
#include <lockstep/lockstep.hpp>

#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

constexpr std::int64_t features = 16, classes = 4, batch = 64;

lockstep::tensor upload(const std::vector<float>& v, lockstep::shape dims, lockstep::stream_ref s) {
  lockstep::tensor t(dims, lockstep::dtype::f32, s);
  auto staged = lockstep::to_device(v, s);
  lockstep::copy(t.span<float>(), lockstep::device_span<const float>(staged.span()), s);
  return t;
}

lockstep::tensor upload(const std::vector<std::int32_t>& v, lockstep::stream_ref s) {
  lockstep::tensor t(lockstep::shape{static_cast<std::int64_t>(v.size())}, lockstep::dtype::i32, s);
  auto staged = lockstep::to_device(v, s);
  lockstep::copy(t.span<std::int32_t>(), lockstep::device_span<const std::int32_t>(staged.span()), s);
  return t;
}

}  // namespace

int main() {
  try {
    const auto selection = lockstep::default_devices();
    std::printf("devices: %s (%s)\n", selection.devices.str().c_str(), selection.reason.c_str());

    lockstep::stream setup(selection.devices.front());
    lockstep::context build(setup);
    lockstep::initializer init(/*seed*/ 1);
    lockstep::graph model(lockstep::shape{features});
    model.add("fc1", lockstep::linear(features, 32, build, init), "input");
    model.add("relu", lockstep::relu(), "fc1");
    model.add("out", lockstep::linear(32, classes, build, init), "relu");
    setup.synchronize();

    lockstep::data_parallel dp(model, lockstep::data_parallel_options{.device_ids = selection.devices});
    lockstep::context& out = dp.output_context();
    const lockstep::stream_ref s0 = dp.replica_context(0).stream();
    lockstep::sgd opt(lockstep::parameters_of(model).pointers(), {.lr = 0.5f});
    lockstep::softmax_cross_entropy loss(lockstep::reduction::mean);

    // A batch the model can learn: the label is the feature block with the largest sum.
    std::vector<float> x(static_cast<std::size_t>(batch * features));
    std::vector<std::int32_t> y(static_cast<std::size_t>(batch));
    for (std::int64_t i = 0; i < batch; ++i) {
      y[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i % classes);
      for (std::int64_t j = 0; j < features; ++j) {
        const bool hot = j / (features / classes) == i % classes;
        x[static_cast<std::size_t>(i * features + j)] = (hot ? 1.0f : 0.0f) + 0.01f * static_cast<float>((i + j) % 7);
      }
    }
    const lockstep::tensor input = upload(x, lockstep::shape{batch, features}, s0);
    const lockstep::tensor labels = upload(y, s0);

    opt.zero_grad();
    loss.forward(dp.forward(input), labels, out);
    const float before = loss.read_loss(out.stream());
    dp.backward(loss.backward(out));
    opt.step(s0);
    loss.forward(dp.forward(input), labels, out);
    const float after = loss.read_loss(out.stream());

    std::printf("one DataParallel step on %zu device(s): loss %.4f -> %.4f\n", dp.report().size(),
                static_cast<double>(before), static_cast<double>(after));
    return after < before ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
