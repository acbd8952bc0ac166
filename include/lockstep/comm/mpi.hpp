// lockstep/comm/mpi.hpp — collectives between processes through MPI, one host device per process.
//
// Compiled only when the program links `lockstep::mpi` (LOCKSTEP_WITH_MPI=1, OpenMPI). Each process runs
//
//   lockstep::mpi_session session(&argc, &argv);        // MPI_Init_thread(MPI_THREAD_MULTIPLE)
//   auto comm = lockstep::make_mpi_communicator(lockstep::device{lockstep::device_kind::host, 0});
//   comm.all_reduce(grads.span(), lockstep::reduce_op::mean, s);
//   comm.synchronize(s);
//
// A collective is a task on the stream's worker thread: it waits for its turn (the collectives of one
// communicator are issued to MPI in the order they were queued, whatever stream they were queued on, because
// MPI requires the same order on every process), starts the non-blocking MPI collective (MPI_Iallreduce,
// MPI_Ibcast, MPI_Ireduce, MPI_Iallgather, MPI_Ireduce_scatter_block, MPI_Ibarrier) and polls MPI_Test until it
// completes, the timeout passes, or the communicator is aborted. That needs MPI_THREAD_MULTIPLE.
//
// Costs: f16/bf16 reductions are widened to an f32 staging buffer, reduced in f32 by MPI and rounded back once;
// they move twice the bytes of the data on the wire and need count * 4 bytes of host memory (twice that for
// reduce_scatter), in staging buffers reused from collective to collective: two are kept, so the largest
// collective's staging (exact sums' gathered terms too) stays allocated while the communicator lives. `mean` is an
// MPI sum followed by a division pass. Counts are limited to INT_MAX elements (MPI's count type).
//
// Failures: every MPI call returns its error (MPI_ERRORS_RETURN on the communicator's own duplicates of the
// user's MPI_Comm) and is turned into mpi_error with MPI_Error_string. A collective that does not complete
// within the timeout fails with timeout_error; MPI cannot cancel a started collective, so the communicator is
// unusable afterwards and tells the other processes, which fail fast too. `abort(reason)` also tells the other
// processes (through a control message on a second duplicate communicator), so that their pending and later
// collectives fail fast with the reason. After either, the job is broken: end it (MPI_Abort), because
// MPI_Finalize may wait for a process that is stuck.
#pragma once

// lockstep uses MPI's C interface only; keep OpenMPI's and MPICH's deprecated C++ bindings (which need
// libmpi_cxx and do not compile cleanly with -Wextra) out of the translation unit.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <span>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/host_reduce.hpp"
#include "lockstep/device/query.hpp"
#include "lockstep/runtime/copy.hpp"

LOCKSTEP_DETAIL_BEGIN

namespace mpi_comm {

/// "MPI_ERR_TRUNCATE" for the error classes of MPI-3.1 that a collective can report.
inline const char* error_class_name(int cls) noexcept {
  switch (cls) {
    case MPI_SUCCESS:
      return "MPI_SUCCESS";
    case MPI_ERR_BUFFER:
      return "MPI_ERR_BUFFER";
    case MPI_ERR_COUNT:
      return "MPI_ERR_COUNT";
    case MPI_ERR_TYPE:
      return "MPI_ERR_TYPE";
    case MPI_ERR_TAG:
      return "MPI_ERR_TAG";
    case MPI_ERR_COMM:
      return "MPI_ERR_COMM";
    case MPI_ERR_RANK:
      return "MPI_ERR_RANK";
    case MPI_ERR_REQUEST:
      return "MPI_ERR_REQUEST";
    case MPI_ERR_ROOT:
      return "MPI_ERR_ROOT";
    case MPI_ERR_GROUP:
      return "MPI_ERR_GROUP";
    case MPI_ERR_OP:
      return "MPI_ERR_OP";
    case MPI_ERR_ARG:
      return "MPI_ERR_ARG";
    case MPI_ERR_UNKNOWN:
      return "MPI_ERR_UNKNOWN";
    case MPI_ERR_TRUNCATE:
      return "MPI_ERR_TRUNCATE";
    case MPI_ERR_OTHER:
      return "MPI_ERR_OTHER";
    case MPI_ERR_INTERN:
      return "MPI_ERR_INTERN";
    case MPI_ERR_IN_STATUS:
      return "MPI_ERR_IN_STATUS";
    case MPI_ERR_PENDING:
      return "MPI_ERR_PENDING";
    case MPI_ERR_NO_MEM:
      return "MPI_ERR_NO_MEM";
    default:
      return "MPI error";
  }
}

/// "MPI_THREAD_SERIALIZED".
inline const char* thread_level_name(int level) noexcept {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
    default:
      return "an unknown thread level";
  }
}

/// Builds "file:line call: MPI_ERR_X (text) while <what>" and throws mpi_error with the MPI error code.
[[noreturn]] LOCKSTEP_COLD inline void throw_mpi_error(int code, const char* call, source_site at, message what) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  int cls = code;
  if (MPI_Error_class(code, &cls) != MPI_SUCCESS) cls = code;
  const std::string status =
      concat(error_class_name(cls), " (",
             length > 0 ? std::string(text, static_cast<std::size_t>(length)) : concat("code ", code), ')');
  throw mpi_error(call_failure_message(at, call, status, what), code);
}

}  // namespace mpi_comm

LOCKSTEP_DETAIL_END

/// Checks an MPI call: `LOCKSTEP_MPI_CHECK(MPI_Ibcast(...), "broadcasting the NCCL id")`. Needs MPI_ERRORS_RETURN
/// on the communicator for errors to come back at all (MPI's default handler aborts the job).
#define LOCKSTEP_MPI_CHECK(call, ...)                                                          \
  do {                                                                                         \
    const int lockstep_mpi_status_ = (call);                                                   \
    if (lockstep_mpi_status_ != MPI_SUCCESS) [[unlikely]] {                                    \
      ::lockstep::detail::mpi_comm::throw_mpi_error(lockstep_mpi_status_, #call, LOCKSTEP_SITE, \
                                                    ::lockstep::detail::message{__VA_ARGS__}); \
    }                                                                                          \
  } while (false)

LOCKSTEP_DETAIL_BEGIN

namespace mpi_comm {

/// Throws unless MPI is initialized, not finalized, and provides MPI_THREAD_MULTIPLE.
inline void require_thread_multiple(const char* what) {
  int initialized = 0, finalized = 0;
  LOCKSTEP_MPI_CHECK(MPI_Initialized(&initialized), "asking whether MPI is initialized");
  LOCKSTEP_MPI_CHECK(MPI_Finalized(&finalized), "asking whether MPI is finalized");
  LOCKSTEP_EXPECTS(initialized && !finalized, what, ": MPI is ", finalized ? "already finalized" : "not initialized",
                   "; create a lockstep::mpi_session first (it calls MPI_Init_thread with MPI_THREAD_MULTIPLE)");
  int provided = 0;
  LOCKSTEP_MPI_CHECK(MPI_Query_thread(&provided), "asking MPI for its thread level");
  if (provided < MPI_THREAD_MULTIPLE) {
    throw mpi_error(concat(what, ": MPI was initialized with ", thread_level_name(provided),
                           ", lockstep needs MPI_THREAD_MULTIPLE (collectives call MPI from stream worker "
                           "threads); initialize MPI with lockstep::mpi_session or MPI_Init_thread(..., "
                           "MPI_THREAD_MULTIPLE, ...)"));
  }
}

enum class wait_result : std::uint8_t { done, timed_out, stopped };

/// Polls `request` until it completes (done), `deadline` passes (timed_out) or `stop()` returns true
/// (stopped). MPI progresses only while it is called, so the first milliseconds poll back to back; later polls
/// back off to 1 ms so that a long wait does not take a core from the other ranks.
template <class Stop>
wait_result wait_requests(MPI_Request* requests, int count, std::chrono::steady_clock::time_point deadline, Stop stop,
                          const char* what) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    int flag = 0;
    LOCKSTEP_MPI_CHECK(MPI_Testall(count, requests, &flag, MPI_STATUSES_IGNORE), "waiting for ", what);
    if (flag) return wait_result::done;
    if (stop()) return wait_result::stopped;
    const auto now = clock::now();
    if (now >= deadline) return wait_result::timed_out;
    if (now - start < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
    }
  }
}

/// wait_requests for one request.
template <class Stop>
wait_result wait_request(MPI_Request& request, std::chrono::steady_clock::time_point deadline, Stop stop,
                         const char* what) {
  return wait_requests(&request, 1, deadline, stop, what);
}

/// What a rank tells every other rank before its collective number `seq` (the fingerprint of the call), so that
/// ranks that issue different collectives fail with an error naming both calls instead of handing MPI buffers of
/// different sizes (which corrupts memory). Sent as 32 bytes.
struct call_record {
  std::uint64_t seq = 0;
  std::uint64_t count = 0;
  std::int32_t root = 0;
  std::uint8_t kind = 0, type = 0, op = 0, magic = 0x5c;
  std::uint64_t reserved = 0;

  static call_record of(std::uint64_t seq, const collective_call& c) noexcept {
    call_record r;
    r.seq = seq;
    r.kind = static_cast<std::uint8_t>(c.kind);
    if (c.kind == collective_kind::barrier) return r;
    r.count = c.count;
    r.type = static_cast<std::uint8_t>(c.type);
    if (c.is_reduction()) r.op = static_cast<std::uint8_t>(c.op);
    if (c.has_root()) r.root = c.root;
    if (c.kind == collective_kind::all_reduce_exact) {
      r.reserved = c.terms;
      r.root = static_cast<std::int32_t>(std::max<std::size_t>(c.tensors, 1));
    }
    return r;
  }
  [[nodiscard]] collective_call call() const noexcept {
    collective_call c;
    c.kind = static_cast<collective_kind>(kind);
    c.count = count;
    c.type = static_cast<dtype>(type);
    c.op = static_cast<reduce_op>(op);
    c.root = root;
    if (c.kind == collective_kind::all_reduce_exact) {
      c.terms = static_cast<std::size_t>(reserved);
      c.tensors = static_cast<std::size_t>(root);  // (the count only: the signature and difference name it)
    }
    return c;
  }
  [[nodiscard]] bool valid() const noexcept {
    return magic == 0x5c && kind <= static_cast<std::uint8_t>(collective_kind::all_reduce_exact) &&
           type <= static_cast<std::uint8_t>(dtype::u8) && op <= static_cast<std::uint8_t>(reduce_op::max);
  }
  friend bool operator==(const call_record&, const call_record&) = default;
};
static_assert(sizeof(call_record) == 32);

/// The MPI datatype that moves elements of `t` (f16/bf16 as 16-bit words).
inline MPI_Datatype datatype_of(dtype t) {
  switch (t) {
    case dtype::f32:
      return MPI_FLOAT;
    case dtype::f16:
      return MPI_UINT16_T;
    case dtype::bf16:
      return MPI_UINT16_T;
    case dtype::i32:
      return MPI_INT32_T;
    case dtype::i64:
      return MPI_INT64_T;
    case dtype::u8:
      return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

inline bool overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) noexcept {
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return a_bytes != 0 && b_bytes != 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

/// f16/bf16 <-> f32 staging conversions (the host clique's block loops).
inline void widen_to(std::vector<float>& dst, const void* src, dtype t, std::size_t n) {
  dst.resize(n);
  if (n == 0) return;
  if (t == dtype::f16) {
    widen_run(static_cast<const half*>(src), dst.data(), static_cast<std::int64_t>(n));
  } else {
    widen_run(static_cast<const bfloat16*>(src), dst.data(), static_cast<std::int64_t>(n));
  }
}
inline void narrow_from(void* dst, const float* src, dtype t, std::size_t n) {
  if (n == 0) return;
  if (t == dtype::f16) {
    narrow_run(src, static_cast<half*>(dst), static_cast<std::int64_t>(n));
  } else {
    narrow_run(src, static_cast<bfloat16*>(dst), static_cast<std::int64_t>(n));
  }
}

inline void divide(float* p, std::size_t n, int k) noexcept {
  const float d = static_cast<float>(k);
  for (std::size_t i = 0; i < n; ++i) p[i] /= d;
}

/// rank_census over MPI: questions and answers travel on `comm` (a communicator of lockstep's own, with tags no
/// other message uses). A question is a collective number; an answer is {entered, completed}, the last collective
/// the rank entered and the last it completed.
class census final : public rank_census {
 public:
  static constexpr int query_tag = 9;
  static constexpr int reply_tag = 10;

  /// Posts the receive of questions on `comm` (not owned: close() before freeing it). Throws mpi_error.
  census(MPI_Comm comm, std::chrono::milliseconds timeout) : comm_(comm), timeout_(timeout) {
    LOCKSTEP_MPI_CHECK(MPI_Comm_rank(comm_, &rank_), "asking for this process's rank");
    LOCKSTEP_MPI_CHECK(MPI_Comm_size(comm_, &size_), "asking for the communicator's size");
    LOCKSTEP_MPI_CHECK(MPI_Irecv(&query_, 1, MPI_UINT64_T, MPI_ANY_SOURCE, query_tag, comm_, &recv_),
                       "posting the receive of census questions");
  }
  ~census() override { close(); }

  /// Cancels the question receive; keeps (leaks) the buffers of what MPI may still read or write. Idempotent.
  void close() noexcept {
    std::lock_guard lock(mutex_);
    int finalized = 1;
    const bool alive = MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized;
    if (alive && recv_ != MPI_REQUEST_NULL) {
      (void)MPI_Cancel(&recv_);
      (void)MPI_Wait(&recv_, MPI_STATUS_IGNORE);
    }
    recv_ = MPI_REQUEST_NULL;
    for (auto& s : sends_) {
      int done = 0;
      if (!alive || MPI_Test(&s.request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done) {
        (void)new (std::nothrow) std::shared_ptr<answer_buffer>(std::move(s.answer));
      }
    }
    sends_.clear();
    for (auto& r : abandoned_) {
      int done = 0;
      if (!alive || MPI_Testall(static_cast<int>(r->requests.size()), r->requests.data(), &done,
                                MPI_STATUSES_IGNORE) != MPI_SUCCESS || !done) {
        (void)new (std::nothrow) std::shared_ptr<round>(std::move(r));
      }
    }
    abandoned_.clear();
  }

  void entered(std::uint64_t seq) noexcept override { raise_to(entered_, seq); }
  void completed(std::uint64_t seq) noexcept override { raise_to(completed_, seq); }

  void answer() noexcept override {
    std::unique_lock lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return;  // another thread answers
    int finalized = 1;  // (an NCCL communicator's watchdog may outlive MPI: then it answers nothing)
    if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) return;
    // every question that arrived (when many ranks time out together, each asks every other one)
    for (int answered = 0; answered < size_ && recv_ != MPI_REQUEST_NULL; ++answered) {
      int flag = 0;
      MPI_Status status{};
      if (MPI_Test(&recv_, &flag, &status) != MPI_SUCCESS || !flag) return;
      try {
        auto a = std::make_shared<answer_buffer>();
        *a = {entered_.load(std::memory_order_relaxed), completed_.load(std::memory_order_relaxed)};
        pending_answer s{MPI_REQUEST_NULL, a};
        if (MPI_Isend(a->data(), 2, MPI_UINT64_T, status.MPI_SOURCE, reply_tag, comm_, &s.request) == MPI_SUCCESS) {
          sends_.push_back(std::move(s));
        }
        std::erase_if(sends_, [](pending_answer& p) {
          int done = 0;
          return MPI_Test(&p.request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done;
        });
      } catch (...) {  // out of memory: no answer (the asker names this rank as silent)
      }
      if (MPI_Irecv(&query_, 1, MPI_UINT64_T, MPI_ANY_SOURCE, query_tag, comm_, &recv_) != MPI_SUCCESS) {
        recv_ = MPI_REQUEST_NULL;  // no more answers: the others then name this rank as silent
      }
    }
  }

  std::string ask(std::uint64_t seq, const std::function<bool()>& stop,
                  const std::function<std::string()>& why) noexcept override {
    try {
      // one question at a time from this rank (the watchdog's and a synchronize's): answers carry no round number
      std::lock_guard one_at_a_time(asking_);
      if (stop()) return concat("the communicator was ended: ", why());
      int finalized = 1;
      if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) return "the other ranks cannot be asked: MPI has ended";
      return ask_or_throw(seq, stop, why);
    } catch (const std::exception& e) {  // out of memory, or MPI failing
      return concat("the other ranks could not be asked where they are (", e.what(), ")");
    } catch (...) {
      return "the other ranks could not be asked where they are";
    }
  }

 private:
  using answer_buffer = std::array<std::uint64_t, 2>;
  struct pending_answer {
    MPI_Request request;
    std::shared_ptr<answer_buffer> answer;
  };
  /// One question to every other rank and their answers, with the requests (rank r's answer at 2r, the question
  /// to it at 2r + 1; null for this rank).
  struct round {
    std::uint64_t query = 0;
    std::vector<answer_buffer> answers;
    std::vector<MPI_Request> requests;
  };

  static void raise_to(std::atomic<std::uint64_t>& a, std::uint64_t v) noexcept {
    std::uint64_t now = a.load(std::memory_order_relaxed);
    while (now < v && !a.compare_exchange_weak(now, v, std::memory_order_relaxed)) {
    }
  }

  std::string ask_or_throw(std::uint64_t seq, const std::function<bool()>& stop,
                           const std::function<std::string()>& why) {
    const auto n = static_cast<std::size_t>(size_), me = static_cast<std::size_t>(rank_);
    constexpr std::uint64_t none = ~std::uint64_t{0};  // no answer written (no collective number is this large)
    auto r = std::make_shared<round>();
    r->query = seq;
    r->answers.assign(n, {none, none});
    r->requests.assign(2 * n, MPI_REQUEST_NULL);
    // MPI may write the answers (and read the question) until the requests complete: on every exit that leaves one
    // pending, the round is kept rather than freed
    struct keep_pending {
      census* self;
      std::shared_ptr<round> r;
      ~keep_pending() {
        for (MPI_Request& q : r->requests) {
          int done = 0;
          if (q != MPI_REQUEST_NULL && (MPI_Test(&q, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done)) {
            try {
              std::lock_guard lock(self->mutex_);
              self->abandoned_.push_back(r);
            } catch (...) {
              (void)new (std::nothrow) std::shared_ptr<round>(r);  // leaked rather than written once freed
            }
            return;
          }
        }
      }
    } keep{this, r};
    for (std::size_t k = 0; k < n; ++k) {
      if (k == me) continue;
      const int to = static_cast<int>(k);
      if (MPI_Irecv(r->answers[k].data(), 2, MPI_UINT64_T, to, reply_tag, comm_, &r->requests[2 * k]) != MPI_SUCCESS) {
        r->requests[2 * k] = MPI_REQUEST_NULL;
      }
      if (MPI_Isend(&r->query, 1, MPI_UINT64_T, to, query_tag, comm_, &r->requests[2 * k + 1]) != MPI_SUCCESS) {
        r->requests[2 * k + 1] = MPI_REQUEST_NULL;
      }
    }
    const auto window = std::clamp<std::chrono::milliseconds>(timeout_ / 4, std::chrono::milliseconds(100),
                                                              std::chrono::milliseconds(2000));
    // answers of ranks that are alive arrive within the window (this rank answers the others meanwhile)
    const wait_result waited = wait_requests(
        r->requests.data(), static_cast<int>(r->requests.size()), std::chrono::steady_clock::now() + window,
        [&] {
          answer();
          return stop();
        },
        "the census of a timed-out collective");
    if (waited == wait_result::stopped) {  // another rank ended the communicator first: its reason says more
      return concat("another rank ended the communicator while this one asked where the ranks are: ", why());
    }
    std::string silent, behind, completed_by, waiting = concat(rank_);
    int silent_count = 0, waiting_count = 1;
    for (std::size_t k = 0; k < n; ++k) {
      if (k == me) continue;
      // a request is null once complete (here, or in wait_requests' MPI_Testall), or when it could not be posted
      for (const std::size_t i : {2 * k, 2 * k + 1}) {
        int done = 0;
        MPI_Request& q = r->requests[i];
        if (q != MPI_REQUEST_NULL) (void)MPI_Test(&q, &done, MPI_STATUS_IGNORE);
      }
      if (r->requests[2 * k] != MPI_REQUEST_NULL || r->answers[k][0] == none) {
        silent += concat(silent.empty() ? "" : ", ", k);
        ++silent_count;
        continue;
      }
      const std::uint64_t entered = r->answers[k][0], completed = r->answers[k][1];
      if (completed >= seq) {
        completed_by += concat(completed_by.empty() ? "" : ", ", k);
      } else if (entered >= seq) {
        waiting += concat(", ", k);
        ++waiting_count;
      } else {
        behind += concat(behind.empty() ? "" : "; ", "rank ", k, " has not reached it (the last collective it ",
                         "entered is #", entered, ", completed #", completed, ")");
      }
    }
    std::string who;
    if (silent_count > 0) {
      who = concat("rank", silent_count == 1 ? " " : "s ", silent, " did not answer within ", format_duration(window),
                   " when asked where ", silent_count == 1 ? "it is: it has" : "they are: they have",
                   " failed, exited or stopped, or ", silent_count == 1 ? "is" : "are", " stuck outside lockstep");
    }
    if (!behind.empty()) who += concat(who.empty() ? "" : "; ", behind);
    if (who.empty()) who = "every rank entered it, but its data did not arrive (a network failure, or a stuck transport)";
    return concat(who, "; rank", waiting_count == 1 ? " " : "s ", waiting, waiting_count == 1 ? " is" : " are",
                  " waiting in it", completed_by.empty() ? std::string() : concat(" (completed by ", completed_by, ")"));
  }

  MPI_Comm comm_;
  std::chrono::milliseconds timeout_;
  int rank_ = 0, size_ = 1;
  std::atomic<std::uint64_t> entered_{0}, completed_{0};
  std::mutex mutex_;  // guards the question receive, the answers in flight and the abandoned rounds
  std::mutex asking_;  // held by ask()
  std::uint64_t query_ = 0;
  MPI_Request recv_ = MPI_REQUEST_NULL;
  std::vector<pending_answer> sends_;
  std::vector<std::shared_ptr<round>> abandoned_;
};

/// The state shared by a communicator and its queued collectives.
class state {
 public:
  static constexpr int control_tag = 7;
  static constexpr int check_tag = 8;  // call records (on the control communicator)
  static constexpr std::size_t control_capacity = 1024;

  state(MPI_Comm data, MPI_Comm control, device dev, std::chrono::milliseconds timeout, bool check_calls)
      : data_(data), control_(control), dev_(dev), timeout_(timeout), check_calls_(check_calls),
        census_(control, timeout) {
    spare_staging_.reserve(kept_staging);
    LOCKSTEP_MPI_CHECK(MPI_Comm_rank(data_, &rank_), "asking for this process's rank");
    LOCKSTEP_MPI_CHECK(MPI_Comm_size(data_, &size_), "asking for the communicator's size");
    LOCKSTEP_MPI_CHECK(MPI_Irecv(control_buffer_.data(), static_cast<int>(control_capacity), MPI_CHAR, MPI_ANY_SOURCE,
                                 control_tag, control_, &control_recv_),
                       "posting the receive of abort messages");
  }
  state(const state&) = delete;
  state& operator=(const state&) = delete;

  /// Releases MPI resources unless MPI is already finalized (then they died with it). Requests that never
  /// completed (abandoned after a timeout or an abort) keep their staging buffers: MPI may still write them.
  ~state() {
    int finalized = 1;
    if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) {
      leak_staging();
      return;
    }
    if (control_recv_ != MPI_REQUEST_NULL) {
      (void)MPI_Cancel(&control_recv_);
      (void)MPI_Wait(&control_recv_, MPI_STATUS_IGNORE);
    }
    for (auto& s : sends_) {
      int flag = 0;
      if (MPI_Test(&s.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || !flag) {
        (void)MPI_Request_free(&s.request);
        (void)s.text.release();  // the send may still read it
      }
    }
    for (auto& a : abandoned_) {
      int flag = 0;
      if (MPI_Test(&a.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || !flag) (void)a.staging.release();
    }
    for (auto& k : abandoned_checks_) {
      int flag = 0;
      if (MPI_Testall(static_cast<int>(k->requests.size()), k->requests.data(), &flag, MPI_STATUSES_IGNORE) !=
              MPI_SUCCESS ||
          !flag) {
        (void)new (std::nothrow) std::shared_ptr<call_check>(std::move(k));  // MPI may still write the records
      }
    }
    census_.close();  // its question receive cancelled while the control communicator lives
    (void)MPI_Comm_free(&data_);
    (void)MPI_Comm_free(&control_);
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] device get_device() const noexcept { return dev_; }

  /// The call records of one collective (check_call): every rank's record and the sends and receives that
  /// exchange them, posted when the collective is queued so that the records travel while earlier work runs.
  struct call_check {
    std::vector<call_record> calls;
    std::vector<MPI_Request> requests;
  };

  /// Posts the exchange of collective `seq`'s call records (on the queuing thread, in queuing order: the k-th
  /// record from a rank is then its collective number k). Null when calls are not checked.
  std::shared_ptr<call_check> post_check(std::uint64_t seq, const collective_call& c) {
    if (!check_calls_ || size_ == 1 || broken_.load(std::memory_order_acquire)) return nullptr;
    auto k = std::make_shared<call_check>();
    const auto n = static_cast<std::size_t>(size_), me = static_cast<std::size_t>(rank_);
    k->calls.assign(n, call_record{});
    k->calls[me] = call_record::of(seq, c);
    k->requests.assign(2 * (n - 1), MPI_REQUEST_NULL);
    try {
      std::size_t i = 0;
      for (std::size_t r = 0; r < n; ++r) {
        if (r == me) continue;
        LOCKSTEP_MPI_CHECK(MPI_Irecv(&k->calls[r], sizeof(call_record), MPI_BYTE, static_cast<int>(r), check_tag,
                                     control_, &k->requests[i]),
                           "receiving the call record of rank ", r, " for collective #", seq);
        LOCKSTEP_MPI_CHECK(MPI_Isend(&k->calls[me], sizeof(call_record), MPI_BYTE, static_cast<int>(r), check_tag,
                                     control_, &k->requests[i + 1]),
                           "sending the call record to rank ", r, " for collective #", seq);
        i += 2;
      }
    } catch (...) {
      abandon(k);  // the records already posted may still be written
      throw;
    }
    return k;
  }

  /// This rank's collective number `seq` (on the stream's worker), with its posted call check. Throws on failure.
  void run(std::uint64_t seq, const collective_call& c, const std::shared_ptr<call_check>& check,
           host_backend::stream_state& on) {
    const std::string where = concat(name_of(c.kind), " #", seq, " on ", self_name());
    std::unique_ptr<buffers> staging = take_staging();
    MPI_Request request = MPI_REQUEST_NULL;
    try {
      wait_for_turn(seq, where);
      // Work this collective depends on failed: its buffers hold nothing valid. Fail it on every rank (break the
      // communicator) rather than let the others complete a step with this rank's stale data.
      if (auto why = reason_not_to_run(on, where)) {
        break_communicator(*why, notify::peers);
        throw error(*why);
      }
      // An abort message that already arrived must win over starting a collective the others left.
      if (poll_control()) throw error(concat(where, " was aborted: ", reason()));
      if (check) check_call(seq, check, where);
      start(c, *staging, request);
    } catch (...) {
      // the call records may still be in flight: MPI must not write into freed memory
      if (check) abandon(check);
      pass_turn(seq);
      throw;
    }
    census_.entered(seq);  // (before the next collective may start)
    pass_turn(seq);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    const wait_result result = wait_request(
        request, deadline, [this] { return poll_control(); }, where.c_str());
    if (result == wait_result::done) {
      finish(c, *staging);
      census_.completed(seq);
      give_back(std::move(staging));
      return;
    }
    abandon(request, std::move(staging));
    if (result == wait_result::timed_out) {
      // MPI does not say which rank is missing: ask every other one where it is. Ranks waiting in a collective
      // answer at once (they poll); one that is stopped, dead or stuck outside lockstep does not.
      const std::string who = census_.ask(seq, [this] { return poll_control(); }, [this] { return reason(); });
      const std::string text =
          concat(where, " did not complete within ", format_duration(timeout_), ": ", who,
                 " (timeout: comm_options::timeout or LOCKSTEP_COMM_TIMEOUT). MPI cannot cancel the started "
                 "collective, so this communicator is unusable: end the job (MPI_Abort)");
      // the reason the other ranks and this rank's later calls report: the same names
      break_communicator(concat(where, " did not complete within ", format_duration(timeout_), ": ", who),
                         notify::peers);
      throw timeout_error(text);
    }
    throw error(concat(where, " was aborted: ", reason()));
  }

  /// Keeps call records that MPI may still write (a collective that could not be queued).
  void abandon_check(const std::shared_ptr<call_check>& check) { abandon(check); }

  /// Throws the reason when the communicator is broken (a timeout, an abort here or on another process).
  void rethrow_failure() {
    if (!poll_control()) return;
    throw error(concat("the MPI communicator of ", self_name(), " no longer works: ", reason()));
  }

  enum class notify : std::uint8_t { self_only, peers };

  /// Marks the communicator unusable with `why` and, with notify::peers, tells every other process.
  void break_communicator(const std::string& why, notify who) noexcept {
    try {
      {
        std::lock_guard lock(mutex_);
        if (broken_.load(std::memory_order_relaxed)) return;
        reason_ = why;
        broken_.store(true, std::memory_order_release);
      }
      turn_cv_.notify_all();
      if (who == notify::peers) send_abort_messages(why);
    } catch (...) {
      broken_.store(true, std::memory_order_release);  // out of memory: at least stop
    }
  }

 private:
  struct buffers {
    std::vector<float> in, out;
    std::vector<std::byte> bytes;
  };
  struct abandoned_request {
    MPI_Request request;
    std::unique_ptr<buffers> staging;
  };
  // Staging buffers are reused from one collective to the next (two kept: a collective may be in flight on each of
  // two streams), so that a bucket's f32 staging is allocated and its pages touched once, not per collective.
  static constexpr std::size_t kept_staging = 2;
  std::unique_ptr<buffers> take_staging() {
    std::lock_guard lock(staging_mutex_);
    if (spare_staging_.empty()) return std::make_unique<buffers>();
    std::unique_ptr<buffers> b = std::move(spare_staging_.back());
    spare_staging_.pop_back();
    return b;
  }
  void give_back(std::unique_ptr<buffers> b) noexcept {
    std::lock_guard lock(staging_mutex_);
    if (spare_staging_.size() < kept_staging) spare_staging_.push_back(std::move(b));  // (reserved: no allocation)
  }
  struct pending_send {
    MPI_Request request;
    std::unique_ptr<std::string> text;
  };

  [[nodiscard]] std::string self_name() const {
    return concat("rank ", rank_, " (", dev_.str(), " of process ", ::getpid(), ')');
  }

  [[nodiscard]] std::string reason() const {
    std::lock_guard lock(mutex_);
    return reason_;
  }

  /// MPI requires the collectives of a communicator to start in the same order on every process: collective
  /// `seq` starts only after `seq - 1` has, even when they were queued on different streams.
  void wait_for_turn(std::uint64_t seq, const std::string& where) {
    std::unique_lock lock(mutex_);
    const bool ok =
        turn_cv_.wait_for(lock, timeout_, [&] { return next_turn_ == seq || broken_.load(std::memory_order_relaxed); });
    if (!ok) {
      lock.unlock();
      const std::string why =
          concat(where, " could not start: collective #", seq - 1,
                 " of this rank, queued on another stream, did not start within ", format_duration(timeout_));
      break_communicator(why, notify::peers);
      throw timeout_error(why);
    }
  }

  void pass_turn(std::uint64_t seq) {
    {
      std::lock_guard lock(mutex_);
      next_turn_ = std::max(next_turn_, seq + 1);
    }
    turn_cv_.notify_all();
  }

  /// Checks for an abort message from another process; true once the communicator is broken.
  bool poll_control() {
    if (broken_.load(std::memory_order_acquire)) return true;
    std::unique_lock lock(control_mutex_, std::try_to_lock);
    if (!lock.owns_lock() || control_recv_ == MPI_REQUEST_NULL) return broken_.load(std::memory_order_acquire);
    census_.answer();
    int flag = 0;
    MPI_Status status{};
    if (MPI_Test(&control_recv_, &flag, &status) != MPI_SUCCESS) return false;
    if (flag) {
      int length = 0;
      (void)MPI_Get_count(&status, MPI_CHAR, &length);
      const std::string text(control_buffer_.data(), static_cast<std::size_t>(std::max(length, 0)));
      control_recv_ = MPI_REQUEST_NULL;
      break_communicator(concat("rank ", status.MPI_SOURCE, " aborted the communicator: ", text), notify::self_only);
    }
    return broken_.load(std::memory_order_acquire);
  }

  void send_abort_messages(const std::string& why) {
    const std::string text = why.substr(0, control_capacity);
    std::lock_guard lock(control_mutex_);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      pending_send s{MPI_REQUEST_NULL, std::make_unique<std::string>(text)};
      if (MPI_Isend(s.text->data(), static_cast<int>(s.text->size()), MPI_CHAR, r, control_tag, control_, &s.request) ==
          MPI_SUCCESS) {
        sends_.push_back(std::move(s));
      }
    }
  }

  void abandon(MPI_Request request, std::unique_ptr<buffers> staging) {
    std::lock_guard lock(control_mutex_);
    abandoned_.push_back({request, std::move(staging)});
  }

  /// Keeps a call check whose exchange may not have completed (its requests stay in it: one copy of each).
  void abandon(const std::shared_ptr<call_check>& check) {
    std::lock_guard lock(control_mutex_);
    for (const auto& k : abandoned_checks_) {
      if (k == check) return;
    }
    abandoned_checks_.push_back(check);
  }

  /// Waits for the call records of collective `seq` (posted by post_check) and compares them. Ranks that called
  /// different collectives all throw precondition_error naming both calls, before any data moves; the
  /// communicator stays usable. A rank whose record does not arrive within the timeout is named (it has failed,
  /// exited or stopped): timeout_error, and the communicator is broken.
  void check_call(std::uint64_t seq, const std::shared_ptr<call_check>& check, const std::string& where) {
    const auto n = static_cast<std::size_t>(size_), me = static_cast<std::size_t>(rank_);
    call_check& k = *check;
    auto& requests = k.requests;
    std::size_t i = 0;
    const wait_result result = wait_requests(
        requests.data(), static_cast<int>(requests.size()), std::chrono::steady_clock::now() + timeout_,
        [this] { return poll_control(); }, where.c_str());
    if (result != wait_result::done) {
      std::string missing, arrived = concat(rank_);
      int arrived_count = 1;
      for (std::size_t r = 0; r < n; ++r) {
        if (r == me) continue;
        int flag = 0;
        if (requests[i] != MPI_REQUEST_NULL) (void)MPI_Test(&requests[i], &flag, MPI_STATUS_IGNORE);
        if (requests[i] == MPI_REQUEST_NULL || flag) {
          arrived += concat(", ", r);
          ++arrived_count;
        } else {
          missing += concat(missing.empty() ? "" : ", ", r);
        }
        i += 2;
      }
      // MPI may still write the records: the abandoned list keeps them alive
      abandon(check);
      if (result == wait_result::stopped) throw error(concat(where, " was aborted: ", reason()));
      if (missing.empty()) {  // every record arrived, but the others did not take this rank's
        const std::string text = concat(where, ": the other ranks did not receive this rank's call record within ",
                                        format_duration(timeout_), "; this communicator is unusable: end the job "
                                        "(MPI_Abort)");
        break_communicator(text, notify::peers);
        throw timeout_error(text);
      }
      const bool one = missing.find(',') == std::string::npos;
      const std::string text = concat(
          where, ": rank", one ? " " : "s ", missing, " did not reach it within ", format_duration(timeout_),
          " (rank", arrived_count == 1 ? " " : "s ", arrived, " did): ", one ? "it has" : "they have",
          " failed, exited or stopped (timeout: comm_options::timeout or LOCKSTEP_COMM_TIMEOUT). This communicator is "
          "unusable: end the job (MPI_Abort)");
      break_communicator(concat(where, ": rank", one ? " " : "s ", missing, " did not reach it within ",
                                format_duration(timeout_)),
                         notify::peers);
      throw timeout_error(text);
    }
    for (std::size_t r = 0; r < n; ++r) {
      const call_record& theirs = k.calls[r];
      if (!theirs.valid() || theirs.seq != seq) {
        throw error(concat(where, ": the call record received from rank ", r, " is not valid (sequence number ",
                           theirs.seq, "): another program, or another version of lockstep, shares the communicator"));
      }
    }
    for (std::size_t r = 1; r < n; ++r) {
      if (k.calls[r] == k.calls[0]) continue;
      const collective_call first = k.calls[0].call(), other = k.calls[r].call();
      throw precondition_error(concat(
          where, ": the ranks issued different collectives as their collective #", seq, ": rank 0 called ",
          first.signature(), ", rank ", r, " called ", other.signature(), " (", first.difference(other),
          "). Every rank must issue the same collectives in the same order with the same count, dtype, op and "
          "root (a rank that runs more steps, another precision or other bucket sizes does not)"));
    }
  }

  void leak_staging() noexcept {
    for (auto& a : abandoned_) (void)a.staging.release();
    for (auto& k : abandoned_checks_) {
      (void)new (std::nothrow) std::shared_ptr<call_check>(std::move(k));  // MPI may still write the records
    }
    for (auto& s : sends_) (void)s.text.release();
  }

  static MPI_Op op_of(reduce_op op) { return op == reduce_op::max ? MPI_MAX : MPI_SUM; }

  /// Starts the non-blocking MPI collective for `c`, staging what needs staging.
  void start(const collective_call& c, buffers& b, MPI_Request& request) {
    const int n = static_cast<int>(c.count);
    const std::size_t es = size_of(c.type);
    // f32 and i64 (exact sums) are reduced as they are; f16/bf16 in f32 staging
    const bool is_f32 = c.type == dtype::f32 || c.type == dtype::i64;
    const MPI_Datatype direct = c.type == dtype::i64 ? MPI_INT64_T : MPI_FLOAT;
    const std::string_view what = name_of(c.kind);
    switch (c.kind) {
      case collective_kind::all_reduce: {
        if (is_f32) {
          const void* send = c.send == c.recv ? MPI_IN_PLACE : c.send;
          LOCKSTEP_MPI_CHECK(MPI_Iallreduce(send, c.recv, n, direct, op_of(c.op), data_, &request), what);
        } else {
          widen_to(b.in, c.send, c.type, c.count);
          LOCKSTEP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, b.in.data(), n, MPI_FLOAT, op_of(c.op), data_, &request),
                             what);
        }
        return;
      }
      case collective_kind::reduce: {
        const bool root = rank_ == c.root;
        if (is_f32) {
          const void* send = root && c.send == c.recv ? MPI_IN_PLACE : c.send;
          LOCKSTEP_MPI_CHECK(
              MPI_Ireduce(send, root ? c.recv : nullptr, n, direct, op_of(c.op), c.root, data_, &request), what);
        } else {
          widen_to(b.in, c.send, c.type, c.count);
          LOCKSTEP_MPI_CHECK(MPI_Ireduce(root ? MPI_IN_PLACE : b.in.data(), root ? b.in.data() : nullptr, n, MPI_FLOAT,
                                         op_of(c.op), c.root, data_, &request),
                             what);
        }
        return;
      }
      case collective_kind::reduce_scatter: {
        const std::size_t total = c.count * static_cast<std::size_t>(size_);
        if (is_f32) {
          const void* send = c.send;
          if (overlap(c.send, total * es, c.recv, c.count * es)) {  // in place: MPI would read what it writes
            b.bytes.assign(static_cast<const std::byte*>(c.send), static_cast<const std::byte*>(c.send) + total * es);
            send = b.bytes.data();
          }
          LOCKSTEP_MPI_CHECK(MPI_Ireduce_scatter_block(send, c.recv, n, direct, op_of(c.op), data_, &request), what);
        } else {
          widen_to(b.in, c.send, c.type, total);
          b.out.resize(c.count);
          LOCKSTEP_MPI_CHECK(
              MPI_Ireduce_scatter_block(b.in.data(), b.out.data(), n, MPI_FLOAT, op_of(c.op), data_, &request), what);
        }
        return;
      }
      case collective_kind::broadcast: {
        if (rank_ == c.root && c.send != c.recv && c.count != 0) std::memmove(c.recv, c.send, c.count * es);
        LOCKSTEP_MPI_CHECK(MPI_Ibcast(c.recv, n, datatype_of(c.type), c.root, data_, &request), what);
        return;
      }
      case collective_kind::all_gather: {
        const std::size_t bytes = c.count * es;
        const void* send = c.send;
        if (c.count != 0 && c.send == static_cast<const std::byte*>(c.recv) + static_cast<std::size_t>(rank_) * bytes) {
          send = MPI_IN_PLACE;
        } else if (overlap(c.send, bytes, c.recv, bytes * static_cast<std::size_t>(size_))) {
          b.bytes.assign(static_cast<const std::byte*>(c.send), static_cast<const std::byte*>(c.send) + bytes);
          send = b.bytes.data();
        }
        LOCKSTEP_MPI_CHECK(
            MPI_Iallgather(send, n, datatype_of(c.type), c.recv, n, datatype_of(c.type), data_, &request), what);
        return;
      }
      case collective_kind::barrier: {
        LOCKSTEP_MPI_CHECK(MPI_Ibarrier(data_, &request), what);
        return;
      }
      case collective_kind::all_reduce_exact: {
        // every rank's terms, packed, to every rank (finish() sums them): this rank's at its place
        const std::size_t term_bytes = c.count * es, piece = c.terms * term_bytes;
        b.bytes.resize(piece * static_cast<std::size_t>(size_));
        std::byte* mine = b.bytes.data() + static_cast<std::size_t>(rank_) * piece;
        for (std::size_t t = 0; t < c.terms && term_bytes != 0; ++t) {
          std::memcpy(mine + t * term_bytes, static_cast<const std::byte*>(c.send) + t * c.stride * es, term_bytes);
        }
        const int gathered = static_cast<int>(c.terms * c.count);
        LOCKSTEP_MPI_CHECK(MPI_Iallgather(MPI_IN_PLACE, gathered, datatype_of(c.type), b.bytes.data(), gathered,
                                          datatype_of(c.type), data_, &request),
                           what);
        return;
      }
    }
  }

  /// After completion: the division of `mean` and the rounding of f16/bf16 staging.
  void finish(const collective_call& c, buffers& b) const {
    if (c.kind == collective_kind::all_reduce_exact) {
      finish_exact(c, b);
      return;
    }
    if (!c.is_reduction() || (c.kind == collective_kind::reduce && rank_ != c.root)) return;
    // f32 is reduced straight into recv; f16/bf16 in f32 staging (reduce_scatter's result is b.out, the
    // others' b.in), rounded into recv once, after the division
    if (c.type == dtype::i64) return;  // exact, in recv already (mean is refused for i64)
    const bool is_f32 = c.type == dtype::f32;
    float* result = is_f32 ? static_cast<float*>(c.recv)
                           : (c.kind == collective_kind::reduce_scatter ? b.out.data() : b.in.data());
    if (c.op == reduce_op::mean) divide(result, c.count, size_);
    if (!is_f32) narrow_from(c.recv, result, c.type, c.count);
  }

  /// all_reduce_exact: recv = the exact sum of the gathered terms, rounded once (NaN in each tensor that received
  /// a term outside the window).
  static void finish_exact(const collective_call& c, buffers& b) {
    if (c.count == 0) return;
    std::vector<std::int64_t> outside(std::max<std::size_t>(c.tensors, 1), 0);
    auto sum = [&]<class T>() {
      const auto* terms = reinterpret_cast<const T*>(b.bytes.data());
      const std::size_t all = b.bytes.size() / sizeof(T) / c.count;
      host_comm::for_each_tensor_run(c, 0, c.count, [&](std::size_t tensor, std::size_t from, std::size_t to) {
        T* const out[1] = {static_cast<T*>(c.recv) + from};
        auto term = [&](std::size_t t) { return terms + t * c.count + from; };
        run_host_loop(to - from, kernels::exact_sums_host_op<T, decltype(term)>{term, all, out, 1, &outside[tensor]});
      });
    };
    dispatch_floating(c.type, "all_reduce_exact", sum);
    host_comm::poison_exact_tensors(c, outside);
  }

  MPI_Comm data_;
  MPI_Comm control_;
  int rank_ = 0;
  int size_ = 1;
  const device dev_;
  const std::chrono::milliseconds timeout_;
  const bool check_calls_;

  mutable std::mutex mutex_;  // guards reason_ and next_turn_
  std::condition_variable turn_cv_;
  std::uint64_t next_turn_ = 1;
  std::atomic<bool> broken_{false};
  std::string reason_;

  std::mutex control_mutex_;  // guards the control receive, the sends and the abandoned requests
  MPI_Request control_recv_ = MPI_REQUEST_NULL;
  std::array<char, control_capacity> control_buffer_{};
  std::vector<pending_send> sends_;
  std::vector<abandoned_request> abandoned_;
  std::vector<std::shared_ptr<call_check>> abandoned_checks_;
  std::mutex staging_mutex_;  // guards spare_staging_
  std::vector<std::unique_ptr<buffers>> spare_staging_;
  class census census_;  // (its tags are not control_tag's nor check_tag's)
};

/// The first of the launcher's variables `names` that holds a number of at least `least`, or -1.
inline int launcher_count(std::span<const char* const> names, int least) noexcept {
  for (const char* name : names) {
    if (const char* v = std::getenv(name); v != nullptr) {
      const int n = parse_index(v);
      if (n >= least) return n;
    }
  }
  return -1;
}

/// The launchers' variables that count the job's processes on this node (OpenMPI, MPICH, MVAPICH).
inline constexpr const char* local_size_variables[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                                                       "MV2_COMM_WORLD_LOCAL_SIZE"};
/// The launchers' variables that give this process's rank on its node (OpenMPI, MPICH, MVAPICH, Slurm).
inline constexpr const char* local_rank_variables[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                                                       "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"};

/// One process's endpoint.
class member final : public communicator_impl {
 public:
  explicit member(std::shared_ptr<state> s) : state_(std::move(s)) {
    const int n = launcher_count(local_size_variables, 1);
    on_this_machine_ = n > 0 ? std::min(n, size()) : size();  // no launcher variable: as if all were here
  }

  [[nodiscard]] int rank() const noexcept override { return state_->rank(); }
  [[nodiscard]] int size() const noexcept override { return state_->size(); }
  [[nodiscard]] int ranks_on_this_machine() const noexcept override { return on_this_machine_; }
  [[nodiscard]] int ranks_in_this_process() const noexcept override { return 1; }
  [[nodiscard]] device get_device() const noexcept override { return state_->get_device(); }

  void check_limits(const collective_call& c) const override {
    LOCKSTEP_EXPECTS(c.count <= static_cast<std::size_t>(INT_MAX), name_of(c.kind), " on rank ", rank(), ": count ",
                     c.count, " exceeds MPI's count limit; valid counts: 0..", INT_MAX, " (split the collective)");
    LOCKSTEP_EXPECTS(c.kind != collective_kind::all_reduce_exact || c.terms * c.count <= static_cast<std::size_t>(INT_MAX),
                     name_of(c.kind), " on rank ", rank(), ": terms * count = ", c.terms * c.count,
                     " exceeds MPI's count limit (", INT_MAX, "); split the collective");
  }

  [[nodiscard]] bool supports(collective_kind) const noexcept override { return true; }

  void enqueue(const collective_call& c, stream_ref s) override {
    host_backend::stream_state* on = &s.host_state();  // before the sequence number is taken
    const std::uint64_t seq = next_seq_.fetch_add(1, std::memory_order_relaxed) + 1;
    std::shared_ptr<state::call_check> check;
    const char* failed = "could not post its call records";
    try {
      check = state_->post_check(seq, c);
      failed = "could not be queued";
      enqueue_host(
          s, [st = state_, seq, c, check, on] { st->run(seq, c, check, *on); }, name_of(c.kind).data(), true);
    } catch (const std::exception& e) {
      // The sequence number is taken: without its records, or with records in flight and no collective behind them
      // (out of memory while queuing), the ranks could never agree again.
      if (check) state_->abandon_check(check);
      state_->break_communicator(concat(name_of(c.kind), " #", seq, " ", failed, ": ", e.what()), state::notify::peers);
      throw;
    }
  }

  void abort(const std::string& reason) noexcept override { state_->break_communicator(reason, state::notify::peers); }
  void rethrow_failure() override { state_->rethrow_failure(); }

 private:
  std::shared_ptr<state> state_;
  int on_this_machine_ = 1;  // ranks_on_this_machine()
  std::atomic<std::uint64_t> next_seq_{0};
};

/// MPI_Comm_idup that fails with timeout_error instead of waiting forever for a process that never calls it.
inline MPI_Comm duplicate(MPI_Comm comm, std::chrono::milliseconds timeout, const char* what) {
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request request = MPI_REQUEST_NULL;
  LOCKSTEP_MPI_CHECK(MPI_Comm_idup(comm, &dup, &request), what);
  const auto result = wait_request(
      request, std::chrono::steady_clock::now() + timeout, [] { return false; }, what);
  if (result != wait_result::done) {
    int rank = -1;
    (void)MPI_Comm_rank(comm, &rank);
    throw timeout_error(concat(what, " on rank ", rank, ": the other processes did not join MPI_Comm_idup within ",
                               format_duration(timeout),
                               "; every process of the communicator must create its communicator"));
  }
  LOCKSTEP_MPI_CHECK(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN), what);
  return dup;
}

/// A census on a duplicate of an MPI communicator, for NCCL communicators made over MPI (make_nccl_communicator).
class process_census final : public rank_census {
 public:
  process_census(MPI_Comm comm, std::chrono::milliseconds timeout)
      : comm_(duplicate(comm, timeout, "make_nccl_communicator (census)")), census_(make(comm_, timeout)) {}
  ~process_census() override {
    census_.reset();  // its receive cancelled, before the communicator goes
    int finalized = 1;
    if (MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) (void)MPI_Comm_free(&comm_);
  }
  void entered(std::uint64_t seq) noexcept override { census_->entered(seq); }
  void completed(std::uint64_t seq) noexcept override { census_->completed(seq); }
  void answer() noexcept override { census_->answer(); }
  std::string ask(std::uint64_t seq, const std::function<bool()>& stop,
                  const std::function<std::string()>& why) noexcept override {
    return census_->ask(seq, stop, why);
  }

 private:
  static std::unique_ptr<census> make(MPI_Comm& comm, std::chrono::milliseconds timeout) {
    try {
      return std::make_unique<census>(comm, timeout);
    } catch (...) {
      (void)MPI_Comm_free(&comm);
      throw;
    }
  }
  MPI_Comm comm_;
  std::unique_ptr<census> census_;
};

}  // namespace mpi_comm

/// Whether the MPI library loaded is an OpenMPI whose libnbc ring all-reduce is correct in place: 4.0.7 and
/// later 4.0.x, 4.1.2 and later, 5 and later. MPI_Get_library_version may be called before MPI_Init.
inline bool openmpi_ring_iallreduce_is_correct() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int length = 0;
  if (MPI_Get_library_version(text, &length) != MPI_SUCCESS) return false;
  int major = 0, minor = 0, release = 0;
  const char* v = std::strstr(text, "Open MPI v");
  if (!v || std::sscanf(v, "Open MPI v%d.%d.%d", &major, &minor, &release) != 3) return false;
  if (major != 4) return major > 4;
  return minor == 0 ? release >= 7 : minor > 1 || release >= 2;
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Initializes MPI with MPI_THREAD_MULTIPLE for the lifetime of the object (RAII), or checks the thread level
/// of an MPI initialized by someone else. With OpenMPI it first makes MPI_Iallreduce use its ring algorithm
/// (OMPI_MCA_coll_libnbc_iallreduce_algorithm=1, unless the environment sets it): a program that initializes MPI
/// itself can set the same variable. Finalizes MPI at the end only if it initialized it. Throws mpi_error
/// naming the provided level when it is lower than MPI_THREAD_MULTIPLE. Destroy every communicator, and
/// synchronize the streams their collectives ran on, before the session ends.
class mpi_session {
 public:
  mpi_session() : mpi_session(nullptr, nullptr) {}
  mpi_session(int* argc, char*** argv) {
    int initialized = 0, finalized = 0;
    LOCKSTEP_MPI_CHECK(MPI_Initialized(&initialized), "asking whether MPI is initialized");
    LOCKSTEP_MPI_CHECK(MPI_Finalized(&finalized), "asking whether MPI is finalized");
    if (finalized) throw mpi_error("mpi_session: MPI was already finalized in this process; it cannot start again");
    if (!initialized) {
      // OpenMPI's non-blocking all-reduce (coll/libnbc, which MPI_Iallreduce reaches) takes a binomial tree for
      // fewer than 4 ranks by default: one rank receives everything, sums alone and sends it all back, half the
      // speed of the blocking MPI_Allreduce. Its ring (algorithm 1) matches or beats MPI_Allreduce from 256 KiB
      // (docs/comm.md has the figures). Read at MPI_Init, so set here; a value the user set is kept. Only from
      // the releases whose ring handles MPI_IN_PLACE (4.0.7, 4.1.2, 5.0: open-mpi/ompi#9385 gave wrong sums
      // from 4 ranks before), which lockstep's in-place all-reduces use.
      if (detail::openmpi_ring_iallreduce_is_correct()) {
        ::setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", /*overwrite*/ 0);
      }
      LOCKSTEP_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided_),
                         "initializing MPI with MPI_THREAD_MULTIPLE");
      owns_ = true;
    } else {
      LOCKSTEP_MPI_CHECK(MPI_Query_thread(&provided_), "asking MPI for its thread level");
    }
    if (provided_ < MPI_THREAD_MULTIPLE) {
      const std::string msg = detail::concat(
          "mpi_session: MPI provides ", detail::mpi_comm::thread_level_name(provided_),
          ", lockstep needs MPI_THREAD_MULTIPLE (collectives call MPI from stream worker threads)",
          owns_
              ? "; this MPI library was built without full thread support (OpenMPI: configure with "
                "--enable-mpi-thread-multiple, the default since 3.0)"
              : "; MPI was initialized before with a lower level: call MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)");
      if (owns_) (void)MPI_Finalize();
      throw mpi_error(msg);
    }
  }
  mpi_session(const mpi_session&) = delete;
  mpi_session& operator=(const mpi_session&) = delete;
  /// Finalizes MPI if this session initialized it — unless an exception is unwinding through it: MPI_Finalize
  /// is collective and would block until every other rank finalizes too, before the error could be printed.
  /// A rank that fails ends the job with abort_mpi_job instead.
  ~mpi_session() {
    if (std::uncaught_exceptions() > unwinding_at_start_) return;
    int finalized = 1;
    if (owns_ && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) (void)MPI_Finalize();
  }

  /// The thread level MPI provides (MPI_THREAD_MULTIPLE).
  [[nodiscard]] int provided() const noexcept { return provided_; }
  /// True when this session initialized MPI (and will finalize it).
  [[nodiscard]] bool owns() const noexcept { return owns_; }

 private:
  int provided_ = 0;
  bool owns_ = false;
  int unwinding_at_start_ = std::uncaught_exceptions();
};

/// How a rank of an MPI job should end on an error: prints "<program>: rank R: <what>" to stderr (flushed), then
/// calls MPI_Abort(MPI_COMM_WORLD, status), which ends every process of the job at once — instead of the other
/// ranks waiting for this one in a collective until LOCKSTEP_COMM_TIMEOUT, or this one blocking in MPI_Finalize
/// before its message is out. Use it in the catch block of main() (see examples/mlp_train). Returns only when
/// MPI is not running (never initialized, or finalized): then the caller exits with `status` itself.
inline void abort_mpi_job(const char* program, const std::exception& e, int status = 1) noexcept {
  int initialized = 0, finalized = 0, rank = -1;
  (void)MPI_Initialized(&initialized);
  (void)MPI_Finalized(&finalized);
  const bool running = initialized != 0 && finalized == 0;
  if (running) (void)MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank >= 0) {
    std::fprintf(stderr, "%s: rank %d: %s\n", program, rank, e.what());
  } else {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  }
  std::fflush(stderr);
  std::fflush(stdout);
  if (running) (void)MPI_Abort(MPI_COMM_WORLD, status);
}

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN
/// The first of the launcher's variables `names` that holds a number of at least `least`, else the rank (or size,
/// `size`) in MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED): local_rank() and local_size().
inline int node_local(std::span<const char* const> names, int least, bool size, const char* what) {
  if (const int n = mpi_comm::launcher_count(names, least); n >= 0) return n;
  int initialized = 0;
  LOCKSTEP_MPI_CHECK(MPI_Initialized(&initialized), "asking whether MPI is initialized");
  LOCKSTEP_EXPECTS(initialized, what, ": no launcher variable (", names.front(),
                   ", ...) is set and MPI is not initialized; create a lockstep::mpi_session first");
  MPI_Comm local = MPI_COMM_NULL;
  LOCKSTEP_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local),
                     "splitting MPI_COMM_WORLD by node");
  int n = 0;
  const int status = size ? MPI_Comm_size(local, &n) : MPI_Comm_rank(local, &n);
  (void)MPI_Comm_free(&local);
  LOCKSTEP_MPI_CHECK(status, what, ": asking MPI within the node");
  return n;
}
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// This process's rank among the processes of its node, to pick its local device: OMPI_COMM_WORLD_LOCAL_RANK
/// (OpenMPI), MPI_LOCALRANKID (MPICH), MV2_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID when set; otherwise the rank
/// in MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED), which is collective over MPI_COMM_WORLD and
/// needs MPI initialized.
inline int local_rank() {
  return detail::node_local(detail::mpi_comm::local_rank_variables, 0, false, "local_rank()");
}

/// The number of processes of this job on this process's node: OMPI_COMM_WORLD_LOCAL_SIZE (OpenMPI),
/// MPI_LOCALNRANKS (MPICH) or MV2_COMM_WORLD_LOCAL_SIZE when set; otherwise the size of that split (collective over
/// MPI_COMM_WORLD, needs MPI initialized).
inline int local_size() {
  return detail::node_local(detail::mpi_comm::local_size_variables, 1, true, "local_size()");
}

/// This process's communicator over `comm` (every process of `comm` calls it, in the same order as its other
/// collective calls on `comm`), running on the host device `local`. Needs an mpi_session (MPI_THREAD_MULTIPLE).
/// The communicator works on its own duplicates of `comm` (with MPI_ERRORS_RETURN), so `comm` itself is left
/// as it was. Throws precondition_error for a device that is not a host device, mpi_error, and timeout_error
/// when the other processes do not join within the timeout.
inline communicator make_mpi_communicator(device local, MPI_Comm comm = MPI_COMM_WORLD, comm_options options = {}) {
  LOCKSTEP_EXPECTS(local.is_host(), "make_mpi_communicator: expected a host device, got ", local.str(),
                   " (GPUs in several processes use make_nccl_communicator)");
  check_device_exists(local);
  LOCKSTEP_EXPECTS(options.timeout.count() > 0, "make_mpi_communicator: comm_options::timeout must be positive, got ",
                   options.timeout.count(), " ms");
  detail::mpi_comm::require_thread_multiple("make_mpi_communicator");
  MPI_Comm data = detail::mpi_comm::duplicate(comm, options.timeout, "make_mpi_communicator (data)");
  MPI_Comm control = MPI_COMM_NULL;
  try {
    control = detail::mpi_comm::duplicate(comm, options.timeout, "make_mpi_communicator (control)");
  } catch (...) {
    (void)MPI_Comm_free(&data);
    throw;
  }
  std::shared_ptr<detail::mpi_comm::state> state;
  try {
    // Every rank must check its calls, or none: a rank that checks waits for records the others never send.
    auto flags = std::make_unique<std::array<int, 2>>(
        std::array<int, 2>{options.check_calls ? 1 : 0, options.check_calls ? -1 : 0});  // max of both: max, -min
    MPI_Request request = MPI_REQUEST_NULL;
    LOCKSTEP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, flags->data(), 2, MPI_INT, MPI_MAX, data, &request),
                       "make_mpi_communicator: agreeing on comm_options::check_calls");
    if (detail::mpi_comm::wait_request(
            request, std::chrono::steady_clock::now() + options.timeout, [] { return false; },
            "make_mpi_communicator: agreeing on comm_options::check_calls") != detail::mpi_comm::wait_result::done) {
      (void)flags.release();  // MPI may still write it
      throw timeout_error(detail::concat("make_mpi_communicator: the other processes did not agree on "
                                         "comm_options::check_calls within ", detail::format_duration(options.timeout)));
    }
    LOCKSTEP_EXPECTS((*flags)[0] == -(*flags)[1],
                     "make_mpi_communicator: comm_options::check_calls (LOCKSTEP_COMM_CHECK) differs between the "
                     "processes: every rank must check its collectives, or none");
    state = std::make_shared<detail::mpi_comm::state>(data, control, local, options.timeout, options.check_calls);
  } catch (...) {
    (void)MPI_Comm_free(&data);
    (void)MPI_Comm_free(&control);
    throw;
  }
  return communicator::from_impl(std::make_unique<detail::mpi_comm::member>(std::move(state)));
}

LOCKSTEP_ABI_END
