// cnn_train's model: a small CNN for 28x28 images,
//   [conv 3x3, padding 1 -> batch norm -> relu -> max pool 2x2] per --channels (default 32,64; the relu fused into
//   the batch norm: batch_norm_options::relu)
//   -> flatten -> [linear -> relu -> dropout] per --hidden (default 128) -> linear(10)
// as a graph whose names PyTorch's state_dict shares (conv1, bn1, ..., fc1, ..., out): tools/safetensors_interop.py
// builds the same model in PyTorch. The convolutions have no bias (the batch norm after them has one).
// --sync-bn: batch norm with the statistics of the whole global batch under dp and ddp (PyTorch's SyncBatchNorm).
#pragma once

#include <lockstep/nn/activation.hpp>
#include <lockstep/nn/batch_norm.hpp>
#include <lockstep/nn/conv2d.hpp>
#include <lockstep/nn/dropout.hpp>
#include <lockstep/nn/flatten.hpp>
#include <lockstep/nn/graph.hpp>
#include <lockstep/nn/init.hpp>
#include <lockstep/nn/linear.hpp>
#include <lockstep/nn/pool.hpp>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "../common/sample.hpp"

namespace cnn_sample {

struct model_options {
  std::vector<std::int64_t> channels = {32, 64};  // --channels: a convolution block each
  std::vector<std::int64_t> hidden = {128};       // --hidden: a linear layer each, before the last
  float dropout = 0.5f;                           // --dropout: after each hidden linear layer
  bool sync_bn = false;                           // --sync-bn
};

/// The side of the square images of `inputs` values (28 for Fashion-MNIST).
inline std::int64_t image_side(std::int64_t inputs) {
  auto side = static_cast<std::int64_t>(std::lround(std::sqrt(static_cast<double>(inputs))));
  if (side * side != inputs) {
    throw lockstep::precondition_error("the images have " + std::to_string(inputs) +
                                       " values, not a square: the CNN takes square images");
  }
  return side;
}

inline lockstep::graph build(const model_options& m, std::int64_t inputs, lockstep::context& ctx, std::uint64_t seed) {
  using namespace lockstep;
  initializer init(seed);
  std::int64_t side = image_side(inputs), width = 1;
  graph g(shape{inputs});
  g.add("image", unflatten(shape{1, side, side}), "input");  // the loader's rows as 1-channel images, NCHW
  std::string previous = "image";
  for (std::size_t i = 0; i < m.channels.size(); ++i) {
    if (side < 2) {
      throw precondition_error("--channels has " + std::to_string(m.channels.size()) + " blocks, but " +
                               std::to_string(i) + " of them pool the " + std::to_string(image_side(inputs)) +
                               "-pixel images down to one pixel: give fewer");
    }
    const std::string n = std::to_string(i + 1);
    g.add("conv" + n, conv2d(width, m.channels[i], 3, ctx, init, conv2d_options{.padding = 1, .bias = false}), previous)
        .add("bn" + n, batch_norm(m.channels[i], ctx, batch_norm_options{.sync = m.sync_bn, .relu = true}),
             "conv" + n)
        .add("pool" + n, max_pool2d(2), "bn" + n);
    previous = "pool" + n;
    width = m.channels[i];
    side /= 2;
  }
  g.add("flat", flatten(), previous);
  previous = "flat";
  width *= side * side;
  for (std::size_t i = 0; i < m.hidden.size(); ++i) {
    const std::string n = std::to_string(i + 1);
    g.add("fc" + n, linear(width, m.hidden[i], ctx, init), previous).add("relu" + n, relu(), "fc" + n);
    previous = "relu" + n;
    if (m.dropout > 0.0f) {
      g.add("drop" + n, dropout(m.dropout, init), previous);
      previous = "drop" + n;
    }
    width = m.hidden[i];
  }
  g.add("out", linear(width, 10, ctx, init), previous);
  return g;
}

/// The sample's recipe for sample::run; its options live as long as the recipe's functions.
inline sample::model_recipe recipe() {
  auto m = std::make_shared<model_options>();
  sample::model_recipe r;
  r.program = "cnn_train";
  r.usage =
      "  --channels A,B,...    output channels of the convolution blocks (3x3 conv, batch norm, ReLU, 2x2 max\n"
      "                        pooling; default 32,64)\n"
      "  --hidden A,B,...      widths of the linear layers after them (default 128)\n"
      "  --dropout P           dropout after each of those layers (default 0.5; 0 for none)\n"
      "  --sync-bn             batch norm over the whole global batch under --mode dp and ddp (SyncBatchNorm);\n"
      "                        with --deterministic, the same weights on any number of devices\n";
  r.parse = [m](std::string_view flag, const std::function<std::string_view()>& value) {
    if (flag == "--channels") {
      m->channels = sample::parse_widths(flag, value());
    } else if (flag == "--hidden") {
      m->hidden = sample::parse_widths(flag, value());
    } else if (flag == "--dropout") {
      m->dropout = sample::parse_fraction(flag, value(), 0.0f, 1.0f);
    } else if (flag == "--sync-bn") {
      m->sync_bn = true;
    } else {
      return false;
    }
    return true;
  };
  r.build = [m](std::int64_t inputs, lockstep::context& ctx, std::uint64_t seed) { return build(*m, inputs, ctx, seed); };
  r.describe = [m] {
    return lockstep::json_value{
        {"channels", m->channels}, {"hidden", m->hidden}, {"dropout", m->dropout}, {"sync_bn", m->sync_bn}};
  };
  // the first convolution's product: one row per output pixel, 3x3 inputs per channel
  r.first_product = [m](std::int64_t rows, std::int64_t inputs) {
    return lockstep::gemm_shape{lockstep::transpose::no, lockstep::transpose::yes, rows * inputs, m->channels.front(), 9};
  };
  return r;
}

}  // namespace cnn_sample
