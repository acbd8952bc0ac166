// lockstep/comm/run_on_devices.hpp — run one function per device, each on its own thread, with a communicator.
//
//   lockstep::run_on_devices(lockstep::device_set("host:0,host:1"), [&](lockstep::rank_context& ctx) {
//     auto grads = lockstep::to_device(local_gradients(ctx.rank()), ctx.compute_stream());
//     ...
//     ctx.comm().all_reduce(grads.span(), lockstep::reduce_op::mean, ctx.compute_stream());
//   });
//
// Threading model: run_on_devices creates a communicator clique over the devices (make_host_clique for host
// devices, make_nccl_clique for GPUs), starts one std::thread per device and blocks the caller until every
// thread has stopped. Thread r makes devices[r] its current device, creates two streams of it (compute and
// communication), calls fn(ctx) and then waits for both streams through the communicator (so a collective that
// cannot complete fails instead of hanging). Rank r's communicator is used by thread r only (like an NCCL
// communicator, an endpoint is used by one thread at a time). `fn` is called concurrently from every thread:
// whatever it shares must be safe to use concurrently.
//
// Failure: when fn throws on one rank (or its streams report an error), that rank aborts the whole clique with
// the error as the reason, so that the other ranks' pending and later collectives fail at once instead of
// waiting for the timeout. Once every thread has stopped, run_on_devices throws lockstep::error naming the rank
// and device that failed first and its message, with that exception nested (std::rethrow_if_nested gives the
// original), and lists the other ranks that failed (most of them as a consequence of the abort).
#pragma once

#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/host_clique.hpp"
#include "lockstep/core/thread_name.hpp"
#include "lockstep/device/device_guard.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/runtime/stream.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/comm/nccl.hpp"
#endif

LOCKSTEP_ABI_BEGIN

/// What one rank's thread gets from run_on_devices: its rank, the world size, its device, two streams of that
/// device owned for the duration of the call, and its communicator.
class rank_context {
 public:
  rank_context(int rank, int size, device dev, communicator_ref comm)
      : rank_(rank), size_(size), dev_(dev), compute_(dev), comm_stream_(dev), comm_(comm) {}
  rank_context(const rank_context&) = delete;
  rank_context& operator=(const rank_context&) = delete;

  /// This rank, 0..size()-1 (the position of the device in the device set).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Number of ranks (devices).
  [[nodiscard]] int size() const noexcept { return size_; }
  /// This rank's device (also the calling thread's current device).
  [[nodiscard]] device get_device() const noexcept { return dev_; }
  /// A stream of this rank's device for computation.
  [[nodiscard]] stream_ref compute_stream() const noexcept { return compute_; }
  /// A second stream of this rank's device, for collectives that overlap with computation.
  [[nodiscard]] stream_ref comm_stream() const noexcept { return comm_stream_; }
  /// This rank's communicator.
  [[nodiscard]] communicator_ref comm() const noexcept { return comm_; }

 private:
  int rank_;
  int size_;
  device dev_;
  stream compute_;
  stream comm_stream_;
  communicator_ref comm_;
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

/// The clique for a device set: host devices through shared memory, GPUs through NCCL.
inline std::vector<communicator> make_clique(const device_set& devices, const comm_options& options) {
  if (devices.kind() == device_kind::host) return make_host_clique(devices, options);
#if LOCKSTEP_HAS_CUDA
  return make_nccl_clique(devices, options);
#else
  throw device_error(concat("run_on_devices(", devices.str(),
                            "): this translation unit was compiled without nvcc and has no GPU backend"));
#endif
}

/// what() of an exception, following nested exceptions: "a: b".
inline std::string describe_exception(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

inline long code_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const error& x) {
    return x.code();
  } catch (...) {
    return 0;
  }
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Runs `fn(rank_context&)` once per device of `devices`, each on its own thread with its own streams and its
/// rank's communicator (see the file comment for the threading model), and returns when every thread has
/// stopped. Throws precondition_error for an empty set; when fn throws on any rank, aborts the clique (the
/// other ranks' collectives fail fast) and, after all threads have stopped, throws lockstep::error naming the
/// first failed rank and device, with its exception nested and the other failures listed.
template <class F>
void run_on_devices(const device_set& devices, F&& fn, comm_options options = {}) {
  LOCKSTEP_EXPECTS(!devices.empty(), "run_on_devices: the device set is empty");
  std::vector<communicator> comms = detail::make_clique(devices, options);
  const int k = static_cast<int>(devices.size());

  struct failure {
    int rank;
    std::exception_ptr error;
    std::string what;
  };
  std::mutex failures_mutex;
  std::vector<failure> failures;  // in the order they happened: the first is the cause
  auto record = [&](int r, std::exception_ptr e) noexcept {
    try {
      std::string what = detail::describe_exception(e);
      bool first = false;
      {
        std::lock_guard lock(failures_mutex);
        first = failures.empty();
        failures.push_back({r, e, what});
      }
      if (first) {
        comms[static_cast<std::size_t>(r)].abort(
            detail::concat(detail::rank_name(r, devices[static_cast<std::size_t>(r)]), " failed: ", what));
      }
    } catch (...) {
      comms[static_cast<std::size_t>(r)].abort("a rank failed (out of memory while recording its error)");
    }
  };

  auto body = [&](int r) {
    const auto u = static_cast<std::size_t>(r);
    detail::name_this_thread("rank", u);
    try {
      device_guard guard(devices[u]);
      rank_context ctx(r, k, devices[u], comms[u]);
      try {
        fn(ctx);
        comms[u].synchronize(ctx.compute_stream());
        comms[u].synchronize(ctx.comm_stream());
      } catch (...) {
        // Abort before ctx's streams are destroyed: their destructors complete the queued work, which must
        // not wait for peers that will never come.
        record(r, std::current_exception());
      }
    } catch (...) {
      record(r, std::current_exception());  // creating the context (streams) failed
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(devices.size());
  try {
    for (int r = 0; r < k; ++r) threads.emplace_back(body, r);
  } catch (...) {
    comms[0].abort("run_on_devices could not start a thread for every device");
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();

  if (failures.empty()) return;
  const failure& first = failures.front();
  std::string msg =
      detail::concat("run_on_devices: ", detail::rank_name(first.rank, devices[static_cast<std::size_t>(first.rank)]),
                     " failed: ", first.what);
  if (failures.size() > 1) {
    msg += detail::concat(" [", failures.size() - 1, " other rank", failures.size() == 2 ? "" : "s",
                          " failed after the clique was aborted:");
    constexpr std::size_t max_listed = 400;  // characters of each other message
    for (std::size_t i = 1; i < failures.size(); ++i) {
      const failure& f = failures[i];
      std::string what = f.what.size() > max_listed ? f.what.substr(0, max_listed) + "..." : f.what;
      msg += detail::concat(i == 1 ? " " : "; ", detail::rank_name(f.rank, devices[static_cast<std::size_t>(f.rank)]),
                            ": ", what);
    }
    msg += ']';
  }
  try {
    std::rethrow_exception(first.error);
  } catch (...) {
    std::throw_with_nested(error(msg, detail::code_of(first.error)));
  }
}

LOCKSTEP_ABI_END
