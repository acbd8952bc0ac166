// Tests of the data-parallel layer: the DataParallel primitives, data_parallel and distributed_data_parallel
// (threads) against single-device training on the same global batch, uneven splits, no_sync, compression hooks,
// parameter checks, reports. Every test that runs on devices runs once per backend: on host devices (4 of them:
// LOCKSTEP_HOST_DEVICES=4 for this program), and on GPUs with NCCL between the ranks (run_on_devices makes the
// clique of the devices' kind), skipped without a GPU or with fewer GPUs than the test needs.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "lockstep/comm/run_on_devices.hpp"
#include "lockstep/nn/dropout.hpp"
#include "lockstep/nn/sequential.hpp"
#include "lockstep/parallel/data_parallel.hpp"
#include "lockstep/parallel/distributed_data_parallel.hpp"
#include "parallel_common.hpp"
#include "test_support.hpp"

using namespace lockstep;
using namespace lockstep_test;
using namespace parallel_test;

namespace {

// data_parallel over `devices` for `steps` steps of global batch `batch`; the final parameters.
std::vector<float> train_data_parallel(const device_set& devices, std::int64_t batch,
                                       std::vector<device_report>* report = nullptr,
                                       std::optional<deterministic_options> deterministic = std::nullopt,
                                       model_variant variant = model_variant::mlp) {
  const device d0 = devices[0];
  stream setup(d0);
  context build_ctx(setup);
  graph model = make_model(build_ctx, seed, variant);
  data_parallel dp(model, data_parallel_options{.device_ids = devices, .deterministic = deterministic});
  auto params = parameters_of(model).pointers();
  sgd opt(params, optimizer_options);
  softmax_cross_entropy loss(reduction::mean);
  context& out = dp.output_context();
  const stream_ref s0 = dp.replica_context(0).stream();
  const auto x = inputs();
  const auto y = labels();
  for (int step = 0; step < steps; ++step) {
    const std::int64_t first = first_row(step, batch);
    tensor xb = device_tensor(slice(x, first, batch, features), shape{batch, features}, s0);
    tensor yb = device_labels(slice(y, first, batch, 1), out.stream());
    opt.zero_grad();
    loss.forward(dp.forward(xb), yb, out, batch);
    dp.backward(loss.backward(out));
    opt.step(s0);
  }
  if (report) *report = dp.report();
  return parameter_values(model, s0);
}

// distributed_data_parallel on one thread per device; every rank trains on its chunk of the same global batch.
// Returns every rank's final parameters.
std::vector<std::vector<float>> train_ddp_threads(const device_set& devices, std::int64_t batch,
                                                  ddp_options options = {},
                                                  std::optional<deterministic_options> deterministic = std::nullopt,
                                                  global_batch global = global_batch::not_told,
                                                  std::vector<char>* gathered = nullptr,
                                                  model_variant variant = model_variant::mlp) {
  std::vector<std::vector<float>> result(devices.size());
  if (gathered != nullptr) gathered->assign(devices.size(), 0);
  run_on_devices(devices, [&](rank_context& rc) {
    context ctx(rc.compute_stream());
    bool mine = false;
    result[static_cast<std::size_t>(rc.rank())] =
        train_ddp_rank(ctx, rc.comm(), rc.comm_stream(), batch, options, deterministic, global, &mine, variant);
    if (gathered != nullptr) (*gathered)[static_cast<std::size_t>(rc.rank())] = mine;
  });
  return result;
}

// One SGD step of one device on the first `batch` rows: the loss (a mean over them) and the parameters after it.
struct one_step {
  float loss;
  std::vector<float> update;
};
one_step one_step_on_one_device(device d, std::int64_t batch) {
  stream s(d);
  context ctx(s);
  graph model = make_model(ctx);
  auto params = parameters_of(model).pointers();
  sgd opt(params, optimizer_options);
  softmax_cross_entropy loss;
  tensor xb = device_tensor(slice(inputs(), 0, batch, features), shape{batch, features}, s);
  tensor yb = device_labels(slice(labels(), 0, batch, 1), s);
  loss.forward(model.forward(xb, ctx), yb, ctx);
  model.backward(loss.backward(ctx), ctx, input_grad::not_required);
  opt.step(s);
  return {loss.read_loss(s), parameter_values(model, s)};
}

// Every suite that runs on devices runs once per backend.
class primitives_test : public backend_test {};
class data_parallel_test : public backend_test {};
class ddp_test : public backend_test {};

}  // namespace

INSTANTIATE_TEST_SUITE_P(all, primitives_test, all_backends(), backend_name);
INSTANTIATE_TEST_SUITE_P(all, data_parallel_test, all_backends(), backend_name);
INSTANTIATE_TEST_SUITE_P(all, ddp_test, all_backends(), backend_name);

// ---- primitives ------------------------------------------------------------------------------------------------

TEST(chunk_rows, follows_torch_chunk) {
  EXPECT_EQ(chunk_rows(130, 4), (std::vector<row_range>{{0, 33}, {33, 33}, {66, 33}, {99, 31}}));
  EXPECT_EQ(chunk_rows(3, 4), (std::vector<row_range>{{0, 1}, {1, 1}, {2, 1}}));
  EXPECT_EQ(chunk_rows(5, 4), (std::vector<row_range>{{0, 2}, {2, 2}, {4, 1}}));
  EXPECT_EQ(chunk_rows(8, 4).size(), 4u);
  EXPECT_TRUE(chunk_rows(0, 4).empty());
  EXPECT_EQ(chunk_rows(7, 1), (std::vector<row_range>{{0, 7}}));
}

TEST_P(primitives_test, scatter_then_gather_round_trips_across_devices) {
  if (!require_devices(4)) return;
  for (std::int64_t rows : {13, 14, 15}) {
    std::vector<stream> streams;
    for (int i = 0; i < 4; ++i) streams.emplace_back(dev(i));
    std::vector<stream_ref> refs(streams.begin(), streams.end());
    std::vector<float> v(static_cast<std::size_t>(rows * 3));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
    tensor input = device_tensor(v, shape{rows, 3}, refs[0]);
    event ready(dev(0));
    ready.record(refs[0]);
    const auto ranges = chunk_rows(rows, 4);
    std::vector<tensor> parts(4);
    scatter_rows(input, ready, ranges, parts, refs);
    std::vector<tensor_view> views;
    std::vector<event> done;
    std::vector<event_ref> done_refs;
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      EXPECT_EQ(parts[i].get_device(), dev(static_cast<int>(i)));
      EXPECT_EQ(parts[i].dims(), (shape{ranges[i].rows, 3}));
      views.push_back(parts[i].view());
      done.emplace_back(dev(static_cast<int>(i)));
      done.back().record(refs[i]);
    }
    for (auto& e : done) done_refs.push_back(e);
    tensor gathered;
    gather_rows(views, done_refs, gathered, refs[3]);
    EXPECT_EQ(gathered.get_device(), dev(3));
    EXPECT_EQ(to_vector(gathered.span<const float>(), refs[3]), v) << rows;
  }
}

TEST_P(primitives_test, coalesced_broadcast_and_reduce_add) {
  if (!require_devices(3)) return;
  std::vector<stream> streams;
  for (int i = 0; i < 3; ++i) streams.emplace_back(dev(i));
  std::vector<std::vector<tensor>> t(3);
  for (int d = 0; d < 3; ++d) {
    for (int j = 0; j < 4; ++j) {
      std::vector<float> v(static_cast<std::size_t>(j * 5 + 1), static_cast<float>(d + 1) * static_cast<float>(j + 1));
      t[static_cast<std::size_t>(d)].push_back(device_tensor(v, shape{j * 5 + 1}, streams[static_cast<std::size_t>(d)]));
    }
  }
  auto views = [&](int d) {
    std::vector<tensor_view> out;
    for (auto& x : t[static_cast<std::size_t>(d)]) out.push_back(x.view());
    return out;
  };
  // reduce: device 0 += devices 1 and 2 -> (1 + 2 + 3) * (j + 1)
  coalesced_reduce_add reduce;
  std::vector<std::vector<tensor_view>> sources{views(1), views(2)};
  std::vector<stream_ref> src{streams[1], streams[2]};
  reduce(sources, src, views(0), streams[0]);
  for (int j = 0; j < 4; ++j) {
    const auto v = to_vector(t[0][static_cast<std::size_t>(j)].span<const float>(), streams[0]);
    for (float x : v) ASSERT_EQ(x, 6.0f * static_cast<float>(j + 1));
  }
  // broadcast: device 0's values to 1 and 2
  coalesced_broadcast broadcast;
  std::vector<std::vector<tensor_view>> destinations{views(1), views(2)};
  std::vector<stream_ref> dst{streams[1], streams[2]};
  broadcast(views(0), streams[0], destinations, dst);
  for (int d = 1; d < 3; ++d) {
    for (int j = 0; j < 4; ++j) {
      const auto v = to_vector(t[static_cast<std::size_t>(d)][static_cast<std::size_t>(j)].span<const float>(),
                               streams[static_cast<std::size_t>(d)]);
      for (float x : v) ASSERT_EQ(x, 6.0f * static_cast<float>(j + 1));
    }
  }
}

// ---- DataParallel ------------------------------------------------------------------------------------------------

// Parameterized over (backend, (devices, global batch)).
class parallel_equivalence : public on_backend<std::tuple<device_kind, std::tuple<int, std::int64_t>>> {};

TEST_P(parallel_equivalence, data_parallel_makes_the_single_device_update) {
  const auto [k, batch] = std::get<1>(GetParam());
  if (!require_devices(k)) return;
  const auto reference = train_single(dev(0), batch);
  const auto dp = train_data_parallel(devices(k), batch);
  EXPECT_LE(relative_difference(dp, reference), 1e-5) << k << " devices, batch " << batch;
}

TEST_P(parallel_equivalence, ddp_with_threads_makes_the_single_device_update) {
  const auto [k, batch] = std::get<1>(GetParam());
  if (!require_devices(k)) return;
  const auto reference = train_single(dev(0), batch);
  const auto ranks = train_ddp_threads(devices(k), batch);
  for (int r = 0; r < k; ++r) {
    EXPECT_LE(relative_difference(ranks[static_cast<std::size_t>(r)], reference), 1e-5)
        << "rank " << r << " of " << k << ", batch " << batch;
    EXPECT_EQ(ranks[static_cast<std::size_t>(r)], ranks[0]) << "ranks must hold identical parameters";
  }
}

INSTANTIATE_TEST_SUITE_P(devices_and_batches, parallel_equivalence,
                         ::testing::Combine(all_backends(),
                                            ::testing::Values(std::make_tuple(1, std::int64_t{64}),
                                                              std::make_tuple(2, std::int64_t{64}),
                                                              std::make_tuple(3, std::int64_t{64}),
                                                              std::make_tuple(4, std::int64_t{64}),
                                                              std::make_tuple(4, std::int64_t{130}),
                                                              std::make_tuple(4, std::int64_t{3}),
                                                              std::make_tuple(3, std::int64_t{130}))),
                         [](const auto& param_info) {
                           const auto& devices_and_batch = std::get<1>(param_info.param);
                           return std::string(name_of(std::get<0>(param_info.param))) + "_" +
                                  std::to_string(std::get<0>(devices_and_batch)) + "_devices_batch_" +
                                  std::to_string(std::get<1>(devices_and_batch));
                         });

// ---- deterministic mode --------------------------------------------------------------------------------------

// ---- bucket_plan: DDP's pure layout, alone ----

namespace {
// Checks what every plan must satisfy: every parameter in exactly one bucket, in reverse model order; 256-byte
// offsets in both layouts; no overlap; under sharding equal ranges whose shards of every parameter partition it.
void expect_valid_plan(const std::vector<detail::planned_parameter>& ps, const detail::bucket_plan& plan,
                       const detail::bucket_plan_options& o) {
  std::vector<std::size_t> order;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& l = plan.buckets[b];
    ASSERT_FALSE(l.params.empty());
    std::size_t end = 0, value_end = 0;
    for (std::size_t i = 0; i < l.params.size(); ++i) {
      const std::size_t k = l.params[i];
      order.push_back(k);
      EXPECT_EQ(plan.bucket_of[k], b);
      EXPECT_EQ(l.offsets[i] * size_of(l.wire) % 256, 0u);
      EXPECT_EQ(l.value_offsets[i] * size_of(l.value_type) % 256, 0u);
      EXPECT_GE(l.offsets[i], end);
      EXPECT_GE(l.value_offsets[i], value_end);
      const auto n = static_cast<std::size_t>(ps[k].numel);
      end = l.offsets[i] + (o.deterministic ? kernels::exact_words(n) : n);
      value_end = l.value_offsets[i] + n;
      EXPECT_EQ(l.value_type, ps[k].compute_type);
    }
    EXPECT_LE(end, l.elements);
    EXPECT_LE(value_end, l.value_elements);
    if (o.sharded) {
      EXPECT_EQ(l.shard_elements * static_cast<std::size_t>(o.world), l.value_elements);
      for (std::size_t i = 0; i < l.params.size(); ++i) {
        const std::int64_t n = ps[l.params[i]].numel;
        std::int64_t covered = 0, next = 0;
        for (int rank = 0; rank < o.world; ++rank) {
          const element_range r = l.shard_of(i, n, rank);
          if (r.empty()) continue;
          EXPECT_EQ(r.begin, next) << "bucket " << b << " parameter " << i << " rank " << rank;
          next = r.end;
          covered += r.size();
        }
        EXPECT_EQ(covered, n);
      }
    }
  }
  std::vector<std::size_t> expected(ps.size());
  for (std::size_t k = 0; k < ps.size(); ++k) expected[k] = ps.size() - 1 - k;
  EXPECT_EQ(order, expected);
}
}  // namespace

TEST(bucket_plan, reverse_order_a_small_first_bucket_and_aligned_offsets) {
  // 4-byte values: 300 floats (1200 B), 100, 1000, 7, 2000
  const std::vector<detail::planned_parameter> ps{{300}, {100}, {1000}, {7}, {2000}};
  const detail::bucket_plan_options o{.bucket_bytes = 5000, .first_bucket_bytes = 1000};
  const auto plan = detail::plan_buckets(ps, o);
  expect_valid_plan(ps, plan, o);
  // backward order 4, 3, 2, 1, 0: {4} fills the 1000-byte first bucket alone; then 5000 bytes: {3, 2, 1} (4428),
  // and {0}
  ASSERT_EQ(plan.buckets.size(), 3u);
  EXPECT_EQ(plan.buckets[0].params, (std::vector<std::size_t>{4}));
  EXPECT_EQ(plan.buckets[1].params, (std::vector<std::size_t>{3, 2, 1}));
  EXPECT_EQ(plan.buckets[2].params, (std::vector<std::size_t>{0}));
  EXPECT_EQ(plan.buckets[1].offsets, (std::vector<std::size_t>{0, 64, 1088}));  // 7 -> 64, 1000 -> 1024
  EXPECT_EQ(plan.buckets[1].elements, 1088u + 128u);
  EXPECT_EQ(plan.buckets[1].buffer_elements, plan.buckets[1].elements);
}

TEST(bucket_plan, whole_units_keep_a_layer_in_one_bucket_whatever_its_size) {
  // three layers (units 0, 1, 2): 300 + 100 floats, 1000 + 7, 2000; 1000-byte first bucket, then 2000 bytes
  const std::vector<detail::planned_parameter> ps{{300, dtype::f32, 0}, {100, dtype::f32, 0}, {1000, dtype::f32, 1},
                                                  {7, dtype::f32, 1}, {2000, dtype::f32, 2}};
  detail::bucket_plan_options o{.bucket_bytes = 2000, .first_bucket_bytes = 1000, .own_type = true, .sharded = true,
                                .reused_buffers = true, .world = 3};
  // without units, parameter by parameter: {4}, {3}, {2}, {1, 0}
  EXPECT_EQ(detail::plan_buckets(ps, o).buckets.size(), 4u);
  // with them: a unit's parameters together, however far past the limit (8000 bytes, 4028, 1600)
  o.whole_units = true;
  const auto plan = detail::plan_buckets(ps, o);
  expect_valid_plan(ps, plan, o);
  ASSERT_EQ(plan.buckets.size(), 3u);
  EXPECT_EQ(plan.buckets[0].params, (std::vector<std::size_t>{4}));
  EXPECT_EQ(plan.buckets[1].params, (std::vector<std::size_t>{3, 2}));
  EXPECT_EQ(plan.buckets[2].params, (std::vector<std::size_t>{1, 0}));
  // small units share a bucket up to the limit, and a bucket closes only between them
  const std::vector<detail::planned_parameter> small{{10, dtype::f32, 0}, {10, dtype::f32, 0}, {10, dtype::f32, 1},
                                                     {10, dtype::f32, 1}, {400, dtype::f32, 2}, {10, dtype::f32, 2}};
  o.first_bucket_bytes = 100;
  const auto packed = detail::plan_buckets(small, o);
  expect_valid_plan(small, packed, o);
  ASSERT_EQ(packed.buckets.size(), 2u);
  EXPECT_EQ(packed.buckets[0].params, (std::vector<std::size_t>{5, 4}));
  EXPECT_EQ(packed.buckets[1].params, (std::vector<std::size_t>{3, 2, 1, 0}));
  // once a bucket holds first_bucket_bytes, the next layer starts a new one, however much room is left: a layer (or
  // a few small ones) gathered at a time
  const std::vector<detail::planned_parameter> layers{{30, dtype::f32, 0}, {30, dtype::f32, 1}, {30, dtype::f32, 2}};
  const auto apart = detail::plan_buckets(layers, o);
  expect_valid_plan(layers, apart, o);
  EXPECT_EQ(apart.buckets.size(), 3u);
}

TEST(bucket_plan, a_change_of_wire_or_value_type_closes_a_bucket) {
  const std::vector<detail::planned_parameter> ps{{10, dtype::f16}, {10, dtype::f32}, {10, dtype::f32}};
  // comm hook none: everything travels in f32, one bucket
  detail::bucket_plan_options o{.bucket_bytes = 1 << 20, .first_bucket_bytes = 1 << 20};
  EXPECT_EQ(detail::plan_buckets(ps, o).buckets.size(), 1u);
  // ZeRO: in their own type; the f16 parameter goes alone
  o.own_type = true;
  auto plan = detail::plan_buckets(ps, o);
  ASSERT_EQ(plan.buckets.size(), 2u);
  EXPECT_EQ(plan.buckets[1].wire, dtype::f16);
  expect_valid_plan(ps, plan, o);
  // a hook's type for everything
  o.own_type = false;
  plan = detail::plan_buckets(ps, o, dtype::bf16);
  ASSERT_EQ(plan.buckets.size(), 1u);
  EXPECT_EQ(plan.buckets[0].wire, dtype::bf16);
}

TEST(bucket_plan, shards_of_uneven_parameters_cover_each_once_on_any_world) {
  const std::vector<detail::planned_parameter> ps{{1}, {333, dtype::bf16}, {64}, {65}, {1000}, {0}, {7}};
  for (const int world : {1, 2, 3, 4, 7}) {
    for (const bool reused : {false, true}) {
      const detail::bucket_plan_options o{.bucket_bytes = 1500, .first_bucket_bytes = 300, .own_type = true,
                                          .sharded = world > 1, .reused_buffers = reused && world > 1, .world = world};
      SCOPED_TRACE(testing::Message() << "world " << world << (reused ? ", ZeRO-2" : ""));
      const auto plan = detail::plan_buckets(ps, o);
      expect_valid_plan(ps, plan, o);
      if (!o.reused_buffers) continue;
      for (std::size_t b = 0; b < plan.buckets.size(); ++b) {  // each reused buffer holds every bucket that takes it
        EXPECT_GE(plan.reused_bytes[b % 2], plan.buckets[b].elements * size_of(plan.buckets[b].wire));
      }
    }
  }
}

TEST(bucket_plan, deterministic_mode_plans_exact_words_and_room_for_gathered_partials) {
  const std::vector<detail::planned_parameter> ps{{100}, {50, dtype::f16}};
  const detail::bucket_plan_options o{.bucket_bytes = 1 << 20, .first_bucket_bytes = 1 << 20, .deterministic = true,
                                      .exact_collective = true, .world = 2};
  const auto plan = detail::plan_buckets(ps, o);
  expect_valid_plan(ps, plan, o);
  ASSERT_EQ(plan.buckets.size(), 2u);  // the value types differ
  for (const auto& l : plan.buckets) {
    EXPECT_EQ(l.wire, dtype::i64);
    EXPECT_GE(l.buffer_elements, 2 * l.value_elements);  // 16 bytes per value for the partials
    EXPECT_EQ(l.exact_ends.size(), 2 * l.params.size());
  }
  EXPECT_EQ(plan.buckets[0].exact_ends, (std::vector<std::size_t>{50, plan.buckets[0].value_elements}));
}

TEST(deterministic_shard, whole_chunks_in_rank_order_as_even_as_chunks_allow) {
  EXPECT_EQ(deterministic_shard(130, 32, 0, 3), (row_range{0, 64}));
  EXPECT_EQ(deterministic_shard(130, 32, 1, 3), (row_range{64, 64}));
  EXPECT_EQ(deterministic_shard(130, 32, 2, 3), (row_range{128, 2}));
  EXPECT_EQ(deterministic_shard(96, 32, 3, 4), (row_range{96, 0}));  // 3 chunks, 4 ranks: the last has none
  EXPECT_EQ(deterministic_shard(5, 32, 0, 1), (row_range{0, 5}));
  EXPECT_EQ(deterministic_shards(96, 32, 4).size(), 3u);
  EXPECT_CONTAINS(message_of<precondition_error>([] { (void)deterministic_shard(10, 0, 0, 1); }), "chunk_rows > 0");
}

// Parameterized over (backend, (devices, global batch, chunk rows)).
class deterministic_equivalence
    : public on_backend<std::tuple<device_kind, std::tuple<int, std::int64_t, std::int64_t>>> {};

TEST_P(deterministic_equivalence, single_dp_and_ddp_give_the_same_bits_on_any_number_of_devices) {
  const auto [k, batch, chunk] = std::get<1>(GetParam());
  if (!require_devices(k)) return;
  const deterministic_options det{.chunk_rows = chunk};
  const auto single = train_single(dev(0), batch, det);
  // the mode is exact, not just repeatable: it stays as close to the ordinary run as two ordinary splits are
  EXPECT_LE(relative_difference(single, train_single(dev(0), batch)), 1e-5);
  EXPECT_NE(single, initial_parameters(dev(0))) << "the run must train";
  EXPECT_EQ(train_data_parallel(devices(k), batch, nullptr, det), single) << "data_parallel on " << k << " devices";
  // DDP two ways: exact accumulators all-reduced, and (told the global batch) the chunks' partial gradients
  // summed by the communicator where they fit (16 bytes per parameter: slots x 4 for f32 with all_reduce_exact,
  // on host cliques; ranks x slots x 4 where they are gathered, NCCL)
  const std::int64_t chunks = (batch + chunk - 1) / chunk, slots = (chunks + k - 1) / k;
  const std::int64_t held = std::get<0>(GetParam()) == device_kind::host ? slots : k * slots;
  for (const global_batch global : {global_batch::not_told, global_batch::told}) {
    std::vector<char> gathered;
    const auto ranks = train_ddp_threads(devices(k), batch, {}, det, global, &gathered);
    const bool expected = global == global_batch::told && held * 4 <= 16;
    for (int r = 0; r < k; ++r) {
      EXPECT_EQ(ranks[static_cast<std::size_t>(r)], single) << "ddp rank " << r << " of " << k << ", gathered " << expected;
      EXPECT_EQ(gathered[static_cast<std::size_t>(r)] != 0, expected) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(devices_batches_chunks, deterministic_equivalence,
                         ::testing::Combine(all_backends(),
                                            ::testing::Values(std::make_tuple(2, std::int64_t{64}, std::int64_t{16}),
                                                              std::make_tuple(3, std::int64_t{130}, std::int64_t{16}),
                                                              std::make_tuple(4, std::int64_t{130}, std::int64_t{32}),
                                                              std::make_tuple(4, std::int64_t{3}, std::int64_t{1}),
                                                              std::make_tuple(3, std::int64_t{100}, std::int64_t{64}),
                                                              std::make_tuple(4, std::int64_t{70}, std::int64_t{32}))),
                         [](const auto& param_info) {
                           const auto& p = std::get<1>(param_info.param);
                           return std::string(name_of(std::get<0>(param_info.param))) + "_" +
                                  std::to_string(std::get<0>(p)) + "_devices_batch_" + std::to_string(std::get<1>(p)) +
                                  "_chunk_" + std::to_string(std::get<2>(p));
                         });

TEST(deterministic_linear, the_weight_gradient_is_the_exact_sum_of_its_chunks_fma_chains_rounded_once) {
  // On a host device (a GPU's chunk products are cuBLAS's): 50 rows in chunks of 16 (the last has 2), a layer of
  // 37 inputs and 11 outputs (partial tiles), random floats. Each chunk's term of W's gradient is the fma chain
  // over its rows (blas/chunk_products.hpp); the gradient is their exact sum, rounded once. Both paths: the
  // one-pass sum of one backward, and the exact accumulator kept across backward calls.
  const std::int64_t rows = 50, in = 37, out = 11, chunk = 16;
  std::uint32_t state = 7;
  auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(static_cast<std::int32_t>(state)) * 0x1p-31f;
  };
  std::vector<float> x(static_cast<std::size_t>(rows * in)), gy(static_cast<std::size_t>(rows * out));
  for (auto& v : x) v = next();
  for (auto& v : gy) v = next();
  std::vector<float> expected(static_cast<std::size_t>(out * in));
  for (std::int64_t o = 0; o < out; ++o) {
    for (std::int64_t i = 0; i < in; ++i) {
      std::int64_t hi = 0, lo = 0, outside = 0;
      for (std::int64_t c0 = 0; c0 < rows; c0 += chunk) {
        float term = 0.0f;
        for (std::int64_t r = c0; r < std::min(rows, c0 + chunk); ++r) {
          term = std::fma(gy[static_cast<std::size_t>(r * out + o)], x[static_cast<std::size_t>(r * in + i)], term);
        }
        kernels::exact_add(term, hi, lo, outside);
      }
      expected[static_cast<std::size_t>(o * in + i)] = kernels::exact_round(hi, lo, outside);
    }
  }
  using accumulation = deterministic_options::accumulation;
  for (const accumulation how : {accumulation::per_backward, accumulation::across_backward_calls}) {
    stream s(device{device_kind::host, 0});
    context ctx(s);
    ctx.set_deterministic(deterministic_options{.chunk_rows = chunk, .gradients = how});
    initializer init(1);
    linear layer(in, out, ctx, init);
    tensor xt = device_tensor(x, shape{rows, in}, s), gt = device_tensor(gy, shape{rows, out}, s);
    (void)layer.forward(xt, ctx);
    (void)layer.backward(gt, ctx, input_grad::not_required);
    const auto got = to_vector(layer.weight().grad().span<const float>(), s);
    ASSERT_EQ(got.size(), expected.size());
    for (std::size_t e = 0; e < got.size(); ++e) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got[e]), std::bit_cast<std::uint32_t>(expected[e]))
          << "element " << e << ", " << (how == accumulation::per_backward ? "one pass" : "accumulator");
    }
  }
}

// ---- buffers (batch norm's running statistics) ---------------------------------------------------------------------

// Each rank updates its running statistics with its own rows; before each forward (or, for a rank without rows, in its
// backward) rank 0's reach every rank, so that evaluation normalizes alike everywhere (PyTorch's broadcast_buffers).
TEST_P(ddp_test, rank_0s_buffers_reach_every_rank_before_each_forward_also_through_a_rank_without_rows) {
  if (!require_devices(3)) return;
  std::vector<std::vector<float>> own(3), seen(3);
  std::vector<std::int64_t> tracked(3);
  run_on_devices(devices(3), [&](rank_context& rc) {
    const auto r = static_cast<std::size_t>(rc.rank());
    context ctx(rc.compute_stream());
    const stream_ref s = ctx.stream();
    graph model = make_model(ctx, seed, model_variant::batch_norm);
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream());
    sgd opt(parameters_of(model).pointers(), optimizer_options);
    softmax_cross_entropy loss(reduction::mean);
    const auto x = inputs();
    const auto y = labels();
    batch_norm& bn = *model.find<batch_norm>("norm1");
    // 3 steps of 9 rows (3 per rank), then 1 of 4 rows (2, 2 and none: rank 2 takes part from backward)
    for (const std::int64_t batch : {9, 9, 9, 4}) {
      opt.zero_grad();
      const auto chunks = chunk_rows(batch, 3);
      if (r < chunks.size()) {
        const row_range mine = chunks[r];
        tensor xb = device_tensor(slice(x, mine.begin + 40 * static_cast<std::int64_t>(r), mine.rows, features),
                                  shape{mine.rows, features}, s);
        tensor yb = device_labels(slice(y, mine.begin, mine.rows, 1), s);
        loss.forward(ddp.forward(xb), yb, ctx, batch);
        ddp.backward(loss.backward(ctx));
      } else {
        ddp.backward(tensor_view());
      }
      opt.step(s);
    }
    own[r] = to_vector(bn.running_mean().span<const float>(), s);
    ctx.set_mode(run_mode::eval);
    tensor xb = device_tensor(slice(x, 0, 2, features), shape{2, features}, s);
    (void)ddp.forward(xb);
    seen[r] = to_vector(bn.running_mean().span<const float>(), s);
    tracked[r] = to_vector(bn.num_batches_tracked().span<const std::int64_t>(), s)[0];
  });
  EXPECT_NE(own[1], own[0]) << "the ranks' own statistics differ (different rows)";
  for (std::size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(seen[r], own[0]) << "rank " << r << " evaluates with rank 0's running statistics";
    EXPECT_EQ(tracked[r], 4) << "rank " << r;
  }
}

TEST_P(data_parallel_test, replicas_normalize_with_device_0s_running_statistics_which_keep_its_chunk) {
  if (!require_devices(2)) return;
  const device d0 = dev(0);
  stream setup(d0);
  context build(setup);
  sequential model(batch_norm(3, build));
  data_parallel dp(model, data_parallel_options{.device_ids = devices(2)});
  std::vector<float> x(24);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 4.0f * philox_uniform(seed, 5, i) - 1.0f;
  tensor xt = device_tensor(x, shape{8, 3}, dp.replica_context(0).stream());
  (void)dp.forward(xt);  // device 0 normalizes rows 0-3, device 1 rows 4-7
  const stream_ref s0 = dp.replica_context(0).stream();
  const auto rm = to_vector(model.get<0>().running_mean().span<const float>(), s0);
  const auto rv = to_vector(model.get<0>().running_var().span<const float>(), s0);
  for (std::size_t c = 0; c < 3; ++c) {
    double mean = 0, var = 0;
    for (std::size_t r = 0; r < 4; ++r) mean += x[r * 3 + c] / 4.0;
    for (std::size_t r = 0; r < 4; ++r) var += (x[r * 3 + c] - mean) * (x[r * 3 + c] - mean) / 3.0;
    EXPECT_NEAR(rm[c], 0.1 * mean, 1e-6) << "channel " << c << ": device 0's chunk";
    EXPECT_NEAR(rv[c], 0.9 + 0.1 * var, 1e-5) << "channel " << c;
  }
  for (context* c : {&dp.replica_context(0), &dp.replica_context(1), &dp.output_context()}) c->set_mode(run_mode::eval);
  const auto y = to_vector(dp.forward(xt).span<const float>(), dp.output_context().stream());
  for (std::size_t r = 4; r < 8; ++r) {  // device 1's rows, normalized with device 0's statistics
    for (std::size_t c = 0; c < 3; ++c) {
      EXPECT_NEAR(y[r * 3 + c], (x[r * 3 + c] - rm[c]) / std::sqrt(rv[c] + 1e-5), 1e-5) << "row " << r;
    }
  }
}

// A synchronized batch norm normalizes with the statistics of the whole global batch: DDP and data_parallel train as
// one device does on it (f32: up to the order of additions; deterministic mode: the same bits, rank counts 1 to 4,
// also with a rank whose shard is empty); without synchronization each replica's statistics are its own.
// reset_report() starts the training window: what setup took (here a 4 MiB buffer made and freed before it) is the
// report's setup peak, not its training peak, which stays what a step holds.
TEST_P(ddp_test, the_report_keeps_the_setup_peak_apart_from_the_training_peak) {
  if (!require_devices(2)) return;
  constexpr std::uint64_t setup_bytes = 4u << 20;
  std::vector<device_report> reports(2);
  run_on_devices(devices(2), [&](rank_context& rc) {
    context ctx(rc.compute_stream());
    const stream_ref s = ctx.stream();
    graph model = make_model(ctx);
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream());
    sgd opt(parameters_of(model).pointers(), optimizer_options);
    softmax_cross_entropy loss(reduction::mean);
    { device_buffer<std::byte> scratch(setup_bytes, s); }  // setup's own temporary
    s.synchronize();
    ddp.reset_report();
    const std::int64_t first = 4 * rc.rank();
    tensor xb = device_tensor(slice(inputs(), first, 4, features), shape{4, features}, s);
    tensor yb = device_labels(slice(labels(), first, 4, 1), s);
    opt.zero_grad();
    loss.forward(ddp.forward(xb), yb, ctx);
    ddp.backward(loss.backward(ctx));
    opt.step(s);
    reports[static_cast<std::size_t>(rc.rank())] = ddp.report();
  });
  for (const auto& r : reports) {
    EXPECT_GE(r.setup_peak_bytes, setup_bytes) << r.device;
    EXPECT_GT(r.peak_bytes, 0u) << r.device;
    EXPECT_LT(r.peak_bytes, setup_bytes) << r.device;  // the model is a few KiB: the step holds far less
    EXPECT_GT(r.compute_ms, 0.0) << r.device;
  }
}

// ddp.compute(f) counts the caller's work on the context's stream (the loss, the optimizer step) as computing time
// of the report and returns f's result; a throwing f leaves no bracket open (later steps are still measured).
TEST_P(ddp_test, compute_brackets_the_callers_work_as_computing_time_also_when_it_throws) {
  if (!require_devices(2)) return;
  using namespace std::chrono_literals;
  std::vector<device_report> reports(2);
  run_on_devices(devices(2), [&](rank_context& rc) {
    context ctx(rc.compute_stream());
    const stream_ref s = ctx.stream();
    graph model = make_model(ctx);
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream());
    sgd opt(parameters_of(model).pointers(), optimizer_options);
    softmax_cross_entropy loss(reduction::mean);
    EXPECT_THROW(ddp.compute([]() -> int { throw std::runtime_error("the user's step failed"); }), std::runtime_error);
    s.synchronize();
    ddp.reset_report();
    const std::int64_t first = 4 * rc.rank();
    tensor xb = device_tensor(slice(inputs(), first, 4, features), shape{4, features}, s);
    tensor yb = device_labels(slice(labels(), first, 4, 1), s);
    opt.zero_grad();
    const tensor_view out = ddp.forward(xb);
    const tensor_view grad = ddp.compute([&] {
      loss.forward(out, yb, ctx);
      return loss.backward(ctx);
    });
    EXPECT_EQ(grad.dims(), out.dims());
    ddp.backward(grad);
    ddp.compute([&] {
      opt.step(s);
      if (kind() == device_kind::host) detail::enqueue_host(s, [] { std::this_thread::sleep_for(50ms); }, "slow step");
    });
    reports[static_cast<std::size_t>(rc.rank())] = ddp.report();
  });
  for (const auto& r : reports) {
    if (kind() == device_kind::host) {
      EXPECT_GE(r.compute_ms, 50.0) << r.device;
    }
    EXPECT_GT(r.compute_ms, 0.0) << r.device;
    EXPECT_LE(r.compute_ms + r.idle_ms, r.wall_ms + 1e-6) << r.device;
  }
}

TEST_P(ddp_test, synchronized_batch_norm_trains_as_one_device_on_the_global_batch) {
  if (!require_devices(4)) return;
  const auto single = train_single(dev(0), 64, std::nullopt, model_variant::sync_batch_norm);
  EXPECT_EQ(single, train_single(dev(0), 64, std::nullopt, model_variant::batch_norm)) << "alone, sync changes nothing";
  for (int k = 2; k <= 4; ++k) {
    const auto ranks = train_ddp_threads(devices(k), 64, {}, std::nullopt, global_batch::not_told, nullptr,
                                         model_variant::sync_batch_norm);
    for (int r = 0; r < k; ++r) {
      EXPECT_LE(relative_difference(ranks[static_cast<std::size_t>(r)], single), 1e-5) << "rank " << r << " of " << k;
    }
    EXPECT_LE(relative_difference(train_data_parallel(devices(k), 64, nullptr, std::nullopt, model_variant::sync_batch_norm),
                                  single),
              1e-5)
        << "data_parallel on " << k;
  }
  // the small CNN (convolution, synchronized batch norm, max pooling) too
  const auto cnn = train_single(dev(0), 64, std::nullopt, model_variant::cnn);
  EXPECT_LE(relative_difference(train_ddp_threads(devices(3), 64, {}, std::nullopt, global_batch::not_told, nullptr,
                                                  model_variant::cnn)[2],
                                cnn),
            1e-5);
  EXPECT_LE(relative_difference(train_data_parallel(devices(3), 64, nullptr, std::nullopt, model_variant::cnn), cnn),
            1e-5);
  const auto unsynced = train_ddp_threads(devices(4), 64, {}, std::nullopt, global_batch::not_told, nullptr,
                                          model_variant::batch_norm);
  EXPECT_GT(relative_difference(unsynced[0], single), 1e-3) << "per-rank statistics train differently";
  // deterministic mode: the bits of one device, whatever the ranks (batch 100, chunks of 16: 7 chunks)
  const deterministic_options det{.chunk_rows = 16};
  const auto exact = train_single(dev(0), 100, det, model_variant::sync_batch_norm);
  EXPECT_LE(relative_difference(exact, train_single(dev(0), 100, std::nullopt, model_variant::sync_batch_norm)), 1e-5);
  for (int k = 2; k <= 4; ++k) {
    for (const global_batch global : {global_batch::not_told, global_batch::told}) {
      const auto ranks = train_ddp_threads(devices(k), 100, {}, det, global, nullptr, model_variant::sync_batch_norm);
      for (int r = 0; r < k; ++r) EXPECT_EQ(ranks[static_cast<std::size_t>(r)], exact) << "rank " << r << " of " << k;
    }
    EXPECT_EQ(train_data_parallel(devices(k), 100, nullptr, det, model_variant::sync_batch_norm), exact)
        << "data_parallel on " << k;
  }
  // 3 rows in chunks of 1 on 4 ranks: rank 3 has none, and runs forward and backward on no rows
  const deterministic_options one_row{.chunk_rows = 1};
  const auto tiny = train_single(dev(0), 3, one_row, model_variant::sync_batch_norm);
  for (const auto& rank : train_ddp_threads(devices(4), 3, {}, one_row, global_batch::not_told, nullptr,
                                            model_variant::sync_batch_norm)) {
    EXPECT_EQ(rank, tiny);
  }
}

// (A named namespace: nvcc warns about a layer's members that a test never calls in an unnamed one.)
namespace parallel_test_layers {
// The identity, except on `fails_on`, where forward throws.
struct failing_on_a_device {
  device fails_on;
  tensor_view forward(const tensor_view& x, context& ctx) {
    if (ctx.get_device() == fails_on) throw error("injected failure on " + fails_on.str());
    return x;
  }
  tensor_view backward(const tensor_view& gy, context&, input_grad) { return gy; }
  void parameters(parameter_list&) {}
  [[nodiscard]] failing_on_a_device clone(context&) const { return *this; }
  [[nodiscard]] shape output_shape(const shape& s) const { return s; }
};
}  // namespace parallel_test_layers
using parallel_test_layers::failing_on_a_device;

// A replica that fails before its synchronized batch norm: the others stop waiting for it, and forward throws.
TEST_P(data_parallel_test, a_replica_failing_before_a_synchronized_batch_norm_fails_the_step_instead_of_hanging) {
  if (!require_devices(2)) return;
  stream setup(dev(0));
  context build(setup);
  sequential model(failing_on_a_device{dev(1)}, batch_norm(3, build, batch_norm_options{.sync = true}));
  data_parallel dp(model, data_parallel_options{.device_ids = devices(2)});
  tensor x = device_tensor(std::vector<float>(24, 1.0f), shape{8, 3}, dp.replica_context(0).stream());
  EXPECT_CONTAINS(message_of<error>([&] { (void)dp.forward(x); }), "injected failure on " + dev(1).str());
}

TEST_P(ddp_test, deterministic_micro_batches_on_one_device_give_the_bits_of_one_batch) {
  // 5 steps of a 64-row batch on one device, as one backward, and as two backward calls of 32 rows between
  // zero_grad and the step (accumulation::across_backward_calls); the one-pass default refuses the second call.
  auto train = [&](int micro_batches, deterministic_options::accumulation how) {
    stream s(dev(0));
    context ctx(s);
    ctx.set_deterministic(deterministic_options{.chunk_rows = 16, .gradients = how});
    graph model = make_model(ctx);
    sgd opt(parameters_of(model).pointers(), optimizer_options);
    softmax_cross_entropy loss(reduction::mean);
    const std::int64_t batch = 64, rows = batch / micro_batches;
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      for (int m = 0; m < micro_batches; ++m) {
        const std::int64_t first = first_row(step, batch) + m * rows;
        ctx.set_row_offset(m * rows);
        tensor xb = device_tensor(slice(inputs(), first, rows, features), shape{rows, features}, s);
        tensor yb = device_labels(slice(labels(), first, rows, 1), s);
        loss.forward(model.forward(xb, ctx), yb, ctx, batch);
        model.backward(loss.backward(ctx), ctx, input_grad::not_required);
      }
      opt.step(s);
    }
    return parameter_values(model, s);
  };
  using accumulation = deterministic_options::accumulation;
  EXPECT_EQ(train(2, accumulation::across_backward_calls), train(1, accumulation::per_backward));
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)train(2, accumulation::per_backward); }),
                  "receives a second backward before zero_grad");
}

TEST_P(ddp_test, deterministic_no_sync_micro_batches_give_the_bits_of_one_device) {
  // 2 ranks x 2 micro-batches of 16 rows (the first under no_sync) make the 64-row batch of one device. Told the
  // global batch, the wrapper could gather partial gradients for it, but not after a no_sync backward: it adds to
  // the exact sums that one kept.
  if (!require_devices(2)) return;
  const deterministic_options det{.chunk_rows = 16};
  const std::int64_t batch = 64, rows = 16;
  std::vector<std::vector<float>> ranks(2);
  std::vector<char> gathered(2, 1);
  run_on_devices(devices(2), [&](rank_context& rc) {
    const stream_ref s = rc.compute_stream();
    context ctx(s);
    graph model = make_model(ctx);
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(), ddp_options{.deterministic = det});
    sgd opt(parameters_of(model).pointers(), optimizer_options);
    softmax_cross_entropy loss(reduction::mean);
    for (int step = 0; step < steps; ++step) {
      opt.zero_grad();
      for (int m = 0; m < 2; ++m) {
        const std::int64_t offset = rc.rank() * 2 * rows + m * rows, first = first_row(step, batch) + offset;
        ctx.set_row_offset(offset);
        ctx.set_global_rows(batch);
        tensor xb = device_tensor(slice(inputs(), first, rows, features), shape{rows, features}, s);
        tensor yb = device_labels(slice(labels(), first, rows, 1), s);
        loss.forward(ddp.forward(xb), yb, ctx, batch);
        if (m == 0) {
          auto guard = ddp.no_sync();
          ddp.backward(loss.backward(ctx));
        } else {
          ddp.backward(loss.backward(ctx));
        }
      }
      opt.step(s);
    }
    ranks[static_cast<std::size_t>(rc.rank())] = parameter_values(model, s);
    gathered[static_cast<std::size_t>(rc.rank())] = ddp.gathered_partials();
  });
  const auto single = train_single(dev(0), batch, det);
  EXPECT_EQ(ranks[0], single);
  EXPECT_EQ(ranks[1], single);
  EXPECT_EQ(gathered, std::vector<char>(2, 0));
}

namespace {
// A layer of one's own that ignores deterministic mode: y = x + b, its gradient written straight (a column sum).
struct plain_bias {
  parameter b;
  tensor y, g;
  plain_bias(context& ctx) : b("bias", shape{features}, ctx.stream()) { fill_zero(b.value().bytes(), ctx.stream()); }
  tensor_view forward(const tensor_view& x, context& ctx) {
    y.ensure(x.dims(), dtype::f32, ctx.stream());
    launch_2d(static_cast<std::size_t>(x.rows()), static_cast<std::size_t>(features),
              kernels::add_bias_op<float>{x.as<float>(), b.value().as<float>(), y.as<float>(),
                                          static_cast<std::size_t>(features)},
              ctx.stream(), "plain bias");
    return y.view();
  }
  tensor_view backward(const tensor_view& gy, context& ctx, input_grad) {
    launch_elementwise(static_cast<std::size_t>(features),
                       kernels::column_sum_op<float>{gy.as<float>(), b.grad().as<float>(),
                                                     static_cast<std::size_t>(gy.rows()),
                                                     static_cast<std::size_t>(features), b.begin_accumulate()},
                       ctx.stream(), "plain bias gradient");
    return gy;
  }
  void parameters(parameter_list& out) { out.add(b); }
  [[nodiscard]] plain_bias clone(context& ctx) const { return plain_bias(ctx); }
  [[nodiscard]] shape output_shape(const shape& s) const { return s; }
};
}  // namespace

TEST_P(ddp_test, a_layer_that_sums_rows_without_exact_gradients_is_named_not_rounded_from_garbage) {
  if (!require_devices(2)) return;
  // with exact sums all-reduced, and with partial gradients gathered (the global batch told: 2 chunks of 8)
  for (const bool told : {false, true}) {
    std::vector<std::string> errors(2);
    run_on_devices(devices(2), [&](rank_context& rc) {
      context ctx(rc.compute_stream());
      ctx.set_deterministic(deterministic_options{.chunk_rows = 8});
      graph g(shape{features});
      g.add("bias", plain_bias(ctx), "input");
      distributed_data_parallel ddp(g, ctx, rc.comm(), rc.comm_stream());
      const row_range mine = deterministic_shard(16, 8, rc.rank(), 2);
      ctx.set_row_offset(mine.begin);
      if (told) ctx.set_global_rows(16);
      tensor x = device_tensor(slice(inputs(), mine.begin, mine.rows, features), shape{mine.rows, features},
                               rc.compute_stream());
      const tensor_view y = ddp.forward(x);
      errors[static_cast<std::size_t>(rc.rank())] = message_of<precondition_error>([&] { ddp.backward(y); });
      rc.comm().synchronize(rc.comm_stream());
    });
    EXPECT_CONTAINS(errors[0], "parameter bias has no exact gradient sum to round");
  }
}

TEST_P(ddp_test, deterministic_ddp_switches_between_gathered_partials_and_exact_sums_as_batches_change) {
  // 2 ranks, chunks of 16, the global batch told: 64 rows (4 chunks: 2 slots per rank, 16 bytes per parameter)
  // gather the partial gradients, 130 (9 chunks: 5 slots) all-reduce exact sums (a step after a gathered one
  // zeroes the buckets first). Either way, and switching, one device's bits.
  if (!require_devices(2)) return;
  const deterministic_options det{.chunk_rows = 16};
  auto batch_of = [](int step) { return step % 3 == 2 ? std::int64_t{130} : std::int64_t{64}; };
  constexpr int rounds = 6;
  std::vector<float> single;
  {
    stream s(dev(0));
    context ctx(s);
    ctx.set_deterministic(det);
    graph model = make_model(ctx);
    sgd opt(parameters_of(model).pointers(), optimizer_options);
    softmax_cross_entropy loss(reduction::mean);
    for (int step = 0; step < rounds; ++step) {
      const std::int64_t batch = batch_of(step), first = first_row(step, batch);
      tensor xb = device_tensor(slice(inputs(), first, batch, features), shape{batch, features}, s);
      tensor yb = device_labels(slice(labels(), first, batch, 1), s);
      opt.zero_grad();
      loss.forward(model.forward(xb, ctx), yb, ctx, batch);
      model.backward(loss.backward(ctx), ctx, input_grad::not_required);
      opt.step(s);
    }
    single = parameter_values(model, s);
  }
  std::vector<std::vector<float>> ranks(2);
  std::vector<std::vector<char>> gathered(2);
  run_on_devices(devices(2), [&](rank_context& rc) {
    const stream_ref s = rc.compute_stream();
    context ctx(s);
    graph model = make_model(ctx);
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(), ddp_options{.deterministic = det});
    sgd opt(parameters_of(model).pointers(), optimizer_options);
    softmax_cross_entropy loss(reduction::mean);
    for (int step = 0; step < rounds; ++step) {
      const std::int64_t batch = batch_of(step), first = first_row(step, batch);
      const row_range mine = deterministic_shard(batch, det.chunk_rows, rc.rank(), 2);
      ctx.set_row_offset(mine.begin);
      ctx.set_global_rows(batch);
      tensor xb = device_tensor(slice(inputs(), first + mine.begin, mine.rows, features), shape{mine.rows, features}, s);
      tensor yb = device_labels(slice(labels(), first + mine.begin, mine.rows, 1), s);
      opt.zero_grad();
      loss.forward(ddp.forward(xb), yb, ctx, batch);
      ddp.backward(loss.backward(ctx));
      opt.step(s);
      gathered[static_cast<std::size_t>(rc.rank())].push_back(ddp.gathered_partials());
    }
    ranks[static_cast<std::size_t>(rc.rank())] = parameter_values(model, s);
  });
  EXPECT_EQ(ranks[0], single);
  EXPECT_EQ(ranks[1], single);
  const std::vector<char> expected{1, 1, 0, 1, 1, 0};
  EXPECT_EQ(gathered[0], expected);
  EXPECT_EQ(gathered[1], expected);
}

TEST_P(ddp_test, deterministic_mode_takes_exact_sums_only_and_replicas_start_at_a_chunk) {
  if (!require_devices(2)) return;
  std::vector<std::string> errors(2);
  run_on_devices(devices(2), [&](rank_context& rc) {
    context ctx(rc.compute_stream());
    ctx.set_deterministic(deterministic_options{.chunk_rows = 8});
    graph model = make_model(ctx);
    errors[static_cast<std::size_t>(rc.rank())] = message_of<precondition_error>([&] {
      distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(),
                                    ddp_options{.reduction = gradient_reduction::mean});
    });
  });
  EXPECT_CONTAINS(errors[0], "use gradient_reduction::sum");
  stream s(dev(0));
  context ctx(s);
  ctx.set_deterministic(deterministic_options{.chunk_rows = 8});
  graph model = make_model(ctx);
  ctx.set_row_offset(4);
  tensor x = device_tensor(slice(inputs(), 0, 8, features), shape{8, features}, s);
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)model.forward(x, ctx); }),
                  "rows start at a multiple of chunk_rows (8), but they start at row 4");
}

TEST_P(data_parallel_test, the_model_must_be_on_the_first_device) {
  if (!require_devices(2)) return;
  const std::string d0 = dev(0).str(), d1 = dev(1).str();  // "host:0", "host:1" or "cuda:0", "cuda:1"
  stream s1(dev(1));
  context ctx(s1);
  graph model = make_model(ctx);
  const std::string msg = message_of<device_error>(
      [&] { data_parallel dp(model, data_parallel_options{.device_ids = device_set(d0 + "," + d1)}); });
  EXPECT_CONTAINS(msg, "must have its parameters on " + d0 + " (device_ids[0])");
  EXPECT_CONTAINS(msg, "is on " + d1);
  EXPECT_CONTAINS(msg, "put " + d1 + " first in device_ids");
  data_parallel ok(model, data_parallel_options{.device_ids = device_set(d1 + "," + d0)});
  EXPECT_EQ(ok.output_device(), dev(1));
}

TEST_P(data_parallel_test, input_must_be_on_one_of_its_devices) {
  if (!require_devices(4)) return;
  stream s0(dev(0));
  context ctx(s0);
  graph model = make_model(ctx);
  data_parallel dp(model, data_parallel_options{.device_ids = devices(2)});
  stream s3(dev(3));
  tensor x = device_tensor(std::vector<float>(static_cast<std::size_t>(4 * features), 0.5f), shape{4, features}, s3);
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)dp.forward(x); }), "is on " + dev(3).str());
}

TEST_P(data_parallel_test, report_shows_the_heavier_first_device) {
  if (!require_devices(3)) return;
  std::vector<device_report> report;
  (void)train_data_parallel(devices(3), 96, &report);
  ASSERT_EQ(report.size(), 3u);
  for (const auto& r : report) {
    EXPECT_GT(r.compute_ms, 0.0) << r.device;
    EXPECT_GE(r.communication_ms, 0.0);
    EXPECT_GE(r.wall_ms, r.compute_ms);
  }
  // device_ids[0] holds the optimizer state and receives every gradient.
  EXPECT_GT(report[0].peak_bytes, report[1].peak_bytes);
  EXPECT_GT(report[0].communication_ms, 0.0);
}

// dp.compute(ctx, f) counts the caller's work on a replica's or the output context's stream as that device's
// computing time and returns f's result; a context on another device is refused, naming the devices.
TEST_P(data_parallel_test, compute_brackets_the_callers_work_on_the_contexts_device) {
  if (!require_devices(3)) return;
  using namespace std::chrono_literals;
  stream setup(dev(0));
  context build_ctx(setup);
  graph model = make_model(build_ctx, seed);
  data_parallel dp(model, data_parallel_options{.device_ids = devices(2)});
  sgd opt(parameters_of(model).pointers(), optimizer_options);
  softmax_cross_entropy loss(reduction::mean);
  context& out = dp.output_context();
  const stream_ref s0 = dp.replica_context(0).stream();
  s0.synchronize();
  dp.reset_report();
  tensor xb = device_tensor(slice(inputs(), 0, 8, features), shape{8, features}, s0);
  tensor yb = device_labels(slice(labels(), 0, 8, 1), out.stream());
  opt.zero_grad();
  const tensor_view y = dp.forward(xb);
  const tensor_view grad = dp.compute(out, [&] {
    loss.forward(y, yb, out);
    return loss.backward(out);
  });
  EXPECT_EQ(grad.dims(), y.dims());
  dp.backward(grad);
  dp.compute(dp.replica_context(0), [&] {
    opt.step(s0);
    if (kind() == device_kind::host) detail::enqueue_host(s0, [] { std::this_thread::sleep_for(50ms); }, "slow step");
  });
  const std::vector<device_report> report = dp.report();
  ASSERT_EQ(report.size(), 2u);
  if (kind() == device_kind::host) {
    EXPECT_GE(report[0].compute_ms, 50.0);
  }
  stream elsewhere(dev(2));
  context other(elsewhere);
  EXPECT_CONTAINS(message_of<precondition_error>([&] { dp.compute(other, [] {}); }), "is not one of this data_parallel's");
  context on_replica_0(setup);  // a replica's device, but not the replica's context
  EXPECT_CONTAINS(message_of<precondition_error>([&] { dp.compute(on_replica_0, [] {}); }), "pass replica_context(i)");
}

// ---- DistributedDataParallel ------------------------------------------------------------------------------------

TEST_P(ddp_test, buckets_fill_in_reverse_order_with_a_smaller_first_bucket) {
  if (!require_devices(2)) return;
  run_on_devices(devices(2), [&](rank_context& rc) {
    context ctx(rc.compute_stream());
    graph model = make_model(ctx);
    // In reverse order: out.bias (40 B), out.weight (640 B), fc2.bias (64 B) fill the 1 KiB first bucket;
    // fc2.weight (2 KiB) starts a 4 KiB bucket with fc1.bias (128 B); fc1.weight (2.5 KiB) needs a third.
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(),
                                  ddp_options{.bucket_bytes = 4096, .first_bucket_bytes = 1024});
    const auto names = parameters_of(model);
    ASSERT_EQ(ddp.bucket_count(), 3u);
    auto bucket_names = [&](std::size_t b) {
      std::vector<std::string> out;
      for (std::size_t k : ddp.bucket_parameters(b)) out.push_back(names[k].name);
      return out;
    };
    EXPECT_EQ(bucket_names(0), (std::vector<std::string>{"out.bias", "out.weight", "fc2.bias"}));
    EXPECT_EQ(bucket_names(1), (std::vector<std::string>{"fc2.weight", "fc1.bias"}));
    EXPECT_EQ(bucket_names(2), (std::vector<std::string>{"fc1.weight"}));
  });
}

namespace ddp_order_test {  // named: nvcc warns about unused members of a layer in an anonymous namespace
// A model whose backward reports every gradient at its end, in registration order (the first layer first): the
// reverse of the order buckets are built in, as a graph with another backward order or a custom layer may.
struct late_reports {
  graph g;
  tensor_view forward(const tensor_view& x, context& ctx) { return g.forward(x, ctx); }
  tensor_view backward(const tensor_view& dy, context& ctx, input_grad ig) {
    const context::gradients_ready_fn hook = ctx.gradients_ready_hook();
    std::vector<parameter*> got;
    ctx.set_gradients_ready_hook([&](std::span<parameter* const> ps) { got.insert(got.end(), ps.begin(), ps.end()); });
    tensor_view dx = g.backward(dy, ctx, ig);
    ctx.set_gradients_ready_hook(hook);
    std::reverse(got.begin(), got.end());
    for (parameter* p : got) ctx.gradients_ready(std::span<parameter* const>(&p, 1));
    return dx;
  }
  void parameters(parameter_list& ps) { g.parameters(ps); }
  [[nodiscard]] late_reports clone(context& ctx) const { return late_reports{g.clone(ctx)}; }
  [[nodiscard]] shape output_shape(const shape& s) const { return g.output_shape(s); }
};
}  // namespace ddp_order_test
using ddp_order_test::late_reports;

// Every rank all-reduces the buckets in bucket order, whatever order backward finishes them in: here rank 0's
// backward makes the last bucket ready first and rank 1 has no data (it issues every bucket at the end). In ready
// order the ranks would issue different all-reduces (a mismatch, or with NCCL a hang or wrong sums).
TEST_P(ddp_test, buckets_are_all_reduced_in_bucket_order_whatever_order_backward_finishes_them) {
  if (!require_devices(2)) return;
  std::vector<std::vector<float>> grads(2);
  run_on_devices(devices(2), [&](rank_context& rc) {
    const stream_ref s = rc.compute_stream();
    context ctx(s);
    late_reports model{make_model(ctx)};
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(),
                                  ddp_options{.bucket_bytes = 4096, .first_bucket_bytes = 1024});
    ASSERT_EQ(ddp.bucket_count(), 3u);
    zero_grad(model);
    if (rc.rank() == 0) {
      tensor xb = device_tensor(std::vector<float>(2 * features, 0.5f), shape{2, features}, s);
      tensor dy = device_tensor(std::vector<float>(2 * classes, 0.25f), shape{2, classes}, s);
      (void)ddp.forward(xb);
      ddp.backward(dy);
    } else {
      ddp.backward(tensor_view{});  // no data this step
    }
    rc.comm().synchronize(s);
    std::vector<float> all;
    for (const auto& p : parameters_of(model)) {
      const auto g = to_vector(device_span<const float>(p.param->grad().span<float>()), s);
      all.insert(all.end(), g.begin(), g.end());
    }
    grads[static_cast<std::size_t>(rc.rank())] = all;
  });
  EXPECT_EQ(grads[0], grads[1]);
  EXPECT_NE(grads[0], std::vector<float>(grads[0].size(), 0.0f));
}

// DDP's construction sends rank 0's values to every rank in packs of bounded size, larger parameters in place, so
// that the staging never holds a second copy of the whole model; the working copies follow.
TEST_P(ddp_test, parameters_are_broadcast_in_bounded_packs_and_large_ones_in_place) {
  if (!require_devices(3)) return;
  std::vector<std::vector<float>> before(3), masters(3), working(3);
  run_on_devices(devices(3), [&](rank_context& rc) {
    const auto r = static_cast<std::size_t>(rc.rank());
    const stream_ref s = rc.compute_stream();
    context ctx(s, dtype::f16);
    graph model = make_model(ctx, seed + r);  // other values on every rank
    const auto params = parameters_of(model);
    const auto values = [&](std::vector<float>& m, std::vector<float>* w) {
      for (const auto& p : params) {
        const auto v = to_vector(p.param->value().span<const float>(), s);
        m.insert(m.end(), v.begin(), v.end());
        if (w == nullptr) continue;
        for (const lockstep::half h : to_vector(p.param->compute_value().span<const lockstep::half>(), s)) {
          w->push_back(to_float(h));
        }
      }
    };
    values(before[r], nullptr);
    // packs of at most 50 values: the 640- and 512-value weights go in place, the others in packs of 32, 16, 48
    // and 3 values (16 + 48 would not fit)
    detail::broadcast_parameters(params, rc.comm(), s, 50);
    values(masters[r], &working[r]);
  });
  ASSERT_FALSE(masters[0].empty());
  EXPECT_EQ(masters[0], before[0]);
  for (std::size_t r = 1; r < 3; ++r) {
    EXPECT_NE(before[r], before[0]) << r;
    EXPECT_EQ(masters[r], masters[0]) << r;
    EXPECT_EQ(working[r], working[0]) << r;
  }
  for (std::size_t i = 0; i < masters[0].size(); ++i) {
    ASSERT_EQ(working[0][i], to_float(convert<lockstep::half>(masters[0][i]))) << i;  // refreshed from the new masters
  }
}

TEST_P(ddp_test, gradients_live_in_their_buckets_and_keep_what_was_accumulated) {
  if (!require_devices(2)) return;
  run_on_devices(devices(2), [&](rank_context& rc) {
    const stream_ref s = rc.compute_stream();
    context ctx(s);
    graph model = make_model(ctx);
    const auto params = parameters_of(model);
    // A gradient accumulated before wrapping (rank-dependent) must survive the move into the bucket.
    parameter& last = *params[params.size() - 1].param;
    const float before = static_cast<float>(rc.rank() + 1);
    fill(last.grad().span<float>(), before, s);
    (void)last.begin_accumulate();
    std::vector<const void*> own;
    for (const auto& p : params) own.push_back(p.param->grad().data());
    const std::uint64_t in_use = get_memory_stats(rc.get_device()).bytes_in_use;
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(),
                                  ddp_options{.bucket_bytes = 4096, .first_bucket_bytes = 1024});
    // Every gradient moved into its bucket, at a 256-byte boundary, in the bucket's order, and its own memory
    // was given back: the buckets replace the gradients instead of doubling them.
    for (std::size_t b = 0; b < ddp.bucket_count(); ++b) {
      const std::byte* previous = nullptr;
      for (std::size_t k : ddp.bucket_parameters(b)) {
        const auto* g = static_cast<const std::byte*>(params[k].param->grad().data());
        EXPECT_NE(static_cast<const void*>(g), own[k]) << params[k].name;
        EXPECT_EQ(reinterpret_cast<std::uintptr_t>(g) % 256, 0u) << params[k].name;
        if (previous != nullptr) {
          EXPECT_GT(g, previous) << params[k].name;
        }
        previous = g;
      }
    }
    std::int64_t elements = 0;
    for (const auto& p : params) elements += p.param->numel();
    const std::uint64_t padding = 256 * params.size();
    EXPECT_LE(get_memory_stats(rc.get_device()).bytes_in_use,
              in_use + padding + 64 * 1024)  // + the construction's small all_gather buffers at most
        << "a second copy of " << elements * 4 << " gradient bytes";
    const auto kept = to_vector(device_span<const float>(last.grad().span<float>()), s);
    for (float v : kept) ASSERT_EQ(v, before);
    // The next backward adds to it, and the all-reduce sums over ranks in place: 1 + 2 from the two ranks.
    tensor xb = device_tensor(std::vector<float>(features, 0.0f), shape{1, features}, s);
    tensor dy = device_tensor(std::vector<float>(classes, 0.0f), shape{1, classes}, s);
    (void)ddp.forward(xb);
    ddp.backward(dy);
    const auto summed = to_vector(device_span<const float>(last.grad().span<float>()), s);
    for (float v : summed) ASSERT_EQ(v, 3.0f);
  });
}

// The model's own gradients go before the buckets that take them are allocated: the wrapper's construction never
// holds both (a 16 MiB weight, broadcast in place: no staging either). f16 gradients stay in their own type in the
// buckets of a communicator that sums them in fp32 (host cliques); on NCCL they travel in f32 buckets, which do not
// take them: they get their memory back.
TEST_P(ddp_test, the_construction_never_holds_the_models_gradients_beside_the_buckets) {
  if (!require_devices(2)) return;
  constexpr std::int64_t in = 2100, out = 2048;  // more than broadcast_parameters' pack
  for (const dtype type : {dtype::f32, dtype::f16}) {
    const std::uint64_t grad_bytes = std::uint64_t{in} * out * size_of(type);
    std::vector<std::uint64_t> extra(2);
    run_on_devices(devices(2), [&](rank_context& rc) {
      const stream_ref s = rc.compute_stream();
      context ctx(s, type);
      initializer init(seed);
      linear model(in, out, ctx, init, bias::no);
      s.synchronize();
      release_cached_memory(rc.get_device());
      reset_memory_stats(rc.get_device());
      const std::uint64_t in_use = get_memory_stats(rc.get_device()).bytes_in_use;
      distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream());
      extra[static_cast<std::size_t>(rc.rank())] = get_memory_stats(rc.get_device()).peak_bytes_in_use - in_use;
      // the gradient has memory and trains (under f16, its own again)
      tensor xb(shape{1, in}, type, s);
      fill_zero(xb.bytes(), s);
      ASSERT_NO_THROW(ddp.backward(ddp.forward(xb)));
      EXPECT_FALSE(model.weight().grad().empty());
      EXPECT_FALSE(model.weight().grad_is_zero());
    });
    if (type != dtype::f32 && kind() == device_kind::cuda) continue;  // (NCCL: an f32 bucket beside the f16 gradient)
    for (std::size_t r = 0; r < 2; ++r) {
      EXPECT_LT(extra[r], grad_bytes / 2) << "rank " << r << ": the bucket beside the model's " << grad_bytes
                                          << " gradient bytes";
    }
  }
}

TEST_P(ddp_test, no_sync_accumulates_locally_and_the_next_backward_reduces_it_all) {
  if (!require_devices(2)) return;
  // Two micro-batches of 32 (the first under no_sync) equal one step of 64 on one device.
  const auto reference = train_single(dev(0), 64);
  std::vector<std::vector<float>> result(2);
  run_on_devices(devices(2), [&](rank_context& rc) {
    context ctx(rc.compute_stream());
    graph model = make_model(ctx);
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream());
    auto params = parameters_of(model).pointers();
    sgd opt(params, optimizer_options);
    softmax_cross_entropy loss(reduction::mean);
    const auto x = inputs();
    const auto y = labels();
    for (int step = 0; step < steps; ++step) {
      const std::int64_t first = first_row(step, 64);
      opt.zero_grad();
      for (int micro = 0; micro < 2; ++micro) {
        // micro-batch m of rank r: rows [first + 16 * (2 * m + r), +16): together, the same 64 rows
        const std::int64_t begin = first + 16 * (2 * micro + rc.rank());
        tensor xb = device_tensor(slice(x, begin, 16, features), shape{16, features}, rc.compute_stream());
        tensor yb = device_labels(slice(y, begin, 16, 1), rc.compute_stream());
        loss.forward(ddp.forward(xb), yb, ctx, 64);
        if (micro == 0) {
          auto guard = ddp.no_sync();
          ddp.backward(loss.backward(ctx));
        } else {
          ddp.backward(loss.backward(ctx));
        }
      }
      opt.step(rc.compute_stream());
    }
    result[static_cast<std::size_t>(rc.rank())] = parameter_values(model, rc.compute_stream());
  });
  EXPECT_LE(relative_difference(result[0], reference), 1e-5);
  EXPECT_EQ(result[0], result[1]);
}

TEST_P(ddp_test, low_precision_communication_hooks_stay_close_to_fp32) {
  if (!require_devices(2)) return;
  const auto reference = train_single(dev(0), 64);
  for (comm_hook hook : {comm_hook::fp16, comm_hook::bf16}) {
    const auto ranks = train_ddp_threads(devices(2), 64, ddp_options{.hook = hook});
    const double diff = relative_difference(ranks[0], reference);
    EXPECT_LE(diff, hook == comm_hook::fp16 ? 5e-3 : 3e-2) << "hook " << static_cast<int>(hook);
    EXPECT_GT(diff, 0.0) << "rounding the gradients must show";  // the hook really changed the wire type
    EXPECT_EQ(ranks[0], ranks[1]);
  }
}

TEST_P(ddp_test, a_plain_mean_loss_is_the_global_batchs_and_read_loss_gives_it_on_every_rank) {
  if (!require_devices(3)) return;
  // No mean_over: 64 rows over 3 ranks (22, 21, 21). The wrapper sums the ranks' rows for the loss on its output
  // and sums the ranks' losses in backward: every rank reads the loss of one device on the 64 rows, and the update
  // is one device's (the equivalence tests train many steps this way, on uneven and empty shards).
  const std::int64_t batch = 64;
  const auto x = inputs();
  const auto y = labels();
  const auto [single_loss, single_update] = one_step_on_one_device(dev(0), batch);
  std::vector<float> read(3), share(3), own(3);
  std::vector<std::vector<float>> updates(3);
  run_on_devices(devices(3), [&](rank_context& rc) {
    const stream_ref s = rc.compute_stream();
    context ctx(s);
    graph model = make_model(ctx);
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream());
    auto params = parameters_of(model).pointers();
    sgd opt(params, optimizer_options);
    softmax_cross_entropy loss;
    const row_range mine = chunk_rows(batch, 3)[static_cast<std::size_t>(rc.rank())];
    tensor xb = device_tensor(slice(x, mine.begin, mine.rows, features), shape{mine.rows, features}, s);
    tensor yb = device_labels(slice(y, mine.begin, mine.rows, 1), s);
    loss.forward(ddp.forward(xb), yb, ctx);
    const auto r = static_cast<std::size_t>(rc.rank());
    share[r] = loss.read_loss(s);  // before backward: this rank's share
    ddp.backward(loss.backward(ctx));
    opt.step(s);
    read[r] = loss.read_loss(s);
    updates[r] = parameter_values(model, s);
    // after the step, the model evaluated outside the wrapper (rank 0's test set, say): a loss of its own rows
    ctx.set_mode(run_mode::eval);
    softmax_cross_entropy evaluation;
    evaluation.forward(model.forward(xb, ctx), yb, ctx);
    own[r] = evaluation.read_loss(s);
  });
  EXPECT_NEAR(share[0] + share[1] + share[2], single_loss, 1e-5 * single_loss);
  for (std::size_t r = 0; r < 3; ++r) {
    EXPECT_LT(share[r], 0.5f * single_loss) << "rank " << r << " divided by its own rows, not the global batch's";
    EXPECT_NEAR(read[r], single_loss, 1e-5 * single_loss) << "rank " << r;
    EXPECT_EQ(read[r], read[0]);
    EXPECT_LE(relative_difference(updates[r], single_update), 1e-5) << "rank " << r;
    EXPECT_GT(own[r], 2.0f * share[r]) << "rank " << r << ": an evaluation after the step divided by the global batch";
  }
}

TEST_P(ddp_test, an_evaluation_forward_then_a_rank_without_rows_keep_the_collectives_matched) {
  if (!require_devices(2)) return;
  // Evaluation forwards sum no rows; the next training step, rank 1 has no rows and calls backward alone: it must
  // still join the rows' sum of rank 0's forward (else the ranks' collectives pair wrongly and hang). Rank 0's
  // update is then one device's on its 16 rows. A loss on part of the output, or a second loss, is refused.
  const std::int64_t batch = 16;
  const auto x = inputs();
  const auto y = labels();
  const std::vector<float> single_update = one_step_on_one_device(dev(0), batch).update;
  std::vector<std::vector<float>> updates(2);
  std::vector<std::string> refusals(2);
  run_on_devices(devices(2), [&](rank_context& rc) {
    const stream_ref s = rc.compute_stream();
    context ctx(s);
    graph model = make_model(ctx);
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream());
    auto params = parameters_of(model).pointers();
    sgd opt(params, optimizer_options);
    softmax_cross_entropy loss;
    tensor xb = device_tensor(slice(x, 0, batch, features), shape{batch, features}, s);
    tensor yb = device_labels(slice(y, 0, batch, 1), s);
    ctx.set_mode(run_mode::eval);
    (void)ddp.forward(xb);
    ctx.set_mode(run_mode::train);
    if (rc.rank() == 0) {
      const tensor_view out = ddp.forward(xb);
      refusals[0] = message_of<precondition_error>([&] { loss.forward(out.slice_rows(0, 4), yb.view().slice_rows(0, 4), ctx); });
      loss.forward(out, yb, ctx);
      softmax_cross_entropy second;
      refusals[1] = message_of<precondition_error>([&] { second.forward(out, yb, ctx); });
      ddp.backward(loss.backward(ctx));
    } else {
      ddp.backward(tensor_view());
    }
    opt.step(s);
    updates[static_cast<std::size_t>(rc.rank())] = parameter_values(model, s);
  });
  EXPECT_LE(relative_difference(updates[0], single_update), 1e-5);
  EXPECT_EQ(updates[1], updates[0]);
  EXPECT_CONTAINS(refusals[0], "the loss reads 40 of the 160 values distributed_data_parallel's forward returned");
  EXPECT_CONTAINS(refusals[1], "a second loss on the output of one distributed_data_parallel forward");
}

TEST_P(ddp_test, ranks_draw_the_dropout_masks_of_their_rows_of_the_global_batch_and_new_ones_each_step) {
  if (!require_devices(2)) return;
  // Nobody sets a row offset or a step: rank r's rows are rows [8r, 8r + 8) of one device's batch of 16 (equal
  // shards), so the ranks draw different masks, those of one device; the loss's backward advances the step.
  const std::int64_t rows = 8, cols = 16;
  auto masks = [&](context& ctx, auto&& forward, std::int64_t n) {
    const stream_ref s = ctx.stream();
    tensor x = device_tensor(std::vector<float>(static_cast<std::size_t>(n * cols), 1.0f), shape{n, cols}, s);
    tensor target = device_tensor(std::vector<float>(static_cast<std::size_t>(n * cols), 0.0f), shape{n, cols}, s);
    mse loss;
    std::vector<std::vector<float>> out;
    for (int step = 0; step < 2; ++step) {
      const tensor_view y = forward(x.view());
      out.push_back(to_vector(y.span<const float>(), s));
      loss.forward(y, target, ctx);
      (void)loss.backward(ctx);
    }
    return out;
  };
  std::vector<std::vector<float>> whole;
  {
    stream s(dev(0));
    context ctx(s);
    ctx.set_seed(3);
    initializer init(0);
    sequential<dropout> model(dropout(0.5f, init));
    whole = masks(ctx, [&](const tensor_view& x) { return model.forward(x, ctx); }, 2 * rows);
  }
  EXPECT_NE(whole[0], whole[1]) << "the second step drew the first step's mask";
  std::vector<std::vector<std::vector<float>>> ranks(2);
  run_on_devices(devices(2), [&](rank_context& rc) {
    context ctx(rc.compute_stream());
    ctx.set_seed(3);
    initializer init(0);
    sequential<dropout> model(dropout(0.5f, init));
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream());
    ranks[static_cast<std::size_t>(rc.rank())] = masks(ctx, [&](const tensor_view& x) { return ddp.forward(x); }, rows);
  });
  for (std::size_t step = 0; step < 2; ++step) {
    for (std::size_t r = 0; r < 2; ++r) {
      const auto begin = whole[step].begin() + static_cast<std::ptrdiff_t>(r * rows * cols);
      EXPECT_EQ(ranks[r][step], std::vector<float>(begin, begin + rows * cols)) << "rank " << r << ", step " << step;
    }
  }
}

namespace unlisted_layer_test {  // (named: nvcc warns of unreferenced members of an unnamed namespace's class)
// A user's layer that forgets to list its second linear in parameters() (PyTorch registers sub-modules by itself).
struct forgetful_block {
  linear first, second;
  forgetful_block(linear a, linear b) : first(std::move(a)), second(std::move(b)) {}
  tensor_view forward(const tensor_view& x, context& ctx) { return second.forward(first.forward(x, ctx), ctx); }
  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    return first.backward(second.backward(gy, ctx, input_grad::required), ctx, need);
  }
  void parameters(parameter_list& list) {
    auto scope = list.scope("first");
    first.parameters(list);  // the mistake: `second` is not listed
  }
  [[nodiscard]] forgetful_block clone(context& ctx) const { return forgetful_block(first.clone(ctx), second.clone(ctx)); }
  [[nodiscard]] shape output_shape(const shape&) const { return shape{3}; }
};
}  // namespace unlisted_layer_test
using unlisted_layer_test::forgetful_block;

TEST_P(ddp_test, a_parameter_its_layer_does_not_list_is_named_when_a_wrapper_backward_writes_its_gradient) {
  if (!require_devices(2)) return;
  // Unlisted, `second`'s weight would get this rank's gradient only and never be stepped, silently.
  const std::string expected = "parameter weight [3, 8] received a gradient in a data-parallel backward but is not "
                               "one of the model's parameters";
  std::vector<std::string> messages(2);
  run_on_devices(devices(2), [&](rank_context& rc) {
    context ctx(rc.compute_stream());
    initializer init(1);
    forgetful_block model(linear(4, 8, ctx, init), linear(8, 3, ctx, init));
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream());
    tensor x = device_tensor(std::vector<float>(8, 0.5f), shape{2, 4}, ctx.stream());
    tensor g = device_tensor(std::vector<float>(6, 1.0f), shape{2, 3}, ctx.stream());
    (void)ddp.forward(x);
    messages[static_cast<std::size_t>(rc.rank())] = message_of<precondition_error>([&] { ddp.backward(g); });
  });
  for (const auto& m : messages) EXPECT_CONTAINS(m, expected);
  // data_parallel's replicas too
  stream s(dev(0));
  context build(s);
  initializer init(1);
  forgetful_block model(linear(4, 8, build, init), linear(8, 3, build, init));
  data_parallel dp(model, data_parallel_options{.device_ids = devices(2)});
  tensor x = device_tensor(std::vector<float>(8, 0.5f), shape{2, 4}, dp.replica_context(0).stream());
  const tensor_view y = dp.forward(x);
  tensor g = device_tensor(std::vector<float>(6, 1.0f), y.dims(), dp.output_context().stream());
  EXPECT_CONTAINS(message_of<precondition_error>([&] { dp.backward(g); }), expected);
  // outside a wrapper, nothing to check: a layer's own tests run its backward alone
  context alone(s);
  tensor xs = device_tensor(std::vector<float>(8, 0.5f), shape{2, 4}, s);
  (void)model.forward(xs, alone);
  tensor gs = device_tensor(std::vector<float>(6, 1.0f), shape{2, 3}, s);
  EXPECT_NO_THROW((void)model.backward(gs, alone, input_grad::not_required));
}

TEST_P(ddp_test, mean_reduction_is_pytorchs_convention) {
  if (!require_devices(2)) return;
  // Each rank's loss a mean over its own 32 rows, gradients averaged: equal shards give the same update.
  const auto reference = train_single(dev(0), 64);
  std::vector<float> rank0;
  run_on_devices(devices(2), [&](rank_context& rc) {
    context ctx(rc.compute_stream());
    graph model = make_model(ctx);
    distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(),
                                  ddp_options{.reduction = gradient_reduction::mean});
    auto params = parameters_of(model).pointers();
    sgd opt(params, optimizer_options);
    softmax_cross_entropy loss(reduction::mean);
    const auto x = inputs();
    const auto y = labels();
    for (int step = 0; step < steps; ++step) {
      const std::int64_t begin = first_row(step, 64) + 32 * rc.rank();
      tensor xb = device_tensor(slice(x, begin, 32, features), shape{32, features}, rc.compute_stream());
      tensor yb = device_labels(slice(y, begin, 32, 1), rc.compute_stream());
      opt.zero_grad();
      loss.forward(ddp.forward(xb), yb, ctx);  // local mean
      ddp.backward(loss.backward(ctx));
      opt.step(rc.compute_stream());
    }
    if (rc.rank() == 0) rank0 = parameter_values(model, rc.compute_stream());
  });
  EXPECT_LE(relative_difference(rank0, reference), 1e-5);
}

TEST_P(ddp_test, ranks_with_different_models_are_rejected_with_the_rank_and_parameter) {
  if (!require_devices(2)) return;
  const std::string msg = message_of<error>([&] {
    run_on_devices(devices(2), [&](rank_context& rc) {
      context ctx(rc.compute_stream());
      initializer init(1);
      graph g(shape{features});
      g.add("fc1", linear(features, rc.rank() == 0 ? 8 : 9, ctx, init), "input");
      g.add("out", linear(rc.rank() == 0 ? 8 : 9, 2, ctx, init), "fc1");
      distributed_data_parallel ddp(g, ctx, rc.comm(), rc.comm_stream());
    });
  });
  EXPECT_CONTAINS(msg, "of rank 1 is 'fc1.weight' [9, 20] f32 but rank 0's is 'fc1.weight' [8, 20] f32");
  // the compute type decides the buckets' layout: ranks of different precisions are told apart too
  const std::string types = message_of<error>([&] {
    run_on_devices(devices(2), [&](rank_context& rc) {
      context ctx(rc.compute_stream(), rc.rank() == 0 ? dtype::f32 : dtype::f16);
      graph model = make_model(ctx);
      distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(), ddp_options{.zero = zero_stage::optimizer_state});
    });
  });
  EXPECT_CONTAINS(types, "of rank 1 is 'fc1.weight' [32, 20] f16 but rank 0's is 'fc1.weight' [32, 20] f32");
}

// Issue 27 item 8: ranks started with other hyperparameters are refused at the first synchronized backward that can
// see the difference (the optimizer's at the first, the clipper's and the loss scaler's, set at the first step, at
// the second), naming the setting and both values, on every rank; the same settings train on.
TEST_P(ddp_test, ranks_with_different_optimizer_options_or_clipping_are_refused_naming_both_values) {
  if (!require_devices(2)) return;
  // rank 1's learning rate and max_norm (0: no clipping); returns each rank's refusal (empty: none) and its steps
  const auto run = [&](float lr1, float clip1) {
    std::array<std::string, 2> errors;
    std::array<int, 2> steps{};
    run_on_devices(devices(2), [&](rank_context& rc) {
      const auto r = static_cast<std::size_t>(rc.rank());
      context ctx(rc.compute_stream());
      graph model = make_model(ctx);
      distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream());
      const auto params = parameters_of(model);
      sgd opt(params.pointers(), {.lr = rc.rank() == 0 ? 0.1f : lr1, .momentum = 0.9f});
      gradient_clipper clipper(rc.compute_stream());
      const float max_norm = rc.rank() == 0 ? 1.0f : clip1;
      softmax_cross_entropy loss;
      const auto x = inputs();
      const auto y = labels();
      try {
        for (int step = 0; step < 3; ++step) {
          tensor xb = device_tensor(slice(x, 0, 8, features), shape{8, features}, rc.compute_stream());
          tensor yb = device_labels(slice(y, 0, 8, 1), rc.compute_stream());
          opt.zero_grad();
          loss.forward(ddp.forward(xb), yb, ctx);
          ddp.backward(loss.backward(ctx));
          const step_inputs in = max_norm > 0.0f ? clipper.clip_grad_norm(params.pointers(), {.max_norm = max_norm},
                                                                          rc.compute_stream())
                                                 : step_inputs{};
          opt.step(rc.compute_stream(), in);
          ++steps[r];
        }
        rc.comm().synchronize(rc.compute_stream());
      } catch (const precondition_error& e) {
        errors[r] = e.what();
      }
    });
    return std::pair(errors, steps);
  };
  const auto [same, all_steps] = run(0.1f, 1.0f);
  EXPECT_EQ(same[0], "");
  EXPECT_EQ(same[1], "");
  EXPECT_EQ(all_steps[0], 3);
  const auto [lr, lr_steps] = run(5.0f, 1.0f);
  for (const auto& e : lr) {
    EXPECT_CONTAINS(e, "the ranks do not train with the same settings: for the optimizer of 'fc1.weight', rank 0 has "
                       "sgd(lr=0.1, momentum=0.9, dampening=0, weight_decay=0, nesterov=no) and rank 1 has sgd(lr=5, "
                       "momentum=0.9");
  }
  EXPECT_EQ(lr_steps[0], 0);  // refused at the first backward: no step taken
  EXPECT_EQ(lr_steps[1], 0);
  const auto [clip, clip_steps] = run(0.1f, 0.0f);
  for (const auto& e : clip) {
    EXPECT_CONTAINS(e, "for the gradient clipping of 'fc1.weight', rank 0 has clip_grad_norm(max_norm=1, norm=l2) and "
                       "rank 1 has none");
  }
  EXPECT_EQ(clip_steps[0], 1);  // the clipper sets its settings at the first step: refused at the second backward
  EXPECT_EQ(clip_steps[1], 1);
}

// Ranks whose wrappers have other options (other buckets, another ZeRO stage: they would issue other collectives)
// are refused at construction, on every rank, naming both; a visit chunk smaller than a float per rank is refused.
TEST_P(ddp_test, ranks_with_different_wrapper_options_are_refused_at_construction) {
  if (!require_devices(2)) return;
  const auto refusals = [&](const ddp_options& rank_0, const ddp_options& rank_1) {
    std::array<std::string, 2> errors;
    run_on_devices(devices(2), [&](rank_context& rc) {
      context ctx(rc.compute_stream());
      graph model = make_model(ctx);
      try {
        distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream(), rc.rank() == 0 ? rank_0 : rank_1);
      } catch (const precondition_error& e) {
        errors[static_cast<std::size_t>(rc.rank())] = e.what();
      }
    });
    return errors;
  };
  for (const auto& e : refusals({}, {.bucket_bytes = 1024})) {
    EXPECT_CONTAINS(e, "the ranks do not train with the same settings: for the wrapper, rank 0 has buckets of 26214400 "
                       "bytes (the first 1048576), ZeRO stage 0, reduction sum, hook none, buffers broadcast, visit "
                       "chunks of 4194304 bytes, not deterministic and rank 1 has buckets of 1024 bytes (the first "
                       "1048576)");
  }
  // deterministic mode changes the buckets (exact sums), its chunks the gathered partials: refused before any step
  for (const auto& e : refusals({}, {.deterministic = deterministic_options{}})) {
    EXPECT_CONTAINS(e, "not deterministic and rank 1 has ");
    EXPECT_CONTAINS(e, "deterministic in chunks of 32 rows");
  }
  for (const auto& e : refusals({.deterministic = deterministic_options{.chunk_rows = 16}},
                                {.deterministic = deterministic_options{}})) {
    EXPECT_CONTAINS(e, "deterministic in chunks of 16 rows and rank 1 has");
  }
  for (const auto& e : refusals({.zero = zero_stage::gradients}, {.zero = zero_stage::optimizer_state})) {
    EXPECT_CONTAINS(e, "ZeRO stage 2");
    EXPECT_CONTAINS(e, "ZeRO stage 1");
  }
  for (const auto& e : refusals({}, {})) EXPECT_EQ(e, "");
  for (const auto& e : refusals({.visit_chunk_bytes = 4}, {.visit_chunk_bytes = 4})) {
    EXPECT_CONTAINS(e, "visit_chunk_bytes must hold a float per rank (2 ranks: 8 bytes), got 4");
  }
}

TEST_P(ddp_test, a_rank_that_throws_makes_the_others_fail_fast) {
  if (!require_devices(3)) return;
  const auto start = std::chrono::steady_clock::now();
  const std::string msg = message_of<error>([&] {
    run_on_devices(
        devices(3),
        [&](rank_context& rc) {
          context ctx(rc.compute_stream());
          graph model = make_model(ctx);
          distributed_data_parallel ddp(model, ctx, rc.comm(), rc.comm_stream());
          softmax_cross_entropy loss;
          const auto x = inputs();
          const auto y = labels();
          for (int step = 0; step < 5; ++step) {
            if (rc.rank() == 1 && step == 2) throw std::runtime_error("rank 1 ran out of patience");
            tensor xb = device_tensor(slice(x, 0, 8, features), shape{8, features}, rc.compute_stream());
            tensor yb = device_labels(slice(y, 0, 8, 1), rc.compute_stream());
            loss.forward(ddp.forward(xb), yb, ctx);
            ddp.backward(loss.backward(ctx));
            rc.comm().synchronize(rc.compute_stream());
          }
        },
        comm_options{.timeout = std::chrono::seconds(60)});
  });
  EXPECT_CONTAINS(msg, "rank 1");
  EXPECT_CONTAINS(msg, "ran out of patience");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20)) << "the others waited for the timeout";
}
