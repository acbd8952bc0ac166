// Tests of comm/mpi.hpp: every collective across the processes of an mpirun job, one host device per process
// (each process uses host:0 of its own host platform). A GoogleTest program with its own main, launched as
//
//   mpirun -np 2 --allow-run-as-root --oversubscribe ./test_comm_mpi     (and -np 3)
//
// Every rank runs every test in the same order; the exit status is non-zero on every rank if a test failed on
// any rank. A test that fails on one rank before a collective makes the others time out (30 s), not hang.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/comm.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/stream.hpp"
#include "comm_common.hpp"
#include "test_support.hpp"

#if !defined(LOCKSTEP_WITH_MPI) || !LOCKSTEP_WITH_MPI
#error "test_comm_mpi is built with lockstep::mpi (LOCKSTEP_WITH_MPI=1)"
#endif

using namespace lockstep;
using namespace lockstep_test;
using namespace comm_test;
using namespace std::chrono_literals;

namespace {

constexpr device host0{device_kind::host, 0};

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/// The nested error of type E of a failed collective, as reported by comm.synchronize(s).
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
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw the wrong exception type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "the collective did not fail";
  return {};
}

/// In f32, rounded once, over every rank's input (each process computes every rank's input itself).
template <class T>
std::vector<T> reference(int k, std::size_t total, reduce_op op, std::size_t offset, std::size_t n) {
  std::vector<std::vector<T>> in;
  for (int r = 0; r < k; ++r) in.push_back(input<T>(r, total));
  return comm_test::reference(in, op, offset, n);
}

/// A communicator over MPI_COMM_WORLD (or `comm`) on host:0, and a stream.
class mpi_comm : public ::testing::Test {
 protected:
  void SetUp() override { make(MPI_COMM_WORLD); }
  void make(MPI_Comm over, comm_options options = comm_options{30s}) {
    c_ = make_mpi_communicator(host0, over, options);
    k_ = c_.size();
    rank_ = c_.rank();
  }

  std::vector<std::size_t> counts() const {
    std::vector<std::size_t> c = {0, 1};
    if (k_ > 2) c.push_back(static_cast<std::size_t>(k_ - 1));
    for (std::size_t n : {std::size_t{1001}, std::size_t{1002}, std::size_t{1003}, std::size_t{20011}}) c.push_back(n);
    return c;
  }

  communicator c_;
  stream s_{host0};
  int k_ = 0;
  int rank_ = 0;
};

}  // namespace

TEST_F(mpi_comm, knows_its_rank_size_and_device) {
  EXPECT_EQ(k_, world_size());
  EXPECT_EQ(rank_, world_rank());
  EXPECT_EQ(c_.get_device(), host0);
  EXPECT_EQ(local_rank(), world_rank()) << "one node: the local rank is the world rank";
}

TEST_F(mpi_comm, all_reduce_matches_the_reference) {
  for_each_type<float, lockstep::half, bfloat16>([&]<class T>() {
    for (reduce_op op : all_ops) {
      for (std::size_t n : counts()) {
        for (bool in_place : {false, true}) {
          const auto expected = reference<T>(k_, n, op, 0, n);
          auto send = to_device(input<T>(rank_, n), s_);
          auto recv = to_device(std::vector<T>(n, sentinel<T>()), s_);
          if (in_place) {
            c_.all_reduce(send.span(), op, s_);
          } else {
            c_.all_reduce(device_span<const T>(send.span()), recv.span(), op, s_);
          }
          c_.synchronize(s_);
          EXPECT_SAME(to_vector(device_span<const T>((in_place ? send : recv).span()), s_), expected,
                      "all_reduce " << name_of(dtype_of_v<T>) << " " << name_of(op) << " count " << n
                                    << (in_place ? " in place" : ""));
        }
      }
    }
  });
}

TEST_F(mpi_comm, reduce_matches_the_reference_at_every_root) {
  for_each_type<float, lockstep::half, bfloat16>([&]<class T>() {
    for (reduce_op op : all_ops) {
      for (std::size_t n : counts()) {
        for (int root = 0; root < k_; ++root) {
          for (bool in_place : {false, true}) {
            const auto mine = input<T>(rank_, n);
            auto send = to_device(mine, s_);
            auto recv = to_device(std::vector<T>(rank_ == root ? n : 0, sentinel<T>()), s_);
            device_span<T> out = rank_ == root && in_place ? send.span() : recv.span();
            c_.reduce(device_span<const T>(send.span()), out, op, root, s_);
            c_.synchronize(s_);
            if (rank_ == root) {
              EXPECT_SAME(to_vector(device_span<const T>(out), s_), (reference<T>(k_, n, op, 0, n)),
                          "reduce " << name_of(dtype_of_v<T>) << " " << name_of(op) << " root " << root << " count "
                                    << n << (in_place ? " in place" : ""));
            } else {
              EXPECT_SAME(to_vector(device_span<const T>(send.span()), s_), mine, "a non-root's send must not change");
            }
          }
        }
      }
    }
  });
}

TEST_F(mpi_comm, broadcast_copies_the_root_for_every_dtype_and_root) {
  for_each_type<float, lockstep::half, bfloat16, std::int32_t, std::int64_t, std::uint8_t>([&]<class T>() {
    for (std::size_t n : counts()) {
      for (int root = 0; root < k_; ++root) {
        for (bool in_place : {false, true}) {
          const auto data = input<T>(root, n);
          auto send = to_device(rank_ == root ? data : std::vector<T>{}, s_);
          auto recv = to_device(std::vector<T>(n, sentinel<T>()), s_);
          const bool root_in_place = in_place && rank_ == root;
          if (root_in_place) {
            c_.broadcast(send.span(), root, s_);
          } else if (in_place) {
            c_.broadcast(recv.span(), root, s_);
          } else {
            c_.broadcast(device_span<const T>(send.span()), recv.span(), root, s_);
          }
          c_.synchronize(s_);
          EXPECT_SAME(to_vector(device_span<const T>((root_in_place ? send : recv).span()), s_), data,
                      "broadcast " << name_of(dtype_of_v<T>) << " root " << root << " count " << n
                                   << (in_place ? " in place" : ""));
        }
      }
    }
  });
}

// The same twelve terms per element as test_comm's cliques, split over the processes (np 2 and 3): the same bits.
TEST_F(mpi_comm, all_reduce_exact_gives_every_rank_the_correctly_rounded_sum_for_any_split_of_the_terms) {
  ASSERT_TRUE(c_.supports(collective_kind::all_reduce_exact));
  constexpr std::size_t total = 12;
  ASSERT_EQ(total % static_cast<std::size_t>(k_), 0u) << "run with 1, 2, 3, 4 or 6 processes";
  const std::size_t per = total / static_cast<std::size_t>(k_);
  for_each_type<float, lockstep::half, bfloat16>([&]<class T>() {
    for (std::size_t n : counts()) {
      const std::size_t stride = n + 3;
      std::vector<T> terms(per * stride, convert<T>(std::numeric_limits<float>::quiet_NaN()));
      for (std::size_t t = 0; t < per; ++t) {
        for (std::size_t i = 0; i < n; ++i) terms[t * stride + i] = exact_term<T>(static_cast<std::size_t>(rank_) * per + t, i);
      }
      auto send = to_device(terms, s_);
      auto recv = to_device(std::vector<T>(n, sentinel<T>()), s_);
      c_.all_reduce_exact(send.data(), per, stride, recv.data(), n, dtype_of_v<T>, s_);
      c_.synchronize(s_);
      EXPECT_SAME(to_vector(device_span<const T>(recv.span()), s_), exact_reference<T>(total, n),
                  "all_reduce_exact " << name_of(dtype_of_v<T>) << " count " << n << " terms " << per);
    }
  });
  // an infinite term on the last rank: every element of every rank is NaN
  std::vector<float> terms(per * 10, 1.0f);
  if (rank_ == k_ - 1) terms[3] = std::numeric_limits<float>::infinity();
  auto send = to_device(terms, s_);
  auto recv = to_device(std::vector<float>(10, 0.0f), s_);
  c_.all_reduce_exact(send.data(), per, 10, recv.data(), 10, dtype::f32, s_);
  c_.synchronize(s_);
  for (float v : to_vector(device_span<const float>(recv.span()), s_)) EXPECT_TRUE(std::isnan(v));
  // the same as three tensors [0, 4), [4, 4), [4, 10): only the first, which holds the infinity, is NaN
  const std::vector<std::size_t> ends = {4, 4, 10};
  c_.all_reduce_exact(send.data(), per, 10, recv.data(), 10, dtype::f32, ends, s_);
  c_.synchronize(s_);
  const auto got = to_vector(device_span<const float>(recv.span()), s_);
  for (std::size_t i = 0; i < 10; ++i) {
    if (i < 4) {
      EXPECT_TRUE(std::isnan(got[i])) << "element " << i;
    } else {
      EXPECT_EQ(got[i], static_cast<float>(total)) << "element " << i;
    }
  }
}

TEST_F(mpi_comm, all_gather_is_rank_major_for_every_dtype) {
  for_each_type<float, lockstep::half, bfloat16, std::int32_t, std::int64_t, std::uint8_t>([&]<class T>() {
    for (std::size_t n : counts()) {
      for (bool in_place : {false, true}) {
        std::vector<T> expected;
        for (int r = 0; r < k_; ++r) {
          const auto part = input<T>(r, n);
          expected.insert(expected.end(), part.begin(), part.end());
        }
        const auto mine = input<T>(rank_, n);
        const std::size_t offset = n * static_cast<std::size_t>(rank_);
        std::vector<T> initial(n * static_cast<std::size_t>(k_), sentinel<T>());
        if (in_place) std::copy(mine.begin(), mine.end(), initial.begin() + static_cast<std::ptrdiff_t>(offset));
        auto recv = to_device(initial, s_);
        auto send = to_device(mine, s_);
        if (in_place) {
          c_.all_gather(recv.span().subspan(offset, n), recv.span(), s_);
        } else {
          c_.all_gather(device_span<const T>(send.span()), recv.span(), s_);
        }
        c_.synchronize(s_);
        EXPECT_SAME(to_vector(device_span<const T>(recv.span()), s_), expected,
                    "all_gather " << name_of(dtype_of_v<T>) << " count " << n << (in_place ? " in place" : ""));
      }
    }
  });
}

TEST_F(mpi_comm, reduce_scatter_matches_the_reference) {
  for_each_type<float, lockstep::half, bfloat16>([&]<class T>() {
    for (reduce_op op : all_ops) {
      for (std::size_t n : counts()) {
        for (bool in_place : {false, true}) {
          const std::size_t total = n * static_cast<std::size_t>(k_);
          const std::size_t offset = n * static_cast<std::size_t>(rank_);
          const auto expected = reference<T>(k_, total, op, offset, n);
          auto send = to_device(input<T>(rank_, total), s_);
          auto recv = to_device(std::vector<T>(n, sentinel<T>()), s_);
          device_span<T> out = in_place ? send.span().subspan(offset, n) : recv.span();
          c_.reduce_scatter(device_span<const T>(send.span()), out, op, s_);
          c_.synchronize(s_);
          EXPECT_SAME(to_vector(device_span<const T>(out), s_), expected,
                      "reduce_scatter " << name_of(dtype_of_v<T>) << " " << name_of(op) << " count " << n
                                        << (in_place ? " in place" : ""));
        }
      }
    }
  });
}

TEST_F(mpi_comm, collectives_wait_for_earlier_work_on_the_stream_and_barriers_order_ranks) {
  const std::size_t n = 5000;
  // The input is written by slow work queued before the collective (slowest on the last rank).
  auto buf = to_device(std::vector<float>(n, 0.0f), s_);
  const auto mine = input<float>(rank_, n);
  float* p = buf.data();
  detail::enqueue_host(
      s_,
      [p, &mine, this] {
        std::this_thread::sleep_for(std::chrono::milliseconds(rank_ == k_ - 1 ? 150 : 0));
        std::memcpy(p, mine.data(), mine.size() * sizeof(float));
      },
      "slow producer");
  c_.all_reduce(buf.span(), reduce_op::sum, s_);
  EXPECT_SAME(to_vector(device_span<const float>(buf.span()), s_), (reference<float>(k_, n, reduce_op::sum, 0, n)),
              "all_reduce after slow work");

  // A barrier: rank 0's stream is busy for 200 ms before it; nobody passes it before that.
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  if (rank_ == 0)
    detail::enqueue_host(
        s_, [] { std::this_thread::sleep_for(200ms); }, "busy rank 0");
  c_.barrier(s_);
  c_.synchronize(s_);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 190ms);
}

TEST_F(mpi_comm, sub_communicators_work_side_by_side) {
  // Split the world into {0, 1} and the rest (a single rank alone with 2 processes: {0} and {1}).
  const int color = world_size() >= 3 ? (world_rank() < 2 ? 0 : 1) : world_rank();
  MPI_Comm sub = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, color, world_rank(), &sub), MPI_SUCCESS);
  {
    auto part = make_mpi_communicator(host0, sub, comm_options{30s});
    auto x = to_device(std::vector<float>(100, static_cast<float>(world_rank() + 1)), s_);
    part.all_reduce(x.span(), reduce_op::sum, s_);
    part.synchronize(s_);
    float expected = 0;
    for (int r = 0; r < world_size(); ++r) {
      const int rc = world_size() >= 3 ? (r < 2 ? 0 : 1) : r;
      if (rc == color) expected += static_cast<float>(r + 1);
    }
    EXPECT_EQ(to_vector(device_span<const float>(x.span()), s_)[99], expected);
  }
  MPI_Comm_free(&sub);
}

TEST_F(mpi_comm, arguments_are_checked) {
  auto buf = to_device(std::vector<float>(8, 1.0f), s_);
  EXPECT_CONTAINS(message_of<precondition_error>([&] {
                    c_.all_reduce(buf.data(), buf.data(), std::size_t{3} << 30, dtype::f32, reduce_op::sum, s_);
                  }),
                  "exceeds MPI's count limit");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { c_.broadcast(buf.span(), k_, s_); }),
                  "root " + std::to_string(k_) + " is out of range");
  EXPECT_CONTAINS(message_of<precondition_error>([&] {
                    (void)make_mpi_communicator(device{device_kind::cuda, 0});
                  }),
                  "expected a host device, got cuda:0");
  // Nothing was queued: the ranks are still in step.
  c_.all_reduce(buf.span(), reduce_op::sum, s_);
  c_.synchronize(s_);
  EXPECT_EQ(to_vector(device_span<const float>(buf.span()), s_)[0], static_cast<float>(k_));
}

TEST_F(mpi_comm, a_rank_that_joins_too_late_makes_the_others_time_out_naming_it) {
  // Rank 0 has the shortest timeout, so it is the one that times out; it then tells the others (which would
  // otherwise wait 3 s) that the communicator is broken.
  make(MPI_COMM_WORLD, comm_options{rank_ == 0 ? 500ms : 3000ms});
  auto x = to_device(std::vector<float>(16, 1.0f), s_);
  s_.synchronize();
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank_ == 1) {
    // Joins only after the others gave up (and told it so): it fails fast with their reason.
    std::this_thread::sleep_for(1500ms);
    c_.all_reduce(x.span(), reduce_op::sum, s_);
    EXPECT_CONTAINS(collective_failure<error>(c_, s_), "aborted");
  } else if (rank_ == 0) {
    const auto start = std::chrono::steady_clock::now();
    c_.all_reduce(x.span(), reduce_op::sum, s_);
    const std::string msg = collective_failure<timeout_error>(c_, s_);
    const auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_GE(waited, 500ms);
    EXPECT_LT(waited, 2500ms);
    EXPECT_CONTAINS(msg, "all_reduce #1 on rank 0 (host:0");
    EXPECT_CONTAINS(msg, k_ == 2 ? "rank 1 did not reach it within 500 ms (rank 0 did)"
                                 : "rank 1 did not reach it within 500 ms (ranks 0, 2 did)");
    EXPECT_CONTAINS(msg, "it has failed, exited or stopped");
    // The communicator is unusable from now on, and says why.
    c_.barrier(s_);
    EXPECT_CONTAINS(collective_failure<error>(c_, s_), "barrier #2 on rank 0");
  } else {
    const auto start = std::chrono::steady_clock::now();
    c_.all_reduce(x.span(), reduce_op::sum, s_);
    EXPECT_CONTAINS(collective_failure<error>(c_, s_), "rank 0 aborted the communicator: all_reduce #1 on rank 0");
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2500ms) << "told by rank 0, not after its own 3 s";
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_F(mpi_comm, abort_on_one_process_makes_the_others_fail_fast_with_the_reason) {
  make(MPI_COMM_WORLD, comm_options{30s});
  auto x = to_device(std::vector<float>(16, 1.0f), s_);
  s_.synchronize();
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  if (rank_ == 1) {
    std::this_thread::sleep_for(100ms);
    c_.abort("rank 1 gave up on purpose");
    c_.all_reduce(x.span(), reduce_op::sum, s_);
    EXPECT_CONTAINS(collective_failure<error>(c_, s_), "was aborted: rank 1 gave up on purpose");
  } else {
    c_.all_reduce(x.span(), reduce_op::sum, s_);
    const std::string msg = collective_failure<error>(c_, s_);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "must not wait for the 30 s timeout";
    EXPECT_CONTAINS(msg, "all_reduce #1 on rank " + std::to_string(rank_));
    EXPECT_CONTAINS(msg, "was aborted: rank 1 aborted the communicator: rank 1 gave up on purpose");
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Ranks that issue different collectives (a rank that runs another precision, other bucket sizes, another
// collective) get an error naming both calls on every rank, before any data moves (MPI itself would corrupt
// memory), and the communicator stays usable.
TEST_F(mpi_comm, ranks_that_issue_different_collectives_fail_on_every_rank_naming_both_calls) {
  make(MPI_COMM_WORLD, comm_options{30s});
  auto x = to_device(std::vector<float>(32, 1.0f), s_);
  auto h = to_device(std::vector<half>(32, half(1.0f)), s_);
  const bool odd = rank_ == k_ - 1;  // the last rank differs
  struct mismatch {
    const char* name;
    std::function<void(bool)> call;
    const char* expect;
  };
  const std::vector<mismatch> cases = {
      {"count", [&](bool o) { c_.all_reduce(x.data(), x.data(), o ? 17 : 16, dtype::f32, reduce_op::sum, s_); },
       "count 16 vs 17"},
      {"dtype", [&](bool o) {
         if (o) {
           c_.all_reduce(h.span(), reduce_op::sum, s_);
         } else {
           c_.all_reduce(x.span(), reduce_op::sum, s_);
         }
       },
       "dtype f32 vs f16"},
      {"kind", [&](bool o) {
         if (o) {
           c_.broadcast(x.span(), 0, s_);
         } else {
           c_.all_reduce(x.span(), reduce_op::sum, s_);
         }
       },
       "collective all_reduce vs broadcast"},
      {"op", [&](bool o) { c_.all_reduce(x.span(), o ? reduce_op::max : reduce_op::sum, s_); }, "op sum vs max"},
  };
  std::uint64_t seq = 0;
  for (const auto& m : cases) {
    SCOPED_TRACE(m.name);
    m.call(odd);
    ++seq;
    const std::string msg = collective_failure<precondition_error>(c_, s_);
    EXPECT_CONTAINS(msg, "#" + std::to_string(seq) + " on rank " + std::to_string(rank_));
    EXPECT_CONTAINS(msg, "the ranks issued different collectives");
    EXPECT_CONTAINS(msg, "rank " + std::to_string(k_ - 1) + " called");
    EXPECT_CONTAINS(msg, m.expect);
  }
  // still usable: the data never moved, the sequence numbers are aligned
  c_.all_reduce(x.span(), reduce_op::sum, s_);
  c_.synchronize(s_);
  EXPECT_EQ(to_vector(device_span<const float>(x.span()), s_)[0], static_cast<float>(k_));
  MPI_Barrier(MPI_COMM_WORLD);
}

// A rank that issues one collective more than the others (it runs one more step) is told which rank did not
// reach it, within the timeout, and the communicator is then broken on every rank.
TEST_F(mpi_comm, an_extra_collective_on_one_rank_times_out_naming_the_ranks_that_did_not_reach_it) {
  make(MPI_COMM_WORLD, comm_options{rank_ == k_ - 1 ? 500ms : 5000ms});
  auto x = to_device(std::vector<float>(8, 1.0f), s_);
  c_.all_reduce(x.span(), reduce_op::sum, s_);
  c_.synchronize(s_);
  if (rank_ == k_ - 1) {
    c_.all_reduce(x.span(), reduce_op::sum, s_);
    const std::string msg = collective_failure<timeout_error>(c_, s_);
    EXPECT_CONTAINS(msg, "all_reduce #2 on rank " + std::to_string(rank_));
    EXPECT_CONTAINS(msg, k_ == 2 ? "rank 0 did not reach it within 500 ms" : "ranks 0, 1 did not reach it");
    EXPECT_THROW(c_.check(), error);
  } else {
    // the others are told, at their next use of the communicator
    std::this_thread::sleep_for(1500ms);
    EXPECT_THROW(c_.check(), error);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

int main(int argc, char** argv) {
  mpi_session session(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (world_rank() != 0) {
    // Keep the output readable: only failures from the other ranks.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    struct failures_only : ::testing::EmptyTestEventListener {
      void OnTestPartResult(const ::testing::TestPartResult& r) override {
        if (r.failed()) {
          std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", world_rank(), r.file_name() ? r.file_name() : "?",
                       r.line_number(), r.summary());
        }
      }
    };
    listeners.Append(new failures_only);
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (failed && world_rank() == 0) std::fprintf(stderr, "test_comm_mpi: a test failed on at least one rank\n");
  return failed;
}
