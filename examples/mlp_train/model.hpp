// mlp_train's model: input -> [linear -> relu] x hidden -> linear(10), as a graph (the depth is a run-time option).
#pragma once

#include <lockstep/nn/activation.hpp>
#include <lockstep/nn/graph.hpp>
#include <lockstep/nn/init.hpp>
#include <lockstep/nn/linear.hpp>

#include <memory>
#include <string>
#include <vector>

#include "../common/sample.hpp"

namespace mlp_sample {

struct model_options {
  std::vector<std::int64_t> hidden = {256, 256};  // --hidden
};

inline lockstep::graph build(const model_options& m, std::int64_t inputs, lockstep::context& ctx, std::uint64_t seed) {
  using namespace lockstep;
  initializer init(seed);
  graph g(shape{inputs});
  std::string previous = "input";
  std::int64_t width = inputs;
  for (std::size_t i = 0; i < m.hidden.size(); ++i) {
    const std::string fc = "fc" + std::to_string(i + 1), act = "relu" + std::to_string(i + 1);
    g.add(fc, linear(width, m.hidden[i], ctx, init), previous);
    g.add(act, relu(), fc);
    previous = act;
    width = m.hidden[i];
  }
  g.add("out", linear(width, 10, ctx, init), previous);
  return g;
}

/// The sample's recipe for sample::run; its options live as long as the recipe's functions.
inline sample::model_recipe recipe() {
  auto m = std::make_shared<model_options>();
  sample::model_recipe r;
  r.program = "mlp_train";
  r.usage = "  --hidden A,B,...      hidden layer widths (default 256,256)\n";
  r.parse = [m](std::string_view flag, const std::function<std::string_view()>& value) {
    if (flag != "--hidden") return false;
    m->hidden = sample::parse_widths(flag, value());
    return true;
  };
  r.build = [m](std::int64_t inputs, lockstep::context& ctx, std::uint64_t seed) { return build(*m, inputs, ctx, seed); };
  r.describe = [m] { return lockstep::json_value{{"hidden", m->hidden}}; };
  r.first_product = [m](std::int64_t rows, std::int64_t inputs) {
    return lockstep::gemm_shape{lockstep::transpose::no, lockstep::transpose::yes, rows, m->hidden.front(), inputs};
  };
  return r;
}

}  // namespace mlp_sample
