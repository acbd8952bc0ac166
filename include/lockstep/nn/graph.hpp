// lockstep/nn/graph.hpp — `graph`: a runtime DAG of named nodes (layers, sums, concatenations) for residual
// and branching networks. A graph is itself a layer, so it nests in sequential, in another graph and in
// any_layer.
//
//   graph g(shape{784});                                    // one input, named "input", samples of [784]
//   g.add("fc1", linear(784, 256, ctx, init), "input")
//    .add("act", gelu(), "fc1")
//    .add("fc2", linear(256, 256, ctx, init), "act")
//    .add("proj", linear(784, 256, ctx, init), "input")
//    .add_sum("res", {"proj", "fc2"})                        // [rows, 256]
//    .add("head", linear(256, 10, ctx, init), "res");        // the output: the last node added
//
// Nodes may be added in any order (a node may read one added later). `build()` — called by the first
// forward, or by parameters()/order() — resolves the names, fixes the topological order (ties broken by
// insertion order, so it is deterministic), computes every node's per-sample shape from the input shape
// with each layer's output_shape, and rejects with a precondition_error naming the nodes involved: an empty
// graph, an input that names no node, a cycle ("graph has a cycle: a -> b -> c -> a"), shapes that do not
// fit (a sum of [256] and [128], a layer whose output_shape rejects its input), and nodes the output does
// not depend on (they would never receive a gradient). Duplicate names and the reserved name "input" are
// rejected by add() itself.
//
// Forward runs the nodes in topological order. Layers compute into their own memory; joins compute into
// memory the graph owns, grown with tensor::ensure, so a step with the same or a smaller batch allocates
// nothing.
//
// Backward runs the nodes in reverse topological order. The gradient of a node's output is the sum of what
// its consumers send back, gathered when the node's turn comes (all its consumers come later in the order,
// so they are done):
//   - a layer consumer sends the gradient its backward returned, a sum consumer its own output gradient
//     (unchanged), a concatenation the node's column range of its output gradient;
//   - one dense contribution is passed on as a view, without a copy;
//   - otherwise (several consumers, or a column range) one kernel writes the sum of all contributions into a
//     buffer of the graph's (no zero-fill first; more than eight contributions take one more pass per eight).
// After each layer node's backward, the context is told that the node's parameters are final
// (detail::backward_and_report), so the gradients-ready hook fires per layer, in reverse topological order.
// A node's gradient is computed only when something needs it: a node upstream of a parameter, or of the
// input when the caller asks for the input gradient. So with input_grad::not_required the layers fed by
// "input" get input_grad::not_required, and a parameter-free layer whose input needs no gradient is not
// run backward at all.
//
// Parameters are listed in topological order, each node's under its name: "fc1.weight".
//
// Memory: the views forward and backward return stay valid until the next forward or backward (of the graph
// or of the layer that owns the memory), as for any layer.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <queue>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/kernels/join.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN

/// A runtime DAG of named layers and joins with one input, "input", and one output; itself a `layer`.
class graph {
 public:
  /// The reserved name of the graph input.
  static constexpr std::string_view input_name = "input";

  /// A graph whose input samples have shape `input_sample` (no batch dimension; rank at most 3, since the
  /// batch adds one). Throws precondition_error for a rank-4 sample.
  explicit graph(shape input_sample) : input_sample_(input_sample) {
    LOCKSTEP_EXPECTS(input_sample.rank() < shape::max_rank, "graph: input samples of shape ", input_sample.str(),
                     " have ", input_sample.rank(), " dimensions; a sample has at most ", shape::max_rank - 1,
                     " (the batch adds one)");
  }

  /// Adds a layer node `name` fed by the node `input` ("input" for the graph input, or a node added before
  /// or later). Throws precondition_error for an empty, duplicate or reserved name or an empty any_layer.
  graph& add(std::string name, any_layer node_layer, std::string input) {
    LOCKSTEP_EXPECTS(node_layer.has_value(), "graph::add: node '", name, "' holds an empty any_layer");
    std::vector<std::string> inputs;
    inputs.push_back(std::move(input));
    return add_node(std::move(name), node_kind::layer, std::move(node_layer), std::move(inputs));
  }

  /// Adds a node `name` that is the element-wise sum of `inputs` (at least two; all of one shape, checked
  /// by build). A node may appear more than once (x + x).
  graph& add_sum(std::string name, std::vector<std::string> inputs) {
    LOCKSTEP_EXPECTS(inputs.size() >= 2, "graph::add_sum: node '", name, "' joins ", inputs.size(),
                     " inputs; a sum joins at least two (use the input node itself instead)");
    return add_node(std::move(name), node_kind::sum, any_layer(), std::move(inputs));
  }

  /// Adds a node `name` that concatenates `inputs` (at least two) along the feature dimension, the first
  /// dimension of a sample: [rows, a] + [rows, b] -> [rows, a + b]; samples of higher rank must agree in
  /// their other dimensions ([rows, a, 3] + [rows, b, 3] -> [rows, a + b, 3]). Checked by build.
  graph& add_concat(std::string name, std::vector<std::string> inputs) {
    LOCKSTEP_EXPECTS(inputs.size() >= 2, "graph::add_concat: node '", name, "' joins ", inputs.size(),
                     " inputs; a concatenation joins at least two (use the input node itself instead)");
    return add_node(std::move(name), node_kind::concat, any_layer(), std::move(inputs));
  }

  /// Makes node `name` the output (default: the last node added). Checked by build.
  graph& set_output(std::string name) {
    LOCKSTEP_EXPECTS(!name.empty(), "graph::set_output: the output name is empty");
    output_name_ = std::move(name);
    built_ = false;
    return *this;
  }

  /// Validates the graph and fixes its order (see the file comment for what is rejected; every error is a
  /// precondition_error naming the nodes involved). Called by the first forward; adding a node or changing
  /// the output later makes the next forward build again. Calls output_shape and parameters of every layer.
  void build() {
    plan p = make_plan();
    std::vector<char> has_params(nodes_.size(), 0);
    for (std::size_t id = 0; id < nodes_.size(); ++id) {
      if (nodes_[id].kind != node_kind::layer) continue;
      parameter_list ps;
      nodes_[id].impl.parameters(ps);
      has_params[id] = ps.size() > 0 ? 1 : 0;
    }
    plan_ = std::move(p);
    has_params_ = std::move(has_params);
    needs_grad_.assign(nodes_.size(), 0);
    built_ = true;
    forwarded_ = false;
  }

  /// Runs the nodes in topological order on x [rows, input sample...] (ctx's compute type and device) and
  /// returns the output node's output. Builds first if needed. Throws precondition_error for an input of
  /// another shape, dtype or device, or a layer whose output breaks its output_shape.
  tensor_view forward(const tensor_view& x, context& ctx) {
    if (!built_) build();
    const dtype ct = ctx.compute_type();
    LOCKSTEP_EXPECTS(x.type() == ct, "graph: input is ", name_of(x.type()), " but the context computes in ",
                     name_of(ct), " (load the input in that type, data_loader_options::input_type = ", name_of(ct),
                     ", or cast it on the device: cast<To, From>(in, out, stream))");
    LOCKSTEP_EXPECTS(x.get_device() == ctx.get_device(), "graph: input on ", x.get_device().str(),
                     " but the graph runs on ", ctx.get_device().str());
    LOCKSTEP_EXPECTS(x.dims().rank() >= 1 && x.dims() == batch_shape(x.rows(), input_sample_), "graph: input of shape ",
                     x.dims().str(), " is not a batch of samples of the declared shape ", input_sample_.str(),
                     " (expected ", batch_shape(x.rows(), input_sample_).str(),
                     "; view other shapes with tensor_view::reshaped)");
    forwarded_ = false;
    x_ = x;
    rows_ = x.rows();
    for (const int id : plan_.order) {
      node& v = nodes_[static_cast<std::size_t>(id)];
      const shape& sample = plan_.samples[static_cast<std::size_t>(id)];
      const shape dims = batch_shape(rows_, sample);
      const auto& inputs = plan_.inputs[static_cast<std::size_t>(id)];
      switch (v.kind) {
        case node_kind::layer: {
          const tensor_view y = detail::naming_the_child([&] { return detail::concat("graph node '", v.name, "' forward"); },
                                                         [&] { return detail::forward_and_report(v.impl, output_of(inputs[0]), ctx); });
          LOCKSTEP_EXPECTS(y.rows() == rows_ && y.numel() == dims.numel() && y.type() == ct, "graph: node '", v.name,
                           "' returned an output of shape ", y.dims().str(), " (", name_of(y.type()),
                           ") for a batch of ", rows_, " rows; its output_shape promised ", dims.str(), " (",
                           name_of(ct), ")");
          v.y = y;
          break;
        }
        case node_kind::sum: {
          v.out.ensure(dims, ct, ctx.stream());
          operands_.clear();
          for (const int in : inputs) operands_.push_back(operand{output_of(in), sample.numel(), 0});
          sum_operands(v.out.view(), ctx, "graph sum");
          v.y = v.out.view();
          break;
        }
        case node_kind::concat: {
          v.out.ensure(dims, ct, ctx.stream());
          const auto& offsets = plan_.offsets[static_cast<std::size_t>(id)];
          for (std::size_t k = 0; k < inputs.size(); ++k) {
            copy_columns(output_of(inputs[k]), v.out.view(), offsets[k], ctx);
          }
          v.y = v.out.view();
          break;
        }
      }
    }
    forwarded_ = true;
    return nodes_[static_cast<std::size_t>(plan_.output)].y;
  }

  /// Given dL/d(output) of the last forward, accumulates every parameter gradient, reporting each layer node's
  /// parameters to the context after its backward, and returns dL/dx — in the graph's memory when several
  /// nodes read the input (or a concatenation does), else the gradient the one reader sent back, as it is —
  /// or an empty view when `need` is not_required. Throws precondition_error without a forward, or for a
  /// gradient of another shape, dtype or device than the output.
  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    LOCKSTEP_EXPECTS(built_ && forwarded_, "graph::backward without a forward");
    const dtype ct = ctx.compute_type();
    const node& out = nodes_[static_cast<std::size_t>(plan_.output)];
    LOCKSTEP_EXPECTS(gy.type() == ct && gy.rows() == out.y.rows() && gy.numel() == out.y.numel(),
                     "graph::backward: gradient of shape ", gy.dims().str(), " (", name_of(gy.type()),
                     ") for an output of shape ", out.y.dims().str(), " (", name_of(ct), ")");
    LOCKSTEP_EXPECTS(gy.get_device() == ctx.get_device(), "graph::backward: gradient on ", gy.get_device().str(),
                     " but the graph runs on ", ctx.get_device().str());

    // A node's output gradient is needed when the node leads back to a parameter, or to the input when the
    // caller wants the input gradient.
    const bool input_needed = need == input_grad::required;
    auto needed = [&](int id) { return id == input_id ? input_needed : needs_grad_[static_cast<std::size_t>(id)] != 0; };
    for (const int id : plan_.order) {
      bool n = has_params_[static_cast<std::size_t>(id)] != 0;
      for (const int in : plan_.inputs[static_cast<std::size_t>(id)]) n = n || needed(in);
      needs_grad_[static_cast<std::size_t>(id)] = n ? 1 : 0;
    }

    for (auto it = plan_.order.rbegin(); it != plan_.order.rend(); ++it) {
      const int id = *it;
      if (!needed(id)) continue;
      node& v = nodes_[static_cast<std::size_t>(id)];
      const tensor_view g = id == plan_.output ? gy.reshaped(v.y.dims()) : gather_gradient(id, ctx);
      if (v.kind != node_kind::layer) {
        v.g = g;
        continue;
      }
      const int in = plan_.inputs[static_cast<std::size_t>(id)][0];
      const bool in_needed = needed(in);
      const tensor_view gx = detail::naming_the_child([&] { return detail::concat("graph node '", v.name, "' backward"); }, [&] {
        return detail::backward_and_report(v.impl, g, ctx, in_needed ? input_grad::required : input_grad::not_required);
      });
      if (in_needed) {
        const tensor_view x = output_of(in);
        LOCKSTEP_EXPECTS(gx.numel() == x.numel() && gx.type() == ct && (gx.numel() == 0 || gx.data() != nullptr),
                         "graph: node '", v.name, "' returned an input gradient of shape ", gx.dims().str(), " (",
                         name_of(gx.type()), ") for an input of shape ", x.dims().str(), " (", name_of(ct), ")");
      }
      v.gx = in_needed ? gx : tensor_view();
    }
    return input_needed ? gather_gradient(input_id, ctx) : tensor_view();
  }

  /// The parameters of every layer node, in topological order, under the node's name ("fc1.weight").
  /// Builds first if needed.
  void parameters(parameter_list& out) {
    if (!built_) build();
    for (const int id : plan_.order) {
      node& v = nodes_[static_cast<std::size_t>(id)];
      if (v.kind != node_kind::layer) continue;
      auto scope = out.scope(v.name);
      v.impl.parameters(out);
    }
  }

  /// How many parameters each layer node that has some holds, in the order of parameters(): the units forward
  /// reports to the context's parameters_needed hook (ZeRO-3 never splits one across gradient buckets).
  [[nodiscard]] std::vector<std::size_t> parameter_units() {
    if (!built_) build();
    std::vector<std::size_t> units;
    for (const int id : plan_.order) {
      node& v = nodes_[static_cast<std::size_t>(id)];
      if (v.kind != node_kind::layer) continue;
      if (const std::size_t n = parameters_of(v.impl).size(); n > 0) units.push_back(n);
    }
    return units;
  }

  /// A graph of the same structure whose layers are clones on ctx's device (parameter values copied in stream
  /// order on ctx.stream(); make it wait for the work that produced the source values).
  [[nodiscard]] graph clone(context& ctx) const {
    graph g(input_sample_);
    g.nodes_.reserve(nodes_.size());
    for (const node& v : nodes_) {
      g.nodes_.emplace_back(v.name, v.kind, v.kind == node_kind::layer ? v.impl.clone(ctx) : any_layer(),
                            v.input_names);
    }
    g.index_ = index_;
    g.output_name_ = output_name_;
    if (built_) {
      g.plan_ = plan_;
      g.has_params_ = has_params_;
      g.needs_grad_.assign(nodes_.size(), 0);
      g.built_ = true;
    }
    return g;
  }

  /// The output node's sample shape for input samples `sample`, which must equal the declared input shape.
  /// Throws precondition_error otherwise, or when the graph does not build.
  [[nodiscard]] shape output_shape(const shape& sample) const {
    LOCKSTEP_EXPECTS(sample == input_sample_, "graph: takes samples of shape ", input_sample_.str(), ", got ",
                     sample.str());
    if (built_) return plan_.samples[static_cast<std::size_t>(plan_.output)];
    const plan p = make_plan();
    return p.samples[static_cast<std::size_t>(p.output)];
  }

  /// The layer of node `node_name` when it is an L; nullptr when it is another type or the node is a join.
  /// Throws precondition_error when no node has that name.
  template <class L>
  [[nodiscard]] L* find(std::string_view node_name) {
    const auto it = index_.find(node_name);
    LOCKSTEP_EXPECTS(it != index_.end(), "graph::find: no node is named '", node_name, "'");
    node& v = nodes_[static_cast<std::size_t>(it->second)];
    return v.kind == node_kind::layer ? v.impl.template target<L>() : nullptr;
  }

  /// The node names in topological order (the order forward runs them). Validates the graph (throws like
  /// build) when it is not built.
  [[nodiscard]] std::vector<std::string> order() const {
    std::vector<std::string> names;
    auto list = [&](const plan& p) {
      names.reserve(p.order.size());
      for (const int id : p.order) names.push_back(nodes_[static_cast<std::size_t>(id)].name);
    };
    if (built_) {
      list(plan_);
    } else {
      list(make_plan());
    }
    return names;
  }

  /// For summaries (nn/summary.hpp): calls row(name, kind, output sample shape, parameter count) for every node in
  /// topological order (joins as "sum" and "concat"). Builds first if needed.
  template <class Row>
  void describe_children(const shape& sample, Row&& row) {
    (void)output_shape(sample);
    if (!built_) build();
    for (const int id : plan_.order) {
      node& v = nodes_[static_cast<std::size_t>(id)];
      const bool is_layer = v.kind == node_kind::layer;
      row(v.name, is_layer ? v.impl.kind() : std::string(v.kind == node_kind::sum ? "sum" : "concat"),
          plan_.samples[static_cast<std::size_t>(id)], is_layer ? detail::parameter_count(v.impl) : std::int64_t{0});
    }
  }

  /// The declared shape of one input sample.
  [[nodiscard]] const shape& input_sample() const noexcept { return input_sample_; }
  /// Number of nodes (the input not counted).
  [[nodiscard]] std::size_t size() const noexcept { return nodes_.size(); }

 private:
  static constexpr int input_id = -1;

  enum class node_kind : std::uint8_t { layer, sum, concat };

  struct node {
    node(std::string n, node_kind k, any_layer l, std::vector<std::string> in)
        : name(std::move(n)), kind(k), impl(std::move(l)), input_names(std::move(in)) {}
    std::string name;
    node_kind kind;
    any_layer impl;                        // layer nodes only
    std::vector<std::string> input_names;  // as given to add
    tensor out;                            // joins: the output
    tensor grad;                           // the output gradient when it is a sum of contributions
    tensor_view y;                         // output of the last forward
    tensor_view g;                         // joins: output gradient of the last backward
    tensor_view gx;                        // layers: input gradient of the last backward (empty if not needed)
  };

  /// Node `reader` reading its input number `slot`.
  struct edge {
    int reader;
    int slot;
  };

  /// What build fixes (all indexed by node id, the insertion index).
  struct plan {
    std::vector<int> order;                           // node ids in topological order
    std::vector<std::vector<int>> inputs;             // input ids; input_id for the graph input
    std::vector<shape> samples;                       // per-sample output shapes
    std::vector<std::vector<edge>> consumers;         // who reads each node, by (consumer position, slot)
    std::vector<edge> input_consumers;                // who reads the graph input
    std::vector<std::vector<std::int64_t>> offsets;   // concatenations: first column of each input
    int output = input_id;
  };

  /// A [rows, cols] operand of a sum: `view` read with row stride `ld` from column `offset`.
  struct operand {
    tensor_view view;
    std::int64_t ld;
    std::int64_t offset;
  };

  graph& add_node(std::string name, node_kind kind, any_layer l, std::vector<std::string> inputs) {
    LOCKSTEP_EXPECTS(!name.empty(), "graph::add: a node needs a name");
    LOCKSTEP_EXPECTS(name != input_name, "graph::add: '", input_name,
                     "' is reserved for the graph input; choose another node name");
    LOCKSTEP_EXPECTS(!index_.contains(name), "graph::add: a node named '", name,
                     "' already exists; node names must be unique");
    for (const auto& in : inputs) {
      LOCKSTEP_EXPECTS(!in.empty(), "graph::add: node '", name, "' names an input with an empty name");
    }
    index_.emplace(name, static_cast<int>(nodes_.size()));
    nodes_.emplace_back(std::move(name), kind, std::move(l), std::move(inputs));
    built_ = false;
    forwarded_ = false;
    return *this;
  }

  /// [rows, sample...].
  static shape batch_shape(std::int64_t rows, const shape& s) {
    switch (s.rank()) {
      case 0: return shape{rows};
      case 1: return shape{rows, s[0]};
      case 2: return shape{rows, s[0], s[1]};
      case 3: return shape{rows, s[0], s[1], s[2]};
      default: break;
    }
    LOCKSTEP_THROW(precondition_error, "graph: samples of shape ", s.str(), " cannot be batched (rank ", s.rank(),
                   "; at most ", shape::max_rank - 1, ")");
  }

  [[nodiscard]] const std::string& name_of_node(int id) const {
    static const std::string input(input_name);
    return id == input_id ? input : nodes_[static_cast<std::size_t>(id)].name;
  }

  [[nodiscard]] std::string node_list() const {
    std::string s(input_name);
    for (const node& v : nodes_) s += ", " + v.name;
    return s;
  }

  [[nodiscard]] tensor_view output_of(int id) const {
    return id == input_id ? x_ : nodes_[static_cast<std::size_t>(id)].y;
  }

  /// Resolves, orders and checks the graph; throws precondition_error naming the culprits.
  [[nodiscard]] plan make_plan() const {
    LOCKSTEP_EXPECTS(!nodes_.empty(), "graph::build: the graph has no nodes; add layers with add(name, layer, \"",
                     input_name, "\") first");
    const std::size_t n = nodes_.size();
    plan p;

    // Names -> ids.
    p.inputs.resize(n);
    std::string missing;
    for (std::size_t id = 0; id < n; ++id) {
      for (const auto& in : nodes_[id].input_names) {
        if (in == input_name) {
          p.inputs[id].push_back(input_id);
        } else if (const auto it = index_.find(in); it != index_.end()) {
          p.inputs[id].push_back(it->second);
        } else {
          missing += detail::concat(missing.empty() ? "" : "; ", "node '", nodes_[id].name, "' takes input '", in,
                                    "', which is not a node of the graph");
        }
      }
    }
    if (!missing.empty()) {
      LOCKSTEP_THROW(precondition_error, "graph::build: ", missing, " (nodes: ", node_list(), ")");
    }
    if (output_name_.empty()) {
      p.output = static_cast<int>(n - 1);
    } else {
      const auto it = index_.find(output_name_);
      LOCKSTEP_EXPECTS(it != index_.end(), "graph::build: the output '", output_name_,
                       "' given to set_output is not a node of the graph (nodes: ", node_list(), ")");
      p.output = it->second;
    }

    // Topological order (Kahn), the earliest-added ready node first.
    std::vector<std::vector<int>> readers(n);
    std::vector<std::size_t> pending(n, 0);
    for (std::size_t id = 0; id < n; ++id) {
      for (const int in : p.inputs[id]) {
        if (in == input_id) continue;
        readers[static_cast<std::size_t>(in)].push_back(static_cast<int>(id));
        ++pending[id];
      }
    }
    std::priority_queue<int, std::vector<int>, std::greater<>> ready;
    for (std::size_t id = 0; id < n; ++id) {
      if (pending[id] == 0) ready.push(static_cast<int>(id));
    }
    while (!ready.empty()) {
      const int id = ready.top();
      ready.pop();
      p.order.push_back(id);
      for (const int r : readers[static_cast<std::size_t>(id)]) {
        if (--pending[static_cast<std::size_t>(r)] == 0) ready.push(r);
      }
    }
    if (p.order.size() != n) throw_cycle(p, pending);

    // Shapes, in order.
    p.samples.resize(n);
    p.offsets.resize(n);
    auto sample_of = [&](int id) -> const shape& {
      return id == input_id ? input_sample_ : p.samples[static_cast<std::size_t>(id)];
    };
    for (const int id : p.order) {
      const node& v = nodes_[static_cast<std::size_t>(id)];
      const auto& inputs = p.inputs[static_cast<std::size_t>(id)];
      shape s;
      switch (v.kind) {
        case node_kind::layer: {
          const shape& in = sample_of(inputs[0]);
          try {
            s = v.impl.output_shape(in);
          } catch (const precondition_error& e) {
            LOCKSTEP_THROW(precondition_error, "graph::build: node '", v.name, "' cannot take its input '",
                           name_of_node(inputs[0]), "' of shape ", in.str(), ": ", e.what());
          }
          LOCKSTEP_EXPECTS(s.rank() < shape::max_rank, "graph::build: node '", v.name, "' gives samples of shape ",
                           s.str(), " for input '", name_of_node(inputs[0]), "' of shape ", in.str(),
                           "; a sample has at most ", shape::max_rank - 1, " dimensions (the batch adds one)");
          break;
        }
        case node_kind::sum: {
          s = sample_of(inputs[0]);
          for (std::size_t k = 1; k < inputs.size(); ++k) {
            const shape& other = sample_of(inputs[k]);
            LOCKSTEP_EXPECTS(other == s, "graph::build: sum node '", v.name, "' needs inputs of one shape, but '",
                             name_of_node(inputs[0]), "' has shape ", s.str(), " and '", name_of_node(inputs[k]),
                             "' has shape ", other.str());
          }
          break;
        }
        case node_kind::concat: {
          const shape& first = sample_of(inputs[0]);
          std::int64_t features = 0;
          for (std::size_t k = 0; k < inputs.size(); ++k) {
            const shape& other = sample_of(inputs[k]);
            LOCKSTEP_EXPECTS(other.rank() >= 1, "graph::build: concat node '", v.name, "' cannot join '",
                             name_of_node(inputs[k]), "' of shape ", other.str(),
                             ": samples need a feature dimension to concatenate along");
            LOCKSTEP_EXPECTS(other.rank() == first.rank() && other.with_rows(first[0]) == first,
                             "graph::build: concat node '", v.name, "' joins '", name_of_node(inputs[0]),
                             "' of shape ", first.str(), " and '", name_of_node(inputs[k]), "' of shape ",
                             other.str(), "; the shapes may differ in their first dimension only");
            p.offsets[static_cast<std::size_t>(id)].push_back(features * first.cols());
            features += other[0];
          }
          s = first.with_rows(features);
          break;
        }
      }
      p.samples[static_cast<std::size_t>(id)] = s;
    }

    // Every node must lead to the output, or it would run forward for nothing and never get a gradient.
    std::vector<char> reaches(n, 0);
    std::vector<int> stack{p.output};
    reaches[static_cast<std::size_t>(p.output)] = 1;
    while (!stack.empty()) {
      const int id = stack.back();
      stack.pop_back();
      for (const int in : p.inputs[static_cast<std::size_t>(id)]) {
        if (in != input_id && !reaches[static_cast<std::size_t>(in)]) {
          reaches[static_cast<std::size_t>(in)] = 1;
          stack.push_back(in);
        }
      }
    }
    std::string unused;
    for (const int id : p.order) {
      if (!reaches[static_cast<std::size_t>(id)]) unused += detail::concat(unused.empty() ? "'" : ", '", name_of_node(id), "'");
    }
    if (!unused.empty()) {
      LOCKSTEP_THROW(precondition_error, "graph::build: the output '", name_of_node(p.output),
                     "' does not depend on node(s) ", unused,
                     ": they would never receive a gradient; remove them, or make the output depend on them");
    }

    // Consumers, in the order backward visits them reversed: by consumer position, then slot.
    p.consumers.resize(n);
    for (const int id : p.order) {
      const auto& inputs = p.inputs[static_cast<std::size_t>(id)];
      for (std::size_t k = 0; k < inputs.size(); ++k) {
        const edge e{id, static_cast<int>(k)};
        if (inputs[k] == input_id) {
          p.input_consumers.push_back(e);
        } else {
          p.consumers[static_cast<std::size_t>(inputs[k])].push_back(e);
        }
      }
    }
    return p;
  }

  /// Names one cycle among the nodes Kahn's algorithm could not order. Each of them still waits for an input
  /// that is also unordered, so walking from one to such an input must come back to a node already seen.
  [[noreturn]] void throw_cycle(const plan& p, const std::vector<std::size_t>& pending) const {
    int start = 0;
    while (pending[static_cast<std::size_t>(start)] == 0) ++start;
    std::vector<int> path;
    std::vector<int> seen_at(nodes_.size(), -1);
    int id = start;
    while (seen_at[static_cast<std::size_t>(id)] < 0) {
      seen_at[static_cast<std::size_t>(id)] = static_cast<int>(path.size());
      path.push_back(id);
      for (const int in : p.inputs[static_cast<std::size_t>(id)]) {
        if (in != input_id && pending[static_cast<std::size_t>(in)] != 0) {
          id = in;
          break;
        }
      }
    }
    // path[seen_at[id]..] follows inputs backwards: reverse it to follow the data, and start at the node
    // added first.
    std::vector<int> cycle(path.begin() + seen_at[static_cast<std::size_t>(id)], path.end());
    std::reverse(cycle.begin(), cycle.end());
    std::rotate(cycle.begin(), std::min_element(cycle.begin(), cycle.end()), cycle.end());
    std::string text;
    for (const int c : cycle) text += name_of_node(c) + " -> ";
    text += name_of_node(cycle.front());
    LOCKSTEP_THROW(precondition_error, "graph::build: graph has a cycle: ", text);
  }

  /// The gradient of node `id`'s output (or of the graph input): the sum of what its consumers sent back.
  tensor_view gather_gradient(int id, context& ctx) {
    const bool is_input = id == input_id;
    const auto& edges = is_input ? plan_.input_consumers : plan_.consumers[static_cast<std::size_t>(id)];
    const tensor_view like = output_of(id);
    const std::int64_t cols = is_input ? input_sample_.numel() : plan_.samples[static_cast<std::size_t>(id)].numel();
    operands_.clear();
    for (const edge& e : edges) {
      const node& c = nodes_[static_cast<std::size_t>(e.reader)];
      switch (c.kind) {
        case node_kind::layer: operands_.push_back(operand{c.gx, cols, 0}); break;
        case node_kind::sum: operands_.push_back(operand{c.g, cols, 0}); break;
        case node_kind::concat:
          operands_.push_back(operand{c.g, plan_.samples[static_cast<std::size_t>(e.reader)].numel(),
                                      plan_.offsets[static_cast<std::size_t>(e.reader)][static_cast<std::size_t>(e.slot)]});
          break;
      }
    }
    if (operands_.size() == 1 && operands_[0].ld == cols && operands_[0].offset == 0) {
      return operands_[0].view.reshaped(like.dims());  // one consumer: its gradient as it is
    }
    tensor& buffer = is_input ? input_grad_ : nodes_[static_cast<std::size_t>(id)].grad;
    buffer.ensure(like.dims(), ctx.compute_type(), ctx.stream());
    sum_operands(buffer.view(), ctx, "graph gradient sum");
    return buffer.view();
  }

  /// out = the sum of operands_ (out dense, [rows_, cols]); one launch per sum_op::max_operands operands.
  void sum_operands(const tensor_view& out, context& ctx, const char* what) const {
    const std::int64_t cols = out.rows() == 0 ? 0 : out.numel() / out.rows();
    const auto n = static_cast<std::size_t>(out.numel());
    if (n == 0) return;
    dispatch_floating(ctx.compute_type(), what, [&]<class T>() {
      constexpr std::size_t max = kernels::sum_op<T>::max_operands;
      for (std::size_t first = 0; first < operands_.size(); first += max) {
        kernels::sum_op<T> op{};
        const std::size_t count = std::min(max, operands_.size() - first);
        for (std::size_t k = 0; k < count; ++k) {
          const operand& o = operands_[first + k];
          op.in[k] = kernels::column_block<T>{o.view.as<T>(), static_cast<std::size_t>(o.ld),
                                              static_cast<std::size_t>(o.offset)};
        }
        op.count = static_cast<int>(count);
        op.out = out.as<T>();
        op.cols = static_cast<std::size_t>(cols);
        op.accumulate = first > 0;
        launch_elementwise(n, op, ctx.stream(), what);
      }
    });
  }

  /// Copies `in` [rows, a] into the columns [offset, offset + a) of `out` [rows, w].
  static void copy_columns(const tensor_view& in, const tensor_view& out, std::int64_t offset, context& ctx) {
    if (in.numel() == 0) return;
    dispatch_floating(ctx.compute_type(), "graph concat", [&]<class T>() {
      launch_elementwise(static_cast<std::size_t>(in.numel()),
                         kernels::copy_columns_op<T>{in.as<T>(), out.as<T>(), static_cast<std::size_t>(in.cols()),
                                                     static_cast<std::size_t>(out.cols()),
                                                     static_cast<std::size_t>(offset)},
                         ctx.stream(), "graph concat");
    });
  }

  shape input_sample_;
  std::vector<node> nodes_;                         // in insertion order; a node's id is its index
  std::map<std::string, int, std::less<>> index_;   // name -> id
  std::string output_name_;                         // empty: the last node added
  plan plan_;
  std::vector<char> has_params_;                    // per node: a layer with parameters
  std::vector<char> needs_grad_;                    // per node, during backward
  std::vector<operand> operands_;                   // scratch of sum_operands (kept: no allocation per step)
  bool built_ = false;
  bool forwarded_ = false;
  tensor_view x_;
  std::int64_t rows_ = 0;
  tensor input_grad_;                               // the input gradient when it is a sum of contributions
};
static_assert(layer<graph>);

LOCKSTEP_ABI_END
