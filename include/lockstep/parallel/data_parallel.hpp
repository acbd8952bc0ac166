// lockstep/parallel/data_parallel.hpp — `data_parallel<Model>`: PyTorch's nn.DataParallel in one process.
//
// The model lives on device_ids[0]; replicas of it on the other devices. Each step:
//
//   forward(input):  parameters and buffers of device_ids[0] broadcast to the replicas (one copy per device);
//                    the batch scattered in chunks of ceil(n/k) rows (torch.chunk); replicas run forward in
//                    parallel, one thread per device; outputs gathered on output_device.
//   (the caller computes the loss on output_device, with the labels there, and its gradient)
//   backward(grad):  the output gradient scattered back; replicas run backward in parallel; their gradients
//                    summed onto device_ids[0] (one copy per device), where the optimizer steps.
//
// With a loss that is a mean over the global batch (or a sum), the summed gradients are those of one device
// training on the whole batch: the same update, up to the order of floating-point additions.
//
// Buffers (batch norm's running statistics) are device_ids[0]'s: each forward gives them to the replicas, and
// the statistics of the replica on device_ids[0] (its chunk of the batch) are the ones kept, as PyTorch's
// DataParallel keeps the in-place updates of device[0]'s replica only.
//
// Device_ids[0] does more than the others — it holds the optimizer state, receives every gradient and, by
// default, the gathered outputs and the loss — which is why DistributedDataParallel is preferred; report()
// shows it.
#pragma once

#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/comm/coalesced.hpp"
#include "lockstep/config.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/deterministic.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/parallel/detail/replica_groups.hpp"
#include "lockstep/parallel/replica_threads.hpp"
#include "lockstep/parallel/timeline.hpp"
#include "lockstep/runtime/stream.hpp"

LOCKSTEP_ABI_BEGIN

struct data_parallel_options {
  /// The devices (default: every device of the default kind). The model must be on the first.
  std::optional<device_set> device_ids = std::nullopt;
  /// Where outputs are gathered and the loss computed (default: device_ids[0]).
  std::optional<device> output_device = std::nullopt;
  /// Precision of activations and gradients (must match the model's parameters).
  dtype compute_type = dtype::f32;
  /// Deterministic mode (nn/deterministic.hpp): batches are split in whole chunks (deterministic_shards) and the
  /// replicas' exact gradient sums are added on device_ids[0], so the gradients do not depend on the devices.
  std::optional<deterministic_options> deterministic = std::nullopt;
};

template <layer Model>
class data_parallel {
 public:
  /// Wraps `model`, whose parameters must be on device_ids[0] (device_error otherwise, naming both devices
  /// and the fix). Replicates it onto the other devices. `model` must outlive this object.
  explicit data_parallel(Model& model, data_parallel_options options = {})
      : model_(&model),
        devices_(options.device_ids ? *options.device_ids : default_devices().devices),
        output_device_(options.output_device ? *options.output_device : devices_.front()) {
    const device first = devices_.front();
    LOCKSTEP_EXPECTS(output_device_.kind == first.kind, "data_parallel: output_device ", output_device_.str(),
                     " is not of the kind of device_ids (", devices_.str(), ")");
    check_device_exists(output_device_);
    // Scatter, gather, broadcast and reduce are copies between these GPUs: peer to peer where the hardware allows.
    std::vector<device> involved = devices_.devices();
    if (!devices_.contains(output_device_)) involved.push_back(output_device_);
    peer_pairs_ = enable_peer_access(involved);
    for (const auto& p : parameters_of(model)) {
      if (p.param->get_device() != first) {
        throw device_error(detail::concat(
            "data_parallel: the module must have its parameters on ", first.str(), " (device_ids[0]), but parameter '",
            p.name, "' is on ", p.param->get_device().str(), ". Build the model with a context on ", first.str(),
            ", or put ", p.param->get_device().str(), " first in device_ids."));
      }
      if (p.param->compute_type() != options.compute_type) {
        throw precondition_error(detail::concat("data_parallel: parameter '", p.name, "' computes in ",
                                                name_of(p.param->compute_type()), " but compute_type is ",
                                                name_of(options.compute_type)));
      }
    }
    // The model was built on some stream of device_ids[0]; replicas are cloned on others: wait for it once.
    synchronize(first);
    for (const device d : devices_) {
      streams_.emplace_back(d);
      contexts_.push_back(std::make_unique<context>(streams_.back(), options.compute_type));
      contexts_.back()->set_deterministic(options.deterministic);
      contexts_.back()->set_gradient_rounding(exact_rounding::by_wrapper);
      timelines_.emplace_back(d);
    }
    deterministic_ = options.deterministic;
    if (devices_.index_of(output_device_) < 0) {
      output_stream_.emplace(output_device_);
      output_context_ = std::make_unique<context>(*output_stream_, options.compute_type);
      timelines_.emplace_back(output_device_);
    }
    // Replicas copy whole master values: a model built under deferred_master_values gets them first.
    bool materialized = false;
    for (const auto& p : parameters_of(model)) {
      materialized = materialized || p.param->masters_deferred();
      p.param->materialize_masters(streams_.front());
    }
    if (materialized) synchronize(first);
    for (std::size_t i = 1; i < devices_.size(); ++i) replicas_.push_back(model.clone(*contexts_[i]));
    for (std::size_t i = 0; i < devices_.size(); ++i) {
      for (const auto& p : parameters_of(replica(i))) p.param->set_owner(this);
    }
    replica_group_ = std::make_unique<detail::thread_replicas>(devices_.size());
    if (devices_.size() > 1) {  // (one device: a synchronized batch norm is alone)
      for (std::size_t i = 0; i < devices_.size(); ++i) contexts_[i]->set_replicas(&replica_group_->of(i));
    }
    for (const device d : devices_) ready_.emplace_back(d);
    grad_ready_.emplace(output_device_);
    threads_ = std::make_unique<detail::replica_threads>(devices_.size());
    inputs_.resize(devices_.size());
    grads_.resize(devices_.size());
  }

  data_parallel(const data_parallel&) = delete;
  data_parallel& operator=(const data_parallel&) = delete;
  ~data_parallel() {
    for (const auto& p : parameters_of(*model_)) {
      if (p.param->owner() == this) p.param->set_owner(nullptr);
    }
  }

  [[nodiscard]] const device_set& device_ids() const noexcept { return devices_; }
  [[nodiscard]] device output_device() const noexcept { return output_device_; }
  /// The context of replica i (device_ids[i]); replica 0 is the wrapped model. Its stream is where the model's
  /// optimizer steps (context(0).stream()) and where a data loader should deliver batches.
  [[nodiscard]] context& replica_context(std::size_t i) { return *contexts_.at(i); }
  /// The context on output_device: compute the loss with it.
  [[nodiscard]] context& output_context() {
    return output_context_ ? *output_context_ : *contexts_[static_cast<std::size_t>(devices_.index_of(output_device_))];
  }
  /// The wrapped model (replica 0).
  [[nodiscard]] Model& module() noexcept { return *model_; }

  /// Training or evaluation for every replica; step and seed for dropout. The step advances by itself (the loss's
  /// backward on output_context() advances it, and each forward gives every replica the output context's step).
  void set_mode(run_mode m) {
    for_each_context([&](context& c) { c.set_mode(m); });
  }
  void set_step(std::uint64_t step) {
    for_each_context([&](context& c) { c.set_step(step); });
  }
  void set_seed(std::uint64_t seed) {
    for_each_context([&](context& c) { c.set_seed(seed); });
  }

  /// Runs the model on `input` [n, ...], split over the devices; returns the outputs gathered on
  /// output_device, valid until the next forward. `input` must be on one of this object's devices (the
  /// replicas' or the output device), written in stream order on that device's context stream.
  tensor_view forward(const tensor_view& input) {
    context& in_ctx = context_on(input.get_device(), "forward input");
    if (!input_ready_ || input_ready_->get_device() != input.get_device()) input_ready_.emplace(input.get_device());
    input_ready_->record(in_ctx.stream());
    chunks_ = deterministic_ ? deterministic_shards(input.rows(), deterministic_->chunk_rows, devices_.size())
                             : chunk_rows(input.rows(), devices_.size());
    LOCKSTEP_EXPECTS(!chunks_.empty(), "data_parallel::forward: an empty batch");
    if (chunks_.size() < devices_.size() && !warned_small_batch_) {
      warned_small_batch_ = true;
      std::clog << "lockstep: data_parallel: a batch of " << input.rows() << " rows on " << devices_.size()
                << " devices uses " << chunks_.size() << " replicas (each needs at least one row); "
                << "use a batch of at least " << devices_.size() << " rows to use them all\n";
    }
    const std::size_t used = chunks_.size();
    broadcast_parameters(used);
    const std::uint64_t step = output_context().step();  // advanced by the last loss's backward
    for (auto& c : contexts_) c->set_step(step);
    std::vector<tensor_view> parts(used);
    replica_group_->start(used);
    threads_->run(
        used,
        [&](std::size_t i) {
          aborting_on_failure([&] {
            context& c = *contexts_[i];
            timelines_[i].begin(phase::communication, c.stream());
            const tensor_view chunk = receive_rows(input, chunks_[i], inputs_[i], c.stream());
            timelines_[i].end(c.stream());
            c.set_row_offset(chunks_[i].begin);
            timelines_[i].begin(phase::compute, c.stream());
            parts[i] = replica(i).forward(chunk, c);
            timelines_[i].end(c.stream());
            ready_[i].record(c.stream());
          });
        },
        [&](std::size_t i) { return detail::concat("data_parallel forward on ", devices_[i].str()); });
    std::vector<event_ref> ready;
    for (std::size_t i = 0; i < used; ++i) ready.push_back(ready_[i]);
    context& out = output_context();
    timeline_of(output_device_).begin(phase::communication, out.stream());
    gather_rows(parts, ready, gathered_, out.stream());
    timeline_of(output_device_).end(out.stream());
    return gathered_.view();
  }

  /// Back-propagates dL/doutput (on output_device, written in stream order on output_context().stream())
  /// through every replica and leaves the gradients summed in the model's parameters on device_ids[0], in
  /// stream order on replica_context(0).stream(). The model's gradients accumulate, as in PyTorch: zero them
  /// before each step.
  void backward(const tensor_view& grad_output) {
    LOCKSTEP_EXPECTS(grad_output.dims() == gathered_.dims(), "data_parallel::backward: gradient of shape ",
                     grad_output.dims().str(), " for outputs of shape ", gathered_.dims().str());
    LOCKSTEP_EXPECTS(grad_output.get_device() == output_device_, "data_parallel::backward: the gradient is on ",
                     grad_output.get_device().str(), ", expected output_device ", output_device_.str());
    context& out = output_context();
    grad_ready_->record(out.stream());
    const std::size_t used = chunks_.size();
    for (std::size_t i = 1; i < used; ++i) zero_grad(replicas_[i - 1]);
    replica_group_->start(used);
    threads_->run(
        used,
        [&](std::size_t i) {
          aborting_on_failure([&] {
            context& c = *contexts_[i];
            timelines_[i].begin(phase::communication, c.stream());
            if (&c != &out) c.stream().wait(*grad_ready_);
            const tensor_view g = receive_rows(grad_output, chunks_[i], grads_[i], c.stream());
            timelines_[i].end(c.stream());
            timelines_[i].begin(phase::compute, c.stream());
            const gradient_owner_scope owner(this);  // a gradient for a parameter the model does not list is an error
            (void)replica(i).backward(g, c, input_grad::not_required);
            for (const auto& p : parameters_of(replica(i))) {
              if (deterministic_) (void)p.param->exact_grad(c.stream());  // an unused parameter's, zeroed next
              p.param->materialize_grad(c.stream());
            }
            timelines_[i].end(c.stream());
          });
        },
        [&](std::size_t i) { return detail::concat("data_parallel backward on ", devices_[i].str()); });
    const stream_ref s0 = contexts_[0]->stream();
    if (used >= 2) {
      std::vector<std::vector<tensor_view>> sources;
      std::vector<stream_ref> streams;
      for (std::size_t i = 1; i < used; ++i) {
        sources.push_back(deterministic_ ? exact_sums_of(replicas_[i - 1]) : grads_of(replicas_[i - 1]));
        streams.push_back(contexts_[i]->stream());
      }
      timelines_[0].begin(phase::communication, s0);
      reduce_(sources, streams, deterministic_ ? exact_sums_of(*model_) : grads_of(*model_), s0);
      timelines_[0].end(s0);
    }
    // the exact sums of every replica are in the model's accumulators: round them once
    if (deterministic_) {
      for (const auto& p : parameters_of(*model_)) round_exact_gradient(*p.param, s0);
    }
  }

  /// The pairs of devices (from, to) where `from` reaches `to`'s memory directly (enable_peer_access): copies
  /// between other pairs of GPUs are staged by the driver through host memory. Host devices: every pair (one
  /// address space; the grants are kept for strict mode's checks). A single device: none.
  [[nodiscard]] const std::vector<std::pair<device, device>>& peer_pairs() const noexcept { return peer_pairs_; }

  /// Runs f() (the caller's work on the stream of `ctx`, replica_context(i) or output_context(): the loss, the
  /// optimizer step) as computing time of ctx's device in report() rather than idle time, and returns what f returns.
  /// f must not call forward or backward; collectives f queues (a loss scaler's overflow check) count as computing.
  template <class F>
  decltype(auto) compute(context& ctx, F&& f) {
    bool ours = false;
    for_each_context([&](context& c) { ours = ours || &c == &ctx; });
    LOCKSTEP_EXPECTS(ours, "data_parallel::compute: the context (on ", ctx.get_device().str(), ") is not one of this "
                     "data_parallel's (replicas on ", devices_.str(), ", output on ", output_device_.str(),
                     "): pass replica_context(i) or output_context()");
    return timed(timeline_of(ctx.get_device()), phase::compute, ctx.stream(), std::forward<F>(f));
  }

  /// Peak memory and the time each device spent computing, communicating and idle since construction (or
  /// the last reset_report), forward, backward and compute() counting as computing. Waits for the work measured so
  /// far.
  [[nodiscard]] std::vector<device_report> report() {
    std::vector<device_report> out;
    for (auto& t : timelines_) out.push_back(t.report());
    return out;
  }
  /// Starts a new window of the report; at the first call each device's memory peak so far becomes its
  /// setup_peak_bytes.
  void reset_report() {
    for (auto& t : timelines_) t.reset();
  }

 private:
  Model& replica(std::size_t i) { return i == 0 ? *model_ : replicas_[i - 1]; }

  template <class F>
  void for_each_context(F&& f) {
    for (auto& c : contexts_) f(*c);
    if (output_context_) f(*output_context_);
  }

  context& context_on(device d, const char* what) {
    const int i = devices_.index_of(d);
    if (i >= 0) return *contexts_[static_cast<std::size_t>(i)];
    if (output_context_ && d == output_device_) return *output_context_;
    throw precondition_error(detail::concat("data_parallel: ", what, " is on ", d.str(), " but this data_parallel runs on ",
                                            devices_.str(), " with output on ", output_device_.str(),
                                            ": stage it on one of them (e.g. a data_loader on replica_context(0).stream())"));
  }

  timeline& timeline_of(device d) {
    const int i = devices_.index_of(d);
    return i >= 0 ? timelines_[static_cast<std::size_t>(i)] : timelines_.back();
  }

  // The rows of `src` for this replica: a view when `src` is already on the replica's device (after making
  // the replica's stream wait for it), else a copy into `buffer`.
  tensor_view receive_rows(const tensor_view& src, row_range r, tensor& buffer, stream_ref s) {
    const tensor_view rows = src.slice_rows(r.begin, r.rows);
    if (src.get_device() == s.get_device()) return rows;  // the caller made s wait for the producer
    buffer.ensure(rows.dims(), rows.type(), s);
    copy(buffer.bytes(), device_span<const std::uint8_t>(rows.bytes()), s);
    return buffer.view();
  }

  void broadcast_parameters(std::size_t used) {
    for (std::size_t i = 0; i < used; ++i) contexts_[i]->stream().wait(*input_ready_);
    if (used < 2) return;
    // the values forward reads, and the buffers: the replicas use device 0's running statistics
    auto state_of = [](Model& m) {
      std::vector<tensor_view> out;
      const parameter_list ps = parameters_of(m);
      for (const auto& p : ps) out.push_back(p.param->compute_value());
      for (const auto& b : ps.buffers()) out.push_back(b.buffer->view());
      return out;
    };
    const std::vector<tensor_view> sources = state_of(*model_);
    std::vector<std::vector<tensor_view>> destinations;
    std::vector<stream_ref> streams;
    for (std::size_t i = 1; i < used; ++i) {
      destinations.push_back(state_of(replicas_[i - 1]));
      streams.push_back(contexts_[i]->stream());
    }
    const stream_ref s0 = contexts_[0]->stream();
    timelines_[0].begin(phase::communication, s0);
    broadcast_(sources, s0, destinations, streams);
    timelines_[0].end(s0);
  }

  // A replica's job; when it throws, the others' synchronized batch norms stop waiting for it.
  template <class F>
  void aborting_on_failure(F&& f) {
    try {
      f();
    } catch (...) {
      replica_group_->abort();
      throw;
    }
  }

  static std::vector<tensor_view> grads_of(Model& m) {
    std::vector<tensor_view> out;
    for (const auto& p : parameters_of(m)) out.push_back(p.param->grad());
    return out;
  }
  static std::vector<tensor_view> exact_sums_of(Model& m) {
    std::vector<tensor_view> out;
    for (const auto& p : parameters_of(m)) out.push_back(p.param->exact_grad());
    return out;
  }

  Model* model_;
  device_set devices_;
  device output_device_;
  std::vector<std::pair<device, device>> peer_pairs_;
  std::vector<stream> streams_;
  std::vector<std::unique_ptr<context>> contexts_;
  std::optional<stream> output_stream_;
  std::unique_ptr<context> output_context_;
  std::vector<Model> replicas_;  // devices_[1..]
  std::unique_ptr<detail::thread_replicas> replica_group_;  // the contexts' replica_group (synchronized batch norm)
  std::vector<event> ready_;     // replica i's forward output is written
  std::optional<event> input_ready_;
  std::optional<event> grad_ready_;
  std::unique_ptr<detail::replica_threads> threads_;
  std::vector<row_range> chunks_;
  std::vector<tensor> inputs_, grads_;
  tensor gathered_;
  coalesced_broadcast broadcast_;
  coalesced_reduce_add reduce_;
  std::vector<timeline> timelines_;
  bool warned_small_batch_ = false;
  std::optional<deterministic_options> deterministic_;
};

LOCKSTEP_ABI_END
