// Tests of comm/: every collective against a CPU reference on cliques of 1 to 4 devices, stream ordering,
// mismatched collectives, timeouts, abort, preconditions and run_on_devices. Also built with ThreadSanitizer
// (a host clique is threads meeting in shared memory).
//
// The clique tests are parameterized over the backend and the number of ranks; the CUDA instances use NCCL
// and skip without enough GPUs. This program configures 4 host devices for itself (before main, see below),
// so it needs no LOCKSTEP_HOST_DEVICES in the environment.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "lockstep/comm/comm.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/stream.hpp"
#include "comm_common.hpp"
#include "test_support.hpp"

using namespace lockstep;
using namespace lockstep_test;
using namespace comm_test;
using namespace std::chrono_literals;

namespace {

// Four host devices for this test program, as strict as GPUs, set before anything can start the host platform (a
// static initializer of this translation unit runs before main). Cliques of 1..4 ranks are subsets of them.
const bool four_host_devices = [] {
  configure_host_platform(host_platform_config{4, {std::uint64_t{1} << 30}, host_strictness::strict});
  return true;
}();

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

/// Synchronizes `s` expecting the failure of a collective: the stream reports async_error with the
/// collective's own error of type E nested. Returns E's message.
template <class E>
std::string collective_failure(communicator_ref comm, stream_ref s) {
  try {
    comm.synchronize(s);
  } catch (const async_error& outer) {
    try {
      std::rethrow_if_nested(outer);
      ADD_FAILURE() << "async_error without a nested error: " << outer.what();
    } catch (const E& inner) {
      return inner.what();
    } catch (const std::exception& other) {
      ADD_FAILURE() << "nested error of the wrong type: " << other.what();
    }
    return {};
  } catch (const E& direct) {  // NCCL's synchronize throws the error itself
    return direct.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw the wrong exception type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "the collective did not fail";
  return {};
}

/// Runs f(r) for every rank on its own thread (the usage pattern of NCCL without group calls) and joins.
template <class F>
void on_each_rank(int k, F f) {
  std::vector<std::thread> threads;
  for (int r = 0; r < k; ++r) threads.emplace_back(f, r);
  for (auto& t : threads) t.join();
}

// ---- the clique fixture -----------------------------------------------------------------------------------------

std::vector<communicator> make_clique(const device_set& devices, comm_options options = {}) {
  if (devices.kind() == device_kind::host) return make_host_clique(devices, options);
#if LOCKSTEP_HAS_CUDA
  return make_nccl_clique(devices, options);
#else
  throw device_error("no CUDA backend in this translation unit");
#endif
}

const char* const dtype_names[] = {"f32", "f16", "bf16", "i32", "i64", "u8"};

class clique : public ::testing::TestWithParam<std::tuple<device_kind, int>> {
 protected:
  void SetUp() override {
    const auto [kind, k] = GetParam();
    if (kind == device_kind::cuda && device_count(kind) < k) {
      GTEST_SKIP() << "needs " << k << " GPUs, " << device_count(kind) << " visible"
                   << (cuda_available() ? std::string() : " (" + cuda_status().reason() + ")");
    }
    k_ = k;
    std::vector<device> devs;
    for (int r = 0; r < k; ++r) devs.push_back(device{kind, r});
    devices_ = device_set(devs);
    comms_ = make_clique(devices_, comm_options{60s});  // a bug fails in a minute rather than hanging 5
    for (int r = 0; r < k; ++r) streams_.emplace_back(devs[static_cast<std::size_t>(r)]);
  }

  stream_ref s(int r) const { return streams_[static_cast<std::size_t>(r)]; }
  communicator_ref comm(int r) const { return comms_[static_cast<std::size_t>(r)]; }
  device dev(int r) const { return devices_[static_cast<std::size_t>(r)]; }

  /// Counts to test: 0, below the number of ranks, n / n+1 / n+2 with n not divisible by 2, 3 or 4, and one
  /// that spans several reduction blocks per rank with a ragged tail.
  std::vector<std::size_t> counts() const {
    std::vector<std::size_t> c = {0, 1};
    if (k_ > 2) c.push_back(static_cast<std::size_t>(k_ - 1));
    for (std::size_t n : {std::size_t{1001}, std::size_t{1002}, std::size_t{1003}}) c.push_back(n);
    c.push_back(2 * 2048 * static_cast<std::size_t>(k_) + 37);
    return c;
  }

  template <class T>
  void check_all_reduce(std::size_t n, reduce_op op, bool in_place) {
    std::vector<std::vector<T>> in(static_cast<std::size_t>(k_));
    for (int r = 0; r < k_; ++r) in[static_cast<std::size_t>(r)] = input<T>(r, n);
    const auto expected = reference(in, op, 0, n);
    on_each_rank(k_, [&](int r) {
      auto send = to_device(in[static_cast<std::size_t>(r)], s(r));
      auto recv = to_device(std::vector<T>(n, sentinel<T>()), s(r));
      if (in_place) {
        comm(r).all_reduce(send.span(), op, s(r));
      } else {
        comm(r).all_reduce(device_span<const T>(send.span()), recv.span(), op, s(r));
      }
      comm(r).synchronize(s(r));
      EXPECT_SAME(to_vector(in_place ? device_span<const T>(send.span()) : device_span<const T>(recv.span()), s(r)),
                  expected,
                  "all_reduce rank " << r << " count " << n << " op " << name_of(op) << (in_place ? " in place" : ""));
    });
  }

  template <class T>
  void check_reduce(std::size_t n, reduce_op op, int root, bool in_place) {
    std::vector<std::vector<T>> in(static_cast<std::size_t>(k_));
    for (int r = 0; r < k_; ++r) in[static_cast<std::size_t>(r)] = input<T>(r, n);
    const auto expected = reference(in, op, 0, n);
    on_each_rank(k_, [&](int r) {
      auto send = to_device(in[static_cast<std::size_t>(r)], s(r));
      auto recv = to_device(std::vector<T>(r == root ? n : 0, sentinel<T>()), s(r));
      device_span<T> out = r == root && in_place ? send.span() : recv.span();
      comm(r).reduce(device_span<const T>(send.span()), out, op, root, s(r));
      comm(r).synchronize(s(r));
      if (r == root) {
        EXPECT_SAME(to_vector(device_span<const T>(out), s(r)), expected,
                    "reduce root " << root << " count " << n << " op " << name_of(op) << (in_place ? " in place" : ""));
      } else {
        EXPECT_SAME(to_vector(device_span<const T>(send.span()), s(r)), in[static_cast<std::size_t>(r)],
                    "reduce must not change a non-root's send buffer");
      }
    });
  }

  template <class T>
  void check_broadcast(std::size_t n, int root, bool in_place) {
    const auto data = input<T>(root, n);
    on_each_rank(k_, [&](int r) {
      auto send = to_device(r == root ? data : std::vector<T>{}, s(r));
      auto recv = to_device(std::vector<T>(n, sentinel<T>()), s(r));
      if (in_place && r == root) {
        comm(r).broadcast(send.span(), root, s(r));
      } else if (in_place) {
        comm(r).broadcast(recv.span(), root, s(r));
      } else {
        comm(r).broadcast(device_span<const T>(send.span()), recv.span(), root, s(r));
      }
      comm(r).synchronize(s(r));
      const auto& result = in_place && r == root ? send : recv;
      EXPECT_SAME(to_vector(device_span<const T>(result.span()), s(r)), data,
                  "broadcast " << dtype_names[static_cast<int>(dtype_of_v<T>)] << " root " << root << " rank " << r
                               << " count " << n << (in_place ? " in place" : ""));
    });
  }

  template <class T>
  void check_all_gather(std::size_t n, bool in_place) {
    std::vector<T> expected;
    for (int r = 0; r < k_; ++r) {
      const auto part = input<T>(r, n);
      expected.insert(expected.end(), part.begin(), part.end());
    }
    on_each_rank(k_, [&](int r) {
      const auto mine = input<T>(r, n);
      std::vector<T> initial(n * static_cast<std::size_t>(k_), sentinel<T>());
      if (in_place)
        std::copy(mine.begin(), mine.end(),
                  initial.begin() + static_cast<std::ptrdiff_t>(n * static_cast<std::size_t>(r)));
      auto recv = to_device(initial, s(r));
      auto send = to_device(mine, s(r));
      if (in_place) {
        comm(r).all_gather(recv.span().subspan(n * static_cast<std::size_t>(r), n), recv.span(), s(r));
      } else {
        comm(r).all_gather(device_span<const T>(send.span()), recv.span(), s(r));
      }
      comm(r).synchronize(s(r));
      EXPECT_SAME(to_vector(device_span<const T>(recv.span()), s(r)), expected,
                  "all_gather " << dtype_names[static_cast<int>(dtype_of_v<T>)] << " rank " << r << " count " << n
                                << (in_place ? " in place" : ""));
    });
  }

  template <class T>
  void check_reduce_scatter(std::size_t n, reduce_op op, bool in_place) {
    const std::size_t total = n * static_cast<std::size_t>(k_);
    std::vector<std::vector<T>> in(static_cast<std::size_t>(k_));
    for (int r = 0; r < k_; ++r) in[static_cast<std::size_t>(r)] = input<T>(r, total);
    on_each_rank(k_, [&](int r) {
      const auto expected = reference(in, op, n * static_cast<std::size_t>(r), n);
      auto send = to_device(in[static_cast<std::size_t>(r)], s(r));
      auto recv = to_device(std::vector<T>(n, sentinel<T>()), s(r));
      device_span<T> out = in_place ? send.span().subspan(n * static_cast<std::size_t>(r), n) : recv.span();
      comm(r).reduce_scatter(device_span<const T>(send.span()), out, op, s(r));
      comm(r).synchronize(s(r));
      EXPECT_SAME(
          to_vector(device_span<const T>(out), s(r)), expected,
          "reduce_scatter rank " << r << " count " << n << " op " << name_of(op) << (in_place ? " in place" : ""));
    });
  }

  int k_ = 0;
  device_set devices_;
  std::vector<communicator> comms_;
  std::vector<stream> streams_;
};

std::string clique_name(const ::testing::TestParamInfo<std::tuple<device_kind, int>>& info) {
  return std::string(name_of(std::get<0>(info.param))) + '_' + std::to_string(std::get<1>(info.param));
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(ranks, clique,
                         ::testing::Combine(::testing::Values(device_kind::host, device_kind::cuda),
                                            ::testing::Values(1, 2, 3, 4)),
                         clique_name);

// ---- every collective against the reference -----------------------------------------------------------------

TEST_P(clique, all_reduce_matches_the_reference_for_every_dtype_op_and_count) {
  ASSERT_EQ(comm(0).size(), k_);
  for (int r = 0; r < k_; ++r) {
    EXPECT_EQ(comm(r).rank(), r);
    EXPECT_EQ(comm(r).get_device(), dev(r));
  }
  for_each_type<float, lockstep::half, bfloat16>([&]<class T>() {
    for (reduce_op op : all_ops) {
      for (std::size_t n : counts()) {
        for (bool in_place : {false, true}) check_all_reduce<T>(n, op, in_place);
      }
    }
  });
}

TEST_P(clique, i64_sums_and_maxima_are_exact_integers) {
  // values beyond 2^53 (no float or double holds their sum) and of both signs, in place and not, with reduce and
  // reduce_scatter; what deterministic mode's exact accumulators rely on
  const std::size_t n = 1000 * static_cast<std::size_t>(k_) + 3;
  auto value = [](int r, std::size_t i) {
    return (static_cast<std::int64_t>(i % 97) - 48) * (std::int64_t{1} << 54) + static_cast<std::int64_t>(i * 7 + r);
  };
  on_each_rank(k_, [&](int r) {
    std::vector<std::int64_t> mine(n), sum(n), max(n);
    for (std::size_t i = 0; i < n; ++i) {
      mine[i] = value(r, i);
      for (int q = 0; q < k_; ++q) {
        sum[i] += value(q, i);
        max[i] = q == 0 ? value(q, i) : std::max(max[i], value(q, i));
      }
    }
    auto a = to_device(mine, s(r)), b = to_device(mine, s(r));
    device_buffer<std::int64_t> c(n, s(r));
    comm(r).all_reduce(a.span(), reduce_op::sum, s(r));
    comm(r).all_reduce(device_span<const std::int64_t>(b.span()), c.span(), reduce_op::max, s(r));
    comm(r).synchronize(s(r));
    EXPECT_EQ(to_vector(device_span<const std::int64_t>(a.span()), s(r)), sum) << "sum, rank " << r;
    EXPECT_EQ(to_vector(device_span<const std::int64_t>(c.span()), s(r)), max) << "max, rank " << r;
    const std::size_t part = n / static_cast<std::size_t>(k_);
    device_buffer<std::int64_t> d(part, s(r));
    comm(r).reduce_scatter(device_span<const std::int64_t>(b.span().subspan(0, part * static_cast<std::size_t>(k_))),
                           d.span(), reduce_op::sum, s(r));
    comm(r).synchronize(s(r));
    EXPECT_EQ(to_vector(device_span<const std::int64_t>(d.span()), s(r)),
              std::vector<std::int64_t>(sum.begin() + static_cast<std::ptrdiff_t>(part * static_cast<std::size_t>(r)),
                                        sum.begin() + static_cast<std::ptrdiff_t>(part * static_cast<std::size_t>(r + 1))))
        << "reduce_scatter, rank " << r;
    EXPECT_CONTAINS(message_of<precondition_error>([&] { comm(r).all_reduce(a.span(), reduce_op::mean, s(r)); }),
                    "i64 reductions are sum or max");
  });
}

TEST_P(clique, all_reduce_of_buffers_larger_than_the_last_level_cache) {
  // When the buffers cannot stay in the last-level cache, the host clique writes with non-temporal stores:
  // a different store path. Sizes derive from this machine's cache so that the path is always taken.
  const std::size_t llc = detail::host_comm::last_level_cache_bytes();
  const std::size_t n = llc / (sizeof(float) * static_cast<std::size_t>(k_)) + 5;
  ASSERT_TRUE(detail::host_comm::stream_outputs(n * sizeof(float) * static_cast<std::size_t>(k_)));
  check_all_reduce<float>(n, reduce_op::sum, false);  // one pass, streaming stores from registers
  check_all_reduce<float>(n, reduce_op::max, true);   // in place: blocks, then streaming copies
  // The other store paths once each (these buffers are large, and slow under ThreadSanitizer).
  if (k_ == 2) check_all_reduce<lockstep::half>(2 * n + 3, reduce_op::mean, false);
  if (k_ == 3) check_reduce_scatter<float>(n / static_cast<std::size_t>(k_) + 1, reduce_op::mean, true);
}

// The f32 reduction's store paths on small buffers, each against the cached block loop (streaming=false):
// outputs aligned to 32 bytes take the AVX2 line loop where the CPU has it, to 16 bytes the SSE2 loop, and
// anything else the block loop with streaming copies; with none or one of the outputs written through the
// cache. Same bits in every case, NaNs of a max included, nothing written outside the outputs, for every op,
// 1 to 3 inputs, 1 or 2 outputs and lengths around the 16-float line.
TEST(host_clique_reduce_range, every_store_path_gives_the_bits_of_the_block_loop) {
  constexpr float untouched = 1e30f;  // no result is 1e30
  // Runs the reduction into m fresh outputs, 64-byte aligned then shifted by `misalign` floats; returns each
  // output's n values followed by the number of elements written in its whole allocation.
  auto reduce = [&](reduce_op op, const std::vector<const void*>& in, int m, std::size_t n, std::size_t misalign,
                    bool streaming, int cached) {
    std::vector<std::vector<float>> storage(static_cast<std::size_t>(m), std::vector<float>(n + 32, untouched));
    std::vector<void*> out;
    for (auto& v : storage) {
      const auto address = reinterpret_cast<std::uintptr_t>(v.data());
      out.push_back(v.data() + ((64 - address % 64) % 64) / sizeof(float) + misalign);
    }
    detail::host_comm::reduce_range(dtype::f32, op, in.data(), static_cast<int>(in.size()), out.data(), m, n,
                                    streaming, cached);
    std::vector<std::vector<float>> result;
    for (std::size_t j = 0; j < storage.size(); ++j) {
      const auto* first = static_cast<const float*>(out[j]);
      result.emplace_back(first, first + n);
      result.back().push_back(static_cast<float>(
          std::count_if(storage[j].begin(), storage[j].end(), [&](float x) { return x != untouched; })));
    }
    return result;
  };
  for (reduce_op op : all_ops) {
    for (std::size_t k = 1; k <= 3; ++k) {
      for (std::size_t n : {0, 1, 15, 16, 17, 47, 4096 + 19}) {
        std::vector<std::vector<float>> inputs(k, std::vector<float>(n));
        std::vector<const void*> in;
        for (std::size_t r = 0; r < k; ++r) {
          for (std::size_t i = 0; i < n; ++i) inputs[r][i] = static_cast<float>((i * 7 + r * 13) % 29) - 14.5f;
          if (n > 5) inputs[r][(r * 5 + 3) % n] = std::numeric_limits<float>::quiet_NaN();
          in.push_back(inputs[r].data());
        }
        for (int m = 1; m <= 2; ++m) {
          for (std::size_t misalign : {0, 4, 1}) {  // in floats
            const auto expected = reduce(op, in, m, n, misalign, false, -1);
            for (int cached : {-1, m - 1}) {
              const auto actual = reduce(op, in, m, n, misalign, true, cached);
              for (std::size_t j = 0; j < expected.size(); ++j) {
                ASSERT_EQ(std::memcmp(expected[j].data(), actual[j].data(), expected[j].size() * sizeof(float)), 0)
                    << "op " << name_of(op) << " inputs " << k << " output " << j << " of " << m << " n " << n
                    << " misaligned by " << misalign << " floats, cached output " << cached;
                ASSERT_EQ(expected[j].back(), static_cast<float>(n));
              }
            }
          }
        }
      }
    }
  }
}

TEST_P(clique, reduce_matches_the_reference_at_every_root) {
  for_each_type<float, lockstep::half, bfloat16>([&]<class T>() {
    for (reduce_op op : all_ops) {
      for (std::size_t n : counts()) {
        for (int root = 0; root < k_; ++root) {
          for (bool in_place : {false, true}) check_reduce<T>(n, op, root, in_place);
        }
      }
    }
  });
}

TEST_P(clique, broadcast_copies_the_root_for_every_dtype_and_root) {
  for_each_type<float, lockstep::half, bfloat16, std::int32_t, std::int64_t, std::uint8_t>([&]<class T>() {
    for (std::size_t n : counts()) {
      for (int root = 0; root < k_; ++root) {
        for (bool in_place : {false, true}) check_broadcast<T>(n, root, in_place);
      }
    }
  });
}

// Twelve terms per element, split over the ranks (12 / k each, strided with NaN padding that must not be read):
// every rank receives the same bits, the reference's, whatever k, so 1, 2, 3 and 4 ranks agree.
TEST_P(clique, all_reduce_exact_gives_every_rank_the_correctly_rounded_sum_for_any_split_of_the_terms) {
  if (!comm(0).supports(collective_kind::all_reduce_exact)) {  // NCCL: refused with a sentence
    auto buf = to_device(std::vector<float>(8, 1.0f), s(0));
    EXPECT_CONTAINS(message_of<precondition_error>(
                        [&] { comm(0).all_reduce_exact(buf.data(), 1, 8, buf.data(), 8, dtype::f32, s(0)); }),
                    "does not run all_reduce_exact");
    return;
  }
  constexpr std::size_t total = 12;
  const std::size_t per = total / static_cast<std::size_t>(k_);
  for_each_type<float, lockstep::half, bfloat16>([&]<class T>() {
    for (std::size_t n : counts()) {
      const std::size_t stride = n + 5;
      const auto expected = exact_reference<T>(total, n);
      for (bool poisoned : {false, true}) {
        if (poisoned && n == 0) continue;
        on_each_rank(k_, [&](int r) {
          std::vector<T> terms(per * stride, convert<T>(std::numeric_limits<float>::quiet_NaN()));
          for (std::size_t t = 0; t < per; ++t) {
            for (std::size_t i = 0; i < n; ++i) terms[t * stride + i] = exact_term<T>(static_cast<std::size_t>(r) * per + t, i);
          }
          // a term outside the window (an infinity) on the last rank: every element of every rank is NaN
          if (poisoned && r == k_ - 1) terms[(per - 1) * stride + n - 1] = convert<T>(std::numeric_limits<float>::infinity());
          auto send = to_device(terms, s(r));
          auto recv = to_device(std::vector<T>(n, sentinel<T>()), s(r));
          comm(r).all_reduce_exact(send.data(), per, stride, recv.data(), n, dtype_of_v<T>, s(r));
          comm(r).synchronize(s(r));
          const auto got = to_vector(device_span<const T>(recv.span()), s(r));
          if (poisoned) {
            EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](T v) { return std::isnan(to_float(v)); }))
                << "all_reduce_exact with an infinite term, rank " << r << " count " << n;
          } else {
            EXPECT_SAME(got, expected, "all_reduce_exact " << dtype_names[static_cast<int>(dtype_of_v<T>)] << " rank "
                                                            << r << " count " << n << " terms " << per);
          }
        });
      }
    }
  });
  // Several tensors in one call (an empty one among them): an infinite term makes its own tensor NaN, the others
  // keep their sums.
  const std::size_t n = 1003, stride = n;
  const std::vector<std::size_t> ends = {300, 300, 700, n};
  const auto expected = exact_reference<float>(total, n);
  on_each_rank(k_, [&](int r) {
    std::vector<float> terms(per * stride);
    for (std::size_t t = 0; t < per; ++t) {
      for (std::size_t i = 0; i < n; ++i) terms[t * stride + i] = exact_term<float>(static_cast<std::size_t>(r) * per + t, i);
    }
    if (r == 0) terms[500] = std::numeric_limits<float>::infinity();  // in tensor 2, [300, 700)
    auto send = to_device(terms, s(r));
    auto recv = to_device(std::vector<float>(n, 0.0f), s(r));
    comm(r).all_reduce_exact(send.data(), per, stride, recv.data(), n, dtype::f32, ends, s(r));
    comm(r).synchronize(s(r));
    const auto got = to_vector(device_span<const float>(recv.span()), s(r));
    for (std::size_t i = 0; i < n; ++i) {
      if (i >= 300 && i < 700) {
        ASSERT_TRUE(std::isnan(got[i])) << "rank " << r << ", element " << i << " of the poisoned tensor";
      } else {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(expected[i]))
            << "rank " << r << ", element " << i << " of a tensor without such a term";
      }
    }
  });
}

TEST_P(clique, all_gather_is_rank_major_for_every_dtype) {
  for_each_type<float, lockstep::half, bfloat16, std::int32_t, std::int64_t, std::uint8_t>([&]<class T>() {
    for (std::size_t n : counts()) {
      for (bool in_place : {false, true}) check_all_gather<T>(n, in_place);
    }
  });
}

TEST_P(clique, reduce_scatter_matches_the_reference) {
  for_each_type<float, lockstep::half, bfloat16>([&]<class T>() {
    for (reduce_op op : all_ops) {
      for (std::size_t n : counts()) {
        for (bool in_place : {false, true}) check_reduce_scatter<T>(n, op, in_place);
      }
    }
  });
}

TEST_P(clique, raw_pointer_forms_take_counts_in_elements) {
  const std::size_t n = 777;
  std::vector<std::vector<lockstep::half>> in(static_cast<std::size_t>(k_));
  for (int r = 0; r < k_; ++r) in[static_cast<std::size_t>(r)] = input<lockstep::half>(r, n);
  const auto expected = reference(in, reduce_op::sum, 0, n);
  on_each_rank(k_, [&](int r) {
    auto buf = to_device(in[static_cast<std::size_t>(r)], s(r));
    comm(r).all_reduce(buf.data(), buf.data(), n, dtype::f16, reduce_op::sum, s(r));
    comm(r).synchronize(s(r));
    EXPECT_SAME(to_vector(device_span<const lockstep::half>(buf.span()), s(r)), expected, "raw all_reduce");
  });
}

// ---- stream order ---------------------------------------------------------------------------------------------

TEST_P(clique, collectives_wait_for_earlier_work_and_later_work_sees_the_result) {
  const std::size_t n = 4099;
  std::vector<std::vector<float>> in(static_cast<std::size_t>(k_));
  for (int r = 0; r < k_; ++r) in[static_cast<std::size_t>(r)] = input<float>(r, n);
  const auto expected = reference(in, reduce_op::sum, 0, n);

  // Per rank: the input is produced on a producer stream (slowly on the last rank, so that the others reach
  // the collective first), handed to the communication stream through an event, reduced there, and the
  // result handed through a second event to a stream driven by another thread (the test's main thread).
  std::vector<stream> producers, consumers;
  std::vector<event> produced, reduced;
  std::vector<device_buffer<float>> buffers;
  for (int r = 0; r < k_; ++r) {
    producers.emplace_back(dev(r));
    consumers.emplace_back(dev(r));
    produced.emplace_back(dev(r));
    reduced.emplace_back(dev(r));
    buffers.emplace_back(n, s(r));
  }
  for (int r = 0; r < k_; ++r) s(r).synchronize();  // the allocations, before other streams use the buffers
  on_each_rank(k_, [&](int r) {
    const auto u = static_cast<std::size_t>(r);
    stream_ref p = producers[u];
    if (dev(r).is_host() && r == k_ - 1) {
      detail::enqueue_host(
          p, [] { std::this_thread::sleep_for(100ms); }, "slow producer");
    }
    copy(buffers[u].span(), std::span<const float>(in[u]), p);
    produced[u].record(p);
    s(r).wait(produced[u]);
    comm(r).all_reduce(buffers[u].span(), reduce_op::sum, s(r));
    reduced[u].record(s(r));
  });
  for (int r = 0; r < k_; ++r) {  // another thread than the ones that queued the collectives
    const auto u = static_cast<std::size_t>(r);
    consumers[u].wait(reduced[u]);
    std::vector<float> out(n);
    copy(std::span<float>(out), device_span<const float>(buffers[u].span()), consumers[u]);
    comm(r).synchronize(consumers[u]);
    EXPECT_SAME(out, expected, "rank " << r << " after the event");
  }
  for (int r = 0; r < k_; ++r) comm(r).synchronize(s(r));
}

TEST_P(clique, barrier_orders_work_across_ranks) {
  if (std::get<0>(GetParam()) != device_kind::host) GTEST_SKIP() << "host streams run host code";
  std::atomic<int> before{0};
  std::vector<int> seen(static_cast<std::size_t>(k_), -1);
  on_each_rank(k_, [&](int r) {
    detail::enqueue_host(
        s(r),
        [&, r] {
          std::this_thread::sleep_for(std::chrono::milliseconds(10 * r));
          before.fetch_add(1);
        },
        "work before the barrier");
    comm(r).barrier(s(r));
    detail::enqueue_host(
        s(r), [&, r] { seen[static_cast<std::size_t>(r)] = before.load(); }, "work after");
    comm(r).synchronize(s(r));
  });
  for (int r = 0; r < k_; ++r) EXPECT_EQ(seen[static_cast<std::size_t>(r)], k_) << "rank " << r;
}

// Issue 28, defect 6: a collective queued while its stream is captured is a node of the user's CUDA graph (the
// watchdog does not follow it: querying an event of a capture would fail and abort the clique); comm.synchronize
// during the capture is refused (a stream query would invalidate it); once the graph is launched the sum is there.
TEST_P(clique, a_collective_captured_into_a_cuda_graph_runs_when_the_graph_is_launched) {
  if (std::get<0>(GetParam()) != device_kind::cuda) GTEST_SKIP() << "CUDA graphs exist on GPUs only";
#if LOCKSTEP_HAS_CUDA
  const std::size_t n = 1 << 20;
  std::vector<std::vector<float>> in(static_cast<std::size_t>(k_));
  for (int r = 0; r < k_; ++r) in[static_cast<std::size_t>(r)] = input<float>(r, n);
  const auto expected = reference(in, reduce_op::sum, 0, n);
  std::barrier captures(k_);  // no rank allocates or synchronizes while another captures (global mode forbids it)
  on_each_rank(k_, [&](int r) {
    auto buf = to_device(in[static_cast<std::size_t>(r)], s(r));
    // A collective outside the capture, still in flight when it starts, on a stream of its own: the watchdog
    // queries its events meanwhile, which must neither be refused nor invalidate the capture (global mode).
    stream other(dev(r));
    auto busy = to_device(std::vector<float>(n, 1.0f), other);
    comm(r).all_reduce(busy.span(), reduce_op::sum, other);
    s(r).synchronize();
    cudaStream_t st = s(r).cuda_stream();
    cudaGraph_t graph = nullptr;
    captures.arrive_and_wait();
    if (cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal) == cudaSuccess) {
      comm(r).all_reduce(buf.span(), reduce_op::sum, s(r));
      EXPECT_CONTAINS(message_of<precondition_error>([&] { comm(r).synchronize(s(r)); }), "captured into a CUDA graph");
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // several watchdog rounds during the capture
      EXPECT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);  // always ended: the other ranks do not wait
    } else {
      ADD_FAILURE() << "cudaStreamBeginCapture failed on rank " << r;
    }
    captures.arrive_and_wait();
    cudaGraphExec_t exec = nullptr;
    if (graph != nullptr && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
      EXPECT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
    } else {
      ADD_FAILURE() << "the captured graph could not be instantiated on rank " << r;
    }
    comm(r).synchronize(s(r));
    comm(r).synchronize(other);
    EXPECT_SAME(to_vector(device_span<const float>(buf.span()), s(r)), expected, "rank " << r);
    EXPECT_SAME(to_vector(device_span<const float>(busy.span()), other), std::vector<float>(n, static_cast<float>(k_)),
                "rank " << r << ", the collective outside the capture");
    if (exec != nullptr) {
      EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
    }
    if (graph != nullptr) {
      EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
    }
  });
#endif
}

TEST_P(clique, one_thread_may_queue_every_ranks_part_on_host_streams) {
  if (std::get<0>(GetParam()) != device_kind::host) {
    GTEST_SKIP() << "an NCCL clique is used one thread per rank (ncclGroupEnd of non-blocking communicators may "
                    "return ncclInProgress: nothing may be queued until all are ready)";
  }
  const std::size_t n = 3001;
  std::vector<std::vector<bfloat16>> in(static_cast<std::size_t>(k_));
  std::vector<device_buffer<bfloat16>> bufs;
  for (int r = 0; r < k_; ++r) {
    in[static_cast<std::size_t>(r)] = input<bfloat16>(r, n);
    bufs.push_back(to_device(in[static_cast<std::size_t>(r)], s(r)));
  }
  for (int round = 0; round < 3; ++round) {
    for (int r = 0; r < k_; ++r) comm(r).all_reduce(bufs[static_cast<std::size_t>(r)].span(), reduce_op::max, s(r));
  }
  const auto expected = reference(in, reduce_op::max, 0, n);  // max is idempotent over rounds
  for (int r = 0; r < k_; ++r) {
    EXPECT_SAME(to_vector(device_span<const bfloat16>(bufs[static_cast<std::size_t>(r)].span()), s(r)), expected,
                "rank " << r);
  }
}

// ---- preconditions --------------------------------------------------------------------------------------------

TEST_P(clique, arguments_are_checked_with_the_valid_range) {
  auto buf = to_device(std::vector<float>(8, 1.0f), s(0));
  auto ints = to_device(std::vector<std::int32_t>(8, 1), s(0));
  const communicator_ref c = comm(0);
  EXPECT_CONTAINS(message_of<precondition_error>([&] { c.broadcast(buf.span(), k_, s(0)); }),
                  "root " + std::to_string(k_) + " is out of range; valid roots: 0.." + std::to_string(k_ - 1));
  EXPECT_CONTAINS(message_of<precondition_error>(
                      [&] { c.reduce(buf.data(), buf.data(), 8, dtype::f32, reduce_op::sum, -1, s(0)); }),
                  "root -1 is out of range");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { c.all_reduce(ints.span(), reduce_op::sum, s(0)); }),
                  "dtype i32 cannot be reduced; valid dtypes for reductions: f32, f16, bf16");
  EXPECT_CONTAINS(
      message_of<precondition_error>([&] { c.all_reduce(nullptr, buf.data(), 8, dtype::f32, reduce_op::sum, s(0)); }),
      "send buffer is null with count 8");
  EXPECT_CONTAINS(message_of<precondition_error>(
                      [&] { c.all_reduce(buf.data(), buf.data(), 8, dtype::f32, static_cast<reduce_op>(9), s(0)); }),
                  "reduce_op value 9 is not an op; valid: sum, mean, max");
  if (k_ > 1) {
    EXPECT_CONTAINS(
        message_of<precondition_error>([&] { c.all_gather(device_span<const float>(buf.span()), buf.span(), s(0)); }),
        "recv holds 8 elements, expected size() * send.size() = " + std::to_string(k_) + " * 8");
    EXPECT_CONTAINS(message_of<precondition_error>([&] { c.all_reduce(buf.span(), reduce_op::sum, s(1)); }),
                    "the stream belongs to " + dev(1).str() + ", expected a stream of " + dev(0).str());
    auto other = to_device(std::vector<float>(8, 1.0f), s(1));
    EXPECT_CONTAINS(message_of<precondition_error>([&] { c.all_reduce(other.span(), reduce_op::sum, s(0)); }),
                    "buffer is memory of " + dev(1).str() + ", expected memory of " + dev(0).str());
  }
  EXPECT_CONTAINS(message_of<precondition_error>([&] {
                    c.all_reduce(device_span<const float>(buf.span()), buf.span().first(4), reduce_op::sum, s(0));
                  }),
                  "send holds 8 elements and recv 4");
  // Nothing was queued: a rejected call does not consume a sequence number, so the ranks stay in step.
  on_each_rank(k_, [&](int r) {
    auto x = to_device(std::vector<float>(3, static_cast<float>(r + 1)), s(r));
    comm(r).all_reduce(x.span(), reduce_op::sum, s(r));
    comm(r).synchronize(s(r));
    EXPECT_EQ(to_vector(device_span<const float>(x.span()), s(r))[0], static_cast<float>(k_ * (k_ + 1) / 2));
  });
}

TEST(communicator, an_empty_communicator_says_so) {
  communicator c;
  EXPECT_FALSE(c);
  EXPECT_CONTAINS(message_of<precondition_error>([&] { (void)c.rank(); }), "empty communicator");
  auto clique = make_host_clique(device_set("host:0,host:1"));
  communicator moved = std::move(clique[1]);
  EXPECT_TRUE(moved);
  EXPECT_EQ(moved.rank(), 1);
  EXPECT_FALSE(clique[1]);  // NOLINT(bugprone-use-after-move)
}

TEST(communicator, options_read_the_timeout_from_the_environment) {
  ::setenv("LOCKSTEP_COMM_TIMEOUT", "0.25", 1);
  EXPECT_EQ(comm_options{}.timeout, 250ms);
  ::setenv("LOCKSTEP_COMM_TIMEOUT", "7", 1);
  EXPECT_EQ(comm_options{}.timeout, 7s);
  ::setenv("LOCKSTEP_COMM_TIMEOUT", "soon", 1);
  EXPECT_CONTAINS(message_of<precondition_error>([] { (void)comm_options{}; }), "LOCKSTEP_COMM_TIMEOUT='soon'");
  ::unsetenv("LOCKSTEP_COMM_TIMEOUT");
  EXPECT_EQ(comm_options{}.timeout, 300s);
}

TEST(host_clique, needs_host_devices_and_a_positive_timeout) {
  EXPECT_CONTAINS(message_of<precondition_error>([] { (void)make_host_clique(device_set{}); }), "empty");
  EXPECT_CONTAINS(
      message_of<precondition_error>([] { (void)make_host_clique(device_set("host:0"), comm_options{0ms}); }),
      "timeout must be positive");
}

// ---- the host clique's block kernels ----------------------------------------------------------------------------

TEST(host_clique_kernels, chunks_cover_the_elements_once_on_cache_line_boundaries) {
  for (int k = 1; k <= 4; ++k) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{17},
                          std::size_t{1001}, std::size_t{65536}}) {
      std::size_t next = 0;
      for (int r = 0; r < k; ++r) {
        const auto [b, e] = detail::host_comm::chunk_of(n, k, r, sizeof(float));
        EXPECT_EQ(b, next) << "k " << k << " n " << n << " r " << r;
        EXPECT_LE(b, e);
        EXPECT_TRUE(b % 16 == 0 || b == n);
        next = e;
      }
      EXPECT_EQ(next, n);
    }
  }
}

// ---- failures: mismatch, timeout, abort ------------------------------------------------------------------------

namespace {
struct host_pair {
  explicit host_pair(int k, comm_options options = comm_options{60s}) {
    std::vector<device> devs;
    for (int r = 0; r < k; ++r) devs.push_back(device{device_kind::host, r});
    comms = make_host_clique(device_set(devs), options);
    for (const auto& d : devs) streams.emplace_back(d);
  }
  stream_ref s(int r) { return streams[static_cast<std::size_t>(r)]; }
  communicator_ref c(int r) { return comms[static_cast<std::size_t>(r)]; }
  std::vector<communicator> comms;
  std::vector<stream> streams;
};
}  // namespace

TEST(host_clique, all_reduce_exact_checks_its_arguments_and_that_every_rank_gives_as_many_terms) {
  host_pair p(2);
  auto a = to_device(std::vector<float>(40, 1.0f), p.s(0));
  auto b = to_device(std::vector<float>(40, 1.0f), p.s(1));
  auto out0 = to_device(std::vector<float>(10, 0.0f), p.s(0));
  auto out1 = to_device(std::vector<float>(10, 0.0f), p.s(1));
  auto words = to_device(std::vector<std::int64_t>(10, 0), p.s(0));
  EXPECT_CONTAINS(message_of<precondition_error>(
                      [&] { p.c(0).all_reduce_exact(a.data(), 0, 10, out0.data(), 10, dtype::f32, p.s(0)); }),
                  "terms 0 is out of range; valid: 1..65535 per rank");
  EXPECT_CONTAINS(message_of<precondition_error>(
                      [&] { p.c(0).all_reduce_exact(a.data(), 2, 9, out0.data(), 10, dtype::f32, p.s(0)); }),
                  "stride 9 is smaller than count 10: the terms would overlap");
  EXPECT_CONTAINS(message_of<precondition_error>([&] {
                    p.c(0).all_reduce_exact(words.data(), 1, 10, words.data(), 10, dtype::i64, p.s(0));
                  }),
                  "dtype i64 is not a float type; valid dtypes: f32, f16, bf16");
  const std::vector<std::size_t> descending = {6, 4, 10}, short_of_count = {4, 9};
  EXPECT_CONTAINS(message_of<precondition_error>([&] {
                    p.c(0).all_reduce_exact(a.data(), 1, 10, out0.data(), 10, dtype::f32, descending, p.s(0));
                  }),
                  "the tensors' ends must ascend to count 10, but end 1 is 4 after 6");
  EXPECT_CONTAINS(message_of<precondition_error>([&] {
                    p.c(0).all_reduce_exact(a.data(), 1, 10, out0.data(), 10, dtype::f32, short_of_count, p.s(0));
                  }),
                  "the tensors' ends must ascend to count 10, but end 1 is 9 after 4");
  // terms 2 on rank 0, 3 on rank 1: both ranks fail, naming the difference
  p.c(0).all_reduce_exact(a.data(), 2, 10, out0.data(), 10, dtype::f32, p.s(0));
  p.c(1).all_reduce_exact(b.data(), 3, 10, out1.data(), 10, dtype::f32, p.s(1));
  for (int r : {0, 1}) {
    const std::string msg = collective_failure<precondition_error>(p.c(r), p.s(r));
    EXPECT_CONTAINS(msg, "terms 2 vs 3");
    EXPECT_CONTAINS(msg, "called all_reduce_exact(count 10, f32, terms 2)");
  }
  // then both give 2 terms (strides of their own): 4 ones per element
  p.c(0).all_reduce_exact(a.data(), 2, 10, out0.data(), 10, dtype::f32, p.s(0));
  p.c(1).all_reduce_exact(b.data(), 2, 15, out1.data(), 10, dtype::f32, p.s(1));
  p.c(0).synchronize(p.s(0));
  p.c(1).synchronize(p.s(1));
  EXPECT_EQ(to_vector(device_span<const float>(out0.span()), p.s(0)), std::vector<float>(10, 4.0f));
  EXPECT_EQ(to_vector(device_span<const float>(out1.span()), p.s(1)), std::vector<float>(10, 4.0f));
}

TEST(host_clique, different_collectives_on_the_ranks_fail_on_every_rank_naming_the_difference) {
  host_pair p(2);
  auto a = to_device(std::vector<float>(11, 1.0f), p.s(0));
  auto b = to_device(std::vector<float>(11, 1.0f), p.s(1));
  auto h = to_device(std::vector<lockstep::half>(11, lockstep::half(1.0f)), p.s(1));
  struct mismatch {
    std::function<void()> rank1;
    const char* difference;
  };
  const mismatch cases[] = {
      {[&] { p.c(1).all_reduce(b.span().first(11), reduce_op::sum, p.s(1)); }, "count 10 vs 11"},
      {[&] { p.c(1).all_reduce(h.span().first(10), reduce_op::sum, p.s(1)); }, "dtype f32 vs f16"},
      {[&] { p.c(1).all_reduce(b.span().first(10), reduce_op::max, p.s(1)); }, "op sum vs max"},
      {[&] { p.c(1).broadcast(b.span().first(10), 0, p.s(1)); }, "collective all_reduce vs broadcast"},
      {[&] { p.c(1).barrier(p.s(1)); }, "collective all_reduce vs barrier"},
  };
  std::uint64_t seq = 0;
  for (const auto& m : cases) {
    ++seq;
    p.c(0).all_reduce(a.span().first(10), reduce_op::sum, p.s(0));
    m.rank1();
    const std::string m0 = collective_failure<precondition_error>(p.c(0), p.s(0));
    const std::string m1 = collective_failure<precondition_error>(p.c(1), p.s(1));
    for (const std::string& msg : {m0, m1}) {
      EXPECT_CONTAINS(msg, m.difference);
      EXPECT_CONTAINS(msg, "the ranks called different collectives");
    }
    EXPECT_CONTAINS(m0, "all_reduce #" + std::to_string(seq) + " on rank 0 (host:0)");
    EXPECT_CONTAINS(m0, "called all_reduce(count 10, f32, sum)");
  }
  // The clique is still usable: the sequence numbers stayed aligned.
  p.c(0).broadcast(a.span(), 1, p.s(0));
  p.c(1).broadcast(b.span(), 1, p.s(1));
  EXPECT_NO_THROW(p.c(0).synchronize(p.s(0)));
  EXPECT_NO_THROW(p.c(1).synchronize(p.s(1)));
  // root mismatch
  p.c(0).broadcast(a.span(), 0, p.s(0));
  p.c(1).broadcast(b.span(), 1, p.s(1));
  EXPECT_CONTAINS(collective_failure<precondition_error>(p.c(1), p.s(1)), "root 0 vs 1");
  EXPECT_CONTAINS(collective_failure<precondition_error>(p.c(0), p.s(0)), "root 0 vs 1");
}

// Issue 28, defect 1: NCCL reads peers' stream-ordered pool memory directly within a process, which faults unless
// the pools grant access (enable_peer_access). make_host_clique grants it like make_nccl_clique, and strict host mode
// refuses a collective between devices without the grant, where a GPU would fault.
TEST(host_clique, a_collective_between_devices_without_peer_access_is_refused_as_a_gpu_would_fault) {
  ASSERT_TRUE(lockstep::detail::host_strict());  // configured above
  host_pair p(2);
  const device devs[] = {device{device_kind::host, 0}, device{device_kind::host, 1}};
  auto a = to_device(std::vector<float>(1000, 1.0f), p.s(0));
  auto b = to_device(std::vector<float>(1000, 2.0f), p.s(1));
  struct restore_grants {  // whatever happens, later tests find the grants the clique made
    std::span<const device> devices;
    ~restore_grants() { (void)enable_peer_access(devices); }
  } restore{devs};
  disable_peer_access(devs);
  const std::string m = message_of<precondition_error>([&] { p.c(0).all_reduce(a.span(), reduce_op::sum, p.s(0)); });
  EXPECT_CONTAINS(m, "all_reduce on rank 0 (host:0): rank 0 (host:0) would read and write the buffers of rank 1 "
                     "(host:1) directly, but host:0 was never given access to the memory of host:1");
  EXPECT_CONTAINS(m, "cudaErrorIllegalAddress");
  EXPECT_CONTAINS(m, "enable_peer_access(devices)");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { p.c(1).broadcast(b.span(), 0, p.s(1)); }),
                  "broadcast on rank 1 (host:1)");
  // Nothing was queued: the ranks' sequence numbers are still aligned once the grants are back.
  const auto pairs = enable_peer_access(devs);
  EXPECT_EQ(pairs.size(), 2u);  // host devices are always connected: both directions
  p.c(0).all_reduce(a.span(), reduce_op::sum, p.s(0));
  p.c(1).all_reduce(b.span(), reduce_op::sum, p.s(1));
  p.c(0).synchronize(p.s(0));
  p.c(1).synchronize(p.s(1));
  EXPECT_EQ(to_vector(device_span<const float>(a.span()), p.s(0)), std::vector<float>(1000, 3.0f));
  EXPECT_EQ(to_vector(device_span<const float>(b.span()), p.s(1)), std::vector<float>(1000, 3.0f));
  // A new clique grants its devices again.
  disable_peer_access(devs);
  host_pair q(2);
  q.c(0).barrier(q.s(0));  // a barrier touches no buffer: allowed either way
  q.c(1).barrier(q.s(1));
  q.c(0).all_reduce(a.span(), reduce_op::max, q.s(0));
  q.c(1).all_reduce(b.span(), reduce_op::max, q.s(1));
  EXPECT_NO_THROW(q.c(0).synchronize(q.s(0)));
  EXPECT_NO_THROW(q.c(1).synchronize(q.s(1)));
}

TEST(host_clique, a_rank_that_never_joins_times_out_on_the_others_naming_it) {
  host_pair p(3, comm_options{300ms});
  auto x0 = to_device(std::vector<float>(5, 1.0f), p.s(0));
  auto x1 = to_device(std::vector<float>(5, 1.0f), p.s(1));
  auto x2 = to_device(std::vector<float>(5, 1.0f), p.s(2));
  p.s(0).synchronize();
  p.s(2).synchronize();
  const auto start = clock_type::now();
  p.c(0).all_reduce(x0.span(), reduce_op::sum, p.s(0));
  p.c(2).all_reduce(x2.span(), reduce_op::sum, p.s(2));
  const std::string m0 = collective_failure<timeout_error>(p.c(0), p.s(0));
  const double waited = seconds_since(start);
  const std::string m2 = collective_failure<timeout_error>(p.c(2), p.s(2));
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 0.3 + 3.0) << "the timeout must fire within the configured time (plus scheduling slack)";
  EXPECT_CONTAINS(m0,
                  "all_reduce #1 on rank 0 (host:0): rank 1 (host:1) did not join within 300 ms; it may have "
                  "failed, exited or be stuck");
  EXPECT_CONTAINS(m2, "all_reduce #1 on rank 2 (host:2): rank 1 (host:1) did not join within 300 ms");
  // The late rank fails at once (the slot is already failed) instead of waiting for peers that gave up.
  p.c(1).all_reduce(x1.span(), reduce_op::sum, p.s(1));
  EXPECT_CONTAINS(collective_failure<timeout_error>(p.c(1), p.s(1)), "this rank arrived after the others had given up");
  // And the clique goes on.
  for (int r = 0; r < 3; ++r) p.c(r).barrier(p.s(r));
  for (int r = 0; r < 3; ++r) EXPECT_NO_THROW(p.c(r).synchronize(p.s(r)));
}

TEST(host_clique, two_missing_ranks_are_both_named) {
  host_pair p(4, comm_options{200ms});
  p.c(0).barrier(p.s(0));
  p.c(2).barrier(p.s(2));
  const std::string msg = collective_failure<timeout_error>(p.c(0), p.s(0));
  EXPECT_CONTAINS(msg, "barrier #1 on rank 0 (host:0): ranks 1 (host:1), 3 (host:3) did not join within 200 ms; they");
  (void)collective_failure<timeout_error>(p.c(2), p.s(2));
}

TEST(host_clique, abort_makes_pending_and_later_collectives_fail_fast_with_the_reason) {
  host_pair p(2, comm_options{20s});
  auto x = to_device(std::vector<float>(5, 1.0f), p.s(0));
  p.s(0).synchronize();
  const auto start = clock_type::now();
  p.c(0).all_reduce(x.span(), reduce_op::sum, p.s(0));
  std::this_thread::sleep_for(50ms);
  p.c(1).abort("rank 1 gave up on purpose");
  const std::string msg = collective_failure<error>(p.c(0), p.s(0));
  EXPECT_LT(seconds_since(start), 5.0) << "abort must not wait for the 20 s timeout";
  EXPECT_CONTAINS(msg, "all_reduce #1 on rank 0 (host:0) was aborted: rank 1 gave up on purpose");
  p.c(0).barrier(p.s(0));
  EXPECT_CONTAINS(collective_failure<error>(p.c(0), p.s(0)), "barrier #2 on rank 0 (host:0) was aborted");
}

// A rank whose stream failed before a collective (its buffers hold nothing valid) fails that collective on
// every rank at once, instead of letting the others complete a step with its stale data.
TEST(host_clique, a_collective_after_failed_work_fails_on_every_rank) {
  host_pair p(2, comm_options{20s});
  auto x0 = to_device(std::vector<float>(5, 1.0f), p.s(0));
  auto x1 = to_device(std::vector<float>(5, 1.0f), p.s(1));
  detail::enqueue_host(p.s(1), [] { throw std::runtime_error("the backward kernel failed"); }, "backward");
  const auto start = clock_type::now();
  p.c(0).all_reduce(x0.span(), reduce_op::sum, p.s(0));
  p.c(1).all_reduce(x1.span(), reduce_op::sum, p.s(1));
  const std::string msg = collective_failure<error>(p.c(0), p.s(0));
  EXPECT_LT(seconds_since(start), 5.0) << "must not wait for the 20 s timeout";
  EXPECT_CONTAINS(msg, "all_reduce #1 on rank 0 (host:0) was aborted: all_reduce #1 on rank 1 (host:1) could not "
                       "run: earlier work on its stream failed");
  EXPECT_CONTAINS(msg, "the backward kernel failed");
  EXPECT_EQ(to_vector(device_span<const float>(x0.span()), p.s(0))[0], 1.0f);  // nothing was summed
  EXPECT_CONTAINS(message_of<async_error>([&] { p.s(1).synchronize(); }), "the backward kernel failed");
}

TEST(host_clique, communicators_may_be_destroyed_while_collectives_are_queued) {
  stream s0(device{device_kind::host, 0}), s1(device{device_kind::host, 1});
  auto a = to_device(std::vector<float>(100, 1.0f), s0);
  auto b = to_device(std::vector<float>(100, 2.0f), s1);
  {
    auto comms = make_host_clique(device_set("host:0,host:1"));
    detail::enqueue_host(
        s0, [] { std::this_thread::sleep_for(20ms); }, "delay");
    comms[0].all_reduce(a.span(), reduce_op::sum, s0);
    comms[1].all_reduce(b.span(), reduce_op::sum, s1);
  }  // the queued collectives keep the clique's state alive
  EXPECT_EQ(to_vector(device_span<const float>(a.span()), s0)[99], 3.0f);
  EXPECT_EQ(to_vector(device_span<const float>(b.span()), s1)[0], 3.0f);
}

// ---- run_on_devices -------------------------------------------------------------------------------------------

namespace {
class run_devices : public ::testing::TestWithParam<device_kind> {
 protected:
  void SetUp() override {
    if (GetParam() == device_kind::cuda && device_count(device_kind::cuda) < 2) {
      GTEST_SKIP() << "needs 2 GPUs: " << (cuda_available() ? "1 visible" : cuda_status().reason());
    }
  }
  device_set devices(int k) const {
    std::vector<device> d;
    for (int r = 0; r < k; ++r) d.push_back(device{GetParam(), r});
    return device_set(d);
  }
  int max_ranks() const { return GetParam() == device_kind::host ? 4 : device_count(device_kind::cuda); }
  std::string name(int r) const { return device{GetParam(), r}.str(); }
};
std::string kind_name(const ::testing::TestParamInfo<device_kind>& info) { return std::string(name_of(info.param)); }
}  // namespace

INSTANTIATE_TEST_SUITE_P(all, run_devices, ::testing::Values(device_kind::host, device_kind::cuda), kind_name);

TEST_P(run_devices, gives_each_rank_its_device_streams_and_communicator) {
  const int k = max_ranks();
  std::vector<float> results(static_cast<std::size_t>(k), -1.0f);
  std::atomic<int> ran{0};
  run_on_devices(devices(k), [&](rank_context& ctx) {
    ran.fetch_add(1);
    EXPECT_EQ(ctx.size(), k);
    EXPECT_EQ(ctx.get_device(), (device{GetParam(), ctx.rank()}));
    EXPECT_EQ(current_device(GetParam()), ctx.get_device());
    EXPECT_EQ(ctx.compute_stream().get_device(), ctx.get_device());
    EXPECT_EQ(ctx.comm_stream().get_device(), ctx.get_device());
    EXPECT_FALSE(ctx.compute_stream() == ctx.comm_stream());
    EXPECT_EQ(ctx.comm().rank(), ctx.rank());
    auto x = to_device(std::vector<float>(1000, static_cast<float>(ctx.rank() + 1)), ctx.comm_stream());
    ctx.comm().all_reduce(x.span(), reduce_op::sum, ctx.comm_stream());
    results[static_cast<std::size_t>(ctx.rank())] =
        to_vector(device_span<const float>(x.span()), ctx.comm_stream())[999];
  });
  EXPECT_EQ(ran.load(), k);
  for (int r = 0; r < k; ++r) EXPECT_EQ(results[static_cast<std::size_t>(r)], static_cast<float>(k * (k + 1) / 2));
}

TEST_P(run_devices, an_exception_on_one_rank_is_rethrown_naming_it_and_the_others_fail_fast) {
  const int k = max_ranks();
  std::atomic<int> stopped{0};
  const auto start = clock_type::now();
  try {
    run_on_devices(
        devices(k),
        [&](rank_context& ctx) {
          struct on_exit {
            std::atomic<int>& n;
            ~on_exit() { n.fetch_add(1); }
          } guard{stopped};
          if (ctx.rank() == 1) throw std::runtime_error("rank 1 exploded");
          auto x = to_device(std::vector<float>(64, 1.0f), ctx.compute_stream());
          for (int i = 0; i < 3; ++i) ctx.comm().all_reduce(x.span(), reduce_op::sum, ctx.compute_stream());
          ctx.comm().synchronize(ctx.compute_stream());  // waits for rank 1, which never comes: aborted
        },
        comm_options{20s});
    FAIL() << "run_on_devices did not throw";
  } catch (const error& e) {
    const double took = seconds_since(start);
    EXPECT_EQ(stopped.load(), k) << "every thread must have stopped before the exception reaches the caller";
    EXPECT_LT(took, 5.0) << "the other ranks must fail fast (abort), not after the 20 s timeout";
    const std::string msg = e.what();
    EXPECT_CONTAINS(msg, "run_on_devices: rank 1 (" + name(1) + ") failed: rank 1 exploded");
    if (k > 1) {
      EXPECT_CONTAINS(msg, std::to_string(k - 1) + " other rank");
      EXPECT_CONTAINS(msg, "was aborted: rank 1 (" + name(1) + ") failed: rank 1 exploded");
    }
    try {
      std::rethrow_if_nested(e);
      ADD_FAILURE() << "the original exception is not nested";
    } catch (const std::runtime_error& original) {
      EXPECT_STREQ(original.what(), "rank 1 exploded");
    }
  }
}

TEST_P(run_devices, a_failure_after_some_collectives_stops_the_others_too) {
  const int k = max_ranks();
  if (k < 3) GTEST_SKIP() << "needs 3 ranks";
  const auto start = clock_type::now();
  const std::string msg = message_of<error>([&] {
    run_on_devices(
        devices(k),
        [&](rank_context& ctx) {
          auto x = to_device(std::vector<float>(256, 1.0f), ctx.comm_stream());
          for (int step = 0; step < 20; ++step) {
            if (ctx.rank() == 2 && step == 3) throw numeric_error("loss is NaN at step 3");
            ctx.comm().all_reduce(x.span(), reduce_op::mean, ctx.comm_stream());
            ctx.comm().synchronize(ctx.comm_stream());
          }
        },
        comm_options{20s});
  });
  EXPECT_LT(seconds_since(start), 5.0);
  EXPECT_CONTAINS(msg, "rank 2 (" + name(2) + ") failed: loss is NaN at step 3");
}

TEST(run_on_devices, rejects_an_empty_device_set) {
  EXPECT_THROW(run_on_devices(device_set{}, [](rank_context&) {}), precondition_error);
}
