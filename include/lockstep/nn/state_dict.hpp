// lockstep/nn/state_dict.hpp — a model's named tensors in memory (PyTorch's model.state_dict() and
// load_state_dict(strict=True)), without files: to copy one model into another (on another device, say), or to
// save in a format of your own.
//
//   std::vector<named_tensor> weights = state_dict(teacher);   // views: parameters' fp32 values, then buffers
//   load_state_dict(student, weights, s);                      // every name and shape must match
//
// The names are PyTorch's ("fc1.weight", "bn1.running_mean"): those of parameters_of(model) and its buffers, the
// names checkpoints write (io/checkpoint.hpp).
#pragma once

#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN

/// One tensor of a model, by its PyTorch name.
struct named_tensor {
  std::string name;
  tensor_view value;
};

/// The model's tensors: each parameter's fp32 master values (what the optimizer updates), then each buffer, in the
/// order of parameters_of(model). Views of the model's memory, not copies: they change as the model trains. Throws
/// precondition_error for a parameter that ZeRO shards (gather whole values first: consolidated()).
template <layer L>
[[nodiscard]] std::vector<named_tensor> state_dict(L& model) {
  parameter_list list = parameters_of(model);
  std::vector<named_tensor> out;
  for (const auto& p : list) out.push_back(named_tensor{p.name, p.param->value()});
  for (const auto& b : list.buffers()) out.push_back(named_tensor{b.name, b.buffer->view()});
  return out;
}

/// Copies `from` into the model's tensors of the same names, in stream order on `s` (a stream of the model's device;
/// tensors of `from` on another device are copied from there: the work that wrote them must be finished, e.g. that
/// device synchronized). Strict, as PyTorch's load_state_dict(strict=True): every tensor of the model must be in
/// `from` with its shape and dtype, and `from` may hold nothing else; a mismatch throws precondition_error naming the
/// tensors before anything is copied. Under f16/bf16, the working copies are refreshed from the loaded values.
template <layer L>
void load_state_dict(L& model, std::span<const named_tensor> from, stream_ref s) {
  std::unordered_map<std::string, const named_tensor*> by_name;
  for (const auto& t : from) {
    LOCKSTEP_EXPECTS(by_name.emplace(t.name, &t).second, "load_state_dict: '", t.name, "' is given twice");
  }
  std::vector<named_tensor> to = state_dict(model);
  std::string missing, mismatched, unexpected;
  auto append = [](std::string& list, const std::string& item) { list += (list.empty() ? "" : ", ") + item; };
  for (const auto& t : to) {
    const auto it = by_name.find(t.name);
    if (it == by_name.end()) {
      append(missing, t.name);
      continue;
    }
    const tensor_view& v = it->second->value;
    if (v.dims() != t.value.dims() || v.type() != t.value.type()) {
      append(mismatched, detail::concat(t.name, " (given ", v.dims().str(), " ", name_of(v.type()), ", the model's ",
                                        t.value.dims().str(), " ", name_of(t.value.type()), ")"));
    }
    by_name.erase(it);
  }
  for (const auto& t : from) {
    if (by_name.contains(t.name)) append(unexpected, t.name);
  }
  LOCKSTEP_EXPECTS(missing.empty() && mismatched.empty() && unexpected.empty(), "load_state_dict: ",
                   missing.empty() ? "" : "missing " + missing + "; ", mismatched.empty() ? "" : "of another shape or dtype " + mismatched + "; ",
                   unexpected.empty() ? "" : "not in the model " + unexpected + "; ",
                   "nothing was loaded (the names are those of parameters_of(model) and its buffers)");
  std::unordered_map<std::string, const named_tensor*> source;
  for (const auto& t : from) source.emplace(t.name, &t);
  for (const auto& t : to) {
    const tensor_view& v = source.at(t.name)->value;
    detail::copy_bytes(t.value.data(), t.value.get_device(), v.data(), v.get_device(), v.bytes().size(), s);
  }
  for (const auto& p : parameters_of(model)) p.param->refresh_working_copy(s);
}

LOCKSTEP_ABI_END
