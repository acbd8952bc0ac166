// Tests of runtime/: streams, events, device and pinned buffers, copies, memory statistics, caching and
// out-of-memory. Also built with ThreadSanitizer (the stream/event machinery is threads underneath).
//
// Tests parameterized over the backend run on host devices here and skip their CUDA instance without a GPU.
#include <gtest/gtest.h>

#if defined(__linux__)
#include <pthread.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <latch>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/device/device_set.hpp"
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/kernels/multi_tensor.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/memory.hpp"
#include "lockstep/runtime/pinned_buffer.hpp"
#include "lockstep/runtime/stream.hpp"
#include "lockstep/runtime/tensor.hpp"
#include "test_support.hpp"

using namespace lockstep;
using namespace lockstep_test;
using namespace std::chrono_literals;

namespace {

constexpr device host0{device_kind::host, 0};
constexpr device host1{device_kind::host, 1};

template <class F>
void in_fresh_process(F body) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        try {
          body();
        } catch (const std::exception& e) {
          std::fprintf(stderr, "unexpected exception: %s\n", e.what());
          std::exit(3);
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

// Both backends: the CUDA instance skips without a GPU.
class backend : public ::testing::TestWithParam<device_kind> {
 protected:
  void SetUp() override {
    if (GetParam() == device_kind::cuda && !cuda_available()) GTEST_SKIP() << "no GPU: " << cuda_status().reason();
  }
  device dev(int i) const { return device{GetParam(), i}; }
  int count() const { return device_count(GetParam()); }
};

std::string kind_name(const ::testing::TestParamInfo<device_kind>& info) { return std::string(name_of(info.param)); }

}  // namespace

INSTANTIATE_TEST_SUITE_P(all, backend, ::testing::Values(device_kind::host, device_kind::cuda), kind_name);

// ---- streams ---------------------------------------------------------------------------------------------------

#if defined(__linux__)
// A host stream's worker carries the stream's name (as top -H, perf and gdb show threads); host:0's labels fit
// Linux's 15 bytes whole.
TEST(host_stream, its_worker_thread_is_named_after_the_stream) {
  stream s(host0);
  std::string name;
  detail::enqueue_host(s, [&] {
    char text[16] = {};
    if (pthread_getname_np(pthread_self(), text, sizeof(text)) == 0) name = text;
  }, "read the thread's name");
  s.synchronize();
  const std::string label = s.ref().host_state().label();
  EXPECT_EQ(name, label.substr(0, 15)) << label;
  EXPECT_EQ(name.rfind("host:0 ", 0), 0u) << name;
}
#endif

TEST(host_stream, runs_queued_work_in_order_and_asynchronously) {
  stream s(host0);
  gate g;
  std::vector<int> seen;
  detail::enqueue_host(s, [&] { g.wait(); }, "test gate");
  for (int i = 0; i < 1000; ++i) detail::enqueue_host(s, [&seen, i] { seen.push_back(i); }, "test work");
  EXPECT_FALSE(s.ready());  // the caller got control back while the stream is blocked
  g.release();
  s.synchronize();
  EXPECT_TRUE(s.ready());
  std::vector<int> expected(1000);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(seen, expected);
}

TEST(host_stream, destroying_a_stream_completes_its_work_first) {
  std::atomic<int> done{0};
  {
    stream s(host1);
    for (int i = 0; i < 100; ++i) {
      detail::enqueue_host(s, [&done] {
        std::this_thread::sleep_for(100us);
        done.fetch_add(1);
      }, "test work");
    }
  }
  EXPECT_EQ(done.load(), 100);
}

TEST(host_stream, queued_work_may_be_move_only_or_larger_than_the_inline_storage_and_is_released_after_it_runs) {
  stream s(host0);
  gate g;
  detail::enqueue_host(s, [&] { g.wait(); }, "test gate");
  auto held = std::make_shared<int>(0);
  std::unique_ptr<int> owned = std::make_unique<int>(5);  // move-only: std::function could not hold it
  detail::enqueue_host(s, [owned = std::move(owned), held] { *held += *owned; }, "test move-only work");
  std::array<std::int64_t, 40> big{};  // 320 bytes: stored on the heap
  std::iota(big.begin(), big.end(), 1);
  detail::enqueue_host(
      s, [big, held] { *held += static_cast<int>(std::accumulate(big.begin(), big.end(), std::int64_t{0})); },
      "test large work");
  EXPECT_EQ(held.use_count(), 3);  // both captures wait in the queue
  g.release();
  s.synchronize();
  EXPECT_EQ(*held, 5 + 40 * 41 / 2);
  EXPECT_EQ(held.use_count(), 1);  // each callable destroyed once it ran

  host_backend::task_body a = [&held] { ++*held; };
  host_backend::task_body b = std::move(a);
  EXPECT_FALSE(static_cast<bool>(a));  // NOLINT(bugprone-use-after-move): a moved-from body is empty
  b();
  EXPECT_EQ(*held, 5 + 820 + 1);
  b = nullptr;
  EXPECT_FALSE(static_cast<bool>(b));
}

TEST(host_stream, an_exception_in_queued_work_is_rethrown_at_the_next_synchronization) {
  stream s(host0);
  std::atomic<bool> later_ran{false};
  detail::enqueue_host(s, [] { throw std::runtime_error("boom in a kernel"); }, "test kernel");
  detail::enqueue_host(s, [&] { later_ran = true; }, "later work");
  try {
    s.synchronize();
    FAIL() << "synchronize did not rethrow";
  } catch (const async_error& e) {
    const std::string msg = e.what();
    EXPECT_CONTAINS(msg, "host:0 stream");
    EXPECT_CONTAINS(msg, "(test kernel)");
    EXPECT_CONTAINS(msg, "boom in a kernel");
    try {
      std::rethrow_if_nested(e);
      FAIL() << "the original exception is not nested";
    } catch (const std::runtime_error& original) {
      EXPECT_STREQ(original.what(), "boom in a kernel");
    }
  }
  EXPECT_FALSE(later_ran.load());     // like kernels after a sticky error on a GPU, later work did not run
  EXPECT_NO_THROW(s.synchronize());   // reported once
  detail::enqueue_host(s, [&] { later_ran = true; }, "work after the report");
  s.synchronize();
  EXPECT_TRUE(later_ran.load());      // the stream works again once its error is reported
  // a query reports it too (as cudaStreamQuery does), once the failed work is done, and once
  detail::enqueue_host(s, [] { throw std::runtime_error("boom again"); }, "test kernel");
  for (;;) {  // until the failed work has run: then ready() throws, or returns true and the test fails
    try {
      if (s.ready()) {
        ADD_FAILURE() << "ready() hid the error";
        break;
      }
    } catch (const async_error& e) {
      EXPECT_CONTAINS(std::string(e.what()), "boom again");
      break;
    }
    std::this_thread::yield();
  }
  EXPECT_TRUE(s.ready());
}

TEST(host_stream, only_the_first_error_is_kept_and_device_synchronize_reports_it) {
  stream s(host1);
  detail::enqueue_host(s, [] { throw std::runtime_error("first"); }, "a");
  detail::enqueue_host(s, [] { throw std::runtime_error("second"); }, "b");
  const std::string msg = message_of<async_error>([] { synchronize(host1); });
  EXPECT_CONTAINS(msg, "first");
  EXPECT_EQ(msg.find("second"), std::string::npos);
  EXPECT_NO_THROW(s.synchronize());
}

TEST(host_stream, synchronizing_a_stream_from_its_own_work_is_an_error_not_a_deadlock) {
  stream s(host0);
  stream_ref r = s;
  detail::enqueue_host(s, [r] { r.synchronize(); }, "self wait");
  EXPECT_CONTAINS(message_of<async_error>([&] { s.synchronize(); }), "would wait for itself");
}

TEST(host_stream, default_stream_is_one_per_device) {
  EXPECT_EQ(default_stream(host0), default_stream(host0));
  EXPECT_FALSE(default_stream(host0) == default_stream(host1));
  EXPECT_EQ(default_stream(host1).get_device(), host1);
  EXPECT_THROW((void)default_stream(device{device_kind::host, 7}), device_error);
  EXPECT_THROW(stream(device{device_kind::host, 7}), device_error);
}

// ---- events ----------------------------------------------------------------------------------------------------

TEST(host_event, orders_work_across_streams) {
  stream a(host0), b(host0), c(host1);
  event e(host0);
  for (int round = 0; round < 50; ++round) {
    int value = 0;  // written on a, read on b and c: ordered only by the event
    int seen_b = -1, seen_c = -1;
    detail::enqueue_host(a, [&value, round] {
      std::this_thread::sleep_for(std::chrono::microseconds(50 * (round % 5)));
      value = round + 1;
    }, "producer");
    e.record(a);
    b.wait(e);
    c.wait(e);  // a stream of another device may wait too
    detail::enqueue_host(b, [&] { seen_b = value; }, "consumer");
    detail::enqueue_host(c, [&] { seen_c = value; }, "consumer");
    b.synchronize();
    c.synchronize();
    EXPECT_EQ(seen_b, round + 1);
    EXPECT_EQ(seen_c, round + 1);
  }
}

TEST(host_event, a_stream_that_waits_for_failed_work_fails_too_and_skips_its_later_work) {
  // The DDP pattern: a collective fails on the communication stream; the compute stream waits for its event.
  stream comm(host0), compute(host0), other(host1);
  event done(host0);
  std::atomic<int> ran{0};
  detail::enqueue_host(comm, [] { throw timeout_error("all_reduce #3 timed out"); }, "all_reduce", true);
  done.record(comm);
  compute.wait(done);
  other.wait(done);  // another device's stream too
  detail::enqueue_host(compute, [&] { ++ran; }, "optimizer step");
  detail::enqueue_host(other, [&] { ++ran; }, "other work");
  done.synchronize();  // the record itself completes: nobody waits for it in vain
  const std::string msg = message_of<async_error>([&] { compute.synchronize(); });
  EXPECT_CONTAINS(msg, "waited for an event recorded after failed work");
  EXPECT_CONTAINS(msg, "(all_reduce)");
  EXPECT_CONTAINS(msg, "all_reduce #3 timed out");
  try {
    other.synchronize();
    ADD_FAILURE() << "the waiting stream of host:1 did not fail";
  } catch (const async_error& e) {
    try {
      std::rethrow_if_nested(e);
      ADD_FAILURE() << "the original error is not nested";
    } catch (const timeout_error&) {
      // the collective's own error, as thrown
    }
  }
  EXPECT_EQ(ran.load(), 0);  // neither the optimizer step nor the other work ran
  EXPECT_THROW(comm.synchronize(), async_error);
  // once reported, the streams work again, and a record on a healthy stream carries nothing
  done.record(comm);
  compute.wait(done);
  detail::enqueue_host(compute, [&] { ++ran; }, "next step");
  EXPECT_NO_THROW(compute.synchronize());
  EXPECT_EQ(ran.load(), 1);
}

// A failure is reported once: a stream that took it over by waiting (a data loader's copy stream waiting for the
// compute stream) stops failing once the original is reported, instead of failing every later batch.
TEST(host_event, a_failure_taken_over_by_waiting_ends_when_the_original_is_reported) {
  stream comm(host0), compute(host0);
  event done(host0);
  std::atomic<int> ran{0};
  detail::enqueue_host(comm, [] { throw std::runtime_error("the all-reduce failed"); }, "all_reduce", true);
  done.record(comm);
  compute.wait(done);
  detail::enqueue_host(compute, [&] { ++ran; }, "skipped");
  done.synchronize();
  EXPECT_CONTAINS(message_of<async_error>([&] { comm.synchronize(); }), "the all-reduce failed");
  compute.wait(done);  // nothing new: the record it waited for carried a failure already reported
  detail::enqueue_host(compute, [&] { ran += 10; }, "runs again");
  EXPECT_NO_THROW(compute.synchronize());  // reported once: through the original
  EXPECT_EQ(ran.load(), 10);  // work queued before the report stayed skipped, work queued after ran
}

// Reporting a failure without waiting (a query, DDP's check before backward) must not let the work queued before
// the report run: it belongs to the failed step.
TEST(host_stream, work_queued_before_a_report_without_waiting_is_still_skipped) {
  stream s(host0);
  std::atomic<bool> release{false};
  std::atomic<int> ran{0};
  detail::enqueue_host(s, [] { throw std::runtime_error("boom"); }, "kernel");
  detail::enqueue_host(s, [&] { while (!release) std::this_thread::yield(); }, "gate", true);
  detail::enqueue_host(s, [&] { ++ran; }, "queued before the report");
  while (true) {  // report it as soon as it is kept, while the gate holds the worker
    try {
      s.ref().host_state().rethrow_if_failed();
    } catch (const async_error& e) {
      EXPECT_CONTAINS(std::string(e.what()), "boom");
      break;
    }
    std::this_thread::yield();
  }
  detail::enqueue_host(s, [&] { ran += 10; }, "queued after the report");
  release = true;
  EXPECT_NO_THROW(s.synchronize());  // reported once
  EXPECT_EQ(ran.load(), 10);
}

TEST(host_stream, collectives_and_markers_still_run_on_a_failed_stream) {
  stream s(host0);
  event e(host0);
  std::atomic<int> ran{0};
  detail::enqueue_host(s, [] { throw std::runtime_error("boom"); }, "kernel");
  detail::enqueue_host(s, [&] { ++ran; }, "collective", true);  // a peer rank waits for it
  detail::enqueue_host(s, [&] { ran += 10; }, "kernel");
  e.record(s);
  e.synchronize();
  EXPECT_EQ(ran.load(), 1);
  EXPECT_THROW(s.synchronize(), async_error);
}

TEST(host_event, a_wait_captures_the_record_current_at_the_call) {
  stream a(host0), b(host0), c(host0);
  event e(host0);
  gate g;
  std::atomic<bool> ran{false};
  detail::enqueue_host(a, [&] { g.wait(); }, "blocked producer");
  e.record(a);  // generation 1: blocked behind the gate
  b.wait(e);    // must wait for generation 1
  detail::enqueue_host(b, [&] { ran = true; }, "consumer");
  e.record(c);  // generation 2 completes at once, out of order
  c.synchronize();
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(ran.load()) << "the wait was released by a later record";
  EXPECT_TRUE(e.ready());  // as cudaEventQuery: it reports on the most recent record, which has run
  g.release();
  b.synchronize();
  EXPECT_TRUE(ran.load());
  EXPECT_TRUE(e.ready());
}

TEST(host_event, waiting_for_a_never_recorded_event_does_nothing) {
  stream s(host0);
  event e(host0);
  EXPECT_TRUE(e.ready());
  s.wait(e);
  s.synchronize();
  e.synchronize();
}

TEST(host_event, timing_events_measure_the_work_between_them) {
  stream s(host0);
  event start(host0, event_timing::enabled), stop(host0, event_timing::enabled);
  start.record(s);
  detail::enqueue_host(s, [] { std::this_thread::sleep_for(20ms); }, "sleep");
  stop.record(s);
  stop.synchronize();
  const float ms = elapsed_ms(start, stop);
  EXPECT_GE(ms, 19.0f);
  EXPECT_LT(ms, 5000.0f);
}

TEST(host_event, misuse_is_reported) {
  stream s0(host0);
  event plain(host0), timed(host0, event_timing::enabled), other(host1, event_timing::enabled);
  EXPECT_CONTAINS(message_of<precondition_error>([&] { other.record(s0); }),
                  "an event of host:1 cannot be recorded on a stream of host:0");
  plain.record(s0);
  timed.record(s0);
  s0.synchronize();
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)elapsed_ms(plain, timed); }), "event_timing::enabled");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)elapsed_ms(timed, other); }), "different devices");
}

TEST(host_event, an_event_may_be_destroyed_while_its_record_is_queued) {
  stream s(host0);
  gate g;
  detail::enqueue_host(s, [&] { g.wait(); }, "gate");
  {
    event e(host0);
    e.record(s);
  }
  g.release();
  s.synchronize();
}

// ---- buffers, memory statistics, caching -----------------------------------------------------------------------

TEST_P(backend, buffer_allocation_is_counted_per_device) {
  stream s(dev(0));
  reset_memory_stats(dev(0));
  const auto before = get_memory_stats(dev(0));
  {
    device_buffer<float> a(1000, s);  // 4000 B, rounded to the pool granularity
    EXPECT_EQ(a.size(), 1000u);
    EXPECT_EQ(a.get_device(), dev(0));
    EXPECT_NE(a.data(), nullptr);
    const auto during = get_memory_stats(dev(0));
    EXPECT_GE(during.bytes_in_use, before.bytes_in_use + 4000);
    EXPECT_EQ(during.allocations, before.allocations + 1);
    EXPECT_EQ(during.live_allocations, before.live_allocations + 1);
    EXPECT_GE(during.peak_bytes_in_use, during.bytes_in_use);
    device_buffer<float> moved = std::move(a);
    EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move): the moved-from state is specified
    EXPECT_EQ(moved.size(), 1000u);
  }
  s.synchronize();
  const auto after = get_memory_stats(dev(0));
  EXPECT_EQ(after.bytes_in_use, before.bytes_in_use);
  EXPECT_EQ(after.frees, before.frees + 1);
  EXPECT_GE(after.peak_bytes_in_use, before.bytes_in_use + 4000);
  reset_memory_stats(dev(0));
  const auto reset = get_memory_stats(dev(0));
  EXPECT_EQ(reset.allocations, 0u);
  EXPECT_EQ(reset.peak_bytes_in_use, reset.bytes_in_use);
  device_buffer<float> empty(0, s);
  EXPECT_EQ(get_memory_stats(dev(0)).allocations, 0u);
}

TEST_P(backend, steady_state_reuse_takes_no_memory_from_the_system) {
  stream s(dev(0));
  { device_buffer<float> warm(1 << 16, s); }
  s.synchronize();
  reset_memory_stats(dev(0));
  for (int i = 0; i < 20; ++i) {
    device_buffer<float> a(1 << 16, s);
    device_buffer<float> b((1 << 16) - 7, s);  // a slightly smaller request fits a cached block too
  }
  s.synchronize();
  const auto st = get_memory_stats(dev(0));
  EXPECT_EQ(st.allocations, 40u);
  EXPECT_LE(st.system_allocations, 1u);  // at most the second block, once
}

TEST(host_memory, frees_are_stream_ordered) {
  stream a(host0), b(host0);
  gate g;
  { device_buffer<float> warm(4096, a); }  // one cached block of this size
  a.synchronize();
  reset_memory_stats(host0);
  detail::enqueue_host(a, [&] { g.wait(); }, "busy");
  float* freed_on_a = nullptr;
  {
    device_buffer<float> x(4096, a);  // from the cache
    freed_on_a = x.data();
  }  // freed while a is still busy: pending on a
  EXPECT_EQ(get_memory_stats(host0).system_allocations, 0u);
  {
    device_buffer<float> y(4096, b);  // b must not get memory a may still be using
    EXPECT_NE(y.data(), freed_on_a);
    EXPECT_EQ(get_memory_stats(host0).system_allocations, 1u);
    device_buffer<float> z(4096, a);  // a itself may: its later work runs after the free
    EXPECT_EQ(z.data(), freed_on_a);
    EXPECT_EQ(get_memory_stats(host0).system_allocations, 1u);
  }
  g.release();
  a.synchronize();
  b.synchronize();
  device_buffer<float> w(4096, b);  // now that a passed the free, b may reuse a's blocks
  EXPECT_EQ(get_memory_stats(host0).system_allocations, 1u);
}

TEST(host_memory, running_out_of_memory_fails_like_a_full_gpu) {
  in_fresh_process([] {
    configure_host_platform(host_platform_config{2, {std::uint64_t{1} << 20}});
    stream s(host1);
    device_buffer<std::byte> a(600 << 10, s);
    const std::string msg = message_of<out_of_memory_error>([&] { device_buffer<std::byte> b(600 << 10, s); });
    for (const char* needle : {"host:1 is out of memory", "tried to allocate 600.00 KiB", "600.00 KiB in use",
                               "limit 1.00 MiB", "LOCKSTEP_HOST_DEVICE_MEMORY"}) {
      if (msg.find(needle) == std::string::npos) {
        std::fprintf(stderr, "missing '%s' in: %s\n", needle, msg.c_str());
        std::exit(4);
      }
    }
    // host:0 has its own memory
    device_buffer<std::byte> other(600 << 10, default_stream(host0));
    // freeing makes room again; a cached block of another size is given back to make room
    a = device_buffer<std::byte>();
    device_buffer<std::byte> c(900 << 10, s);
    if (get_memory_stats(host1).bytes_reserved > (std::uint64_t{1} << 20)) std::exit(5);
  });
}

TEST(host_memory, out_of_memory_waits_for_pending_frees_before_failing) {
  in_fresh_process([] {
    configure_host_platform(host_platform_config{1, {std::uint64_t{1} << 20}});
    stream a(host0), b(host0);
    detail::enqueue_host(a, [] { std::this_thread::sleep_for(50ms); }, "busy");
    { device_buffer<std::byte> x(800 << 10, a); }  // freed on a while a is busy
    device_buffer<std::byte> y(800 << 10, b);      // fits only once a passes the free
  });
}

TEST(memory, statistics_of_a_device_that_does_not_exist) {
  EXPECT_THROW((void)get_memory_stats(device{device_kind::host, 5}), device_error);
}

TEST(pinned, buffers_are_page_aligned_and_writable) {
  pinned_buffer<float> p(3000);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.data()) % 4096, 0u);
  EXPECT_EQ(p.page_locked(), cuda_available());
  for (std::size_t i = 0; i < p.size(); ++i) p[i] = static_cast<float>(i);
  EXPECT_EQ(p.span()[2999], 2999.0f);
  pinned_buffer<float> q = std::move(p);
  EXPECT_TRUE(p.empty());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(q.size(), 3000u);
}

TEST(pinned, staging_for_a_host_device_is_not_page_locked_and_for_a_gpu_it_is) {
  // Host devices read ordinary memory: pinning it would take a CUDA context (on GPU 0) for nothing.
  pinned_buffer<float> for_host(100, host0);
  EXPECT_FALSE(for_host.page_locked());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(for_host.data()) % 4096, 0u);
  if (!cuda_available()) GTEST_SKIP() << "no GPU: " << cuda_status().reason();
  pinned_buffer<float> for_gpu(100, device{device_kind::cuda, 0});
  EXPECT_TRUE(for_gpu.page_locked());
}

// Issue 28, defect 7: a pinned buffer freed on a thread without a CUDA context (a loader's or a checkpoint writer's)
// is freed under the context that allocated it; an unscoped cudaFreeHost there would make a context on GPU 0.
TEST(pinned, memory_staged_for_a_gpu_is_freed_under_that_gpus_context_on_any_thread) {
  if (device_count(device_kind::cuda) < 2) {
    GTEST_SKIP() << "needs 2 GPUs, " << device_count(device_kind::cuda) << " visible"
                 << (cuda_available() ? std::string() : " (" + cuda_status().reason() + ")");
  }
#if LOCKSTEP_HAS_CUDA
  pinned_buffer<float> p(1000, device{device_kind::cuda, 1});
  ASSERT_TRUE(p.page_locked());
  bool had_context = true;
  int current = -1;
  std::thread([&] {
    had_context = detail::cuda_context_is_current();
    { const pinned_buffer<float> q = std::move(p); }
    EXPECT_EQ(cudaGetDevice(&current), cudaSuccess);
  }).join();
  EXPECT_FALSE(had_context);
  EXPECT_EQ(current, 1) << "the free made a context current on cuda:" << current << ", not cuda:1's";
#endif
}

// ---- copies in every direction --------------------------------------------------------------------------------

namespace {
template <class T>
std::vector<T> pattern(std::size_t n, int salt) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>((i * 7 + static_cast<std::size_t>(salt)) % 251 + 1);
  return v;
}
}  // namespace

TEST_P(backend, copies_in_every_direction_with_ragged_sizes) {
  for (std::size_t n : {std::size_t{1000}, std::size_t{1001}, std::size_t{1002}}) {
    stream s0(dev(0));
    const auto host = pattern<float>(n, 3);
    // host memory -> device (from pinned staging, as a loader does)
    pinned_buffer<float> staging(n);
    std::copy(host.begin(), host.end(), staging.data());
    device_buffer<float> a(n, s0);
    copy(a.span(), std::span<const float>(staging.span()), s0);
    // device -> device, same device
    device_buffer<float> b(n, s0);
    copy(b.span(), device_span<const float>(a.span()), s0);
    // device -> host memory
    std::vector<float> back(n, -1.0f);
    copy(std::span<float>(back), device_span<const float>(b.span()), s0);
    s0.synchronize();
    EXPECT_EQ(back, host) << "n = " << n;
    if (count() < 2) continue;
    // device -> peer device, on the destination's stream and on the source's stream
    stream s1(dev(1));
    event ready(dev(0));
    ready.record(s0);
    s1.wait(ready);
    device_buffer<float> c(n, s1);
    copy(c.span(), device_span<const float>(b.span()), s1);
    device_buffer<float> d(n, s1);
    copy(d.span(), device_span<const float>(c.span()), s1);
    s1.synchronize();
    device_buffer<float> e(n, s0);
    copy(e.span(), device_span<const float>(d.span()), s0);
    EXPECT_EQ(to_vector(device_span<const float>(e.span()), s0), host) << "peer copy, n = " << n;
    EXPECT_EQ(e.get_device(), dev(0));
  }
}

TEST_P(backend, copies_of_other_element_types_and_subspans) {
  stream s(dev(0));
  const auto bytes = pattern<std::uint8_t>(1003, 1);
  auto d = to_device(bytes, s);
  EXPECT_EQ(to_vector(device_span<const std::uint8_t>(d.span()), s), bytes);
  const auto longs = pattern<std::int64_t>(17, 5);
  auto l = to_device(longs, s);
  auto tail = to_vector(device_span<const std::int64_t>(l.span().subspan(10, 7)), s);
  EXPECT_EQ(tail, std::vector<std::int64_t>(longs.begin() + 10, longs.end()));
  EXPECT_THROW((void)l.span().subspan(10, 8), precondition_error);
}

TEST_P(backend, to_device_keeps_no_reference_to_the_host_values) {
  stream s(dev(0));
  device_buffer<int> d;
  {
    std::vector<int> temporary{1, 2, 3, 4};
    d = to_device(temporary, s);
    temporary.assign(4, -1);
  }
  EXPECT_EQ(to_vector(device_span<const int>(d.span()), s), (std::vector<int>{1, 2, 3, 4}));
}

TEST_P(backend, fill_zero_clears_exactly_the_range) {
  stream s(dev(0));
  auto d = to_device(std::vector<int>(9, 7), s);
  fill_zero(d.span().subspan(2, 5), s);
  EXPECT_EQ(to_vector(device_span<const int>(d.span()), s), (std::vector<int>{7, 7, 0, 0, 0, 0, 0, 7, 7}));
}

// An empty view (default-constructed: a scalar's shape, no memory; or a shape without memory) spans no bytes, so that
// a copy or a read of it touches nothing instead of one element at a null pointer.
TEST_P(backend, an_empty_view_spans_no_memory) {
  stream s(dev(0));
  for (const tensor_view& v : {tensor_view{}, tensor_view(nullptr, dtype::f32, shape{3, 4}, dev(0))}) {
    EXPECT_TRUE(v.empty());
    EXPECT_EQ(v.bytes().size(), 0U);
    EXPECT_EQ(v.span<float>().size(), 0U);
  }
  EXPECT_TRUE(to_vector(tensor_view(nullptr, dtype::f32, shape{3, 4}, dev(0)).bytes(), s).empty());
}

TEST_P(backend, copy_preconditions_say_what_is_wrong) {
  if (count() < 2) GTEST_SKIP() << "needs two devices";
  stream s0(dev(0)), s1(dev(1));
  device_buffer<float> a(10, s0), b(11, s0), c(10, s1);
  EXPECT_CONTAINS(message_of<precondition_error>([&] { copy(a.span(), device_span<const float>(b.span()), s0); }),
                  "destination holds 10 elements, source 11");
  device_buffer<float> other(10, s1);
  stream s1b(dev(1));
  EXPECT_CONTAINS(message_of<precondition_error>([&] {
                    device_buffer<float> x(10, s0);
                    copy(x.span(), device_span<const float>(a.span()), s1b);
                  }),
                  "cannot run on a stream of " + dev(1).str());
  EXPECT_CONTAINS(message_of<precondition_error>([&] { fill_zero(c.span(), s0); }), "fill_zero of memory on");
  s0.synchronize();
  s1.synchronize();
}

// ---- host_strictness::strict: what a GPU would reject fails on host devices too -------------------------------
// CTest runs every lockstep test with LOCKSTEP_HOST_STRICT=1; run by hand without it, these skip.

namespace {

bool strict_host() { return host_platform_configuration().strictness == host_strictness::strict; }

#define LOCKSTEP_REQUIRE_STRICT() \
  if (!strict_host()) GTEST_SKIP() << "host devices are lenient: set LOCKSTEP_HOST_STRICT=1 (CTest does)"

struct add_one_op {
  float* x;
  LOCKSTEP_HD void operator()(std::size_t i) const { x[i] += 1.0f; }
};

struct scaled_sum_op {  // one scalar read through a pointer, as a loss scale or a skip flag is
  const float* factor;
  LOCKSTEP_HD void operator()(const tensor_group<1>& g, std::size_t i) const {
    static_cast<float*>(g.ptr[0])[i] *= *factor;
  }
};

}  // namespace

TEST(host_strict, a_kernel_that_touches_another_devices_memory_is_refused_as_a_gpu_would_fault) {
  LOCKSTEP_REQUIRE_STRICT();
  stream s0(host0), s1(host1);
  device_buffer<float> a(1000, s0);
  fill_zero(a.span(), s0);
  s0.synchronize();
  for (float* p : {a.data(), a.data() + 999}) {  // the start of the block, and inside it
    const auto message = message_of<precondition_error>([&] { launch_elementwise(1, add_one_op{p}, s1, "add_one"); });
    EXPECT_CONTAINS(message, "add_one on host:1 uses memory of host:0");
    EXPECT_CONTAINS(message, "cudaErrorIllegalAddress");
    EXPECT_CONTAINS(message, "run the work on a stream of host:0");
  }
  launch_elementwise(1000, add_one_op{a.data()}, s0, "add_one");  // on its own device it runs
  EXPECT_EQ(to_vector(device_span<const float>(a.span()), s0), std::vector<float>(1000, 1.0f));
}

TEST(host_strict, a_multi_tensor_launch_checks_every_group_and_the_scalars_it_reads) {
  LOCKSTEP_REQUIRE_STRICT();
  stream s0(host0), s1(host1);
  device_buffer<float> x0(70, s0), y0(3, s0), factor0(1, s0), factor1(1, s1), x1(5, s1);
  const std::vector<tensor_group<1>> mixed{{{x0.data()}, 70}, {{x1.data()}, 5}, {{y0.data()}, 3}};
  auto message = message_of<precondition_error>(
      [&] { launch_multi_tensor<1>(mixed, scaled_sum_op{factor0.data()}, s0, "scaled sum"); });
  EXPECT_CONTAINS(message, "scaled sum on host:0 uses memory of host:1");
  // every tensor on host:0, but the scalar on host:1: the case of a loss scaler made on another device
  const std::vector<tensor_group<1>> local{{{x0.data()}, 70}, {{y0.data()}, 3}};
  message = message_of<precondition_error>(
      [&] { launch_multi_tensor<1>(local, scaled_sum_op{factor1.data()}, s0, "scaled sum"); });
  EXPECT_CONTAINS(message, "scaled sum on host:0 uses memory of host:1");
  fill(factor0.span(), 2.0f, s0);
  fill(x0.span(), 1.5f, s0);
  fill(y0.span(), -4.0f, s0);
  launch_multi_tensor<1>(local, scaled_sum_op{factor0.data()}, s0, "scaled sum");
  EXPECT_EQ(to_vector(device_span<const float>(x0.span()), s0), std::vector<float>(70, 3.0f));
  EXPECT_EQ(to_vector(device_span<const float>(y0.span()), s0), std::vector<float>(3, -8.0f));
}

TEST(host_strict, a_span_must_hold_memory_of_the_device_it_names) {
  LOCKSTEP_REQUIRE_STRICT();
  stream s0(host0), s1(host1);
  device_buffer<float> a(64, s0), b(64, s1);
  // a span that says host:1 but holds host:0's memory (a bug a shared address space would hide)
  const device_span<float> lying(a.data(), 64, host1);
  auto message = message_of<precondition_error>([&] { copy(lying, device_span<const float>(b.span()), s1); });
  EXPECT_CONTAINS(message, "copy destination on host:1 uses memory of host:0");
  message = message_of<precondition_error>([&] { fill_zero(lying, s1); });
  EXPECT_CONTAINS(message, "fill_zero on host:1 uses memory of host:0");
  // ordinary host memory is no device's memory
  std::vector<float> host(64);
  const device_span<float> not_device(host.data(), 64, host0);
  message = message_of<precondition_error>([&] { copy(device_span<float>(b.span()), device_span<const float>(not_device), s1); });
  EXPECT_CONTAINS(message, "is said to be memory of host:0 but is no live allocation of any host device");
  // a range that runs past its allocation
  const device_span<float> too_long(a.data() + 60, 8, host0);
  message = message_of<precondition_error>([&] { fill_zero(too_long, s0); });
  EXPECT_CONTAINS(message, "run 16 B past the end of its allocation on host:0");
  // ... also into the slack of its pool block (100 floats get a 512 B block; the allocation is 400 B)
  device_buffer<float> c(100, s0);
  message = message_of<precondition_error>([&] { fill_zero(device_span<float>(c.data(), 110, host0), s0); });
  EXPECT_CONTAINS(message, "run 40 B past the end of its allocation on host:0 (400 B)");
  // a peer copy touches both devices, as cudaMemcpyPeerAsync does: allowed from either side
  fill(a.span(), 7.0f, s0);
  s0.synchronize();
  copy(b.span(), device_span<const float>(a.span()), s1);
  EXPECT_EQ(to_vector(device_span<const float>(b.span()), s1), std::vector<float>(64, 7.0f));
}

#if !defined(__SANITIZE_THREAD__)  // the race below is deliberate: ThreadSanitizer would (rightly) report it
TEST(host_strict, streams_of_two_devices_that_no_event_orders_race_visibly) {
  LOCKSTEP_REQUIRE_STRICT();
  // The mistake: a consumer on host:1 copies what a producer on host:0 writes, with no event between them. A
  // shared queue order would make it pass most of the time; strict streams start work late at random, so in
  // some of 200 rounds the copy reads the old values. With the event, never.
  stream s0(host0), s1(host1);
  device_buffer<float> produced(4096, s0), seen(4096, s1);
  event written(host0);
  int stale_without_event = 0, stale_with_event = 0;
  for (int round = 1; round <= 200; ++round) {
    for (const bool ordered : {false, true}) {
      fill(produced.span(), 0.0f, s0);
      s0.synchronize();
      fill(produced.span(), static_cast<float>(round), s0);
      if (ordered) {
        written.record(s0);
        s1.wait(written);
      }
      copy(seen.span(), device_span<const float>(produced.span()), s1);
      const auto values = to_vector(device_span<const float>(seen.span()), s1);
      s0.synchronize();
      const bool stale = values.front() != static_cast<float>(round) || values.back() != static_cast<float>(round);
      (ordered ? stale_with_event : stale_without_event) += stale ? 1 : 0;
    }
  }
  EXPECT_GT(stale_without_event, 0) << "strict host streams should make the missing event visible";
  EXPECT_EQ(stale_with_event, 0);
}
#endif

TEST(host_strict, the_switch_is_read_from_the_environment_and_checked) {
  host_platform_config c;
  detail::apply_host_environment(c, "", "", "1");
  EXPECT_EQ(c.strictness, host_strictness::strict);
  detail::apply_host_environment(c, "", "", "0");
  EXPECT_EQ(c.strictness, host_strictness::lenient);
  const auto message =
      message_of<device_error>([&] { detail::apply_host_environment(c, "", "", "yes"); });
  EXPECT_CONTAINS(message, "LOCKSTEP_HOST_STRICT='yes' is not a switch");
}

// ---- a host device and a GPU in one program: events order them both ways (issue 13, defect 2) -----------------

TEST(mixed_kinds, a_host_stream_waits_for_gpu_work_and_a_gpu_stream_for_host_work) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU: " << cuda_status().reason();
  const device gpu{device_kind::cuda, 0};
  stream on_gpu(gpu), on_host(host0);
  device_buffer<float> g(1 << 20, on_gpu), h(1 << 20, on_host);
  event gpu_done(gpu), host_done(host0);
  for (int round = 1; round <= 20; ++round) {
    // GPU -> host device: the host stream's copy must see the GPU's fill
    fill(g.span(), static_cast<float>(round), on_gpu);
    gpu_done.record(on_gpu);
    on_host.wait(gpu_done);
    copy(h.span(), device_span<const float>(g.span()), on_host);
    auto seen = to_vector(device_span<const float>(h.span()), on_host);
    EXPECT_EQ(seen.front(), static_cast<float>(round));
    EXPECT_EQ(seen.back(), static_cast<float>(round));
    // host device -> GPU: the GPU stream's copy must see the host stream's fill, however late it runs
    fill(h.span(), static_cast<float>(-round), on_host);
    host_done.record(on_host);
    on_gpu.wait(host_done);
    copy(g.span(), device_span<const float>(h.span()), on_gpu);
    seen = to_vector(device_span<const float>(g.span()), on_gpu);
    EXPECT_EQ(seen.front(), static_cast<float>(-round));
    EXPECT_EQ(seen.back(), static_cast<float>(-round));
  }
}

TEST(peer_access, every_pair_the_hardware_connects_is_enabled_and_pool_memory_copies_across) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU: " << cuda_status().reason();
  if (device_count(device_kind::cuda) < 2) GTEST_SKIP() << "needs 2 GPUs, found " << device_count(device_kind::cuda);
#if LOCKSTEP_HAS_CUDA
  const device a{device_kind::cuda, 0}, b{device_kind::cuda, 1};
  const device both[] = {a, b};
  const auto pairs = enable_peer_access(both);
  for (const auto& [from, to] : {std::pair{a, b}, std::pair{b, a}}) {
    int can = 0;
    ASSERT_EQ(cudaDeviceCanAccessPeer(&can, from.index, to.index), cudaSuccess);
    const bool enabled = std::find(pairs.begin(), pairs.end(), std::pair{from, to}) != pairs.end();
    EXPECT_EQ(enabled, can != 0) << from.str() << " -> " << to.str();
  }
  EXPECT_EQ(enable_peer_access(both), pairs);  // idempotent
  // memory of b's stream-ordered pool, copied by a stream of a (peer to peer where enabled, staged otherwise)
  stream sa(a), sb(b);
  auto src = to_device(std::vector<float>(1 << 20, 3.0f), sb);
  sb.synchronize();
  device_buffer<float> dst(1 << 20, sa);
  copy(dst.span(), device_span<const float>(src.span()), sa);
  EXPECT_EQ(to_vector(device_span<const float>(dst.span()), sa), std::vector<float>(1 << 20, 3.0f));
#endif
}
