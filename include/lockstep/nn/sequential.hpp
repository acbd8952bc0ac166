// lockstep/nn/sequential.hpp — `sequential<L...>`: a chain of layers fixed at compile time.
//
// Forward runs the layers in order; backward in reverse, telling the context after each layer that its
// parameters' gradients are final (the hook DistributedDataParallel overlaps communication with). Parameter
// names are the layer's position and its own name: "0.weight", "2.bias" (PyTorch's nn.Sequential naming).
// A sequential is itself a layer, so chains nest.
#pragma once

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/nn/layer.hpp"

LOCKSTEP_ABI_BEGIN

template <layer... L>
class sequential {
  static_assert(sizeof...(L) > 0, "a sequential needs at least one layer");

 public:
  explicit sequential(L... layers) : layers_(std::move(layers)...) {}

  tensor_view forward(const tensor_view& x, context& ctx) {
    return std::apply([&](auto&... l) {
      tensor_view h = x;
      std::size_t i = 0;
      ((h = detail::naming_the_child([&] { return detail::concat("sequential layer ", i, " forward"); },
                                     [&] { return detail::forward_and_report(l, h, ctx); }),
        ++i),
       ...);
      return h;
    }, layers_);
  }

  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    return backward_from<sizeof...(L) - 1>(gy, ctx, need);
  }

  void parameters(parameter_list& out) {
    std::size_t i = 0;
    std::apply([&](auto&... l) {
      ((void)[&] {
        auto scope = out.scope(std::to_string(i++));
        l.parameters(out);
      }(), ...);
    }, layers_);
  }

  /// How many parameters each layer that has some holds, in the order of parameters(): the units forward reports
  /// to the context's parameters_needed hook (ZeRO-3 never splits one across gradient buckets).
  [[nodiscard]] std::vector<std::size_t> parameter_units() {
    std::vector<std::size_t> units;
    std::apply([&](auto&... l) {
      ((void)[&] {
        if (const std::size_t n = parameters_of(l).size(); n > 0) units.push_back(n);
      }(), ...);
    }, layers_);
    return units;
  }

  [[nodiscard]] sequential clone(context& ctx) const {
    return std::apply([&](const auto&... l) { return sequential(l.clone(ctx)...); }, layers_);
  }

  [[nodiscard]] shape output_shape(const shape& sample) const {
    return std::apply([&](const auto&... l) {
      shape s = sample;
      ((s = l.output_shape(s)), ...);
      return s;
    }, layers_);
  }

  /// For summaries (nn/summary.hpp): calls row(index, kind, output sample shape, parameter count) for every layer.
  template <class Row>
  void describe_children(const shape& sample, Row&& row) {
    std::apply([&](auto&... l) {
      shape s = sample;
      std::size_t i = 0;
      ((s = l.output_shape(s),
        row(std::to_string(i++), detail::layer_kind<std::remove_cvref_t<decltype(l)>>(), s, detail::parameter_count(l))),
       ...);
    }, layers_);
  }

  /// Layer I of the chain.
  template <std::size_t I>
  [[nodiscard]] auto& get() noexcept {
    return std::get<I>(layers_);
  }
  static constexpr std::size_t size() noexcept { return sizeof...(L); }

 private:
  template <std::size_t I>
  tensor_view backward_from(const tensor_view& gy, context& ctx, input_grad need) {
    auto& l = std::get<I>(layers_);
    auto where = [] { return detail::concat("sequential layer ", I, " backward"); };
    if constexpr (I == 0) {
      return detail::naming_the_child(where, [&] { return detail::backward_and_report(l, gy, ctx, need); });
    } else {
      const tensor_view g = detail::naming_the_child(
          where, [&] { return detail::backward_and_report(l, gy, ctx, input_grad::required); });
      return backward_from<I - 1>(g, ctx, need);
    }
  }

  std::tuple<L...> layers_;
};

LOCKSTEP_ABI_END
