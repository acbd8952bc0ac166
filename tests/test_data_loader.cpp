// Tests of data/data_loader.hpp on host devices: batch order for every worker count, prefetch depth and sampler;
// ragged last batches; targets; f16/bf16 conversion; errors raised by the dataset; cancellation by start_epoch and
// by destruction; the prefetch bound; steady-state memory; ordering against the compute stream (a blocked copy
// stream, a blocked compute stream); and the real Fashion-MNIST test split. Also built with ThreadSanitizer.
//
// Sample i of the synthetic datasets has input[j] = i * 1000 + j (exact in f32) and label i, so every row of
// every batch can be checked against the sampler's order. Batches are always read back by copies queued on the
// compute stream, as training work would read them.
#include <gtest/gtest.h>

#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "lockstep/data/data_loader.hpp"
#include "lockstep/data/dataset.hpp"
#include "lockstep/data/idx.hpp"
#include "lockstep/data/sampler.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/memory.hpp"
#include "lockstep/runtime/stream.hpp"
#include "test_support.hpp"

using namespace lockstep;
using namespace lockstep_test;
using namespace std::chrono_literals;

namespace {

constexpr device host0{device_kind::host, 0};
constexpr device host1{device_kind::host, 1};

using clock_type = std::chrono::steady_clock;

static_assert(!std::is_copy_constructible_v<data_loader<in_memory_dataset, sequential_sampler>>);
static_assert(!std::is_move_constructible_v<data_loader<in_memory_dataset, sequential_sampler>>);

float value_of(std::size_t sample, std::size_t j) { return static_cast<float>(sample * 1000 + j); }

// n samples of `width` f32; sample i's input j is i * 1000 + j, its label i.
in_memory_dataset numbered(std::size_t n, std::size_t width) {
  std::vector<float> inputs(n * width);
  std::vector<std::int32_t> labels(n);
  for (std::size_t i = 0; i < n; ++i) {
    labels[i] = static_cast<std::int32_t>(i);
    for (std::size_t j = 0; j < width; ++j) inputs[i * width + j] = value_of(i, j);
  }
  return in_memory_dataset(std::move(inputs), {width}, std::move(labels));
}

// Wraps a dataset: counts fetches (in flight, in total, and of indices below `low_limit`), sleeps in each, and
// throws data_error("disk on fire") for index `bad` while armed.
template <class Inner>
class instrumented_dataset {
 public:
  explicit instrumented_dataset(const Inner& inner) : inner_(inner) {}

  [[nodiscard]] std::size_t size() const { return inner_.size(); }
  [[nodiscard]] sample_layout layout() const { return inner_.layout(); }
  void fetch(std::size_t index, sample_ref dst) const {
    const bool low = index < low_limit;
    live.fetch_add(1);
    total.fetch_add(1);
    if (low) {
      live_low.fetch_add(1);
      total_low.fetch_add(1);
    }
    struct leave {
      const instrumented_dataset* d;
      bool low;
      ~leave() {
        if (low) d->live_low.fetch_sub(1);
        d->live.fetch_sub(1);
      }
    } on_exit{this, low};
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    if (armed.load() && index == bad) throw data_error("disk on fire");
    inner_.fetch(index, dst);
  }

  std::chrono::microseconds delay{0};
  std::size_t bad = static_cast<std::size_t>(-1);
  std::atomic<bool> armed{true};
  std::size_t low_limit = 0;
  mutable std::atomic<int> live{0}, live_low{0};
  mutable std::atomic<std::size_t> total{0}, total_low{0};

 private:
  const Inner& inner_;
};

using counted = instrumented_dataset<in_memory_dataset>;

// Epoch e visits [(e % 2) * m, (e % 2 + 1) * m) of a dataset of 2m samples: the epochs touch disjoint indices.
class halves_sampler {
 public:
  explicit halves_sampler(std::size_t m) : m_(m) {}
  [[nodiscard]] std::size_t size() const { return m_; }
  void set_epoch(std::uint64_t e) { epoch_ = e; }
  [[nodiscard]] std::vector<std::size_t> indices() const {
    std::vector<std::size_t> out(m_);
    std::iota(out.begin(), out.end(), static_cast<std::size_t>(epoch_ % 2) * m_);
    return out;
  }

 private:
  std::size_t m_;
  std::uint64_t epoch_ = 0;
};
static_assert(sampler<halves_sampler>);

// A batch copied back to host memory by copies queued on a stream; valid once that stream has been synchronized.
struct host_batch {
  std::size_t index = 0;
  std::int64_t rows = 0;
  std::vector<float> input;
  std::vector<std::int32_t> target;
};

void enqueue_read(const batch& b, stream_ref s, host_batch& out) {
  out.index = b.index;
  out.rows = b.rows;
  out.input.assign(static_cast<std::size_t>(b.input.numel()), -1.0f);
  out.target.assign(static_cast<std::size_t>(b.target.numel()), -1);
  copy(std::span<float>(out.input), b.input.span<const float>(), s);
  copy(std::span<std::int32_t>(out.target), b.target.span<const std::int32_t>(), s);
}

// Rows of `h` hold samples order[index * batch_size + r] of a `numbered` dataset of `width`.
::testing::AssertionResult holds_samples(const host_batch& h, const std::vector<std::size_t>& order,
                                         std::size_t batch_size, std::size_t width) {
  for (std::size_t r = 0; r < static_cast<std::size_t>(h.rows); ++r) {
    const std::size_t position = h.index * batch_size + r;
    if (position >= order.size()) return ::testing::AssertionFailure() << "row " << r << " is past the epoch";
    const std::size_t sample = order[position];
    if (h.target[r] != static_cast<std::int32_t>(sample)) {
      return ::testing::AssertionFailure() << "batch " << h.index << " row " << r << ": target " << h.target[r]
                                           << ", expected sample " << sample;
    }
    for (std::size_t j = 0; j < width; ++j) {
      if (h.input[r * width + j] != value_of(sample, j)) {
        return ::testing::AssertionFailure() << "batch " << h.index << " row " << r << " element " << j << ": "
                                             << h.input[r * width + j] << ", expected " << value_of(sample, j);
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// Runs one epoch and checks every batch against the sampler's order. With `sync_each`, each batch is read back
// and checked before the next is asked for; otherwise every read is queued first and the stream synchronized
// once at the end, so the loader reuses device slots while the reads are still queued. Returns the batches.
template <class Loader>
std::deque<host_batch> check_epoch(Loader& loader, std::uint64_t epoch, const std::vector<std::size_t>& order,
                                   stream_ref compute, std::size_t width, bool sync_each) {
  loader.start_epoch(epoch);
  std::deque<host_batch> seen;
  while (std::optional<batch> b = loader.next()) {
    EXPECT_EQ(b->index, seen.size());
    EXPECT_EQ(b->input.get_device(), compute.get_device());
    EXPECT_EQ(b->input.dims(), shape({b->rows, static_cast<std::int64_t>(width)}));
    EXPECT_EQ(b->target.dims(), shape({b->rows}));
    enqueue_read(*b, compute, seen.emplace_back());
    if (sync_each) {
      compute.synchronize();
      EXPECT_TRUE(holds_samples(seen.back(), order, loader.batch_size(), width));
    }
  }
  compute.synchronize();
  if (!sync_each) {
    for (const host_batch& h : seen) EXPECT_TRUE(holds_samples(h, order, loader.batch_size(), width));
  }
  EXPECT_EQ(seen.size(), loader.batches_per_epoch());
  EXPECT_FALSE(loader.next().has_value()) << "the end of an epoch stays the end";
  return seen;
}

std::vector<std::size_t> order_of(auto s, std::uint64_t epoch) {
  s.set_epoch(epoch);
  return s.indices();
}

template <class F>
bool eventually(F condition, std::chrono::milliseconds timeout = 5000ms) {
  const auto deadline = clock_type::now() + timeout;
  while (!condition()) {
    if (clock_type::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

}  // namespace

// ---- order -----------------------------------------------------------------------------------------------------

// workers, prefetch, shuffled
class loader_order : public ::testing::TestWithParam<std::tuple<int, std::size_t, bool>> {};

TEST_P(loader_order, delivers_the_samplers_order_whatever_the_workers) {
  const auto [workers, prefetch, shuffled] = GetParam();
  constexpr std::size_t n = 103, width = 5, batch_size = 8;  // 13 batches, the last of 7
  const in_memory_dataset data = numbered(n, width);
  stream compute(host0);
  const data_loader_options options{.batch_size = batch_size, .workers = workers, .prefetch = prefetch};
  if (shuffled) {
    const random_sampler order(n, 42);
    data_loader loader(data, order, compute, options);
    EXPECT_EQ(loader.workers(), workers);
    EXPECT_EQ(loader.prefetch(), prefetch);
    ASSERT_EQ(loader.batches_per_epoch(), 13u);
    const auto epoch0 = order_of(order, 0), epoch1 = order_of(order, 1);
    ASSERT_NE(epoch0, epoch1);
    check_epoch(loader, 0, epoch0, compute, width, true);
    check_epoch(loader, 1, epoch1, compute, width, false);
  } else {
    const sequential_sampler order(n);
    data_loader loader(data, order, compute, options);
    ASSERT_EQ(loader.batches_per_epoch(), 13u);
    check_epoch(loader, 0, order_of(order, 0), compute, width, true);
    check_epoch(loader, 1, order_of(order, 1), compute, width, false);
  }
}

INSTANTIATE_TEST_SUITE_P(all, loader_order,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8), ::testing::Values<std::size_t>(2, 3, 4),
                                            ::testing::Bool()),
                         [](const auto& p) {
                           return "workers" + std::to_string(std::get<0>(p.param)) + "_prefetch" +
                                  std::to_string(std::get<1>(p.param)) +
                                  (std::get<2>(p.param) ? "_random" : "_sequential");
                         });

// ---- ragged last batch -------------------------------------------------------------------------------------------

// n, tail
class ragged : public ::testing::TestWithParam<std::tuple<std::size_t, last_batch>> {};

TEST_P(ragged, keep_gives_a_smaller_last_batch_and_drop_none) {
  const auto [n, tail] = GetParam();
  constexpr std::size_t width = 3, batch_size = 5;
  const in_memory_dataset data = numbered(n, width);
  stream compute(host0);
  const random_sampler order(n, 7);
  data_loader loader(data, order, compute, {.batch_size = batch_size, .workers = 3, .tail = tail});
  const std::size_t full = n / batch_size, left = n % batch_size;
  const std::size_t expected_batches = full + (tail == last_batch::keep && left != 0 ? 1 : 0);
  EXPECT_EQ(loader.batches_per_epoch(), expected_batches);
  for (std::uint64_t epoch = 0; epoch < 2; ++epoch) {
    const std::deque<host_batch> seen = check_epoch(loader, epoch, order_of(order, epoch), compute, width, false);
    ASSERT_EQ(seen.size(), expected_batches);
    std::int64_t rows = 0;
    for (std::size_t k = 0; k < seen.size(); ++k) {
      const bool last_partial = k == full;
      EXPECT_EQ(seen[k].rows, static_cast<std::int64_t>(last_partial ? left : batch_size)) << "batch " << k;
      rows += seen[k].rows;
    }
    EXPECT_EQ(rows, static_cast<std::int64_t>(tail == last_batch::keep ? n : full * batch_size));
  }
}

INSTANTIATE_TEST_SUITE_P(all, ragged,
                         ::testing::Combine(::testing::Values<std::size_t>(20, 21, 22),
                                            ::testing::Values(last_batch::keep, last_batch::drop)),
                         [](const auto& p) {
                           return "n" + std::to_string(std::get<0>(p.param)) +
                                  (std::get<1>(p.param) == last_batch::keep ? "_keep" : "_drop");
                         });

TEST(data_loader, an_epoch_shorter_than_a_batch_has_no_batch_with_drop) {
  const in_memory_dataset data = numbered(3, 2);
  stream compute(host0);
  data_loader loader(data, sequential_sampler(3), compute, {.batch_size = 5, .tail = last_batch::drop});
  EXPECT_EQ(loader.batches_per_epoch(), 0u);
  loader.start_epoch(0);
  EXPECT_FALSE(loader.next().has_value());
  EXPECT_FALSE(loader.next().has_value());
}

// ---- targets, shapes and conversion ----------------------------------------------------------------------------

TEST(data_loader, delivers_multidimensional_inputs_and_vector_targets) {
  // Sample i: input [2, 3] with values i * 1000 + j, target [2] = {-i, i + 0.5}.
  constexpr std::size_t n = 23, batch_size = 4;
  std::vector<float> inputs(n * 6), targets(n * 2);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < 6; ++j) inputs[i * 6 + j] = value_of(i, j);
    targets[i * 2] = -static_cast<float>(i);
    targets[i * 2 + 1] = static_cast<float>(i) + 0.5f;
  }
  const in_memory_dataset data(std::move(inputs), {2, 3}, std::move(targets), {2});
  stream compute(host1);
  const random_sampler order(n, 3);
  data_loader loader(data, order, compute, {.batch_size = batch_size, .workers = 2, .prefetch = 3});
  const auto expected = order_of(order, 5);
  loader.start_epoch(5);
  std::size_t count = 0;
  while (std::optional<batch> b = loader.next()) {
    ASSERT_EQ(b->input.get_device(), host1);
    ASSERT_EQ(b->input.type(), dtype::f32);
    ASSERT_EQ(b->input.dims(), shape({b->rows, 2, 3}));
    ASSERT_EQ(b->target.type(), dtype::f32);
    ASSERT_EQ(b->target.dims(), shape({b->rows, 2}));
    std::vector<float> in(static_cast<std::size_t>(b->input.numel())), out(static_cast<std::size_t>(b->target.numel()));
    copy(std::span<float>(in), b->input.span<const float>(), compute);
    copy(std::span<float>(out), b->target.span<const float>(), compute);
    compute.synchronize();
    for (std::size_t r = 0; r < static_cast<std::size_t>(b->rows); ++r) {
      const std::size_t i = expected[b->index * batch_size + r];
      EXPECT_EQ(out[r * 2], -static_cast<float>(i));
      EXPECT_EQ(out[r * 2 + 1], static_cast<float>(i) + 0.5f);
      for (std::size_t j = 0; j < 6; ++j) EXPECT_EQ(in[r * 6 + j], value_of(i, j));
    }
    ++count;
  }
  EXPECT_EQ(count, 6u);  // 5 of 4 and one of 3
}

class conversion : public ::testing::TestWithParam<dtype> {};

TEST_P(conversion, f32_inputs_are_rounded_to_nearest_even_in_pinned_memory) {
  const dtype type = GetParam();
  constexpr std::size_t n = 40, width = 6, batch_size = 6;  // values up to 39005: finite in f16
  const in_memory_dataset data = numbered(n, width);
  stream compute(host1);
  const random_sampler order(n, 11);
  data_loader loader(data, order, compute, {.batch_size = batch_size, .workers = 3, .input_type = type});
  const auto expected = order_of(order, 0);
  loader.start_epoch(0);
  std::size_t rows_checked = 0;
  bool saw_tie_sample = false;
  while (std::optional<batch> b = loader.next()) {
    ASSERT_EQ(b->input.type(), type);
    ASSERT_EQ(b->input.dims(), shape({b->rows, static_cast<std::int64_t>(width)}));
    ASSERT_EQ(b->target.type(), dtype::i32);  // targets are never converted
    std::vector<std::uint16_t> bits(static_cast<std::size_t>(b->input.numel()));
    std::vector<std::int32_t> labels(static_cast<std::size_t>(b->rows));
    dispatch_floating(type, "test", [&]<class T>() {
      if constexpr (!std::is_same_v<T, float>) {
        std::vector<T> in(bits.size());
        copy(std::span<T>(in), b->input.span<const T>(), compute);
        copy(std::span<std::int32_t>(labels), b->target.span<const std::int32_t>(), compute);
        compute.synchronize();
        for (std::size_t e = 0; e < in.size(); ++e) bits[e] = in[e].bits;
      }
    });
    for (std::size_t r = 0; r < static_cast<std::size_t>(b->rows); ++r) {
      const std::size_t i = expected[b->index * batch_size + r];
      ASSERT_EQ(labels[r], static_cast<std::int32_t>(i));
      for (std::size_t j = 0; j < width; ++j) {
        const std::uint16_t want = type == dtype::f16 ? to_half(value_of(i, j)).bits : to_bfloat16(value_of(i, j)).bits;
        ASSERT_EQ(bits[r * width + j], want) << "sample " << i << " element " << j;
      }
      if (i == 3) {
        // 3005 is halfway between the halves 3004 and 3006 (ties to the even 3004); the nearest bfloat16 is 3008.
        const std::uint16_t got = bits[r * width + 5];
        const float value = type == dtype::f16 ? to_float(lockstep::half::from_bits(got))
                                                 : to_float(lockstep::bfloat16::from_bits(got));
        EXPECT_EQ(value, type == dtype::f16 ? 3004.0f : 3008.0f);
        saw_tie_sample = true;
      }
      ++rows_checked;
    }
  }
  EXPECT_EQ(rows_checked, n);
  EXPECT_TRUE(saw_tie_sample);
}

INSTANTIATE_TEST_SUITE_P(all, conversion, ::testing::Values(dtype::f16, dtype::bf16),
                         [](const auto& p) { return std::string(name_of(p.param)); });

// A dataset of u8 inputs (4 bytes per sample: i, i + 1, i + 2, i + 3) and i32 labels.
class byte_dataset {
 public:
  explicit byte_dataset(std::size_t n) : n_(n) {}
  [[nodiscard]] std::size_t size() const { return n_; }
  [[nodiscard]] sample_layout layout() const { return {{4}, dtype::u8, {}, dtype::i32}; }
  void fetch(std::size_t index, sample_ref dst) const {
    detail::check_fetch(layout(), n_, index, dst);
    for (std::size_t j = 0; j < 4; ++j) dst.input[j] = static_cast<std::byte>(index + j);
    const auto label = static_cast<std::int32_t>(index);
    std::memcpy(dst.target.data(), &label, sizeof label);
  }

 private:
  std::size_t n_;
};

TEST(data_loader, non_f32_inputs_pass_through_unchanged) {
  const byte_dataset data(50);
  stream compute(host0);
  data_loader loader(data, sequential_sampler(50), compute, {.batch_size = 8, .workers = 2, .input_type = dtype::u8});
  loader.start_epoch(0);
  std::size_t rows = 0;
  while (std::optional<batch> b = loader.next()) {
    ASSERT_EQ(b->input.type(), dtype::u8);
    const std::vector<std::uint8_t> in = to_vector(b->input.span<const std::uint8_t>(), compute);
    for (std::size_t r = 0; r < static_cast<std::size_t>(b->rows); ++r) {
      const std::size_t i = b->index * 8 + r;
      for (std::size_t j = 0; j < 4; ++j) ASSERT_EQ(in[r * 4 + j], static_cast<std::uint8_t>(i + j));
      ++rows;
    }
  }
  EXPECT_EQ(rows, 50u);
}

// ---- errors ------------------------------------------------------------------------------------------------------

TEST(data_loader, a_failing_sample_surfaces_from_next_for_its_batch_and_the_loader_restarts) {
  constexpr std::size_t n = 64, width = 4, batch_size = 4;
  const in_memory_dataset inner = numbered(n, width);
  counted data(inner);
  data.bad = 22;  // position 22: row 2 of batch 5
  stream compute(host0);
  const sequential_sampler order(n);
  data_loader loader(data, order, compute, {.batch_size = batch_size, .workers = 4, .prefetch = 3});
  const auto expected = order_of(order, 0);
  loader.start_epoch(0);
  for (std::size_t k = 0; k < 5; ++k) {
    std::optional<batch> b = loader.next();
    ASSERT_TRUE(b.has_value());
    host_batch h;
    enqueue_read(*b, compute, h);
    compute.synchronize();
    EXPECT_TRUE(holds_samples(h, expected, batch_size, width));
  }
  try {
    (void)loader.next();
    ADD_FAILURE() << "next() for the batch holding sample 22 did not throw";
  } catch (const data_error& e) {
    const std::string msg = e.what();
    EXPECT_CONTAINS(msg, "sample 22");
    EXPECT_CONTAINS(msg, "batch 5");
    EXPECT_CONTAINS(msg, "row 2");
    EXPECT_CONTAINS(msg, "worker ");
    EXPECT_CONTAINS(msg, " of 4");
    EXPECT_CONTAINS(msg, "disk on fire");
    try {
      std::rethrow_if_nested(e);
      ADD_FAILURE() << "the original exception is not nested";
    } catch (const data_error& original) {
      EXPECT_STREQ(original.what(), "disk on fire");
    }
  }
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)loader.next(); }), "start_epoch");
  EXPECT_EQ(data.live.load(), 0) << "the failed epoch's workers were waited for";

  data.armed = false;
  check_epoch(loader, 1, order_of(order, 1), compute, width, false);
  data.armed = true;  // and fails again, cleanly, in the next epoch
  loader.start_epoch(2);
  EXPECT_THROW(
      {
        while (loader.next()) {
        }
      },
      data_error);
  data.armed = false;
  check_epoch(loader, 3, order_of(order, 3), compute, width, true);
}

TEST(data_loader, the_error_names_the_dataset_index_not_the_position) {
  constexpr std::size_t n = 50, width = 2, batch_size = 4;
  const in_memory_dataset inner = numbered(n, width);
  counted data(inner);
  data.bad = 7;
  stream compute(host0);
  const random_sampler order(n, 99);
  const auto expected = order_of(order, 0);
  const auto position = static_cast<std::size_t>(std::find(expected.begin(), expected.end(), 7) - expected.begin());
  ASSERT_NE(position, 7u) << "pick another seed: the test needs the index and its position to differ";
  data_loader loader(data, order, compute, {.batch_size = batch_size, .workers = 2});
  loader.start_epoch(0);
  std::size_t delivered = 0;
  const std::string msg = message_of<data_error>([&] {
    while (std::optional<batch> b = loader.next()) {
      host_batch h;
      enqueue_read(*b, compute, h);
      compute.synchronize();
      EXPECT_TRUE(holds_samples(h, expected, batch_size, width));
      ++delivered;
    }
  });
  EXPECT_EQ(delivered, position / batch_size) << "every batch before the failing one is delivered";
  EXPECT_CONTAINS(msg, "sample 7 ");
  EXPECT_CONTAINS(msg, "batch " + std::to_string(position / batch_size) + " ");
  EXPECT_CONTAINS(msg, "row " + std::to_string(position % batch_size));
}

// ---- cancellation ------------------------------------------------------------------------------------------------

TEST(data_loader, destruction_mid_epoch_stops_and_joins_the_workers_promptly) {
  constexpr std::size_t n = 1600, width = 4, batch_size = 32;  // 50 batches
  constexpr std::size_t prefetch = 4, workers = 4;
  const in_memory_dataset inner = numbered(n, width);
  counted data(inner);
  data.delay = 2ms;  // a batch takes a worker 64 ms, the epoch 4 workers 800 ms
  stream compute(host0);
  auto loader = std::make_unique<data_loader<counted, sequential_sampler>>(
      data, sequential_sampler(n), compute,
      data_loader_options{.batch_size = batch_size, .workers = workers, .prefetch = prefetch});
  loader->start_epoch(0);
  std::optional<batch> b = loader->next();
  ASSERT_TRUE(b.has_value());
  host_batch h;
  enqueue_read(*b, compute, h);
  // Batches 1..3 were assembled alongside batch 0; batch 4 (claimable once batch 0 was handed out) takes 64 ms.
  ASSERT_TRUE(eventually([&] { return data.live.load() > 0; })) << "the workers are busy prefetching";
  std::this_thread::sleep_for(10ms);  // well inside it
  const std::size_t started = data.total.load();
  const auto start = clock_type::now();
  loader.reset();
  const auto took = clock_type::now() - start;
  EXPECT_EQ(data.live.load(), 0) << "a fetch is still running after the destructor returned";
  EXPECT_LT(took, 250ms);
  // Each worker finishes the sample it is fetching (and may have begun one more as the destructor started); it
  // does not finish its batch.
  EXPECT_LE(data.total.load() - started, 2 * workers);
  // Batches 1..prefetch at most were claimed after batch 0: nothing beyond them was fetched.
  EXPECT_LE(data.total.load(), (prefetch + 1) * batch_size);
  const std::size_t total = data.total.load();
  std::this_thread::sleep_for(10ms);
  EXPECT_EQ(data.total.load(), total) << "no fetch after destruction";
  compute.synchronize();  // the read queued before the destruction is intact
  EXPECT_TRUE(holds_samples(h, order_of(sequential_sampler(n), 0), batch_size, width));
}

TEST(data_loader, start_epoch_mid_epoch_cancels_the_old_epochs_work) {
  constexpr std::size_t m = 160, width = 3, batch_size = 8;
  const in_memory_dataset inner = numbered(2 * m, width);
  counted data(inner);
  data.delay = 1ms;
  data.low_limit = m;  // epoch 0 fetches indices below m, epoch 1 at or above
  stream compute(host0);
  const halves_sampler order(m);
  data_loader loader(data, order, compute, {.batch_size = batch_size, .workers = 4, .prefetch = 3});
  loader.start_epoch(0);
  const auto expected0 = order_of(order, 0);
  for (std::size_t k = 0; k < 3; ++k) {
    std::optional<batch> b = loader.next();
    ASSERT_TRUE(b.has_value());
    host_batch h;
    enqueue_read(*b, compute, h);
    compute.synchronize();
    EXPECT_TRUE(holds_samples(h, expected0, batch_size, width));
  }
  ASSERT_TRUE(eventually([&] { return data.live_low.load() > 0; })) << "epoch 0 is prefetching";
  loader.start_epoch(1);
  EXPECT_EQ(data.live_low.load(), 0) << "start_epoch returned while a fetch of the old epoch was running";
  const std::size_t old_fetches = data.total_low.load();
  EXPECT_LE(old_fetches, (3 + 3) * batch_size);
  const auto expected1 = order_of(order, 1);
  std::size_t count = 0;
  while (std::optional<batch> b = loader.next()) {
    EXPECT_EQ(b->index, count++);
    host_batch h;
    enqueue_read(*b, compute, h);
    compute.synchronize();
    EXPECT_TRUE(holds_samples(h, expected1, batch_size, width));
  }
  EXPECT_EQ(count, m / batch_size);
  EXPECT_EQ(data.total_low.load(), old_fetches) << "the cancelled epoch went on fetching";
  // And back to epoch 0's half, from its start.
  check_epoch(loader, 2, order_of(order, 2), compute, width, false);
}

TEST(data_loader, workers_stay_at_most_prefetch_batches_ahead) {
  constexpr std::size_t n = 200, width = 2, batch_size = 4, prefetch = 3;
  const in_memory_dataset inner = numbered(n, width);
  counted data(inner);
  stream compute(host0);
  data_loader loader(data, sequential_sampler(n), compute,
                     {.batch_size = batch_size, .workers = 8, .prefetch = prefetch});
  const auto settled_at = [&](std::size_t samples) {
    if (!eventually([&] { return data.total.load() >= samples; })) return false;
    std::this_thread::sleep_for(30ms);
    return data.total.load() == samples;
  };
  EXPECT_EQ(data.total.load(), 0u) << "nothing is produced before start_epoch";
  loader.start_epoch(0);
  EXPECT_TRUE(settled_at(prefetch * batch_size)) << data.total.load();
  for (std::size_t k = 0; k < 3; ++k) {
    std::optional<batch> b = loader.next();
    ASSERT_TRUE(b.has_value());
    // Holding batch k, the workers assemble k+1 .. k+prefetch and stop.
    EXPECT_TRUE(settled_at((k + 1 + prefetch) * batch_size)) << "holding batch " << k << ": " << data.total.load();
  }
}

// ---- streams and memory ------------------------------------------------------------------------------------------

TEST(data_loader, after_the_first_batches_no_device_memory_is_allocated) {
  constexpr std::size_t n = 90, width = 16, batch_size = 8;  // 12 batches, the last of 2
  constexpr std::size_t prefetch = 3;
  const in_memory_dataset data = numbered(n, width);
  stream compute(host0);
  compute.synchronize();
  const memory_stats before = get_memory_stats(host0);
  {
    const random_sampler order(n, 5);
    data_loader loader(data, order, compute, {.batch_size = batch_size, .workers = 2, .prefetch = prefetch});
    const auto expected = order_of(order, 0);
    loader.start_epoch(0);
    std::deque<host_batch> seen;
    for (std::size_t k = 0; k < prefetch + 1; ++k) {
      std::optional<batch> b = loader.next();
      ASSERT_TRUE(b.has_value());
      enqueue_read(*b, compute, seen.emplace_back());
    }
    const memory_stats warm = get_memory_stats(host0);
    while (std::optional<batch> b = loader.next()) enqueue_read(*b, compute, seen.emplace_back());
    compute.synchronize();
    for (const host_batch& h : seen) EXPECT_TRUE(holds_samples(h, expected, batch_size, width));
    check_epoch(loader, 1, order_of(order, 1), compute, width, false);
    loader.start_epoch(2);  // and an epoch cancelled after two batches
    ASSERT_TRUE(loader.next().has_value());
    ASSERT_TRUE(loader.next().has_value());
    check_epoch(loader, 3, order_of(order, 3), compute, width, false);
    const memory_stats steady = get_memory_stats(host0);
    EXPECT_EQ(steady.allocations, warm.allocations);
    EXPECT_EQ(steady.system_allocations, warm.system_allocations);
    EXPECT_GT(warm.live_allocations, before.live_allocations) << "the device slots live on the device";
  }
  compute.synchronize();
  EXPECT_EQ(get_memory_stats(host0).live_allocations, before.live_allocations) << "the loader leaked device memory";
}

TEST(data_loader, the_compute_stream_waits_for_a_blocked_copy_stream_not_the_host) {
  constexpr std::size_t n = 64, width = 4, batch_size = 4, prefetch = 2;
  const in_memory_dataset data = numbered(n, width);
  stream compute(host0);
  const random_sampler order(n, 17);
  data_loader loader(data, order, compute, {.batch_size = batch_size, .workers = 2, .prefetch = prefetch});
  check_epoch(loader, 0, order_of(order, 0), compute, width, true);  // the device slots now hold epoch 0's data

  loader.start_epoch(1);
  gate g;
  detail::enqueue_host(loader.copy_stream(), [&g] { g.wait(); }, "test: hold the copy stream");
  std::deque<host_batch> seen;
  for (std::size_t k = 0; k < prefetch; ++k) {  // assembled without the copy stream's help
    std::optional<batch> b = loader.next();     // returns although its copy cannot have run
    ASSERT_TRUE(b.has_value());
    enqueue_read(*b, compute, seen.emplace_back());
  }
  std::this_thread::sleep_for(10ms);
  EXPECT_FALSE(compute.ready()) << "the compute stream did not wait for the copies";
  g.release();
  compute.synchronize();
  const auto expected = order_of(order, 1);
  for (const host_batch& h : seen) EXPECT_TRUE(holds_samples(h, expected, batch_size, width));
  while (std::optional<batch> b = loader.next()) enqueue_read(*b, compute, seen.emplace_back());
  compute.synchronize();
  EXPECT_EQ(seen.size(), n / batch_size);
  for (const host_batch& h : seen) EXPECT_TRUE(holds_samples(h, expected, batch_size, width));
}

TEST(data_loader, a_device_slot_is_not_overwritten_while_the_compute_stream_may_read_it) {
  constexpr std::size_t n = 40, width = 4, batch_size = 4, prefetch = 2;  // device slots: prefetch + 1 = 3
  const in_memory_dataset data = numbered(n, width);
  stream compute(host0);
  const sequential_sampler order(n);
  data_loader loader(data, order, compute, {.batch_size = batch_size, .workers = 2, .prefetch = prefetch});
  loader.start_epoch(0);
  gate g;
  detail::enqueue_host(compute, [&g] { g.wait(); }, "test: hold the compute stream");
  // Batch prefetch + 1 reuses batch 0's device slot while the reads of batch 0 are still queued. (With the compute
  // stream held, at most 2 * prefetch + 1 batches can be handed out: later ones need pinned slots freed by copies
  // that wait for the compute stream.)
  std::deque<host_batch> seen;
  for (std::size_t k = 0; k < prefetch + 2; ++k) {
    std::optional<batch> b = loader.next();
    ASSERT_TRUE(b.has_value());
    enqueue_read(*b, compute, seen.emplace_back());
  }
  std::this_thread::sleep_for(20ms);  // time for a wrongly ordered copy to overwrite slot 0
  EXPECT_FALSE(compute.ready());
  g.release();
  compute.synchronize();
  const auto expected = order_of(order, 0);
  for (const host_batch& h : seen) EXPECT_TRUE(holds_samples(h, expected, batch_size, width));
  while (std::optional<batch> b = loader.next()) enqueue_read(*b, compute, seen.emplace_back());
  compute.synchronize();
  EXPECT_EQ(seen.size(), n / batch_size);
  for (const host_batch& h : seen) EXPECT_TRUE(holds_samples(h, expected, batch_size, width));
}

TEST(data_loader, slow_fetches_and_a_slowed_copy_stream_still_deliver_every_batch_in_order) {
  constexpr std::size_t n = 48, width = 3, batch_size = 4;
  const in_memory_dataset inner = numbered(n, width);
  counted data(inner);
  data.delay = 300us;
  stream compute(host0);
  const random_sampler order(n, 23);
  data_loader loader(data, order, compute, {.batch_size = batch_size, .workers = 3, .prefetch = 2});
  loader.start_epoch(0);
  std::deque<host_batch> seen;
  for (;;) {
    detail::enqueue_host(loader.copy_stream(), [] { std::this_thread::sleep_for(2ms); }, "test: slow copy");
    std::optional<batch> b = loader.next();
    if (!b) break;
    enqueue_read(*b, compute, seen.emplace_back());
  }
  compute.synchronize();
  ASSERT_EQ(seen.size(), n / batch_size);
  const auto expected = order_of(order, 0);
  for (const host_batch& h : seen) EXPECT_TRUE(holds_samples(h, expected, batch_size, width));
}

// ---- options and preconditions -----------------------------------------------------------------------------------

TEST(data_loader, defaults) {
  const in_memory_dataset data = numbered(10, 2);
  stream compute(host0);
  const int cores = detail::host_cores();  // the affinity mask's (the next test)
  {
    data_loader loader(data, sequential_sampler(10), compute);
    EXPECT_EQ(loader.batch_size(), 128u);
    EXPECT_EQ(loader.workers(), std::max(1, std::min(4, cores)));
    EXPECT_EQ(loader.prefetch(), std::max<std::size_t>(2, loader.workers()));  // every worker can be busy
    EXPECT_EQ(loader.batches_per_epoch(), 1u);
    EXPECT_EQ(loader.get_device(), host0);
    EXPECT_EQ(loader.copy_stream().get_device(), host0);
    EXPECT_FALSE(loader.copy_stream() == loader.compute_stream());
  }
  {
    data_loader loader(data, sequential_sampler(10), compute, {.device_count_hint = 2, .prefetch = 1});
    EXPECT_EQ(loader.workers(), std::max(1, std::min(8, cores)));
    EXPECT_EQ(loader.prefetch(), 2u) << "prefetch is at least 2";
  }
}

#if defined(__linux__)
// The default worker count follows the cores this process may run on (its affinity mask: taskset, mpirun's binding),
// not the machine's CPUs, which std::thread::hardware_concurrency counts.
TEST(data_loader, default_workers_follow_the_affinity_mask) {
  const in_memory_dataset data = numbered(10, 2);
  stream compute(host0);
  struct restore_mask {  // the later tests of this program run on every CPU again, also if this one fails
    cpu_set_t mask;
    ~restore_mask() { (void)sched_setaffinity(0, sizeof(mask), &mask); }
  } before{};
  ASSERT_EQ(sched_getaffinity(0, sizeof(before.mask), &before.mask), 0);
  int first = 0;
  while (!CPU_ISSET(first, &before.mask)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);  // this thread only: the loader reads the caller's mask
  data_loader loader(data, sequential_sampler(10), compute, {.device_count_hint = 2});
  EXPECT_EQ(loader.workers(), 1) << "one core: one worker, whatever the machine has";
}
#endif

TEST(data_loader, preconditions_say_what_is_wrong) {
  const in_memory_dataset data = numbered(10, 2);
  stream compute(host0);
  const sequential_sampler order(10);
  using loader = data_loader<in_memory_dataset, sequential_sampler>;
  EXPECT_CONTAINS(message_of<precondition_error>([&] { loader l(data, order, compute, {.batch_size = 0}); }),
                  "batch_size must be at least 1");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { loader l(data, order, compute, {.workers = -1}); }),
                  "workers must be >= 0");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { loader l(data, order, compute, {.device_count_hint = 0}); }),
                  "device_count_hint must be 1");
  EXPECT_CONTAINS(
      message_of<precondition_error>([&] { loader l(data, order, compute, {.input_type = dtype::i32}); }),
      "convert to f16 or bf16 only");

  const byte_dataset bytes(10);
  const std::string msg = message_of<precondition_error>([&] {
    data_loader l(bytes, order, compute, {.input_type = dtype::f16});
  });
  EXPECT_CONTAINS(msg, "the dataset's inputs are u8");
  EXPECT_CONTAINS(msg, "set options.input_type = dtype::u8");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { data_loader l(bytes, order, compute); }),
                  "the dataset's inputs are u8");

  const in_memory_dataset rank4(std::vector<float>(32), {2, 2, 2, 2}, std::vector<std::int32_t>(2));
  EXPECT_CONTAINS(message_of<precondition_error>([&] { loader l(rank4, sequential_sampler(2), compute); }),
                  "a sample has at most 3");

  loader l(data, sequential_sampler(15), compute, {.batch_size = 4});  // a sampler larger than the dataset
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)l.next(); }), "call start_epoch");
  const std::string range = message_of<precondition_error>([&] { l.start_epoch(0); });
  EXPECT_CONTAINS(range, "index 10 at position 10");
  EXPECT_CONTAINS(range, "dataset of 10 samples");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)l.next(); }), "call start_epoch");
}

// ---- Fashion-MNIST -----------------------------------------------------------------------------------------------

TEST(data_loader, fashion_mnist_test_split_in_batches_of_1000) {
  const std::filesystem::path dir{default_fashion_mnist_dir};
  if (!std::filesystem::is_directory(dir)) {
    GTEST_SKIP() << dir << " is missing; install the Debian package dataset-fashion-mnist to run this test";
  }
  const mnist_dataset data = load_fashion_mnist(dir, mnist_split::test);
  stream compute(host0);
  data_loader loader(data, sequential_sampler(data.size()), compute, {.batch_size = 1000});
  ASSERT_EQ(loader.batches_per_epoch(), 10u);
  loader.start_epoch(0);
  std::vector<float> expected(784);
  std::int32_t label = -1;
  std::size_t count = 0;
  while (std::optional<batch> b = loader.next()) {
    ASSERT_EQ(b->index, count);
    ASSERT_EQ(b->rows, 1000);
    ASSERT_EQ(b->input.dims(), shape({1000, 784}));
    const std::vector<float> pixels = to_vector(b->input.span<const float>(), compute);
    const std::vector<std::int32_t> labels = to_vector(b->target.span<const std::int32_t>(), compute);
    for (std::size_t r = 0; r < 1000; ++r) {
      const std::size_t i = count * 1000 + r;
      ASSERT_EQ(labels[r], data.label(i)) << "sample " << i;
      data.fetch(i, {std::as_writable_bytes(std::span(expected)), std::as_writable_bytes(std::span(&label, 1))});
      ASSERT_EQ(std::memcmp(pixels.data() + r * 784, expected.data(), 784 * sizeof(float)), 0) << "sample " << i;
    }
    ++count;
  }
  EXPECT_EQ(count, 10u);
}
