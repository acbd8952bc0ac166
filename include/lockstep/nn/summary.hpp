// lockstep/nn/summary.hpp — a model's summary (torchinfo's table): each layer's name, kind, output shape and
// parameter count, and the bytes the parameters take in each precision.
//
//   summary(model, shape{784}, dtype::f16);            // prints to std::cout
//   model_summary s = summarize(model, shape{784});    // or the rows, to print your own way
//
// A container (graph, sequential) gives a row per child (a graph's joins included), in the order forward runs them;
// any other layer is one row.
#pragma once

#include <cstdint>
#include <algorithm>
#include <iostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/shape.hpp"
#include "lockstep/nn/layer.hpp"

LOCKSTEP_ABI_BEGIN

/// One row of a summary: a layer (or a graph's join) by name, its kind ("linear", "sum"), the shape of one output
/// sample, and its parameters (its sub-layers' included).
struct summary_row {
  std::string name;
  std::string kind;
  shape output;
  std::int64_t parameters = 0;
};

struct model_summary {
  std::vector<summary_row> rows;
  shape input;
  shape output;
  std::int64_t parameters = 0;
  std::int64_t buffer_bytes = 0;  // running statistics and the like
  dtype compute_type = dtype::f32;

  /// Bytes of the parameters' fp32 master values, of the working copy forward reads under f16/bf16 (0 under f32),
  /// and of the gradients (in the compute type).
  [[nodiscard]] std::int64_t master_bytes() const noexcept { return 4 * parameters; }
  [[nodiscard]] std::int64_t working_bytes() const {
    return compute_type == dtype::f32 ? 0 : parameters * static_cast<std::int64_t>(size_of(compute_type));
  }
  [[nodiscard]] std::int64_t gradient_bytes() const {
    return parameters * static_cast<std::int64_t>(size_of(compute_type));
  }

  /// The table.
  [[nodiscard]] std::string str() const {
    std::size_t name_width = 5, shape_width = 12;
    std::vector<std::string> names;
    for (const auto& r : rows) {
      names.push_back(r.name + " (" + r.kind + ")");
      name_width = std::max(name_width, names.back().size());
      shape_width = std::max(shape_width, r.output.str().size());
    }
    std::ostringstream out;
    auto pad = [](std::string s, std::size_t w) {
      s.resize(std::max(w, s.size()), ' ');
      return s;
    };
    out << pad("layer", name_width) << "  " << pad("output shape", shape_width) << "  parameters\n";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      out << pad(names[i], name_width) << "  " << pad(rows[i].output.str(), shape_width) << "  "
          << grouped(rows[i].parameters) << '\n';
    }
    out << "input " << input.str() << ", output " << output.str() << " per sample\n"
        << "parameters " << grouped(parameters) << ": fp32 values " << megabytes(master_bytes());
    if (working_bytes() > 0) out << ", " << name_of(compute_type) << " working copy " << megabytes(working_bytes());
    out << ", " << name_of(compute_type) << " gradients " << megabytes(gradient_bytes()) << "; buffers "
        << megabytes(buffer_bytes) << '\n';
    return out.str();
  }

 private:
  static std::string grouped(std::int64_t n) {
    std::string digits = std::to_string(n), out;
    for (std::size_t i = 0; i < digits.size(); ++i) {
      if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
      out += digits[i];
    }
    return out;
  }
  static std::string megabytes(std::int64_t bytes) {
    std::ostringstream s;
    s.setf(std::ios::fixed);
    s.precision(2);
    s << static_cast<double>(bytes) / 1e6 << " MB";
    return s.str();
  }
};

LOCKSTEP_ABI_END

LOCKSTEP_ABI_BEGIN

/// The rows of `model` for input samples of shape `input_sample` (what forward takes without the batch dimension),
/// computing in `compute_type`. Throws precondition_error when the model does not take that shape.
template <layer L>
[[nodiscard]] model_summary summarize(L& model, const shape& input_sample, dtype compute_type = dtype::f32) {
  model_summary s;
  s.input = input_sample;
  s.output = model.output_shape(input_sample);
  s.compute_type = compute_type;
  auto row = [&](std::string name, std::string kind, shape output, std::int64_t parameters) {
    s.rows.push_back(summary_row{std::move(name), std::move(kind), output, parameters});
  };
  if constexpr (requires { model.describe_children(input_sample, row); }) {
    model.describe_children(input_sample, row);
  } else {
    s.rows.push_back(summary_row{"(model)", std::string(detail::layer_kind<L>()), s.output, 0});
  }
  const parameter_list list = parameters_of(model);
  for (const auto& p : list) s.parameters += p.param->numel();
  for (const auto& b : list.buffers()) s.buffer_bytes += static_cast<std::int64_t>(b.buffer->view().bytes().size());
  if (s.rows.size() == 1 && s.rows[0].name == "(model)") s.rows[0].parameters = s.parameters;
  return s;
}

/// Prints summarize(model, input_sample, compute_type) to `out`.
template <layer L>
void summary(L& model, const shape& input_sample, dtype compute_type = dtype::f32, std::ostream& out = std::cout) {
  out << summarize(model, input_sample, compute_type).str();
}

LOCKSTEP_ABI_END
