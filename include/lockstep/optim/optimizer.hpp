// lockstep/optim/optimizer.hpp — what SGD and AdamW share: parameter groups, state on the parameters'
// device, a device-side step count, and one fused multi-tensor update per group and dtype.
#pragma once

#include <array>
#include <cstring>
#include <optional>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/kernels/multi_tensor.hpp"
#include "lockstep/kernels/optim.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_ABI_BEGIN

/// What a step reads from mixed precision (amp/): the inverse loss scale applied to gradients as they are
/// read, and a device flag that skips the step. Both null (the default) outside mixed precision.
using step_inputs = kernels::step_inputs;

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

/// Parameter groups with `State` fp32 state tensors per parameter (momentum; Adam's m and v).
template <class Options, int State>
class optimizer_core {
 public:
  /// State tensors per parameter.
  static constexpr int state_count = State;

  /// Adds a group of parameters updated with `options`. All parameters of an optimizer live on one device.
  /// A group may be added after steps were taken (unfreezing layers): it keeps its own step count, so its
  /// first update is a first step (SGD's momentum buffer starts at the gradient, AdamW's bias corrections
  /// are those of step 1), as in PyTorch.
  void add_param_group(std::span<parameter* const> params, const Options& options) {
    param_group g{std::vector<parameter*>(params.begin(), params.end()), options, {}};
    for (parameter* p : g.params) {
      LOCKSTEP_EXPECTS(p != nullptr, "a null parameter in an optimizer group");
      if (!dev_) dev_ = p->get_device();
      LOCKSTEP_EXPECTS(p->get_device() == *dev_, "optimizer parameters must be on one device: ", p->name(), " is on ",
                       p->get_device().str(), ", others on ", dev_->str(),
                       " (use one optimizer per replica, or DataParallel which steps on device_ids[0])");
      for (const auto& other : groups_)
        for (parameter* q : other.params)
          LOCKSTEP_EXPECTS(q != p, "parameter ", p->name(), " is in two optimizer groups");
    }
    detail::set_update_settings(g.params, update_role::optimizer, std::make_shared<const std::string>(options.describe()));
    groups_.push_back(std::move(g));
  }

  /// Marks every gradient of every group zero.
  void zero_grad() noexcept {
    for (auto& g : groups_)
      for (parameter* p : g.params) p->zero_grad();
  }

  [[nodiscard]] std::size_t group_count() const noexcept { return groups_.size(); }
  [[nodiscard]] Options& options(std::size_t index = 0) { return groups_.at(index).options; }
  [[nodiscard]] const std::vector<parameter*>& params(std::size_t index = 0) const { return groups_.at(index).params; }

  /// Whether `group` holds state tensors (after its first step or materialize_state, when its options need them).
  [[nodiscard]] bool has_state(std::size_t group_index) const { return !groups_.at(group_index).state.empty(); }

  /// State tensor `which` of parameter `index` of `group` (empty before the first step).
  [[nodiscard]] tensor_view state(std::size_t group_index, std::size_t index, int which) const {
    const auto& g = groups_.at(group_index);
    if (g.state.empty()) return {};
    return g.state.at(index).at(static_cast<std::size_t>(which)).view();
  }

  /// Allocates what a first step would (zeroed state for the groups whose options need it, step counters at
  /// zero) without stepping, in stream order on `s`; no-op for what exists. Checkpoint loading writes into it.
  /// A zero step count keeps the next step a first step, so this changes no update.
  void materialize_state(stream_ref s) {
    LOCKSTEP_EXPECTS(dev_.has_value(), "an optimizer without parameters has no state");
    LOCKSTEP_EXPECTS(s.get_device() == *dev_, "optimizer step or state on a stream of ", s.get_device().str(),
                     " for parameters on ", dev_->str());
    if (counted_groups_ < groups_.size()) grow_counters(s);
    for (auto& g : groups_) {
      if (!g.state.empty() || !group_needs_state(g.options)) continue;
      g.state.resize(g.params.size());
      for (std::size_t i = 0; i < g.params.size(); ++i) {
        for (auto& t : g.state[i]) {
          t.ensure(state_shape(*g.params[i]), dtype::f32, s);
          fill_zero(t.template span<float>(), s);
        }
      }
    }
  }

  /// The shape of a parameter's state tensors: its own, or under ZeRO its shard's (flat).
  [[nodiscard]] static shape state_shape(const parameter& p) {
    return p.is_sharded() ? shape{p.shard().size()} : p.dims();
  }

  /// Replaces state tensor `which` of parameter `index` of `group` (ZeRO gathers and re-shards the state when
  /// the parameters' shards change) and returns the old one, for the caller to free in the order of the streams
  /// that read it (tensor::set_stream). `t` must have state_shape() of the parameter as it will be stepped.
  [[nodiscard]] tensor replace_state(std::size_t group_index, std::size_t index, int which, tensor t) {
    auto& g = groups_.at(group_index);
    LOCKSTEP_EXPECTS(!g.state.empty(), "replace_state: group ", group_index, " has no state");
    return std::exchange(g.state.at(index).at(static_cast<std::size_t>(which)), std::move(t));
  }

  /// Bytes of state on the device: the state tensors and the step counters.
  [[nodiscard]] std::uint64_t state_bytes() const noexcept {
    std::uint64_t n = counters_.empty() ? 0 : counted_groups_ * sizeof(kernels::optimizer_counters);
    for (const auto& g : groups_)
      for (const auto& per_param : g.state)
        for (const auto& t : per_param) n += static_cast<std::uint64_t>(t.numel()) * size_of(t.type());
    return n;
  }

  /// Whether a group with `options` keeps state tensors (SGD: with momentum; AdamW: always).
  [[nodiscard]] static bool group_needs_state(const Options& options) noexcept {
    if constexpr (requires { options.momentum; }) {
      return options.momentum != 0.0f;
    } else {
      return true;
    }
  }

  /// The device step counters, one kernels::optimizer_counters per group (empty before the first step or
  /// materialize_state).
  [[nodiscard]] device_span<std::uint8_t> step_counters() const noexcept {
    if (counters_.empty()) return {};
    return counters_.template span<std::uint8_t>().first(counted_groups_ * sizeof(kernels::optimizer_counters));
  }

  /// Steps applied so far to group `group_index` (the first by default); synchronizes `s`. (The counts live on
  /// the device: a skipped step does not count.)
  [[nodiscard]] std::int64_t steps_taken(stream_ref s, std::size_t group_index = 0) const {
    LOCKSTEP_EXPECTS(group_index < groups_.size(), "steps_taken: group ", group_index, " of ", groups_.size());
    if (group_index >= counted_groups_) return 0;
    kernels::optimizer_counters c{};
    const auto bytes = to_vector(counters_.template span<const std::uint8_t>().subspan(group_index * sizeof c, sizeof c), s);
    std::memcpy(&c, bytes.data(), sizeof c);
    return c.step;
  }

 protected:
  struct param_group {
    std::vector<parameter*> params;
    Options options;
    std::vector<std::array<tensor, State>> state;
  };

  /// Allocates zeroed state (for groups whose options need it) and step counters on a group's first step,
  /// materializes gradients nobody wrote, and advances the device step counts (unless skipped). Returns the
  /// counters, one per group.
  kernels::optimizer_counters* prepare(stream_ref s, step_inputs in, float beta1, float beta2) {
    LOCKSTEP_EXPECTS(dev_.has_value(), "an optimizer without parameters cannot step");
    // The scaler's inverse scale and skip flag are read by the step's kernels: they must be on its device (with
    // data_parallel's output_device elsewhere, a scaler made there would be read across GPUs: illegal address).
    detail::expect_pointer_on_device(s.get_device(), in.grad_multiplier,
                                     "the optimizer step's inverse loss scale (step_inputs)");
    detail::expect_pointer_on_device(s.get_device(), in.skip, "the optimizer step's skip flag (step_inputs)");
    materialize_state(s);
    for (auto& g : groups_)
      for (parameter* p : g.params) p->materialize_grad(s);
    auto* counters = reinterpret_cast<kernels::optimizer_counters*>(counters_.data());
    launch_elementwise(groups_.size(), kernels::prepare_step_op{counters, in, beta1, beta2}, s, "optimizer step counts");
    return counters;
  }

  // Counters for every group: the existing ones copied, the new ones zero. Groups are rarely added after a
  // step, so the copy is waited for before the old counters are freed (their memory is stream-ordered on the
  // stream of the step that allocated them, which may not be `s`).
  void grow_counters(stream_ref s) {
    constexpr std::size_t each = sizeof(kernels::optimizer_counters);
    tensor grown(shape{static_cast<std::int64_t>(groups_.size() * each)}, dtype::u8, s);
    fill_zero(grown.template span<std::uint8_t>(), s);
    if (counted_groups_ > 0) {
      copy(grown.template span<std::uint8_t>().first(counted_groups_ * each),
           device_span<const std::uint8_t>(counters_.template span<std::uint8_t>().first(counted_groups_ * each)), s);
      s.synchronize();
    }
    counters_ = std::move(grown);
    counted_groups_ = groups_.size();
  }

  /// Calls launch(T, tensor groups of dtype T, options, group index) for every parameter group and every
  /// gradient dtype T present, with the tensor groups [value, grad, state..., working] built for T, to update them
  /// in stream order on `s`.
  template <int K, class Launch>
  void for_each_batch(stream_ref s, Launch&& launch) {
    static_assert(K == State + 3, "tensor groups are [value, grad, state..., working]");
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      auto& g = groups_[gi];
      for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
        std::vector<tensor_group<K>> batch;
        for (std::size_t i = 0; i < g.params.size(); ++i) {
          parameter* p = g.params[i];
          if (p->compute_type() != t) continue;
          // the parameter's shard (all of it without ZeRO); the state covers the same elements
          const auto n = static_cast<std::size_t>(p->shard().size());
          p->before_update(s);  // (every rank, also for an empty shard: ZeRO then gathers on every rank alike)
          if (!g.state.empty()) {
            const auto held = static_cast<std::size_t>(g.state[i][0].numel());
            LOCKSTEP_EXPECTS(held == n, "optimizer state of ", p->name(), " covers ", held, " elements but this rank "
                             "updates ", n, " of them: the optimizer stepped (or loaded state) before "
                             "distributed_data_parallel sharded the parameters (ZeRO); build the wrapper first, also "
                             "before loading a checkpoint");
          }
          if (n == 0) continue;
          tensor_group<K> tg{};
          tg.ptr[0] = p->master_shard().data();
          tg.ptr[1] = p->grad_shard().data();
          for (int k = 0; k < State; ++k) {
            tg.ptr[2 + k] = g.state.empty() ? nullptr : g.state[i][static_cast<std::size_t>(k)].data();
          }
          tg.ptr[K - 1] = p->working_shard().data();  // null under f32
          tg.size = n;
          batch.push_back(tg);
        }
        if (!batch.empty()) launch(t, std::span<const tensor_group<K>>(batch), g.options, gi);
      }
    }
  }

  std::vector<param_group> groups_;
  std::optional<device> dev_;
  tensor counters_;                 // kernels::optimizer_counters, one per group (the first counted_groups_)
  std::size_t counted_groups_ = 0;
};

LOCKSTEP_DETAIL_END
