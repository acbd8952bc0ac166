// lockstep/comm/nccl.hpp — collectives between GPUs through NCCL.
//
//   make_nccl_clique(gpus)                     one communicator per GPU of this process, each used from its own
//                                               thread (run_on_devices)
//   make_nccl_communicator(gpu, MPI_Comm)      one rank per process (needs lockstep::mpi, LOCKSTEP_WITH_MPI)
//
// Collectives map one to one onto ncclAllReduce, ncclBroadcast, ncclReduce, ncclAllGather and
// ncclReduceScatter on the stream (mean is ncclAvg; f16 is ncclFloat16, bf16 ncclBfloat16); barrier is a
// one-element all-reduce on a scratch word. They are queued on the GPU stream and return at once.
//
// Never a hang: the communicators are created non-blocking (ncclConfig_t::blocking = 0), so no NCCL call
// blocks the host; when a call reports ncclInProgress the communicator is polled (ncclCommGetAsyncError) until
// it is ready, the timeout passes, or the communicator is aborted. A collective whose peer never joins makes
// the GPU wait, not the host: wait for it with `comm.synchronize(s)` instead of `s.synchronize()`. It polls
// cudaStreamQuery and ncclCommGetAsyncError and, on an NCCL error or after the timeout, aborts the
// communicators (ncclCommAbort, which stops the waiting kernels) and throws nccl_error or timeout_error.
// `abort(reason)` aborts every communicator of a clique at once (NCCL wants all local ranks aborted
// together); for make_nccl_communicator it aborts this process's communicator only.
//
// The watchdog: every clique (or process communicator) has a thread that, every 20 ms, polls each
// communicator's ncclCommGetAsyncError and the event recorded after each queued collective. On an NCCL error,
// or when the oldest unfinished collective has waited longer than the timeout (counted from when it was queued,
// or from when the collective before it finished, whichever is later), it aborts the communicators
// (ncclCommAbort stops their kernels, so that no cudaStreamSynchronize waits forever on a collective whose peer
// died) and keeps the reason: the next collective, comm.check() (which distributed_data_parallel calls before
// each backward) and comm.synchronize() throw it. On GPUs, a stream that waited for an aborted collective
// goes on with the work queued after it, so wait with comm.synchronize(s), or call comm.check(), before trusting
// results.
//
// Destruction: ncclCommFinalize + ncclCommDestroy when the communicator is healthy, ncclCommAbort after an
// error; a clique's communicators are released together, when the last of them is destroyed. A communicator made
// over MPI (make_nccl_communicator(gpu, MPI_Comm)) asks and answers the other processes over MPI when a collective
// times out (the census that names a stopped rank): destroy it before MPI_Finalize (before the mpi_session ends).
//
// This header is empty unless the translation unit is compiled by nvcc. Link with -lnccl (lockstep::lockstep
// does when the CUDA backend is on).
#pragma once

#include "lockstep/config.hpp"

#if LOCKSTEP_HAS_CUDA

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/cuda_check.hpp"
#include "lockstep/core/thread_name.hpp"
#include "lockstep/device/device_guard.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/runtime/memory.hpp"  // enable_peer_access
#include "lockstep/runtime/stream.hpp"

#if defined(LOCKSTEP_WITH_MPI) && LOCKSTEP_WITH_MPI
#include "lockstep/comm/mpi.hpp"
#endif

LOCKSTEP_DETAIL_BEGIN

namespace nccl_comm {

/// "ncclInvalidUsage".
inline const char* result_name(ncclResult_t r) noexcept {
  switch (r) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    default:
      return "ncclResult";
  }
}

/// "ncclX (text); last NCCL error: ..." for a failed call or an asynchronous error.
inline std::string describe(ncclResult_t status) {
  std::string msg = concat(result_name(status), " (", ncclGetErrorString(status), ')');
  // NCCL keeps the detailed message of the last error per thread; its argument is unused (NCCL docs).
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && *last != '\0') msg += concat("; last NCCL error: ", last);
  return msg;
}

/// Builds "file:line call: ncclX (text); last NCCL error: ... while <what>" and throws nccl_error.
[[noreturn]] LOCKSTEP_COLD inline void throw_nccl_error(ncclResult_t status, const char* call, source_site at,
                                                      message what) {
  throw nccl_error(call_failure_message(at, call, describe(status), what), status);
}

}  // namespace nccl_comm

LOCKSTEP_DETAIL_END

/// Checks an NCCL call: `LOCKSTEP_NCCL_CHECK(ncclGroupEnd(), "creating the clique of ", gpus.str())`. The message
/// has ncclGetErrorString and ncclGetLastError. ncclInProgress is a failure here: calls on a non-blocking
/// communicator go through the communicator's own check, which waits for it.
#define LOCKSTEP_NCCL_CHECK(call, ...)                                                           \
  do {                                                                                           \
    const ncclResult_t lockstep_nccl_status_ = (call);                                           \
    if (lockstep_nccl_status_ != ncclSuccess) [[unlikely]] {                                     \
      ::lockstep::detail::nccl_comm::throw_nccl_error(lockstep_nccl_status_, #call, LOCKSTEP_SITE, \
                                                      ::lockstep::detail::message{__VA_ARGS__}); \
    }                                                                                            \
  } while (false)

LOCKSTEP_DETAIL_BEGIN

namespace nccl_comm {

inline ncclDataType_t datatype_of(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
      return ncclFloat32;
    case dtype::f16:
      return ncclFloat16;
    case dtype::bf16:
      return ncclBfloat16;
    case dtype::i32:
      return ncclInt32;
    case dtype::i64:
      return ncclInt64;
    case dtype::u8:
      return ncclUint8;
  }
  return ncclUint8;
}

inline ncclRedOp_t op_of(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum:
      return ncclSum;
    case reduce_op::mean:
      return ncclAvg;
    case reduce_op::max:
      return ncclMax;
  }
  return ncclSum;
}

/// A non-blocking config: no NCCL call blocks the host, so every wait can time out.
inline ncclConfig_t nonblocking_config() noexcept {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

/// Sleeps a little longer each time (from a yield up to 1 ms): polling without taking a core from the GPU's
/// host threads (NCCL's proxy) for long waits.
class backoff {
 public:
  void pause() {
    if (rounds_++ < 64) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min<std::chrono::microseconds>(sleep_ * 2, std::chrono::milliseconds(1));
  }

 private:
  int rounds_ = 0;
  std::chrono::microseconds sleep_{10};
};

/// The communicators of one clique (or the single one of a process), shared by their endpoints. Every use of a
/// handle holds the endpoint's mutex, so that abort() from another thread never frees a handle in use.
class shared_comms {
 public:
  /// A queued collective the watchdog follows: events recorded before and after it.
  struct pending {
    cudaEvent_t before = nullptr;
    cudaEvent_t done = nullptr;
    std::string what;  // "all_reduce #17 on rank 1 (cuda:1)"
    std::optional<std::chrono::steady_clock::time_point> started;  // when the watchdog saw `before` complete
    std::uint64_t seq = 0;  // the endpoint's collective number
  };

  struct endpoint {
    std::mutex mutex;
    ncclComm_t comm = nullptr;  // null once aborted or destroyed
    device dev;
    int rank = 0;
    void* scratch = nullptr;  // the barrier's one word of device memory
    std::deque<pending> in_flight;        // oldest first (guarded by mutex)
    std::vector<cudaEvent_t> spare_events;  // recycled (guarded by mutex)
  };

  /// Takes ownership of `comms` (released by the destructor, also when this constructor throws) and allocates
  /// each endpoint's barrier word.
  shared_comms(std::vector<ncclComm_t> comms, const std::vector<device>& devices, const std::vector<int>& ranks) {
    endpoints_.reserve(comms.size());
    for (std::size_t i = 0; i < comms.size(); ++i) {
      auto e = std::make_unique<endpoint>();
      e->comm = comms[i];
      e->dev = devices[i];
      e->rank = ranks[i];
      endpoints_.push_back(std::move(e));
    }
    try {
      for (auto& e : endpoints_) {
        device_guard guard(e->dev);
        LOCKSTEP_CUDA_CHECK(cudaMalloc(&e->scratch, sizeof(float)), "allocating the barrier word of ", e->dev.str());
        LOCKSTEP_CUDA_CHECK(cudaMemset(e->scratch, 0, sizeof(float)), "clearing the barrier word of ", e->dev.str());
      }
    } catch (...) {
      release();
      throw;
    }
  }
  shared_comms(const shared_comms&) = delete;
  shared_comms& operator=(const shared_comms&) = delete;

  ~shared_comms() {
    stop_watchdog();
    release();
  }

  /// The census that names a stopped rank when a collective times out (a communicator of processes made over MPI;
  /// in one process, a stopped process is every rank). Before start_watchdog.
  void set_census(std::unique_ptr<rank_census> c) noexcept { census_ = std::move(c); }

  /// Who is missing from the oldest collective still unfinished on endpoint `index`, asked of the other processes
  /// (empty without a census, or when none is unfinished). Never throws.
  [[nodiscard]] std::string census_of_oldest(std::size_t index) noexcept {
    if (!census_) return {};
    std::uint64_t seq = 0;
    std::string what;
    try {
      endpoint& e = *endpoints_[index];
      std::lock_guard lock(e.mutex);
      // only one this rank's stream reached (the watchdog saw its start): the census speaks of this rank as in it
      if (e.in_flight.empty() || !e.in_flight.front().started) return {};
      seq = e.in_flight.front().seq;
      what = e.in_flight.front().what;
    } catch (...) {
      return {};
    }
    const std::string who = census_->ask(seq, [this] { return aborted(); }, [this] { return reason(); });
    return aborted() ? std::string() : concat("the oldest unfinished collective is ", what, ": ", who);
  }

  /// Starts the watchdog thread (once the communicators are initialized). `timeout` bounds a collective.
  void start_watchdog(std::chrono::milliseconds timeout) {
    timeout_ = timeout;
    watchdog_ = std::thread([this] {
      detail::name_this_thread("nccl watchdog");
      watch();
    });
  }

  /// Records on `s` an event for the watchdog (endpoint `e`'s mutex held by the caller): before a collective,
  /// then, with follow(), after it. Throws cuda_error.
  cudaEvent_t mark(endpoint& e, cudaStream_t s, const std::string& what) {
    cudaEvent_t ev = nullptr;
    if (!e.spare_events.empty()) {
      ev = e.spare_events.back();
      e.spare_events.pop_back();
    } else {
      LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "creating the watchdog's event on ",
                          e.dev.str());
    }
    const cudaError_t r = cudaEventRecord(ev, s);
    if (r != cudaSuccess) {
      e.spare_events.push_back(ev);
      throw_cuda_error(r, "cudaEventRecord", LOCKSTEP_SITE,
                       ::lockstep::detail::message{"recording the watchdog's event for ", what});
    }
    return ev;
  }

  /// Hands the watchdog a collective queued on `s` between `before` (from mark()) and an event recorded now.
  void follow(endpoint& e, cudaStream_t s, cudaEvent_t before, std::string what, std::uint64_t seq) {
    cudaEvent_t done = nullptr;
    try {
      done = mark(e, s, what);
      e.in_flight.push_back(pending{before, done, std::move(what), std::nullopt, seq});
    } catch (...) {
      e.spare_events.push_back(before);
      if (done != nullptr) e.spare_events.push_back(done);
      throw;
    }
  }

  /// Gives back an event from mark() whose collective was not queued.
  static void unmark(endpoint& e, cudaEvent_t ev) noexcept {
    try {
      e.spare_events.push_back(ev);
    } catch (...) {
      (void)cudaEventDestroy(ev);
    }
  }

  [[nodiscard]] endpoint& at(std::size_t i) { return *endpoints_.at(i); }
  [[nodiscard]] std::size_t count() const noexcept { return endpoints_.size(); }

  [[nodiscard]] bool aborted() const noexcept { return aborted_.load(std::memory_order_acquire); }
  [[nodiscard]] std::string reason() const {
    std::lock_guard lock(reason_mutex_);
    return reason_;
  }

  /// Throws lockstep::error with the reason once the communicators were aborted (by a rank, or the watchdog).
  void rethrow_failure(const std::string& who) const {
    if (!aborted()) return;
    throw error(concat("the NCCL communicator of ", who, " no longer works: ", reason()));
  }

  /// Aborts every communicator (ncclCommAbort), which also stops their kernels waiting on the GPU. Never throws.
  void abort_all(const std::string& why) noexcept {
    try {
      std::lock_guard lock(reason_mutex_);
      if (!aborted_.load(std::memory_order_relaxed)) reason_ = why;
    } catch (...) {
      // keep the first reason, or none: the abort itself matters more
    }
    aborted_.store(true, std::memory_order_release);
    for (auto& e : endpoints_) {
      std::lock_guard lock(e->mutex);
      if (e->comm == nullptr) continue;
      detail::cuda_device_scope current(e->dev.index);  // restores only a device the thread had a context on
      (void)ncclCommAbort(std::exchange(e->comm, nullptr));
    }
    (void)cudaGetLastError();
  }

 private:
  /// Releases the communicators together: ncclCommFinalize on all healthy ones, inside one ncclGroupStart/
  /// ncclGroupEnd (NCCL's rule for one thread finalizing several communicators; non-blocking, so they progress in
  /// the background), wait up to 10 s for each to become quiescent, then ncclCommDestroy (local once finalized); any
  /// that failed or did not finish is aborted instead. Then frees the barrier words: only now, because cudaFree
  /// synchronizes the device and would wait for a kernel stuck on a missing peer. Never throws.
  void release() noexcept {
    std::vector<endpoint*> healthy;
    for (auto& e : endpoints_) {
      if (e->comm == nullptr) continue;
      detail::cuda_device_scope current(e->dev.index);
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(e->comm, &async) == ncclSuccess && async == ncclSuccess) {
        healthy.push_back(e.get());
      } else {
        (void)ncclCommAbort(std::exchange(e->comm, nullptr));
      }
    }
    std::vector<ncclComm_t> finalizing;
    const bool grouped = healthy.size() > 1 && ncclGroupStart() == ncclSuccess;
    std::vector<ncclResult_t> started(healthy.size(), ncclSuccess);
    for (std::size_t i = 0; i < healthy.size(); ++i) {
      detail::cuda_device_scope current(healthy[i]->dev.index);
      started[i] = ncclCommFinalize(healthy[i]->comm);
    }
    const ncclResult_t group = grouped ? ncclGroupEnd() : ncclSuccess;
    for (std::size_t i = 0; i < healthy.size(); ++i) {
      const bool ok = (started[i] == ncclSuccess || started[i] == ncclInProgress) &&
                      (group == ncclSuccess || group == ncclInProgress);
      if (ok) {
        finalizing.push_back(std::exchange(healthy[i]->comm, nullptr));
      } else {
        detail::cuda_device_scope current(healthy[i]->dev.index);
        (void)ncclCommAbort(std::exchange(healthy[i]->comm, nullptr));
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    backoff wait;
    for (ncclComm_t c : finalizing) {
      ncclResult_t state = ncclInProgress;
      while ((ncclCommGetAsyncError(c, &state) == ncclSuccess && state == ncclInProgress) &&
             std::chrono::steady_clock::now() < deadline) {
        wait.pause();
      }
      if (state == ncclSuccess) {
        (void)ncclCommDestroy(c);
      } else {
        (void)ncclCommAbort(c);
      }
    }
    for (auto& e : endpoints_) {
      detail::cuda_device_scope current(e->dev.index);
      for (auto& p : e->in_flight) {
        (void)cudaEventDestroy(p.before);
        (void)cudaEventDestroy(p.done);
      }
      for (cudaEvent_t ev : e->spare_events) (void)cudaEventDestroy(ev);
      e->in_flight.clear();
      e->spare_events.clear();
      if (e->scratch != nullptr) (void)cudaFree(std::exchange(e->scratch, nullptr));
    }
    (void)cudaGetLastError();
  }

  void stop_watchdog() noexcept {
    {
      std::lock_guard lock(watch_mutex_);
      stopping_ = true;
    }
    watch_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
  }

  /// The watchdog thread: see the file comment.
  void watch() noexcept {
    if (!endpoints_.empty()) (void)cudaSetDevice(endpoints_.front()->dev.index);  // never a context on GPU 0
    // While another thread captures a CUDA graph in cudaStreamCaptureModeGlobal (the default), a query from this
    // thread would be refused (cudaErrorStreamCaptureUnsupported) and would invalidate the user's capture; the
    // watchdog's events are never part of a capture, so its queries are safe in relaxed mode.
    cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&relaxed);
    (void)cudaGetLastError();
    std::unique_lock wait_lock(watch_mutex_);
    while (!watch_cv_.wait_for(wait_lock, std::chrono::milliseconds(20), [this] { return stopping_; })) {
      // where this rank is, for another that timed out (also once aborted: NCCL tells the peers nothing)
      if (census_) census_->answer();
      if (aborted()) continue;
      try {
        std::optional<std::uint64_t> timed_out;
        std::string failure = inspect(timed_out);
        if (timed_out) {
          // NCCL does not say which peer is missing: the census asks them (no endpoint lock held)
          std::string who = "a peer rank has failed, exited or stopped";
          if (census_) {
            who = census_->ask(*timed_out, [this] { return aborted(); }, [this] { return reason(); });
            if (aborted()) continue;  // aborted meanwhile (synchronize's timeout), with its reason
          }
          failure += concat(": ", who, " (timeout: comm_options::timeout or LOCKSTEP_COMM_TIMEOUT); the watchdog "
                            "aborted the NCCL communicators");
        }
        if (!failure.empty()) abort_all(failure);
      } catch (...) {
        abort_all("the NCCL watchdog failed (out of memory while describing a failure)");
      }
    }
  }

  /// One round of the watchdog: the first failure found, or empty; `timed_out` gets the number of a collective that
  /// did not finish within the timeout.
  std::string inspect(std::optional<std::uint64_t>& timed_out) {
    const auto now = std::chrono::steady_clock::now();
    for (auto& ep : endpoints_) {
      endpoint& e = *ep;
      std::lock_guard lock(e.mutex);
      if (e.comm == nullptr) continue;
      ncclResult_t async = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(e.comm, &async);
      if (q != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
        return concat("NCCL reported an asynchronous error on rank ", e.rank, " (", e.dev.str(), "): ",
                      describe(q != ncclSuccess ? q : async),
                      e.in_flight.empty() ? std::string() : concat(" (oldest unfinished: ", e.in_flight.front().what, ')'),
                      "; the watchdog aborted the NCCL communicators");
      }
      while (!e.in_flight.empty()) {
        pending& p = e.in_flight.front();
        if (!p.started) {  // the clock starts when the stream reaches the collective, not when it was queued
          const cudaError_t b = cudaEventQuery(p.before);
          if (b == cudaErrorNotReady || b == cudaErrorStreamCaptureUnsupported) {  // (a capture elsewhere: later)
            (void)cudaGetLastError();
            break;
          }
          if (b != cudaSuccess) return stream_failure(p, b);
          p.started = now;
          if (census_) census_->entered(p.seq);
        }
        const cudaError_t r = cudaEventQuery(p.done);
        if (r == cudaErrorNotReady || r == cudaErrorStreamCaptureUnsupported) {
          (void)cudaGetLastError();
          if (now - *p.started > timeout_) {
            timed_out = p.seq;  // (watch() says who is missing)
            return concat(p.what, " did not finish within ", format_duration(timeout_), " of starting");
          }
          break;
        }
        if (r != cudaSuccess) return stream_failure(p, r);
        if (census_) census_->completed(p.seq);
        e.spare_events.push_back(p.before);
        e.spare_events.push_back(p.done);
        e.in_flight.pop_front();
      }
    }
    return {};
  }

  static std::string stream_failure(const pending& p, cudaError_t r) {
    return concat("waiting for ", p.what, ": ", cudaGetErrorName(r), " (", cudaGetErrorString(r),
                  "); the watchdog aborted the NCCL communicators");
  }

  std::vector<std::unique_ptr<endpoint>> endpoints_;
  std::unique_ptr<rank_census> census_;  // processes only (set_census)
  std::chrono::milliseconds timeout_{0};
  std::thread watchdog_;
  std::mutex watch_mutex_;
  std::condition_variable watch_cv_;
  bool stopping_ = false;
  std::atomic<bool> aborted_{false};
  mutable std::mutex reason_mutex_;
  std::string reason_;
};

/// One rank's endpoint.
class member final : public communicator_impl {
 public:
  member(std::shared_ptr<shared_comms> comms, std::size_t index, int size, std::chrono::milliseconds timeout)
      : comms_(std::move(comms)), index_(index), size_(size), timeout_(timeout) {
    const auto& e = comms_->at(index_);
    rank_ = e.rank;
    dev_ = e.dev;
  }

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return size_; }
  [[nodiscard]] device get_device() const noexcept override { return dev_; }
  /// ncclFloat16 / ncclBfloat16 reductions add in the type (rounding at every step of the ring).
  [[nodiscard]] bool reduces_in_f32() const noexcept override { return false; }

  void enqueue(const collective_call& c, stream_ref s) override {
    const std::uint64_t seq = ++seq_;
    const std::string where = concat(name_of(c.kind), " #", seq, " on ", rank_name(rank_, dev_));
    auto& e = comms_->at(index_);
    std::unique_lock lock(e.mutex);
    if (e.comm == nullptr) throw error(concat(where, " was aborted: ", comms_->reason()));
    device_guard guard(dev_);
    cudaStream_t st = s.cuda_stream();
    const ncclDataType_t type = datatype_of(c.type);
    // Inside a CUDA graph capture the collective becomes a node of the user's graph and runs when the graph is
    // launched: the watchdog gets no events for it (an event recorded in a capture is a graph node, and querying
    // it would fail and abort the clique); launched graphs are waited for with the stream, as other work is.
    const bool captured = capturing(st);
    cudaEvent_t before = captured ? nullptr : comms_->mark(e, st, where);
    ncclResult_t r = ncclSuccess;
    switch (c.kind) {
      case collective_kind::all_reduce:
        r = ncclAllReduce(c.send, c.recv, c.count, type, op_of(c.op), e.comm, st);
        break;
      case collective_kind::broadcast:
        r = ncclBroadcast(c.send, c.recv, c.count, type, c.root, e.comm, st);
        break;
      case collective_kind::reduce:
        r = ncclReduce(c.send, c.recv, c.count, type, op_of(c.op), c.root, e.comm, st);
        break;
      case collective_kind::all_gather:
        r = ncclAllGather(c.send, c.recv, c.count, type, e.comm, st);
        break;
      case collective_kind::reduce_scatter:
        r = ncclReduceScatter(c.send, c.recv, c.count, type, op_of(c.op), e.comm, st);
        break;
      case collective_kind::barrier:
        r = ncclAllReduce(e.scratch, e.scratch, 1, ncclFloat32, ncclSum, e.comm, st);
        break;
      case collective_kind::all_reduce_exact:  // refused by check_collective: supports() is false
        throw precondition_error(concat(where, ": NCCL communicators do not run all_reduce_exact"));
    }
    last_ = concat(name_of(c.kind), " #", seq);
    try {
      complete_call(lock, e, r, where);
    } catch (...) {
      if (before == nullptr) throw;
      if (lock.owns_lock()) {
        shared_comms::unmark(e, before);
      } else {
        std::lock_guard relock(e.mutex);
        shared_comms::unmark(e, before);
      }
      throw;
    }
    if (!captured) comms_->follow(e, st, before, where, seq);
  }

  void abort(const std::string& reason) noexcept override { comms_->abort_all(reason); }
  void rethrow_failure() override { comms_->rethrow_failure(rank_name(rank_, dev_)); }

  /// Polls the stream and the communicator's asynchronous error until the stream is idle; aborts the
  /// communicators and throws on an NCCL error or after the timeout.
  void synchronize(stream_ref s) override {
    LOCKSTEP_EXPECTS(s.get_device() == dev_, "synchronize on ", rank_name(rank_, dev_), ": the stream belongs to ",
                     s.get_device().str(), ", expected a stream of ", dev_.str());
    const std::string where = concat("synchronize on ", rank_name(rank_, dev_));
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    device_guard guard(dev_);
    cudaStream_t st = s.cuda_stream();
    LOCKSTEP_EXPECTS(!capturing(st), where, ": the stream is being captured into a CUDA graph, where nothing runs "
                     "until the graph is launched (and querying the stream would invalidate the capture); end the "
                     "capture, launch the graph, then synchronize");
    backoff wait;
    for (;;) {
      const cudaError_t q = cudaStreamQuery(st);
      if (q != cudaErrorNotReady) {
        if (q != cudaSuccess) {
          throw_cuda_error(q, "cudaStreamQuery", LOCKSTEP_SITE,
                           ::lockstep::detail::message{"waiting for a stream of ", dev_.str(), " (last collective: ",
                                                       last_or_none(), ')'});
        }
        check_async_error(where);
        return;
      }
      (void)cudaGetLastError();  // cudaErrorNotReady is not an error
      check_async_error(where);
      if (std::chrono::steady_clock::now() >= deadline) {
        const std::string who = comms_->census_of_oldest(index_);  // (processes: the others asked)
        comms_->rethrow_failure(rank_name(rank_, dev_));  // the watchdog aborted meanwhile: its reason
        const std::string text =
            concat(where, ": the stream did not finish within ", format_duration(timeout_),
                   " (last collective: ", last_or_none(), "); ",
                   who.empty() ? std::string("a peer rank may have failed, exited or be stuck") : who,
                   " (timeout: comm_options::timeout or LOCKSTEP_COMM_TIMEOUT); the NCCL communicators were aborted");
        comms_->abort_all(text);
        throw timeout_error(text);
      }
      wait.pause();
    }
  }

 private:
  [[nodiscard]] std::string last_or_none() const { return last_.empty() ? std::string("none") : last_; }

  /// Whether `st` is being captured into a CUDA graph (cudaStreamIsCapturing).
  [[nodiscard]] bool capturing(cudaStream_t st) const {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    LOCKSTEP_CUDA_CHECK(cudaStreamIsCapturing(st, &status), "asking whether a stream of ", dev_.str(),
                        " is being captured into a CUDA graph");
    return status != cudaStreamCaptureStatusNone;
  }

  /// Throws when the communicator was aborted or reports an asynchronous error (aborting the others then).
  void check_async_error(const std::string& where) {
    auto& e = comms_->at(index_);
    std::unique_lock lock(e.mutex);
    if (e.comm == nullptr) throw error(concat(where, " was aborted: ", comms_->reason()));
    ncclResult_t async = ncclSuccess;
    LOCKSTEP_NCCL_CHECK(ncclCommGetAsyncError(e.comm, &async), where);
    if (async == ncclSuccess || async == ncclInProgress) return;
    lock.unlock();
    const std::string text = concat(where, ": NCCL reported an asynchronous error: ", describe(async),
                                    " (last collective: ", last_or_none(), "); the NCCL communicators were aborted");
    comms_->abort_all(text);
    throw nccl_error(text, async);
  }

  /// Finishes a call on a non-blocking communicator: waits while it reports ncclInProgress (releasing the lock
  /// between polls, so that abort() can get in), and turns an error into nccl_error after aborting the others.
  void complete_call(std::unique_lock<std::mutex>& lock, shared_comms::endpoint& e, ncclResult_t r,
                     const std::string& where) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    backoff wait;
    while (r == ncclInProgress) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(e.comm, &state);
      r = q != ncclSuccess ? q : state;
      if (r != ncclInProgress) break;
      lock.unlock();
      if (std::chrono::steady_clock::now() >= deadline) {
        const std::string text = concat(where, ": NCCL did not accept the collective within ",
                                        format_duration(timeout_), "; the NCCL communicators were aborted");
        comms_->abort_all(text);
        throw timeout_error(text);
      }
      wait.pause();
      lock.lock();
      if (e.comm == nullptr) throw error(concat(where, " was aborted: ", comms_->reason()));
    }
    if (r == ncclSuccess) return;
    const std::string text = concat(where, ": ", describe(r), "; the NCCL communicators were aborted");
    lock.unlock();
    comms_->abort_all(text);
    throw nccl_error(text, r);
  }

  std::shared_ptr<shared_comms> comms_;
  std::size_t index_;
  int rank_ = 0;
  int size_;
  device dev_{};
  std::chrono::milliseconds timeout_;
  std::uint64_t seq_ = 0;
  std::string last_;  // "all_reduce #17": the last collective queued, for messages
};

/// Waits until every communicator of `comms` has finished initializing (non-blocking init), or throws after
/// aborting them all.
inline void wait_initialized(std::vector<ncclComm_t>& comms, const std::vector<device>& devices,
                             std::chrono::milliseconds timeout, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  backoff wait;
  auto abort_all = [&] {
    for (std::size_t i = 0; i < comms.size(); ++i) {
      if (comms[i] == nullptr) continue;
      (void)cudaSetDevice(devices[i].index);
      (void)ncclCommAbort(std::exchange(comms[i], nullptr));
    }
  };
  for (std::size_t i = 0; i < comms.size(); ++i) {
    for (;;) {
      ncclResult_t state = ncclInProgress;
      const ncclResult_t q = ncclCommGetAsyncError(comms[i], &state);
      const ncclResult_t r = q != ncclSuccess ? q : state;
      if (r == ncclSuccess) break;
      if (r != ncclInProgress) {
        const std::string text =
            concat(what, ": ", describe(r), " while initializing rank ", i, " on ", devices[i].str());
        abort_all();
        throw nccl_error(text, r);
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        abort_all();
        throw timeout_error(concat(what, ": the communicators did not finish initializing within ",
                                   format_duration(timeout), "; a peer may not have joined"));
      }
      wait.pause();
    }
  }
}

}  // namespace nccl_comm

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// One communicator per GPU of `gpus`, rank i on gpus[i], all in this process: peer access enabled between the
/// GPUs (enable_peer_access), then ncclCommInitRankConfig for each GPU inside ncclGroupStart/ncclGroupEnd
/// (checked), non-blocking, waited for with the timeout. Use each from its own thread (see run_on_devices).
/// Queuing several ranks' collectives from one thread inside a user's ncclGroupStart/ncclGroupEnd is not
/// supported: with non-blocking communicators ncclGroupEnd may return ncclInProgress, after which nothing may be
/// queued until every communicator of the group is ready, and the watchdog's events would be recorded before the
/// group's kernels exist. Throws precondition_error for an empty set or host devices, nccl_error, cuda_error and
/// timeout_error.
inline std::vector<communicator> make_nccl_clique(const device_set& gpus, comm_options options = {}) {
  LOCKSTEP_EXPECTS(!gpus.empty(), "make_nccl_clique: the device set is empty");
  LOCKSTEP_EXPECTS(gpus.kind() == device_kind::cuda, "make_nccl_clique: expected GPUs, got ", gpus.str(),
                   " (host devices use make_host_clique)");
  LOCKSTEP_EXPECTS(options.timeout.count() > 0, "make_nccl_clique: comm_options::timeout must be positive, got ",
                   options.timeout.count(), " ms");
  // Within one process NCCL reads and writes peers' buffers directly (P2P direct), and lockstep's buffers come
  // from stream-ordered pools that a peer may touch only once the pool grants it: without this, large messages
  // fault with cudaErrorIllegalAddress or hang. Pairs the hardware does not connect go through NCCL's staging.
  (void)enable_peer_access(gpus.devices());
  const int n = static_cast<int>(gpus.size());
  const std::string what = detail::concat("make_nccl_clique(", gpus.str(), ')');
  ncclUniqueId id;
  LOCKSTEP_NCCL_CHECK(ncclGetUniqueId(&id), "creating the unique id of the NCCL clique ", gpus.str());
  std::vector<ncclComm_t> comms(gpus.size(), nullptr);
  std::vector<ncclConfig_t> configs(gpus.size(), detail::nccl_comm::nonblocking_config());
  {
    device_guard restore(gpus[0]);
    LOCKSTEP_NCCL_CHECK(ncclGroupStart(), "starting the group that creates the NCCL clique ", gpus.str());
    ncclResult_t first_error = ncclSuccess;
    for (int i = 0; i < n; ++i) {
      const auto u = static_cast<std::size_t>(i);
      if (cudaSetDevice(gpus[u].index) != cudaSuccess) {
        (void)cudaGetLastError();
        first_error = ncclUnhandledCudaError;
        break;
      }
      const ncclResult_t r = ncclCommInitRankConfig(&comms[u], n, id, i, &configs[u]);
      if (r != ncclSuccess && r != ncclInProgress) {
        first_error = r;
        break;
      }
    }
    const ncclResult_t end = ncclGroupEnd();  // reports the errors of the calls in the group
    if (first_error != ncclSuccess || (end != ncclSuccess && end != ncclInProgress)) {
      for (std::size_t i = 0; i < comms.size(); ++i) {
        if (comms[i] == nullptr) continue;
        (void)cudaSetDevice(gpus[i].index);
        (void)ncclCommAbort(std::exchange(comms[i], nullptr));
      }
      const bool in_group_end = first_error == ncclSuccess;
      detail::nccl_comm::throw_nccl_error(in_group_end ? end : first_error,
                                          in_group_end ? "ncclGroupEnd" : "ncclCommInitRankConfig", LOCKSTEP_SITE,
                                          ::lockstep::detail::message{"creating the NCCL clique ", gpus.str()});
    }
    detail::nccl_comm::wait_initialized(comms, gpus.devices(), options.timeout, what);
  }
  std::vector<int> ranks(gpus.size());
  for (int i = 0; i < n; ++i) ranks[static_cast<std::size_t>(i)] = i;
  auto shared = std::make_shared<detail::nccl_comm::shared_comms>(comms, gpus.devices(), ranks);
  shared->start_watchdog(options.timeout);
  std::vector<communicator> out;
  out.reserve(gpus.size());
  for (std::size_t i = 0; i < gpus.size(); ++i) {
    out.push_back(communicator::from_impl(std::make_unique<detail::nccl_comm::member>(shared, i, n, options.timeout)));
  }
  return out;
}

#if defined(LOCKSTEP_WITH_MPI) && LOCKSTEP_WITH_MPI
/// This process's NCCL communicator over the processes of `comm`, on GPU `local_gpu` (usually
/// cuda:local_rank()): rank 0 of `comm` creates the NCCL id, MPI_Ibcast sends it (waited for with the
/// timeout), and ncclCommInitRankConfig joins, non-blocking, waited for with the timeout. Every process of
/// `comm` calls it. abort() aborts this process's communicator only; the others see NCCL's remote error or
/// their own timeout in synchronize().
inline communicator make_nccl_communicator(device local_gpu, MPI_Comm comm, comm_options options = {}) {
  LOCKSTEP_EXPECTS(local_gpu.is_cuda(), "make_nccl_communicator: expected a GPU, got ", local_gpu.str(),
                   " (host devices use make_mpi_communicator)");
  check_device_exists(local_gpu);
  LOCKSTEP_EXPECTS(options.timeout.count() > 0, "make_nccl_communicator: comm_options::timeout must be positive, got ",
                   options.timeout.count(), " ms");
  detail::mpi_comm::require_thread_multiple("make_nccl_communicator");
  int rank = 0, size = 0;
  LOCKSTEP_MPI_CHECK(MPI_Comm_rank(comm, &rank), "asking for this process's rank");
  LOCKSTEP_MPI_CHECK(MPI_Comm_size(comm, &size), "asking for the communicator's size");
  const std::string what = detail::concat("make_nccl_communicator on rank ", rank, " (", local_gpu.str(), ')');
  // On the heap: when the broadcast times out, the pending MPI_Ibcast may still write the id, so it is leaked
  // then rather than left pointing at this function's stack.
  auto id_buffer = std::make_unique<ncclUniqueId>();
  ncclUniqueId& id = *id_buffer;
  if (rank == 0) LOCKSTEP_NCCL_CHECK(ncclGetUniqueId(&id), "creating the unique id of the NCCL communicator");
  MPI_Request request = MPI_REQUEST_NULL;
  LOCKSTEP_MPI_CHECK(MPI_Ibcast(&id, static_cast<int>(sizeof id), MPI_BYTE, 0, comm, &request),
                     "broadcasting the NCCL unique id");
  const auto sent = detail::mpi_comm::wait_request(
      request, std::chrono::steady_clock::now() + options.timeout, [] { return false; }, "the NCCL unique id");
  if (sent != detail::mpi_comm::wait_result::done) {
    (void)id_buffer.release();  // MPI may still write it
    throw timeout_error(detail::concat(what, ": the NCCL unique id did not arrive from rank 0 within ",
                                       detail::format_duration(options.timeout),
                                       "; every process of the MPI communicator must call make_nccl_communicator"));
  }
  std::vector<ncclComm_t> comms(1, nullptr);
  ncclConfig_t config = detail::nccl_comm::nonblocking_config();
  {
    device_guard guard(local_gpu);
    const ncclResult_t r = ncclCommInitRankConfig(&comms[0], size, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      detail::nccl_comm::throw_nccl_error(r, "ncclCommInitRankConfig", LOCKSTEP_SITE,
                                          ::lockstep::detail::message{what});
    }
    detail::nccl_comm::wait_initialized(comms, {local_gpu}, options.timeout, what);
  }
  auto shared =
      std::make_shared<detail::nccl_comm::shared_comms>(comms, std::vector<device>{local_gpu}, std::vector<int>{rank});
  // a stopped process is named on a timeout: the others are asked over MPI where they are
  shared->set_census(std::make_unique<detail::mpi_comm::process_census>(comm, options.timeout));
  shared->start_watchdog(options.timeout);
  return communicator::from_impl(std::make_unique<detail::nccl_comm::member>(shared, 0, size, options.timeout));
}
#endif

LOCKSTEP_ABI_END

#endif  // LOCKSTEP_HAS_CUDA
