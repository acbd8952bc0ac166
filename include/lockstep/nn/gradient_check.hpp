// lockstep/nn/gradient_check.hpp — check_gradients: a layer's backward against central finite differences.
//
//   context ctx(default_stream(dev));                 // f32: the check runs the layer in f32
//   my_layer l(..., ctx, init);
//   const gradient_check_report r = check_gradients(l, ctx, shape{4, 16});
//   if (r.worst() > 1e-3) std::cerr << r.str();       // one line per tensor: "input", "weight", ...
//
// The objective is L = sum(G * layer(x)) for a fixed random G, summed in double on the host; for each checked
// element e of the input and of every parameter, (L(e + h) - L(e - h)) / 2h is compared with what the layer's
// backward gave for G. Each tensor reports its worst error |analytic - numeric| / max(1, |numeric|) (relative
// for gradients larger than 1, absolute below), where it was, and both values.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/random.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN

struct gradient_check_options {
  double step = 1e-2;               ///< h of the central differences (the layer runs in f32: not much smaller)
  std::int64_t max_elements = 0;    ///< per tensor: at most this many elements, evenly spaced (0: all of them)
  std::uint64_t seed = 0;           ///< of the random input (when none is given) and of G
  float input_low = -1.0f;          ///< the random input is uniform in [input_low, input_high)
  float input_high = 1.0f;
  input_grad input = input_grad::required;  ///< not_required: check the parameters only
};

/// One tensor's result: its worst element.
struct tensor_gradient_error {
  std::string name;             ///< "input", or the parameter's qualified name ("fc.weight")
  double worst_error = 0.0;     ///< max over checked elements of |analytic - numeric| / max(1, |numeric|)
  std::int64_t worst_index = -1;
  double analytic = 0.0;        ///< at worst_index
  double numeric = 0.0;
  std::int64_t checked = 0;     ///< how many elements were compared
};

struct gradient_check_report {
  std::vector<tensor_gradient_error> tensors;

  /// The worst error over all tensors (0 when nothing was checked).
  [[nodiscard]] double worst() const noexcept {
    double w = 0.0;
    for (const auto& t : tensors) w = std::max(w, t.worst_error);
    return w;
  }
  /// The entry named `name`; throws precondition_error when there is none.
  [[nodiscard]] const tensor_gradient_error& at(const std::string& name) const {
    for (const auto& t : tensors)
      if (t.name == name) return t;
    throw precondition_error(detail::concat("gradient check: no tensor named ", name));
  }
  /// One line per tensor: "weight: worst error 3.1e-05 at element 7 (analytic 0.412, numeric 0.41201), 12 checked".
  [[nodiscard]] std::string str() const {
    std::ostringstream o;
    for (const auto& t : tensors) {
      o << t.name << ": worst error " << t.worst_error;
      if (t.worst_index >= 0) o << " at element " << t.worst_index << " (analytic " << t.analytic << ", numeric " << t.numeric << ")";
      o << ", " << t.checked << " checked\n";
    }
    return o.str();
  }
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN
inline std::vector<float> uniform_values(std::size_t n, std::uint64_t seed, std::uint64_t stream, float lo, float hi) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = lo + (hi - lo) * philox_uniform(seed, stream, i);
  return v;
}

inline std::vector<std::int64_t> checked_elements(std::int64_t n, std::int64_t max_elements) {
  std::vector<std::int64_t> out;
  if (max_elements <= 0 || max_elements >= n) {
    for (std::int64_t i = 0; i < n; ++i) out.push_back(i);
    return out;
  }
  for (std::int64_t k = 0; k < max_elements; ++k) out.push_back(k * n / max_elements);  // evenly spaced, first included
  return out;
}

inline void note_difference(tensor_gradient_error& e, std::int64_t i, double analytic, double numeric) {
  const double err = std::abs(analytic - numeric) / std::max(1.0, std::abs(numeric));
  ++e.checked;
  if (e.worst_index < 0 || err > e.worst_error || std::isnan(err)) {
    e.worst_error = std::isnan(err) ? INFINITY : err;
    e.worst_index = i;
    e.analytic = analytic;
    e.numeric = numeric;
  }
}
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Checks l's backward (input gradient and every parameter's gradient) against central differences of
/// sum(G * l(x)) at x = `input` (of shape `input_shape`, a batch), with a fixed random G. Runs in ctx's mode
/// (training: a dropout's mask is the step's, the same in every forward); requires ctx.compute_type() == f32.
/// Afterwards the parameters and buffers hold their values again and the gradients are the analytic ones. Cost: two
/// forwards per checked element (use max_elements for larger tensors).
template <layer L>
gradient_check_report check_gradients(L& l, context& ctx, const std::vector<float>& input, const shape& input_shape,
                                      const gradient_check_options& o = {}) {
  LOCKSTEP_EXPECTS(ctx.compute_type() == dtype::f32, "check_gradients runs the layer in f32, but the context computes "
                   "in ", name_of(ctx.compute_type()), ": build the layer with a context in f32 for the check");
  LOCKSTEP_EXPECTS(static_cast<std::int64_t>(input.size()) == input_shape.numel(), "check_gradients: ", input.size(),
                   " input values for shape ", input_shape.str());
  LOCKSTEP_EXPECTS(o.step > 0.0, "check_gradients: the step must be positive, got ", o.step);
  const stream_ref s = ctx.stream();
  auto read = [&](const tensor_view& t) { return to_vector(t.span<const float>(), s); };
  auto set_element = [&](const tensor_view& t, std::int64_t i, float v) {
    copy(device_span<float>(t.as<float>() + i, 1, t.get_device()), std::span<const float>(&v, 1), s);
    s.synchronize();
  };

  // the buffers (running statistics), which every training forward below changes: restored at the end
  const parameter_list params = parameters_of(l);
  std::vector<std::vector<std::uint8_t>> buffers;
  for (const auto& b : params.buffers()) buffers.push_back(to_vector(device_span<const std::uint8_t>(b.buffer->view().bytes()), s));
  tensor x(input_shape, dtype::f32, s);
  copy(x.span<float>(), std::span<const float>(input), s);
  s.synchronize();
  const tensor_view y0 = l.forward(x.view(), ctx);
  const std::vector<float> g = detail::uniform_values(static_cast<std::size_t>(y0.numel()), o.seed, 1, -1.0f, 1.0f);
  tensor gy(y0.dims(), dtype::f32, s);
  copy(gy.span<float>(), std::span<const float>(g), s);
  s.synchronize();
  auto objective = [&]() {
    const std::vector<float> y = read(l.forward(x.view(), ctx));
    double sum = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) sum += static_cast<double>(y[i]) * g[i];
    return sum;
  };

  // the analytic gradients
  for (const auto& p : params) p.param->zero_grad();
  (void)l.forward(x.view(), ctx);
  const tensor_view gx = l.backward(gy.view(), ctx, o.input);
  gradient_check_report report;
  std::vector<std::vector<float>> analytic;
  if (o.input == input_grad::required) {
    LOCKSTEP_EXPECTS(gx.numel() == x.numel() && gx.type() == dtype::f32, "check_gradients: the layer's backward "
                     "returned an input gradient of shape ", gx.dims().str(), " for an input of shape ",
                     input_shape.str());
    analytic.push_back(read(gx));
    report.tensors.push_back({"input"});
  }
  for (const auto& p : params) {
    p.param->materialize_grad(s);
    analytic.push_back(read(p.param->grad()));
    report.tensors.push_back({p.name});
  }

  // the numeric ones, one element at a time
  auto differences = [&](const tensor_view& t, std::vector<float> values, std::size_t k, parameter* p) {
    for (const std::int64_t i : detail::checked_elements(static_cast<std::int64_t>(values.size()), o.max_elements)) {
      const float original = values[static_cast<std::size_t>(i)];
      auto at = [&](double v) {
        set_element(t, i, static_cast<float>(v));
        if (p != nullptr) p->refresh_working_copy(s);
        return objective();
      };
      const double plus = at(original + o.step), minus = at(original - o.step);
      set_element(t, i, original);
      if (p != nullptr) p->refresh_working_copy(s);
      detail::note_difference(report.tensors[k], i, analytic[k][static_cast<std::size_t>(i)],
                              (plus - minus) / (2.0 * o.step));
    }
  };
  std::size_t k = 0;
  if (o.input == input_grad::required) differences(x.view(), input, k++, nullptr);
  for (const auto& p : params) differences(p.param->value(), read(p.param->value()), k++, p.param);
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    copy(params.buffers()[i].buffer->view().bytes(), std::span<const std::uint8_t>(buffers[i]), s);
  }
  s.synchronize();
  return report;
}

/// check_gradients at a random input, uniform in [o.input_low, o.input_high) (from o.seed).
template <layer L>
gradient_check_report check_gradients(L& l, context& ctx, const shape& input_shape,
                                      const gradient_check_options& o = {}) {
  return check_gradients(l, ctx,
                         detail::uniform_values(static_cast<std::size_t>(input_shape.numel()), o.seed, 0, o.input_low,
                                                o.input_high),
                         input_shape, o);
}

LOCKSTEP_ABI_END
