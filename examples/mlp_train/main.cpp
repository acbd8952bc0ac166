// mlp_train — the sample users start from: an MLP trained on Fashion-MNIST with lockstep.
//
//   mlp_train [--data DIR] [--devices SPEC] [--epochs N] [--batch N] [--lr X] [--momentum X]
//             [--hidden 256,256] [--optimizer sgd|adamw] [--seed N] [--workers N] [--json] ...
//
// It runs on the first device of --devices (default: the first GPU, or host:0 when there is none), prints a
// live progress line while training, and a summary at the end: test accuracy, training seconds, samples per
// second and peak memory per device. With --json the last line is one JSON object with those figures.
#include <lockstep/lockstep.hpp>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "options.hpp"

namespace {

using namespace lockstep;
using clock_type = std::chrono::steady_clock;

// The model: input -> [linear -> relu] x hidden -> linear(10), as a graph (the depth is a run-time option).
graph build_mlp(std::int64_t inputs, const std::vector<std::int64_t>& hidden, std::int64_t classes, context& ctx,
                initializer& init) {
  graph g(shape{inputs});
  std::string previous = "input";
  std::int64_t width = inputs;
  for (std::size_t i = 0; i < hidden.size(); ++i) {
    const std::string fc = "fc" + std::to_string(i + 1), act = "relu" + std::to_string(i + 1);
    g.add(fc, linear(width, hidden[i], ctx, init), previous);
    g.add(act, relu(), fc);
    previous = act;
    width = hidden[i];
  }
  g.add("out", linear(width, classes, ctx, init), previous);
  return g;
}

// One optimizer of either kind behind one interface for the training loop.
class any_optimizer {
 public:
  any_optimizer(const mlp_options& o, std::span<parameter* const> params) {
    if (o.optimizer == "adamw") {
      adamw_.emplace(params, adamw_options{.lr = o.lr, .weight_decay = o.weight_decay});
    } else {
      sgd_.emplace(params, sgd_options{.lr = o.lr, .momentum = o.momentum, .weight_decay = o.weight_decay});
    }
  }
  void step(stream_ref s, step_inputs in = {}) { sgd_ ? sgd_->step(s, in) : adamw_->step(s, in); }
  void zero_grad() { sgd_ ? sgd_->zero_grad() : adamw_->zero_grad(); }

 private:
  std::optional<sgd> sgd_;
  std::optional<adamw> adamw_;
};

std::string memory_summary(const std::vector<device>& devices) {
  std::string s;
  for (const device d : devices) {
    if (!s.empty()) s += ", ";
    s += d.str() + " " + format_bytes(get_memory_stats(d).bytes_in_use);
  }
  return s;
}

// Fraction of `dataset` classified correctly by `model`, in evaluation mode.
template <class Dataset>
double evaluate(graph& model, const Dataset& dataset, context& ctx, const mlp_options& o) {
  data_loader loader(dataset, sequential_sampler(dataset.size()), ctx.stream(),
                     data_loader_options{.batch_size = static_cast<std::size_t>(o.eval_batch),
                                         .workers = o.workers,
                                         .input_type = ctx.compute_type()});
  ctx.set_mode(run_mode::eval);
  accuracy_counter acc;
  loader.start_epoch(0);
  while (auto b = loader.next()) acc.add(model.forward(b->input, ctx), b->target, ctx);
  ctx.set_mode(run_mode::train);
  return static_cast<double>(acc.correct(ctx.stream())) / static_cast<double>(acc.rows());
}

int run(const mlp_options& o) {
  const device_selection selection =
      o.devices.empty() ? default_devices() : device_selection{device_set(o.devices), "--devices " + o.devices};
  const device dev = selection.devices.front();
  if (!o.json) std::printf("devices: %s (%s); training on %s\n", selection.devices.str().c_str(), selection.reason.c_str(), dev.str().c_str());

  const auto train = load_fashion_mnist(o.data, mnist_split::train);
  const auto test = load_fashion_mnist(o.data, mnist_split::test);
  const std::int64_t inputs = static_cast<std::int64_t>(train.layout().input_elements());

  stream compute(dev);
  context ctx(compute, o.precision);
  ctx.set_seed(o.seed);
  initializer init(o.seed);
  graph model = build_mlp(inputs, o.hidden, 10, ctx, init);
  const auto params = parameters_of(model).pointers();
  any_optimizer optimizer(o, params);
  softmax_cross_entropy loss(reduction::mean);

  data_loader loader(train, random_sampler(train.size(), o.seed), compute,
                     data_loader_options{.batch_size = static_cast<std::size_t>(o.batch),
                                         .workers = o.workers,
                                         .input_type = o.precision});
  const bool live = ::isatty(STDOUT_FILENO) && !o.json;
  const std::size_t steps_per_epoch = loader.batches_per_epoch();
  std::int64_t samples = 0, step = 0;
  double train_seconds = 0;
  float last_loss = 0;
  reset_memory_stats(dev);

  for (int epoch = 0; epoch < o.epochs; ++epoch) {
    const auto t0 = clock_type::now();
    loader.start_epoch(static_cast<std::uint64_t>(epoch));
    std::int64_t epoch_samples = 0;
    std::size_t epoch_step = 0;
    while (auto b = loader.next()) {
      if (o.max_steps > 0 && step >= o.max_steps) break;
      ctx.set_step(static_cast<std::uint64_t>(step));
      optimizer.zero_grad();
      const tensor_view logits = model.forward(b->input, ctx);
      loss.forward(logits, b->target, ctx);
      model.backward(loss.backward(ctx), ctx, input_grad::not_required);
      optimizer.step(compute);
      samples += b->rows;
      epoch_samples += b->rows;
      ++step;
      ++epoch_step;
      if (epoch_step % static_cast<std::size_t>(o.print_every) == 0 || epoch_step == steps_per_epoch) {
        last_loss = loss.read_loss(compute);  // the one host synchronization: the user asked for a value
        const double seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
        if (!o.json) {
          std::printf("%sepoch %d/%d  step %zu/%zu  loss %.4f  %.0f samples/s  memory %s%s", live ? "\r" : "",
                      epoch + 1, o.epochs, epoch_step, steps_per_epoch, last_loss,
                      static_cast<double>(epoch_samples) / seconds, memory_summary({dev}).c_str(), live ? "   " : "\n");
          std::fflush(stdout);
        }
      }
    }
    compute.synchronize();
    train_seconds += std::chrono::duration<double>(clock_type::now() - t0).count();
    if (live) std::printf("\n");
    if (o.max_steps > 0 && step >= o.max_steps) break;
  }

  const double accuracy = evaluate(model, test, ctx, o);
  const auto stats = get_memory_stats(dev);
  const double throughput = static_cast<double>(samples) / train_seconds;
  if (!o.json) {
    std::printf("\ntest accuracy      %.4f\n", accuracy);
    std::printf("training seconds   %.2f\n", train_seconds);
    std::printf("samples per second %.0f\n", throughput);
    std::printf("peak memory        %s %s\n", dev.str().c_str(), format_bytes(stats.peak_bytes_in_use).c_str());
  } else {
    nlohmann::json j;
    j["test_accuracy"] = accuracy;
    j["train_seconds"] = train_seconds;
    j["samples_per_second"] = throughput;
    j["epochs"] = o.epochs;
    j["steps"] = step;
    j["batch"] = o.batch;
    j["hidden"] = o.hidden;
    j["optimizer"] = o.optimizer;
    j["precision"] = std::string(name_of(o.precision));
    j["mode"] = "single";
    j["devices"] = nlohmann::json::array({dev.str()});
    j["peak_memory_bytes"] = nlohmann::json::object({{dev.str(), stats.peak_bytes_in_use}});
    j["final_loss"] = last_loss;
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  mlp_options o;
  try {
    o = parse_options(argc, argv);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "mlp_train: %s\n\n%s", e.what(), usage_text);
    return 2;
  }
  if (o.help) {
    std::printf("%s", usage_text);
    return 0;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mlp_train: %s\n", e.what());
    return 1;
  }
}
