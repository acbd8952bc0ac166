// lockstep/nn/layer.hpp — the `layer` concept user code writes against, and `any_layer`, its type-erased box.
//
// A layer maps a batch [rows, ...] to a batch [rows, ...] on one device:
//
//   tensor_view forward(const tensor_view& x, context& ctx);
//       Computes the output into memory the layer owns (valid until its next forward) and remembers what
//       backward needs. Work is queued on ctx.stream(); nothing waits for the device.
//   tensor_view backward(const tensor_view& grad_y, context& ctx, input_grad need);
//       Given dL/dy for the last forward's output, accumulates dL/dparameter into each parameter's gradient
//       (parameter::begin_accumulate gives the factor for the old contents) and returns dL/dx in memory the
//       layer owns — or an empty view when `need` is input_grad::not_required.
//   void parameters(parameter_list& out);
//       Adds its parameters, always in the same order.
//   L clone(context& ctx) const;
//       A copy on ctx's device with the same parameter values (copied in stream order on ctx.stream()).
//   shape output_shape(const shape& sample) const;
//       The shape of one output sample for one input sample (no batch dimension); throws
//       precondition_error when the input shape does not fit the layer. Graphs check shapes with it.
//
// Activations are kept in ctx.compute_type(); parameters are read through parameter::compute_value().
#pragma once

#include <concepts>
#include <memory>
#include <cctype>
#include <string>
#include <type_traits>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN

template <class L>
concept layer = std::movable<L> && requires(L& l, const L& cl, const tensor_view& t, context& ctx, parameter_list& ps,
                                            const shape& s) {
  { l.forward(t, ctx) } -> std::same_as<tensor_view>;
  { l.backward(t, ctx, input_grad::required) } -> std::same_as<tensor_view>;
  l.parameters(ps);
  { cl.clone(ctx) } -> std::same_as<L>;
  { cl.output_shape(s) } -> std::same_as<shape>;
};

/// All parameters of a layer, in order, with qualified names.
template <layer L>
parameter_list parameters_of(L& l) {
  parameter_list out;
  l.parameters(out);
  return out;
}

/// Marks every gradient of `l` zero (no memory is written; see parameter::zero_grad).
template <layer L>
void zero_grad(L& l) {
  for (const auto& p : parameters_of(l)) p.param->zero_grad();
}

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN
/// Runs f() (a child's forward or backward) and returns what it returns; a precondition_error it throws comes back
/// with the child named in front ("graph node 'fc1' forward: ..."), so that an error deep in a model says where.
template <class Name, class F>
decltype(auto) naming_the_child(const Name& name, F&& f) {
  try {
    return f();
  } catch (const precondition_error& e) {
    throw precondition_error(concat(name(), ": ", e.what()));
  }
}

/// The unqualified name of type T, for summaries: T::summary_name() when it has one ("relu"), else its type's name:
/// "linear", "pool2d<max>", "sequential<linear, relu>" (from the compiler's signature of this function; every
/// "namespace::" and "class::" qualifier dropped).
template <class T>
std::string layer_kind() {
  if constexpr (requires { T::summary_name(); }) {
    return std::string(T::summary_name());
  } else {
    const std::string_view f = __PRETTY_FUNCTION__;  // "... [with T = lockstep::...::linear; ...]" (GCC), "[T = ...]"
    const std::size_t at = f.find("T = ");
    if (at == std::string_view::npos) return "layer";
    std::string_view t = f.substr(at + 4);
    t = t.substr(0, t.find_first_of(";]"));
    std::string out;
    for (std::size_t i = 0; i < t.size(); ++i) {
      if (t[i] == ':' && i + 1 < t.size() && t[i + 1] == ':') {
        while (!out.empty() && (std::isalnum(static_cast<unsigned char>(out.back())) != 0 || out.back() == '_')) {
          out.pop_back();
        }
        ++i;
        continue;
      }
      out += t[i];
    }
    return out;
  }
}

/// Number of parameter values of a layer (its sub-layers' included).
template <class L>
std::int64_t parameter_count(L& l) {
  parameter_list ps;
  l.parameters(ps);
  std::int64_t n = 0;
  for (const auto& p : ps) n += p.param->numel();
  return n;
}

/// Runs a child's forward, first telling the context which parameters it is about to read (a container inside the
/// child reports nothing: the hook is put back only after the child's forward).
template <layer L>
tensor_view forward_and_report(L& child, const tensor_view& x, context& ctx) {
  if (!ctx.has_parameters_needed_hook()) return child.forward(x, ctx);
  struct restore {
    context& ctx;
    context::parameters_needed_fn hook;
    ~restore() { ctx.set_parameters_needed_hook(std::move(hook)); }
  } held{ctx, ctx.take_parameters_needed_hook()};
  const auto ptrs = parameters_of(child).pointers();
  if (!ptrs.empty()) held.hook(ptrs);
  return child.forward(x, ctx);
}

/// Runs a child's backward and tells the context which parameters now have final gradients.
template <layer L>
tensor_view backward_and_report(L& child, const tensor_view& grad_y, context& ctx, input_grad need) {
  tensor_view gx = child.backward(grad_y, ctx, need);
  if (ctx.has_gradients_ready_hook()) {
    const auto ptrs = parameters_of(child).pointers();
    ctx.gradients_ready(ptrs);
  }
  return gx;
}
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// A layer of any type satisfying `layer`, behind one type: what runtime graphs hold. Move-only.
class any_layer {
 public:
  any_layer() = default;
  // any_layer is excluded before `layer` is checked: checking layer<any_layer> inside any_layer's own
  // constructor would recurse (clang rejects it).
  template <class L>
    requires(!std::same_as<std::remove_cvref_t<L>, any_layer> && layer<L>)
  any_layer(L l)  // NOLINT(google-explicit-constructor): wrapping is the point
      : self_(std::make_unique<model<L>>(std::move(l))) {}

  tensor_view forward(const tensor_view& x, context& ctx) { return get().forward(x, ctx); }
  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) { return get().backward(gy, ctx, need); }
  void parameters(parameter_list& out) { get().parameters(out); }
  [[nodiscard]] any_layer clone(context& ctx) const { return any_layer(get().clone(ctx)); }
  [[nodiscard]] shape output_shape(const shape& s) const { return get().output_shape(s); }
  [[nodiscard]] bool has_value() const noexcept { return static_cast<bool>(self_); }
  /// The wrapped layer's kind ("linear"), for summaries.
  [[nodiscard]] std::string kind() const { return get().kind(); }

  /// The wrapped layer when it is an L, else nullptr.
  template <class L>
  [[nodiscard]] L* target() noexcept {
    auto* m = dynamic_cast<model<L>*>(self_.get());
    return m ? &m->impl : nullptr;
  }

 private:
  struct interface {
    virtual ~interface() = default;
    virtual tensor_view forward(const tensor_view& x, context& ctx) = 0;
    virtual tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) = 0;
    virtual void parameters(parameter_list& out) = 0;
    [[nodiscard]] virtual std::unique_ptr<interface> clone(context& ctx) const = 0;
    [[nodiscard]] virtual shape output_shape(const shape& s) const = 0;
    [[nodiscard]] virtual std::string kind() const = 0;
  };
  template <class L>
  struct model final : interface {
    explicit model(L l) : impl(std::move(l)) {}
    tensor_view forward(const tensor_view& x, context& ctx) override { return impl.forward(x, ctx); }
    tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) override {
      return impl.backward(gy, ctx, need);
    }
    void parameters(parameter_list& out) override { impl.parameters(out); }
    [[nodiscard]] std::unique_ptr<interface> clone(context& ctx) const override {
      return std::make_unique<model<L>>(impl.clone(ctx));
    }
    [[nodiscard]] shape output_shape(const shape& s) const override { return impl.output_shape(s); }
    [[nodiscard]] std::string kind() const override { return detail::layer_kind<L>(); }
    L impl;
  };
  explicit any_layer(std::unique_ptr<interface> p) : self_(std::move(p)) {}
  interface& get() const {
    LOCKSTEP_EXPECTS(self_ != nullptr, "use of an empty any_layer");
    return *self_;
  }

  std::unique_ptr<interface> self_;
};
static_assert(layer<any_layer>);

LOCKSTEP_ABI_END
