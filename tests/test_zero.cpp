// Tests of ZeRO (ddp_options::zero, parallel/distributed_data_parallel.hpp): stages 1 and 2 against plain DDP on
// host cliques (the same bits: the same reduction order), their state split between the ranks, no_sync and
// clipping, consolidation for checkpoints, and the errors a sharded rank gives. Its own program so that it also
// runs under ThreadSanitizer, which checks the hand-offs between the compute and communication streams
// (reduce-scatter, the ZeRO-2 buffers' reuse, the all-gather read by the next forward). Every test runs once per
// backend (host devices, 4 of them: LOCKSTEP_HOST_DEVICES=4; GPUs with NCCL, skipped without them).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "lockstep/comm/run_on_devices.hpp"
#include "lockstep/io/checkpoint.hpp"
#include "lockstep/parallel/distributed_data_parallel.hpp"
#include "parallel_common.hpp"
#include "test_support.hpp"

using namespace lockstep;
using namespace lockstep_test;
using namespace parallel_test;

namespace {

class zero_test : public backend_test {};
INSTANTIATE_TEST_SUITE_P(all, zero_test, all_backends(), backend_name);

// Steps [from, to) of the 64-row global batches (32 rows per rank, 2 ranks) in the context's type.
template <class Optimizer>
void train_steps(rank_context& rc, context& ctx, distributed_data_parallel<graph>& ddp, Optimizer& opt, int from, int to) {
  const stream_ref s = ctx.stream();
  softmax_cross_entropy loss(reduction::mean);
  for (int step = from; step < to; ++step) {
    opt.zero_grad();
    const std::int64_t begin = first_row(step, 64) + 32 * rc.rank();
    tensor xf = device_tensor(slice(inputs(), begin, 32, features), shape{32, features}, s);
    tensor xb(shape{32, features}, ctx.compute_type(), s);
    detail::convert_floating(xf, xb, s);
    tensor yb = device_labels(slice(labels(), begin, 32, 1), s);
    loss.forward(ddp.forward(xb), yb, ctx, 64);
    ddp.backward(loss.backward(ctx));
    opt.step(s);
  }
}

// Recipe r on one thread per device; every rank's result.
std::vector<recipe_result> train_recipe_threads(const device_set& devices, std::int64_t batch, const recipe& r) {
  std::vector<recipe_result> out(devices.size());
  run_on_devices(devices, [&](rank_context& rc) {
    out[static_cast<std::size_t>(rc.rank())] = train_recipe_rank(rc.comm(), rc.compute_stream(), rc.comm_stream(), batch, r);
  });
  return out;
}

}  // namespace

// Parameterized over (backend, (devices, global batch, precision, AdamW rather than SGD)).
class zero_equivalence : public on_backend<std::tuple<device_kind, std::tuple<int, std::int64_t, dtype, bool>>> {};

TEST_P(zero_equivalence, stages_1_2_and_3_give_the_bits_of_ddp_and_split_the_state_between_the_ranks) {
  const auto [k, batch, precision, use_adamw] = std::get<1>(GetParam());
  if (!require_devices(k)) return;
  recipe r{.precision = precision, .adamw = use_adamw};
  const auto ddp = train_recipe_threads(devices(k), batch, r);
  ASSERT_NE(ddp[0].parameters, initial_parameters(dev(0))) << "the run must train";
  std::uint64_t stage_2_bytes = 0;  // ZeRO-2's rank 0 (the last run, whole or deferred)
  for (const auto& [zero, deferred] : {std::pair{1, false}, std::pair{2, false}, std::pair{3, false}, std::pair{1, true},
                                       std::pair{2, true}, std::pair{3, true}, std::pair{0, true}}) {
    SCOPED_TRACE(deferred ? "built with deferred master values" : "built whole");
    r.zero = zero;
    r.deferred_masters = deferred;
    const auto sharded = train_recipe_threads(devices(k), batch, r);
    std::uint64_t optimizer_bytes = 0, parameter_bytes = 0;
    if (zero == 2) stage_2_bytes = sharded[0].report.parameter_bytes;
    for (int rank = 0; rank < k; ++rank) {
      const auto& mine = sharded[static_cast<std::size_t>(rank)];
      if (kind() == device_kind::cuda && precision != dtype::f32) {
        // both fp32 sums now, but NCCL's reduce-scatter and all-reduce may add the ranks in different orders
        EXPECT_LE(relative_difference(mine.parameters, ddp[0].parameters), 1e-2) << "ZeRO-" << zero << ", rank " << rank;
      } else {
        EXPECT_EQ(mine.parameters, ddp[0].parameters) << "ZeRO-" << zero << ", rank " << rank << " of " << k;
        EXPECT_EQ(mine.optimizer_state, ddp[0].optimizer_state) << "ZeRO-" << zero << ", rank " << rank << " of " << k;
      }
      EXPECT_EQ(mine.skipped_steps, ddp[0].skipped_steps) << "ZeRO-" << zero << ", rank " << rank << " of " << k;
      optimizer_bytes += mine.report.optimizer_bytes;
      parameter_bytes += mine.report.parameter_bytes;
    }
    if (zero == 0) continue;  // (plain DDP from deferred master values: every rank holds the whole state)
    // the shards partition the state: together the ranks hold one copy (plus a step counter each)
    const std::uint64_t counters = sizeof(kernels::optimizer_counters);
    EXPECT_EQ(optimizer_bytes, ddp[0].report.optimizer_bytes + static_cast<std::uint64_t>(k - 1) * counters)
        << "ZeRO-" << zero;
    // ZeRO-3 between steps (the whole values freed): the ranks' values shards together are one copy of the values
    // in the buckets' aligned layout (V), with every rank's masters shard on top under f16/bf16 (4 bytes per
    // parameter, a third of DDP's 6). ZeRO-2's rank 0 holds V and its shard of the masters, but in its own layout:
    // ZeRO-3's buckets keep a layer whole (fewer buckets, less padding)
    if (zero == 3 && k > 1) {
      const auto values = static_cast<std::uint64_t>(ddp[0].parameters.size());
      const std::uint64_t masters = precision == dtype::f32 ? 0 : values * 4;
      EXPECT_GE(parameter_bytes, values * size_of(precision) + masters);
      EXPECT_LE(parameter_bytes, stage_2_bytes + masters) << parameter_bytes;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(devices_batches_precisions, zero_equivalence,
                         ::testing::Combine(all_backends(),
                                            ::testing::Values(std::make_tuple(1, std::int64_t{64}, dtype::f32, false),
                                                              std::make_tuple(2, std::int64_t{64}, dtype::f32, false),
                                                              std::make_tuple(3, std::int64_t{130}, dtype::f16, true),
                                                              std::make_tuple(4, std::int64_t{130}, dtype::bf16, false),
                                                              std::make_tuple(4, std::int64_t{64}, dtype::f16, false),
                                                              std::make_tuple(3, std::int64_t{64}, dtype::f32, true),
                                                              std::make_tuple(4, std::int64_t{3}, dtype::bf16, true),
                                                              std::make_tuple(2, std::int64_t{66}, dtype::f16, false),
                                                              std::make_tuple(2, std::int64_t{64}, dtype::f32, true),
                                                              std::make_tuple(3, std::int64_t{64}, dtype::bf16, false),
                                                              std::make_tuple(4, std::int64_t{130}, dtype::f32, true))),
                         [](const auto& param_info) {
                           const auto& p = std::get<1>(param_info.param);
                           return std::string(name_of(std::get<0>(param_info.param))) + "_" +
                                  std::to_string(std::get<0>(p)) + "_devices_batch_" + std::to_string(std::get<1>(p)) +
                                  "_" + std::string(name_of(std::get<2>(p))) + (std::get<3>(p) ? "_adamw" : "_sgd");
                         });

namespace in_type {  // (named: nvcc warns of unreferenced members of an unnamed namespace's class)
// A rank's communicator that forwards every collective to `inner` but says, as NCCL does, that it adds f16/bf16
// in their own type (reduces_in_f32() false), and notes the dtype of every reduction it is given.
class recording_comm final : public detail::communicator_impl {
 public:
  recording_comm(communicator_ref inner, std::vector<dtype>* reduced) : inner_(inner), reduced_(reduced) {}
  [[nodiscard]] int rank() const noexcept override { return inner_.rank(); }
  [[nodiscard]] int size() const noexcept override { return inner_.size(); }
  [[nodiscard]] device get_device() const noexcept override { return inner_.get_device(); }
  [[nodiscard]] bool supports(collective_kind k) const noexcept override { return inner_.supports(k); }
  [[nodiscard]] bool reduces_in_f32() const noexcept override { return false; }
  void enqueue(const detail::collective_call& c, stream_ref s) override {
    if (c.is_reduction()) reduced_->push_back(c.type);
    switch (c.kind) {
      case collective_kind::all_reduce: inner_.all_reduce(c.send, c.recv, c.count, c.type, c.op, s); break;
      case collective_kind::broadcast: inner_.broadcast(c.send, c.recv, c.count, c.type, c.root, s); break;
      case collective_kind::reduce: inner_.reduce(c.send, c.recv, c.count, c.type, c.op, c.root, s); break;
      case collective_kind::all_gather: inner_.all_gather(c.send, c.recv, c.count, c.type, s); break;
      case collective_kind::reduce_scatter: inner_.reduce_scatter(c.send, c.recv, c.count, c.type, c.op, s); break;
      case collective_kind::barrier: inner_.barrier(s); break;
      case collective_kind::all_reduce_exact:
        inner_.all_reduce_exact(c.send, c.terms, c.stride, c.recv, c.count, c.type,
                                std::span<const std::size_t>(c.ends, c.tensors), s);
        break;
    }
  }
  void abort(const std::string& reason) noexcept override { inner_.abort(reason); }
  void synchronize(stream_ref s) override { inner_.synchronize(s); }
  void rethrow_failure() override { inner_.check(); }

 private:
  communicator_ref inner_;
  std::vector<dtype>* reduced_;
};
}  // namespace in_type

TEST_P(zero_test, on_a_communicator_that_adds_in_the_type_f16_and_bf16_are_reduce_scattered_in_fp32) {
  if (kind() != device_kind::host) GTEST_SKIP() << "the recording communicator wraps a host clique";
  if (!require_devices(3)) return;
  // issue 28, item 3: on NCCL (reduces_in_f32() false) ZeRO widens f16/bf16 buckets into fp32 for the
  // reduce-scatter, so every reduction is f32 (i64: the rows) and the bits are DDP's, as on host cliques
  for (const dtype precision : {dtype::f16, dtype::bf16}) {
    recipe r{.precision = precision, .clip = 1.0f};
    const auto ddp = train_recipe_threads(devices(3), 130, r);
    for (const int zero : {1, 2, 3}) {
      r.zero = zero;
      std::vector<std::vector<dtype>> reduced(3);
      std::vector<recipe_result> sharded(3);
      run_on_devices(devices(3), [&](rank_context& rc) {
        const auto u = static_cast<std::size_t>(rc.rank());
        const communicator comm =
            communicator::from_impl(std::make_unique<in_type::recording_comm>(rc.comm(), &reduced[u]));
        sharded[u] = train_recipe_rank(comm, rc.compute_stream(), rc.comm_stream(), 130, r);
      });
      for (std::size_t rank = 0; rank < 3; ++rank) {
        SCOPED_TRACE(testing::Message() << name_of(precision) << ", ZeRO-" << zero << ", rank " << rank);
        ASSERT_FALSE(reduced[rank].empty());
        for (const dtype t : reduced[rank]) EXPECT_TRUE(t == dtype::f32 || t == dtype::i64) << name_of(t);
        EXPECT_EQ(sharded[rank].parameters, ddp[0].parameters);
        EXPECT_EQ(sharded[rank].skipped_steps, ddp[0].skipped_steps);
      }
    }
  }
}

TEST_P(zero_test, no_sync_micro_batches_and_clipping_agree_with_ddp) {
  if (!require_devices(3)) return;
  // no_sync: stage 1 accumulates whole gradients as DDP does (the same bits); stage 2 reduces every micro-batch
  // and adds the sums (the same sum, rounded in another order)
  recipe r{.precision = dtype::f32, .adamw = true, .micro_batches = 2};
  const auto ddp = train_recipe_threads(devices(3), 130, r);
  r.zero = 1;
  EXPECT_EQ(train_recipe_threads(devices(3), 130, r)[2].parameters, ddp[0].parameters);
  r.zero = 2;
  EXPECT_LE(relative_difference(train_recipe_threads(devices(3), 130, r)[1].parameters, ddp[0].parameters), 1e-5);
  // clipping: the norm over the ranks' shards (one all-reduce) is DDP's norm
  r = recipe{.precision = dtype::f16, .adamw = true, .clip = 0.05f};
  const auto clipped = train_recipe_threads(devices(3), 130, r);
  ASSERT_GT(clipped[0].norm, 0.05f) << "the test must clip";
  for (int zero : {1, 2, 3}) {
    r.zero = zero;
    const auto sharded = train_recipe_threads(devices(3), 130, r);
    for (const auto& rank : sharded) {
      // (ZeRO-3's buckets keep a layer whole: other shards, so the squares are summed in another order)
      EXPECT_LE(std::abs(rank.norm - clipped[0].norm), (zero == 3 ? 1e-4 : 1e-6) * clipped[0].norm) << "ZeRO-" << zero;
      EXPECT_LE(relative_difference(rank.parameters, clipped[0].parameters), 1e-5) << "ZeRO-" << zero;
    }
  }
}

// ddp_options::host_collectives: the collectives of host devices on the compute stream instead of the communication
// stream are the same collectives in the same order, so every mode gives the same bits; GPUs ignore the option.
// Strict host devices (the tests') imitate GPUs: automatic keeps the communication stream there.
TEST_P(zero_test, collectives_on_the_compute_stream_give_the_communication_streams_bits_in_every_mode) {
  if (!require_devices(3)) return;
  const std::vector<recipe> recipes = {
      recipe{.precision = dtype::f32},
      recipe{.precision = dtype::bf16, .micro_batches = 2},  // plain DDP: gradients in their own type, no_sync
      recipe{.precision = dtype::f16, .adamw = true, .clip = 0.05f},
      recipe{.precision = dtype::f16, .adamw = true, .zero = 1, .clip = 0.05f},
      recipe{.precision = dtype::bf16, .zero = 2, .micro_batches = 2},
      recipe{.precision = dtype::f32, .adamw = true, .zero = 2, .deterministic = deterministic_options{.chunk_rows = 16}},
      recipe{.precision = dtype::f32, .deterministic = deterministic_options{.chunk_rows = 16},
             .global = global_batch::told},
  };
  for (recipe r : recipes) {
    const std::string what = detail::concat("ZeRO-", r.zero, " ", name_of(r.precision), r.adamw ? " AdamW" : " SGD",
                                    r.deterministic ? " deterministic" : "", " micro-batches ", r.micro_batches);
    const auto automatic = train_recipe_threads(devices(3), 130, r);
    r.collectives = host_collective_stream::communication_stream;
    const auto apart = train_recipe_threads(devices(3), 130, r);
    r.collectives = host_collective_stream::compute_stream;
    const auto together = train_recipe_threads(devices(3), 130, r);
    ASSERT_NE(apart[0].parameters, initial_parameters(dev(0))) << what << ": the run must train";
    for (std::size_t rank = 0; rank < 3; ++rank) {
      EXPECT_FALSE(automatic[rank].collectives_on_compute_stream) << what << ": strict devices keep two streams";
      EXPECT_FALSE(apart[rank].collectives_on_compute_stream) << what;
      EXPECT_EQ(together[rank].collectives_on_compute_stream, kind() == device_kind::host) << what << ", rank " << rank;
      EXPECT_EQ(together[rank].parameters, apart[rank].parameters) << what << ", rank " << rank;
      EXPECT_EQ(together[rank].optimizer_state, apart[rank].optimizer_state) << what << ", rank " << rank;
      EXPECT_EQ(together[rank].skipped_steps, apart[rank].skipped_steps) << what << ", rank " << rank;
      EXPECT_EQ(together[rank].norm, apart[rank].norm) << what << ", rank " << rank;
      if (kind() == device_kind::host) {
        EXPECT_EQ(automatic[rank].parameters, apart[rank].parameters) << what;
      }
    }
  }
}

// host_collective_stream::automatic's rule: the compute stream below two cores per rank sharing them; a process
// whose affinity mask covers the machine shares it with every rank there, one bound to fewer cores (mpirun's
// binding, taskset) with the ranks in the process.
TEST(host_collectives, automatic_takes_the_compute_stream_below_two_cores_per_rank_sharing_them) {
  using detail::collectives_on_compute;
  // threads: every rank in the process, the whole machine
  EXPECT_TRUE(collectives_on_compute(/*mask*/ 2, /*online*/ 2, /*in process*/ 2, /*on machine*/ 2));
  EXPECT_TRUE(collectives_on_compute(3, 3, 2, 2));
  EXPECT_FALSE(collectives_on_compute(4, 4, 2, 2));
  EXPECT_FALSE(collectives_on_compute(64, 64, 4, 4));
  EXPECT_TRUE(collectives_on_compute(1, 64, 2, 2));  // taskset -c 0
  // processes without binding: the machine's cores over every process on it
  EXPECT_TRUE(collectives_on_compute(8, 8, 1, 6));
  EXPECT_FALSE(collectives_on_compute(8, 8, 1, 4));
  // processes bound to their own cores: this process's cores for its one rank
  EXPECT_TRUE(collectives_on_compute(1, 64, 1, 2));
  EXPECT_FALSE(collectives_on_compute(2, 64, 1, 32));
}

TEST_P(zero_test, overflowing_f16_steps_are_skipped_on_every_rank_as_ddp_skips_them) {
  if (!require_devices(3)) return;
  // a loss scale of 2^24 overflows f16 gradients: the scaler skips steps and backs off until they fit; each rank
  // checks its own shard, and the verdict is all-reduced, so every rank skips the same steps as DDP
  for (const bool use_adamw : {false, true}) {
    recipe r{.precision = dtype::f16, .adamw = use_adamw, .initial_scale = 16777216.0f};
    const auto ddp = train_recipe_threads(devices(3), 130, r);
    ASSERT_GE(ddp[0].skipped_steps, 2) << "the test must overflow";
    ASSERT_LT(ddp[0].skipped_steps, steps - 5) << "and then train";
    for (int zero : {1, 2, 3}) {
      r.zero = zero;
      const auto sharded = train_recipe_threads(devices(3), 130, r);
      for (int rank = 0; rank < 3; ++rank) {
        const auto& mine = sharded[static_cast<std::size_t>(rank)];
        EXPECT_EQ(mine.skipped_steps, ddp[0].skipped_steps) << "ZeRO-" << zero << ", rank " << rank;
        if (kind() == device_kind::host) {
          EXPECT_EQ(mine.parameters, ddp[0].parameters) << "ZeRO-" << zero;
        } else {  // NCCL's reduce-scatter and all-reduce orders (see above)
          EXPECT_LE(relative_difference(mine.parameters, ddp[0].parameters), 1e-2) << "ZeRO-" << zero;
        }
      }
    }
  }
}

// Deterministic mode under ZeRO: the bits of DDP on one rank (which are one device's), whatever the number of
// ranks, the stage, the precision or the optimizer, with micro-batches too (ZeRO-2 adds them into its shards'
// exact sums). And plain DDP told the global batch, which gathers the partial gradients where they fit: after
// no_sync micro-batches every rank adds to the exact sums instead, also a rank that had no rows in them (4 ranks,
// 3 rows, chunks of 1: rank 3 has none).
TEST_P(zero_test, deterministic_zero_1_and_2_give_the_bits_of_one_device_on_2_3_and_4_ranks) {
  if (!require_devices(4)) return;
  struct mix {
    dtype precision;
    bool adamw;
    std::int64_t batch, chunk;
    int micro_batches;
  };
  for (const mix& m : {mix{dtype::f32, false, 130, 16, 1}, mix{dtype::f16, true, 100, 32, 1},
                       mix{dtype::bf16, false, 64, 8, 2}, mix{dtype::f32, true, 3, 1, 1}, mix{dtype::f32, true, 3, 1, 2}}) {
    recipe r{.precision = m.precision, .adamw = m.adamw, .micro_batches = m.micro_batches,
             .deterministic = deterministic_options{.chunk_rows = m.chunk}};
    const auto one = train_recipe_threads(devices(1), m.batch, r);
    ASSERT_NE(one[0].parameters, initial_parameters(dev(0))) << "the run must train";
    for (int zero : {0, 1, 2, 3}) {
      r.zero = zero;
      r.global = zero == 0 ? global_batch::told : global_batch::not_told;
      for (int k = 2; k <= 4; ++k) {
        const std::int64_t slots = (deterministic_shard(m.batch, m.chunk, 0, k).rows + m.chunk - 1) / m.chunk;
        // host cliques sum the slots where they are (all_reduce_exact): a rank holds its own only
        const std::int64_t held = dev(0).is_host() ? slots : k * slots;
        const bool gathers = zero == 0 && m.micro_batches == 1 &&
                             static_cast<std::size_t>(held) * size_of(m.precision) <= 16;
        const auto ranks = train_recipe_threads(devices(k), m.batch, r);
        for (int rank = 0; rank < k; ++rank) {
          const auto& mine = ranks[static_cast<std::size_t>(rank)];
          const std::string what = "ZeRO-" + std::to_string(zero) + ", " + std::string(name_of(m.precision)) + " batch " +
                                   std::to_string(m.batch) + ", rank " + std::to_string(rank) + " of " + std::to_string(k);
          EXPECT_EQ(mine.parameters, one[0].parameters) << what;
          EXPECT_EQ(mine.optimizer_state, one[0].optimizer_state) << what;
          EXPECT_EQ(mine.gathered_partials, gathers) << what;
        }
      }
    }
  }
}

// A layer_norm's and a convolution's parameter gradients are sums over rows like a linear layer's, and a synchronized
// batch_norm's statistics exact sums over the ranks (collectives on the communication stream among ZeRO's gathers and
// the buckets'): deterministic DDP and ZeRO give the bits of one device with each (and with the small CNN), in f32 and
// bf16, told the global batch (partials gathered) or not.
TEST_P(zero_test, deterministic_mode_with_normalization_gives_the_bits_of_one_device_on_2_3_and_4_ranks) {
  if (!require_devices(4)) return;
  for (const auto& [variant, precision] :
       {std::pair{model_variant::layer_norm, dtype::f32}, std::pair{model_variant::layer_norm, dtype::bf16},
        std::pair{model_variant::sync_batch_norm, dtype::f32}, std::pair{model_variant::sync_batch_norm, dtype::bf16},
        std::pair{model_variant::cnn, dtype::f32}, std::pair{model_variant::cnn, dtype::bf16}}) {
    recipe r{.precision = precision, .adamw = true, .deterministic = deterministic_options{.chunk_rows = 16},
             .variant = variant};
    const auto one = train_recipe_threads(devices(1), 100, r);
    for (int zero : {0, 1, 2, 3}) {
      r.zero = zero;
      for (const global_batch global : {global_batch::not_told, global_batch::told}) {
        if (zero != 0 && global == global_batch::told) continue;
        r.global = global;
        for (int k = 2; k <= 4; ++k) {
          const auto ranks = train_recipe_threads(devices(k), 100, r);
          for (int rank = 0; rank < k; ++rank) {
            EXPECT_EQ(ranks[static_cast<std::size_t>(rank)].parameters, one[0].parameters)
                << name_of(precision) << " variant " << static_cast<int>(variant) << " ZeRO-" << zero << " told "
                << (global == global_batch::told) << ", rank "
                << rank << " of " << k;
          }
        }
      }
    }
  }
}

TEST_P(zero_test, names_what_a_sharded_rank_cannot_do) {
  if (!require_devices(2)) return;
  std::vector<std::string> messages(8);
  run_on_devices(devices(2), [&](rank_context& rc) {
    const stream_ref s = rc.compute_stream();
    context ctx(s, dtype::f16);
    graph model = make_model(ctx);
    auto params = parameters_of(model).pointers();
    adamw early(params, adamw_options{});
    early.step(s);  // state for whole parameters, before the wrapper shards them
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(), ddp_options{.zero = zero_stage::gradients});
    EXPECT_EQ(ddp.zero(), zero_stage::gradients);
    softmax_cross_entropy loss(reduction::mean);
    tensor x(shape{4, features}, dtype::f16, s);
    fill_zero(x.bytes(), s);
    tensor y = device_labels({1, 2, 3, 4}, s);
    loss.forward(ddp.forward(x), y, ctx);
    ddp.backward(loss.backward(ctx));
    context scaled(s);  // the gradients set below stand for a backward that read the scale
    loss_scaler scaler(scaled);
    gradient_clipper clip(s);
    if (rc.rank() != 0) return;
    messages[0] = message_of<precondition_error>([&] { (void)params[0]->value(); });
    messages[1] = message_of<precondition_error>([&] { (void)model.forward(x, ctx); });
    messages[2] = message_of<precondition_error>([&] { scaler.unscale_and_check(params, s); });
    messages[3] = message_of<precondition_error>([&] { (void)clip.clip_grad_norm(params, {}, s); });
    messages[4] = message_of<precondition_error>([&] { early.step(s); });
    adamw late(params, adamw_options{});
    stream other(s.get_device());
    messages[5] = message_of<precondition_error>([&] { late.step(other); });  // (ZeRO orders on ctx.stream())
  });
  EXPECT_CONTAINS(messages[0], "ZeRO shards it over the ranks: this rank updates elements [");
  EXPECT_CONTAINS(messages[0], "and keeps only their fp32 master values");
  EXPECT_CONTAINS(messages[0], "consolidated(optimizer)");
  EXPECT_CONTAINS(messages[1], "stale");
  EXPECT_CONTAINS(messages[1], "gather_parameters()");
  EXPECT_CONTAINS(messages[2], "pass the communicator so that every rank skips the same steps");
  EXPECT_CONTAINS(messages[3], "so that the norm covers every rank's shard");
  EXPECT_CONTAINS(messages[4], "before distributed_data_parallel sharded the parameters");
  EXPECT_CONTAINS(messages[5], "an optimizer step on another stream of");
  EXPECT_CONTAINS(messages[5], "step on the context's stream, ctx.stream()");
  for (const auto& [options, expected] :
       {std::pair{ddp_options{.zero = static_cast<zero_stage>(4)}, "ZeRO stage must be 0 (plain DDP), 1"},
        std::pair{ddp_options{.hook = comm_hook::fp16, .zero = zero_stage::optimizer_state}, "cannot be combined with a comm hook"}}) {
    const auto o = options;
    EXPECT_CONTAINS(message_of<error>([&] {
                      run_on_devices(devices(2), [&](rank_context& rc) {
                        context ctx(rc.compute_stream());
                        graph model = make_model(ctx);
                        distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(), o);
                      });
                    }),
                    expected);
  }
}

// The model used between backward and the step (gather_parameters(), then an evaluation outside the wrapper): the
// values gathered there are stale after the step, so the next forward gathers again and training keeps DDP's bits
// (it trained on rank-local stale values before parameter::before_update), in every precision (f16/bf16: the step
// writes the working shard, which the held copy must not shadow). A step inside consolidated() is refused.
TEST_P(zero_test, the_model_used_between_backward_and_the_step_keeps_the_bits_of_ddp) {
  if (!require_devices(2)) return;
  auto train = [&](int zero, dtype precision) {
    std::vector<std::vector<float>> out(2);
    std::vector<std::string> refused(2);
    run_on_devices(devices(2), [&](rank_context& rc) {
      const stream_ref s = rc.compute_stream();
      context ctx(s, precision);
      graph model = make_model(ctx);
      distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(), ddp_options{.zero = to_zero_stage(zero)});
      sgd opt(parameters_of(model).pointers(), optimizer_options);
      softmax_cross_entropy loss(reduction::mean);
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        const std::int64_t begin = first_row(step, 64) + 32 * rc.rank();
        tensor xf = device_tensor(slice(inputs(), begin, 32, features), shape{32, features}, s);
        tensor x(shape{32, features}, precision, s);
        detail::convert_floating(xf, x, s);
        tensor y = device_labels(slice(labels(), begin, 32, 1), s);
        loss.forward(ddp.forward(x), y, ctx, 64);
        ddp.backward(loss.backward(ctx));
        ddp.gather_parameters();
        (void)model.forward(x, ctx);
        opt.step(s);
      }
      auto whole = ddp.consolidated(opt);
      const auto r = static_cast<std::size_t>(rc.rank());
      out[r] = parameter_values(model, s);
      if (zero > 0) refused[r] = message_of<precondition_error>([&] { opt.step(s); });
    });
    if (zero > 0) {
      for (const auto& m : refused) EXPECT_CONTAINS(m, "step after the consolidation's guard ends");
    }
    return out;
  };
  for (const dtype precision : {dtype::f32, dtype::f16, dtype::bf16}) {
    const auto plain = train(0, precision);
    for (int zero : {1, 2, 3}) {
      const auto sharded = train(zero, precision);
      EXPECT_EQ(sharded[0], plain[0]) << "ZeRO-" << zero << ", " << name_of(precision);
      EXPECT_EQ(sharded[1], plain[0]) << "ZeRO-" << zero << ", " << name_of(precision);
    }
  }
}

// Values loaded while ZeRO-3 holds the whole values gathered: the load writes the values shard and the held copy,
// so the model reads the loaded values without another gather (DDP's output), in every precision.
TEST_P(zero_test, stage_3_loads_into_the_values_it_holds_gathered) {
  if (!require_devices(2)) return;
  auto output_after_load = [&](int zero, dtype precision) {
    std::vector<std::vector<float>> out(2);
    run_on_devices(devices(2), [&](rank_context& rc) {
      const stream_ref s = rc.compute_stream();
      context ctx(s, precision);
      graph model = make_model(ctx);
      distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(), ddp_options{.zero = to_zero_stage(zero)});
      tensor xf = device_tensor(slice(inputs(), 0, 8, features), shape{8, features}, s);
      tensor x(shape{8, features}, precision, s);
      detail::convert_floating(xf, x, s);
      ddp.gather_parameters();  // held whole (ZeRO-3: until a synchronized backward)
      for (const auto& np : parameters_of(model)) {
        std::vector<float> values(static_cast<std::size_t>(np.param->numel()));
        for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.01f * static_cast<float>(i % 37) - 0.15f;
        tensor full = device_tensor(values, shape{np.param->numel()}, s);
        np.param->load_values(full.view(), s);
      }
      const auto y = model.forward(x, ctx);
      tensor yf(y.dims(), dtype::f32, s);
      detail::convert_floating(y, yf, s);
      out[static_cast<std::size_t>(rc.rank())] = to_vector(yf.span<const float>(), s);
    });
    return out;
  };
  for (const dtype precision : {dtype::f32, dtype::bf16}) {
    const auto plain = output_after_load(0, precision);
    const auto sharded = output_after_load(3, precision);
    EXPECT_EQ(sharded[0], plain[0]) << name_of(precision);
    EXPECT_EQ(sharded[1], plain[0]) << name_of(precision);
  }
}

// ZeRO-3 gathers a graph's values layer by layer (FSDP's schedule: parallel/detail/gathered_values.hpp): a step holds
// this rank's shard and the values of a few layers, not the model's, and trains to the bits of ZeRO-2 and of a whole
// gather (a model that does not report its layers: the same graph behind any_layer), also with a forward without a
// backward (an evaluation) before a step's.
TEST_P(zero_test, stage_3_gathers_layer_by_layer_and_holds_a_few_layers_at_the_step_peak) {
  if (!require_devices(3)) return;
  constexpr std::int64_t width = 96, rows = 8;  // per rank
  const auto build = [](context& ctx) {  // 12 hidden layers of 37 KB: 459 KB of values
    initializer init(seed);
    graph g(shape{features});
    g.add("in", linear(features, width, ctx, init), "input");
    std::string previous = "in";
    for (int i = 0; i < 12; ++i) {
      const std::string act = "act" + std::to_string(i), fc = "fc" + std::to_string(i);
      g.add(act, relu(), previous).add(fc, linear(width, width, ctx, init), act);
      previous = fc;
    }
    g.add("out", linear(width, classes, ctx, init), previous);
    return g;
  };
  enum form : std::uint8_t { stage_2, by_layer, whole, forms };
  std::vector<float> values[forms][3];
  std::uint64_t peak[forms][3] = {}, held[forms][3] = {}, gathered[forms][3] = {};
  std::uint64_t value_bytes = 0;
  const auto train = [&]<class Model>(rank_context& rc, context& ctx, Model& model, form f) {
    const stream_ref s = ctx.stream();
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(),
                                  ddp_options{.bucket_bytes = 1024, .first_bucket_bytes = 512,
                                              .zero = f == stage_2 ? zero_stage::gradients : zero_stage::parameters});
    const parameter_list params = parameters_of(model);
    sgd opt(params.pointers(), optimizer_options);
    softmax_cross_entropy loss(reduction::mean);
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      const std::int64_t begin = first_row(step, 3 * rows) + rows * rc.rank();
      tensor x = device_tensor(slice(inputs(), begin, rows, features), shape{rows, features}, s);
      tensor y = device_labels(slice(labels(), begin, rows, 1), s);
      if (step == 1) (void)ddp.forward(x);  // an evaluation: its gathers, and none of its values kept
      loss.forward(ddp.forward(x), y, ctx, 3 * rows);
      ddp.backward(loss.backward(ctx));
      opt.step(s);
      if (step == 0) ddp.reset_report();  // the steps' peak, after the first one built what training keeps
    }
    const auto r = static_cast<std::size_t>(rc.rank());
    const device_report report = ddp.report();
    peak[f][r] = report.peak_bytes;
    held[f][r] = report.parameter_bytes;
    gathered[f][r] = report.gathered_peak_bytes;
    if (r == 0) value_bytes = static_cast<std::uint64_t>(params.numel()) * 4;  // (one writer: the ranks are threads)
    auto guard = ddp.consolidated(opt);
    values[f][r] = parameter_values(model, s);
  };
  for (const form f : {stage_2, by_layer, whole}) {
    run_on_devices(devices(3), [&](rank_context& rc) {
      const stream_ref s = rc.compute_stream();
      s.synchronize();
      release_cached_memory(rc.get_device());
      context ctx(s);
      if (f == whole) {
        any_layer model(build(ctx));
        train(rc, ctx, model, f);
      } else {
        graph model = build(ctx);
        train(rc, ctx, model, f);
      }
    });
  }
  for (std::size_t r = 0; r < 3; ++r) {
    SCOPED_TRACE(testing::Message() << "rank " << r << ": peaks " << peak[stage_2][r] << " (ZeRO-2), " << peak[by_layer][r]
                                    << " (by layer), " << peak[whole][r] << " (whole); values " << value_bytes);
    if (kind() == device_kind::cuda) {  // NCCL: other buckets, so other ranges summed in another order
      EXPECT_LE(relative_difference(values[by_layer][r], values[stage_2][0]), 1e-6);
      EXPECT_LE(relative_difference(values[whole][r], values[stage_2][0]), 1e-6);
    } else {
      EXPECT_EQ(values[by_layer][r], values[stage_2][0]);
      EXPECT_EQ(values[whole][r], values[stage_2][0]);
    }
    // between steps: the shards alone either way (in their buckets' layouts: a layer whole in one, or not)
    EXPECT_LT(held[by_layer][r], value_bytes * 2 / 5);
    EXPECT_LT(held[whole][r], value_bytes * 2 / 5);
    // the whole gather holds every value and the shard at once; layer by layer, about three layers of 37 KB
    EXPECT_LT(peak[by_layer][r] + value_bytes / 2, peak[whole][r]);
    EXPECT_LT(peak[by_layer][r] + value_bytes / 4, peak[stage_2][r]);
    // the report's gathered peak (the buckets' whole values held at once): a few layers, every value, nothing
    EXPECT_GE(gathered[by_layer][r], static_cast<std::uint64_t>(width * width) * 4);
    EXPECT_LE(gathered[by_layer][r], value_bytes / 3);
    EXPECT_GE(gathered[whole][r], value_bytes);
    EXPECT_EQ(gathered[stage_2][r], 0U);
  }
}

// ZeRO-3 layer by layer keeps every rank's collectives in step (a mismatch hangs or fails the clique): with a model of
// buffers (batch norm's, broadcast before each step's forward) over four buckets and a rank without rows (batch 6 on
// 4 ranks: it calls backward without forward, and replays the forward's gathers after the broadcast, as the others
// ran them), also with an evaluation's forward through the wrapper before each step, and with a consolidation
// between forward and backward (the values backward starts with gathered again) on ranks that all have rows: DDP's
// bits.
TEST_P(zero_test, stage_3_keeps_every_ranks_collectives_in_step_around_buffers_evaluations_and_consolidations) {
  if (!require_devices(4)) return;
  struct scenario {
    const char* name;
    std::int64_t batch;
    bool evaluate, consolidate;
  };
  for (const scenario c : {scenario{"a rank without rows", 6, false, false},
                           scenario{"an evaluation before each step", 6, true, false},
                           scenario{"a consolidation between forward and backward", 64, false, true}}) {
    SCOPED_TRACE(c.name);
    recipe r{.precision = dtype::f32, .adamw = true, .variant = model_variant::batch_norm, .evaluate = c.evaluate,
             .consolidate = c.consolidate};
    const auto ddp = train_recipe_threads(devices(4), c.batch, r);
    r.zero = 3;
    const auto sharded = train_recipe_threads(devices(4), c.batch, r);
    for (std::size_t rank = 0; rank < 4; ++rank) {
      if (kind() == device_kind::cuda) {
        EXPECT_LE(relative_difference(sharded[rank].parameters, ddp[0].parameters), 1e-6) << "rank " << rank;
      } else {
        EXPECT_EQ(sharded[rank].parameters, ddp[0].parameters) << "rank " << rank;
      }
    }
  }
}

// ZeRO-3 frees the whole values after a synchronized backward: the model used outside the wrapper says so and names
// gather_parameters(), after which it reads the gathered values (the wrapper's own forward's output).
TEST_P(zero_test, stage_3_names_the_gather_a_model_needs_outside_the_wrapper) {
  if (!require_devices(2)) return;
  std::vector<std::string> messages(4);  // per rank: before the first forward, after backward
  std::vector<std::vector<float>> outputs(2), after_gather(2);
  run_on_devices(devices(2), [&](rank_context& rc) {
    const stream_ref s = rc.compute_stream();
    context ctx(s);
    graph model = make_model(ctx);
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(), ddp_options{.zero = zero_stage::parameters});
    EXPECT_EQ(ddp.zero(), zero_stage::parameters);
    const auto r = static_cast<std::size_t>(rc.rank());
    messages[2 * r] = message_of<precondition_error>([&] { (void)parameters_of(model)[0].param->compute_value(); });
    softmax_cross_entropy loss(reduction::mean);
    tensor x = device_tensor(slice(inputs(), 0, 4, features), shape{4, features}, s);
    tensor y = device_labels({1, 2, 3, 4}, s);
    outputs[r] = to_vector(ddp.forward(x).span<const float>(), s);
    loss.forward(ddp.forward(x), y, ctx);
    ddp.backward(loss.backward(ctx));
    messages[2 * r + 1] = message_of<precondition_error>([&] { (void)model.forward(x, ctx); });
    ddp.gather_parameters();
    after_gather[r] = to_vector(model.forward(x, ctx).span<const float>(), s);
  });
  for (const auto& m : messages) {
    EXPECT_CONTAINS(m, "ZeRO-3 keeps only this rank's shard of its values between steps");
    EXPECT_CONTAINS(m, "gather_parameters()");
  }
  EXPECT_EQ(outputs[1], outputs[0]);
  EXPECT_EQ(after_gather[0], outputs[0]);  // no step between: the same values
  EXPECT_EQ(after_gather[1], outputs[0]);
}

// A model built inside a deferred_master_values scope: its f16/bf16 parameters hold the working copy alone, with the
// bits of a whole build, its f32 parameters nothing but the recipe (forward says what to do); their masters come
// whole on demand, with the same bits; reading them before says what to do; an optimizer on the bare model names the
// fix.
TEST_P(zero_test, deferred_master_values_give_the_bits_of_a_whole_build_and_name_what_needs_them) {
  if (!require_devices(1)) return;
  stream s(dev(0));
  for (const dtype type : {dtype::f16, dtype::bf16, dtype::f32}) {
    SCOPED_TRACE(name_of(type));
    context ctx(s, type);
    graph whole = make_model(ctx, seed, model_variant::batch_norm);
    graph deferred = [&] {
      deferred_master_values scope;
      return make_model(ctx, seed, model_variant::batch_norm);
    }();
    const parameter_list a = parameters_of(whole), b = parameters_of(deferred);
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t k = 0; k < a.size(); ++k) {
      parameter& p = *b[k].param;
      SCOPED_TRACE(b[k].name);
      EXPECT_TRUE(p.masters_deferred());
      EXPECT_TRUE(p.grad().empty());  // its memory comes with the master values (or a wrapper's buckets)
      EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)p.begin_accumulate(); }),
                      "backward (its gradient, whose memory comes with them) needs its fp32 master values, which are "
                      "deferred");
      if (type == dtype::f32) {
        EXPECT_TRUE(p.working().empty());  // nothing on the device
        const std::string m = message_of<precondition_error>([&] { (void)p.compute_value(); });
        EXPECT_CONTAINS(m, "forward (compute_value()) needs its fp32 master values, which are deferred");
        EXPECT_CONTAINS(m, "zero_stage::parameters (an f32 model: forward reads them)");
      } else {
        EXPECT_EQ(to_vector(p.working().bytes(), s), to_vector(a[k].param->working().bytes(), s));
      }
      // the recipe gives the same values in any split
      std::vector<float> parts(static_cast<std::size_t>(p.numel()));
      const std::int64_t mid = p.numel() / 2;
      p.initial_values_of(0, std::span<float>(parts).first(static_cast<std::size_t>(mid)));
      p.initial_values_of(mid, std::span<float>(parts).subspan(static_cast<std::size_t>(mid)));
      EXPECT_EQ(parts, to_vector(a[k].param->value().span<const float>(), s));
      EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)p.value(); }),
                      "needs its fp32 master values, which are deferred");
      const parameter copy = p.clone(s);  // deferred too: the recipe and the working copy
      EXPECT_TRUE(copy.masters_deferred());
      if (type != dtype::f32) {
        EXPECT_EQ(to_vector(copy.working().bytes(), s), to_vector(a[k].param->working().bytes(), s));
      }
      p.materialize_masters(s);
      EXPECT_FALSE(p.masters_deferred());
      EXPECT_EQ(p.grad().numel(), p.numel());
      EXPECT_EQ(p.grad().type(), type);
      EXPECT_EQ(to_vector(p.value().span<const float>(), s), to_vector(a[k].param->value().span<const float>(), s));
      EXPECT_EQ(to_vector(p.compute_value().bytes(), s), to_vector(a[k].param->compute_value().bytes(), s));
    }
  }
  // a parameter larger than one chunk of the working copy's writes (detail::initial_values_chunk elements), in f16:
  // the chunks' bits are the whole cast's; then f32, which needs the master values
  const shape large{1025, 1024};
  ASSERT_GT(large.numel(), detail::initial_values_chunk);
  initializer init_whole(seed), init_deferred(seed);
  parameter whole_large("weight", large, s, dtype::f16);
  init_whole.uniform(whole_large, 0.5f, s);
  parameter deferred_large = [&] {
    deferred_master_values scope;
    return parameter("weight", large, s, dtype::f16);
  }();
  init_deferred.uniform(deferred_large, 0.5f, s);
  EXPECT_TRUE(deferred_large.masters_deferred());
  EXPECT_EQ(to_vector(deferred_large.working().bytes(), s), to_vector(whole_large.working().bytes(), s));
  deferred_large.set_compute_type(dtype::f32, s);
  EXPECT_FALSE(deferred_large.masters_deferred());
  EXPECT_EQ(to_vector(deferred_large.value().span<const float>(), s), to_vector(whole_large.value().span<const float>(), s));

  context ctx(s, dtype::bf16);
  graph deferred = [&] {
    deferred_master_values scope;
    return make_model(ctx);
  }();
  EXPECT_CONTAINS(message_of<precondition_error>([&] {
                    sgd opt(parameters_of(deferred).pointers(), optimizer_options);
                    opt.step(s);
                  }),
                  "wrap the model in distributed_data_parallel with zero_stage::optimizer_state, gradients or parameters");
}

// As for a model built whole, every rank starts from rank 0's values: the ranks build under deferred_master_values
// from other seeds, and the wrapper streams rank 0's recipe (in chunks of 16 values) into every rank's shard of the
// master values and its whole working copy (ZeRO-3: its shard of it, gathered; f32 below ZeRO-3: whole masters
// first, broadcast from rank 0). A rank built whole among deferred ones is named.
TEST_P(zero_test, deferred_master_values_of_rank_0_reach_every_ranks_shards_and_working_copies) {
  if (!require_devices(3)) return;
  for (const dtype type : {dtype::f16, dtype::bf16, dtype::f32}) {
    for (const int zero : {1, 2, 3}) {
      SCOPED_TRACE(testing::Message() << name_of(type) << ", ZeRO-" << zero);
      std::vector<std::vector<float>> values(3);
      std::vector<std::vector<std::uint8_t>> working(3);
      std::vector<float> expected_values;
      std::vector<std::uint8_t> expected_working;
      run_on_devices(devices(3), [&](rank_context& rc) {
        const auto r = static_cast<std::size_t>(rc.rank());
        const stream_ref s = rc.compute_stream();
        context ctx(s, type);
        if (r == 0) {  // the reference: rank 0's model built whole
          graph whole = make_model(ctx, seed, model_variant::batch_norm);
          expected_values = parameter_values(whole, s);
          for (const auto& p : parameters_of(whole)) {
            const auto bytes = to_vector(p.param->compute_value().bytes(), s);
            expected_working.insert(expected_working.end(), bytes.begin(), bytes.end());
          }
        }
        graph model = [&] {
          deferred_master_values scope;
          return make_model(ctx, seed + r, model_variant::batch_norm);
        }();
        distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(),
                                      ddp_options{.bucket_bytes = 1024, .first_bucket_bytes = 512,
                                                  .zero = to_zero_stage(zero), .visit_chunk_bytes = 64});
        if (zero == 3) ddp.gather_parameters();  // (ZeRO-3 keeps each rank's shard of the working copy)
        for (const auto& p : parameters_of(model)) {
          const auto bytes = to_vector(p.param->compute_value().bytes(), s);
          working[r].insert(working[r].end(), bytes.begin(), bytes.end());
        }
        sgd opt(parameters_of(model).pointers(), optimizer_options);
        auto guard = ddp.consolidated(opt);
        values[r] = parameter_values(model, s);
      });
      for (std::size_t r = 0; r < 3; ++r) {
        EXPECT_EQ(values[r], expected_values) << "rank " << r;
        EXPECT_EQ(working[r], expected_working) << "rank " << r;
      }
    }
  }
  EXPECT_CONTAINS(message_of<error>([&] {
                    run_on_devices(devices(2), [&](rank_context& rc) {
                      context ctx(rc.compute_stream(), dtype::bf16);
                      graph model = [&] {
                        std::optional<deferred_master_values> scope;
                        if (rc.rank() == 1) scope.emplace();
                        return make_model(ctx);
                      }();
                      distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(),
                                                    ddp_options{.zero = zero_stage::optimizer_state});
                    });
                  }),
                  "with deferred master values (built inside deferred_master_values)");
}

// A ZeRO wrapper around a model built under deferred_master_values writes only its shard of the fp32 master values:
// while the model is built and wrapped, no device holds more than its steady state plus small chunks (a parameter's
// fp32 staging, a bucket), where a whole build held every master value until the wrapper sharded them. The model
// built deferred holds its f16/bf16 working copy alone (f32: nothing), no gradient.
TEST_P(zero_test, a_model_built_with_deferred_master_values_is_sharded_without_whole_masters_on_any_device) {
  if (!require_devices(2)) return;
  const auto build = [](context& ctx) {
    initializer init(seed);
    graph g(shape{features});
    g.add("in", linear(features, 128, ctx, init), "input");
    std::string previous = "in";
    for (int i = 0; i < 6; ++i) {  // 99,072 parameters in 128x128 layers: fp32 staging of 66 KB at a time
      const std::string act = "act" + std::to_string(i), fc = "fc" + std::to_string(i);
      g.add(act, relu(), previous).add(fc, linear(128, 128, ctx, init), act);
      previous = fc;
    }
    g.add("out", linear(128, classes, ctx, init), previous);
    return g;
  };
  for (const dtype type : {dtype::f16, dtype::bf16, dtype::f32}) {
    for (const int zero : {1, 2, 3}) {
      if (type == dtype::f32 && zero < 3) continue;  // (below ZeRO-3 an f32 model's values are its whole masters)
      std::vector<std::uint64_t> transient(2), deferred_transient(2), masters(2), deferred_built(2);
      std::vector<std::vector<float>> values(2), deferred_values(2);
      run_on_devices(devices(2), [&](rank_context& rc) {
        const auto r = static_cast<std::size_t>(rc.rank());
        const stream_ref s = rc.compute_stream();
        for (const bool deferred : {false, true}) {
          s.synchronize();
          release_cached_memory(rc.get_device());
          reset_memory_stats(rc.get_device());
          context ctx(s, type);
          const std::uint64_t before = get_memory_stats(rc.get_device()).bytes_in_use;
          graph model = [&] {
            std::optional<deferred_master_values> scope;
            if (deferred) scope.emplace();
            return build(ctx);
          }();
          s.synchronize();
          if (deferred) deferred_built[r] = get_memory_stats(rc.get_device()).bytes_in_use - before;
          distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(),
                                        ddp_options{.bucket_bytes = 32 << 10, .first_bucket_bytes = 16 << 10,
                                                    .zero = to_zero_stage(zero), .visit_chunk_bytes = 4096});
          s.synchronize();
          const memory_stats m = get_memory_stats(rc.get_device());
          (deferred ? deferred_transient : transient)[r] = m.peak_bytes_in_use - m.bytes_in_use;
          masters[r] = static_cast<std::uint64_t>(parameters_of(model).numel()) * 4;
          adamw opt(parameters_of(model).pointers(), adamw_options{.lr = 0.01f});
          auto guard = ddp.consolidated(opt);
          (deferred ? deferred_values : values)[r] = parameter_values(model, s);
        }
      });
      for (std::size_t r = 0; r < 2; ++r) {
        SCOPED_TRACE(testing::Message() << name_of(type) << ", ZeRO-" << zero << ", rank " << r);
        EXPECT_EQ(deferred_values[r], values[0]);
        EXPECT_GE(transient[r], masters[r] / 2) << "a whole build holds every master value until the wrapper shards them";
        EXPECT_LT(deferred_transient[r], masters[r] / 4);
        const std::uint64_t working_copy = type == dtype::f32 ? 0 : masters[r] / 2;
        EXPECT_GE(deferred_built[r], working_copy);
        EXPECT_LT(deferred_built[r], working_copy + masters[r] / 8) << "a deferred build holds no whole gradient";
      }
    }
  }
}

// visit_master_values gives weights_sha256 the digest of the consolidated model without whole values on the device:
// its peak above what training holds stays below the model's master values (gathered through chunks of 200 bytes,
// also with the whole model in one bucket, against 5,480 bytes of masters), where consolidated() holds them all, and
// the optimizer state.
TEST_P(zero_test, weights_are_hashed_in_chunks_without_whole_values_on_any_device) {
  if (!require_devices(2)) return;
  for (const dtype type : {dtype::f32, dtype::bf16}) {
    for (const int zero : {0, 1, 2, 3}) {
      const std::size_t bucket = zero >= 2 ? std::size_t{1} << 20 : 512;  // ZeRO-2 and 3: the whole model in one bucket
      std::vector<std::string> streamed(2), whole(2);
      std::vector<std::uint64_t> streamed_peak(2), whole_peak(2), masters(2);
      run_on_devices(devices(2), [&](rank_context& rc) {
        const auto r = static_cast<std::size_t>(rc.rank());
        const stream_ref s = rc.compute_stream();
        context ctx(s, type);
        graph model = make_model(ctx);
        distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(),
                                      ddp_options{.bucket_bytes = bucket, .first_bucket_bytes = bucket / 2,
                                                  .zero = to_zero_stage(zero), .visit_chunk_bytes = 200});
        const parameter_list params = parameters_of(model);
        adamw opt(params.pointers(), adamw_options{.lr = 0.01f});
        train_steps(rc, ctx, ddp, opt, 0, 2);
        masters[r] = static_cast<std::uint64_t>(params.numel()) * 4;
        const auto measure = [&](const auto& hash) {
          s.synchronize();
          release_cached_memory(rc.get_device());
          reset_memory_stats(rc.get_device());
          const std::uint64_t in_use = get_memory_stats(rc.get_device()).bytes_in_use;
          std::string digest = hash();
          return std::pair{std::move(digest), get_memory_stats(rc.get_device()).peak_bytes_in_use - in_use};
        };
        std::tie(streamed[r], streamed_peak[r]) =
            measure([&] { return weights_sha256(params, s, [&](const auto& f) { ddp.visit_master_values(f); }); });
        std::tie(whole[r], whole_peak[r]) = measure([&] {
          auto guard = ddp.consolidated(opt);
          return weights_sha256(params, s);
        });
      });
      for (std::size_t r = 0; r < 2; ++r) {
        SCOPED_TRACE(testing::Message() << name_of(type) << ", ZeRO-" << zero << ", rank " << r);
        EXPECT_EQ(streamed[r], whole[0]);
        EXPECT_EQ(whole[r], whole[0]);
        if (zero == 0) continue;  // (plain DDP: whole already, neither allocates)
        EXPECT_LT(streamed_peak[r], masters[r] * 3 / 4);
        EXPECT_GE(whole_peak[r], masters[r]);
      }
    }
  }
}

namespace {

// Per rank, for the checkpoint test below: the parameters trained on straight and after a load, and the save's peak.
struct streamed_save_result {
  std::vector<float> straight, resumed;
  std::uint64_t save_peak = 0, masters = 0;
};

// Trains 2 steps under ZeRO-`zero` in `type` with an optimizer made by make_opt(params), saves under `root` streamed
// ("streamed", checkpoint_state::sharded) and consolidated ("consolidated"), trains 2 more; then a new model (other
// initial values), wrapper and optimizer load the streamed checkpoint (each rank its own range) and train the same 2.
template <class MakeOptimizer>
streamed_save_result save_streamed_and_resume(rank_context& rc, dtype type, int zero, const std::filesystem::path& root,
                                              MakeOptimizer&& make_opt) {
  streamed_save_result out;
  const stream_ref s = rc.compute_stream();
  // streamed through chunks of 200 bytes (25 floats per rank: the ranges end inside a chunk); ZeRO-2 and 3 with the whole
  // model in one bucket, ZeRO-1 in buckets of 512 bytes
  const std::size_t bucket = zero >= 2 ? std::size_t{1} << 20 : 512;
  const ddp_options options{.bucket_bytes = bucket, .first_bucket_bytes = bucket / 2, .zero = to_zero_stage(zero),
                            .visit_chunk_bytes = 200};
  const auto train = [&](context& ctx, distributed_data_parallel<graph>& ddp, auto& opt, int from, int to) {
    train_steps(rc, ctx, ddp, opt, from, to);
  };
  context ctx(s, type);
  graph model = make_model(ctx);
  distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(), options);
  auto opt = make_opt(parameters_of(model).pointers());
  train(ctx, ddp, opt, 0, 2);
  out.masters = static_cast<std::uint64_t>(parameters_of(model).numel()) * 4;
  checkpoint_state streamed(parameters_of(model));
  streamed.optimizer(opt).sharded([&](const auto& f) { ddp.visit_whole_state(opt, f); });
  streamed.position.step = 2;
  streamed.position.precision = type;
  s.synchronize();
  release_cached_memory(rc.get_device());
  reset_memory_stats(rc.get_device());
  const std::uint64_t in_use = get_memory_stats(rc.get_device()).bytes_in_use;
  checkpointer(root / "streamed").save(streamed, s, rc.comm());
  out.save_peak = get_memory_stats(rc.get_device()).peak_bytes_in_use - in_use;
  {
    auto whole = ddp.consolidated(opt);
    checkpoint_state st(parameters_of(model));
    st.optimizer(opt);
    st.position.step = 2;
    st.position.precision = type;
    checkpointer(root / "consolidated").save(st, s, rc.comm());
  }
  train(ctx, ddp, opt, 2, 4);
  {
    auto whole = ddp.consolidated(opt);
    out.straight = parameter_values(model, s);
  }
  context ctx2(s, type);
  graph model2 = make_model(ctx2, seed + 1);
  distributed_data_parallel ddp2(model2, ctx2, rc.comm(), rc.comm_stream(), options);
  auto opt2 = make_opt(parameters_of(model2).pointers());
  checkpoint_state loaded(parameters_of(model2));
  loaded.optimizer(opt2);
  (void)load_checkpoint(root / "streamed", loaded, s);
  EXPECT_EQ(loaded.position.step, 2);
  train(ctx2, ddp2, opt2, 2, 4);
  auto whole = ddp2.consolidated(opt2);
  out.resumed = parameter_values(model2, s);
  return out;
}

}  // namespace

// A checkpoint saved under ZeRO streams its whole tensors to rank 0 through the host (checkpoint_state::sharded with
// visit_whole_state): the files hold the bytes of a consolidated save, the save's device peak above training stays
// below the model's master values (gathered in chunks, also with the model in one bucket; AdamW's state is twice as
// large again), and each rank of a new wrapper loads its own range, without a collective: training on from it gives
// the bits of training on. AdamW and SGD with momentum, f32 and bf16, ZeRO-1 and 2.
TEST_P(zero_test, checkpoints_stream_whole_tensors_to_the_writer_and_load_each_ranks_range) {
  if (!require_devices(2)) return;
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("lockstep_test_zero." + std::to_string(::getpid()));
  const auto file_bytes = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  for (const auto& [type, zero, adam] : {std::tuple{dtype::f32, 1, true}, std::tuple{dtype::f32, 2, false},
                                         std::tuple{dtype::bf16, 1, false}, std::tuple{dtype::bf16, 2, true},
                                         std::tuple{dtype::f32, 3, true}, std::tuple{dtype::bf16, 3, false}}) {
    SCOPED_TRACE(testing::Message() << name_of(type) << ", ZeRO-" << zero << (adam ? ", AdamW" : ", SGD"));
    fs::remove_all(root);
    std::vector<streamed_save_result> out(2);
    run_on_devices(devices(2), [&](rank_context& rc) {
      const auto r = static_cast<std::size_t>(rc.rank());
      if (adam) {
        out[r] = save_streamed_and_resume(rc, type, zero, root, [](const std::vector<parameter*>& ps) {
          return adamw(ps, adamw_options{.lr = 0.01f});
        });
      } else {
        out[r] = save_streamed_and_resume(rc, type, zero, root, [](const std::vector<parameter*>& ps) {
          return sgd(ps, sgd_options{.lr = 0.1f, .momentum = 0.9f});
        });
      }
    });
    for (const char* file : {"model.safetensors", "training.safetensors"}) {
      const std::string a = file_bytes(root / "streamed" / "step-000000000002" / file);
      EXPECT_FALSE(a.empty()) << file;
      EXPECT_TRUE(a == file_bytes(root / "consolidated" / "step-000000000002" / file)) << file;
    }
    for (std::size_t r = 0; r < 2; ++r) {
      EXPECT_EQ(out[r].resumed, out[0].straight) << "rank " << r;
      EXPECT_EQ(out[r].straight, out[0].straight) << "rank " << r;
      EXPECT_LT(out[r].save_peak, out[r].masters * 3 / 4) << "rank " << r;
    }
  }
  fs::remove_all(root);
}

// Rank 0 cannot keep what the source gives (here a tensor given twice): the source still runs to its end on every
// rank, every rank's save throws (rank 0 its error, the others "rank 0 could not write"), nothing is written, and the
// ranks stay matched: the next save works.
TEST_P(zero_test, a_streamed_save_that_rank_0_cannot_keep_fails_on_every_rank_and_the_next_one_works) {
  if (!require_devices(2)) return;
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("lockstep_test_zero_keep." + std::to_string(::getpid()));
  fs::remove_all(root);
  std::vector<std::string> messages(2);
  std::vector<char> saved(2, 0);  // (not vector<bool>: the ranks write their elements at once)
  run_on_devices(devices(2), [&](rank_context& rc) {
    const stream_ref s = rc.compute_stream();
    context ctx(s);
    graph model = make_model(ctx);
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(), ddp_options{.zero = zero_stage::optimizer_state});
    adamw opt(parameters_of(model).pointers(), adamw_options{});
    bool twice = true;
    checkpoint_state st(parameters_of(model));
    st.optimizer(opt).sharded([&](const auto& f) {
      ddp.visit_whole_state(opt, f);
      if (!twice) return;
      const parameter& p = *parameters_of(model)[0].param;
      const std::vector<float> zeros(static_cast<std::size_t>(p.numel()));
      f(p, master_values_tensor, std::span<const float>(zeros));
    });
    checkpointer saver(root);
    messages[static_cast<std::size_t>(rc.rank())] = message_of<error>([&] { saver.save(st, s, rc.comm()); });
    twice = false;
    saved[static_cast<std::size_t>(rc.rank())] = fs::exists(saver.save(st, s, rc.comm()) / "manifest.json") ? 1 : 0;
  });
  EXPECT_CONTAINS(messages[0], "gave tensor -1 of parameter ");
  EXPECT_CONTAINS(messages[0], " twice");
  EXPECT_CONTAINS(messages[1], "rank 0 could not write the checkpoint: ");
  EXPECT_TRUE(saved[0]);
  EXPECT_TRUE(saved[1]);
  fs::remove_all(root);
}

TEST_P(zero_test, consolidation_before_the_first_step_nested_or_between_backward_and_step_changes_nothing) {
  if (!require_devices(2)) return;
  // Each rank: a rank-0-only materialize_state (what a checkpoint saved before the first step does), nested
  // consolidated() guards, then steps with a consolidation between backward and the step (a save there, under
  // ZeRO-2, must keep the gradient shards). The same bits as plain DDP, and every collective matched.
  auto train = [&](int zero) {
    std::vector<std::vector<float>> out(2);
    run_on_devices(devices(2), [&](rank_context& rc) {
      const stream_ref s = rc.compute_stream();
      context ctx(s, dtype::f16);
      graph model = make_model(ctx);
      distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(),
                                    ddp_options{.bucket_bytes = 2048, .first_bucket_bytes = 512, .zero = to_zero_stage(zero)});
      auto params = parameters_of(model).pointers();
      adamw opt(params, adamw_options{.lr = 0.01f});
      context scaled(s);  // the gradients set below stand for a backward that read the scale
      loss_scaler scaler(scaled, loss_scaler_options{.initial_scale = 256.0f});
      scaler.attach(ctx);
      softmax_cross_entropy loss(reduction::mean);
      if (rc.rank() == 0) opt.materialize_state(s);
      {
        auto outer = ddp.consolidated(opt);
        { auto inner = ddp.consolidated(opt); }
        EXPECT_EQ(parameter_values(model, s).size(), static_cast<std::size_t>(parameters_of(model).numel()));
      }
      const auto x = inputs();
      const auto y = labels();
      for (int step = 0; step < 4; ++step) {
        opt.zero_grad();
        const std::int64_t begin = first_row(step, 64) + 32 * rc.rank();
        tensor xf = device_tensor(slice(x, begin, 32, features), shape{32, features}, s);
        tensor xb(shape{32, features}, dtype::f16, s);
        cast<lockstep::half, float>(xf.span<const float>(), xb.span<lockstep::half>(), s);
        tensor yb = device_labels(slice(y, begin, 32, 1), s);
        loss.forward(ddp.forward(xb), yb, ctx, 64);
        ddp.backward(loss.backward(ctx));
        { auto whole = ddp.consolidated(opt); }
        scaler.unscale_and_check(params, s, rc.comm());
        opt.step(s, scaler.optimizer_inputs());
        scaler.update(s);
      }
      auto whole = ddp.consolidated(opt);
      out[static_cast<std::size_t>(rc.rank())] = parameter_values(model, s);
    });
    return out;
  };
  const auto plain = train(0);
  for (int zero : {1, 2, 3}) {
    const auto sharded = train(zero);
    EXPECT_EQ(sharded[0], plain[0]) << "ZeRO-" << zero;
    EXPECT_EQ(sharded[1], plain[0]) << "ZeRO-" << zero;
  }
  // f32: the master values are the values forward reads, whole on every rank, yet only a shard is current
  std::string f32_value;
  run_on_devices(devices(2), [&](rank_context& rc) {
    context ctx(rc.compute_stream());
    graph model = make_model(ctx);
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(), ddp_options{.zero = zero_stage::optimizer_state});
    if (rc.rank() == 0) f32_value = message_of<precondition_error>([&] { (void)parameters_of(model)[0].param->value(); });
  });
  EXPECT_CONTAINS(f32_value, "ZeRO shards it over the ranks: this rank updates elements [");
}
