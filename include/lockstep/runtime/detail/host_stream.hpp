// lockstep/runtime/detail/host_stream.hpp — streams and events of host virtual devices.
//
// A host stream is a worker thread that runs queued work in order, asynchronously to the caller, as a CUDA
// stream does. An exception thrown by queued work is kept (the first one) and rethrown, with the stream and
// the work named, at the next synchronization of that stream, like CUDA's asynchronous errors. Until then the
// stream is failed: later work is skipped (it would compute on what the failed work did not produce), as a GPU
// context runs no more kernels after a sticky error; only event markers and collectives still run (so that no
// waiter and no peer rank waits for them in vain).
//
// A host event is a generation counter: recording enqueues a marker that completes that generation;
// waiting captures the generation current at the time of the call, as cudaStreamWaitEvent does. Generations
// may complete out of order (records on different streams); an event is complete for generation g when
// that very record has run. A record that runs on a failed stream carries the failure: a stream that waits
// for it fails too, with the original error nested. So a failed collective on a communication stream fails
// the compute stream that waits for its result, and the step's later work (an optimizer step) does not run.
//
// These types do not depend on the build configuration (no CUDA), so they live in `lockstep::host_backend`
// and are shared by translation units compiled with and without nvcc.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

#include "lockstep/core/error.hpp"
#include "lockstep/core/thread_name.hpp"

namespace lockstep::host_backend {

/// The callable of a task: move-only, called once. A callable of up to `inline_bytes` that moves without throwing
/// (a kernel launch's functor and its extent, a copy's pointers) is stored in place, a larger one on the heap.
/// Unlike std::function it needs no copy and no allocation per launch, and each callable type costs one table of
/// three small functions (std::function's manager also clones and reports the type, in every translation unit).
class task_body {
 public:
  static constexpr std::size_t inline_bytes = 112;

  task_body() noexcept = default;
  task_body(std::nullptr_t) noexcept {}  // NOLINT(google-explicit-constructor): as std::function's
  template <class F, class D = std::decay_t<F>>
    requires(!std::is_same_v<D, task_body> && std::is_invocable_r_v<void, D&>)
  task_body(F&& f) {  // NOLINT(google-explicit-constructor): a lambda converts, as to std::function
    if constexpr (stored_inline<D>) {
      ::new (static_cast<void*>(storage_)) D(std::forward<F>(f));
      table_ = &in_place<D>::table;
    } else {
      D* held = new D(std::forward<F>(f));
      ::new (static_cast<void*>(storage_)) D*(held);
      table_ = &on_heap<D>::table;
    }
  }
  task_body(task_body&& other) noexcept { take(other); }
  task_body& operator=(task_body&& other) noexcept {
    if (this != &other) {
      reset();
      take(other);
    }
    return *this;
  }
  task_body& operator=(std::nullptr_t) noexcept {
    reset();
    return *this;
  }
  task_body(const task_body&) = delete;
  task_body& operator=(const task_body&) = delete;
  ~task_body() { reset(); }

  void operator()() { table_->call(storage_); }
  explicit operator bool() const noexcept { return table_ != nullptr; }

 private:
  struct operations {
    void (*call)(void* storage);
    void (*move)(void* from, void* to) noexcept;  // constructs `to` from `from`, and destroys `from`
    void (*destroy)(void* storage) noexcept;
  };
  template <class D>
  static constexpr bool stored_inline = sizeof(D) <= inline_bytes && alignof(D) <= alignof(std::max_align_t) &&
                                        std::is_nothrow_move_constructible_v<D>;
  template <class D>
  struct in_place {
    static D& held(void* storage) noexcept { return *std::launder(static_cast<D*>(storage)); }
    static void call(void* storage) { held(storage)(); }
    static void move(void* from, void* to) noexcept {
      ::new (to) D(std::move(held(from)));
      held(from).~D();
    }
    static void destroy(void* storage) noexcept { held(storage).~D(); }
    static constexpr operations table{&call, &move, &destroy};
  };
  template <class D>
  struct on_heap {
    static D*& held(void* storage) noexcept { return *std::launder(static_cast<D**>(storage)); }
    static void call(void* storage) { (*held(storage))(); }
    static void move(void* from, void* to) noexcept { ::new (to) D*(held(from)); }
    static void destroy(void* storage) noexcept { delete held(storage); }
    static constexpr operations table{&call, &move, &destroy};
  };

  void take(task_body& other) noexcept {
    if (other.table_ == nullptr) return;
    other.table_->move(other.storage_, storage_);
    table_ = std::exchange(other.table_, nullptr);
  }
  void reset() noexcept {
    if (table_ != nullptr) std::exchange(table_, nullptr)->destroy(storage_);
  }

  alignas(std::max_align_t) std::byte storage_[inline_bytes];
  const operations* table_ = nullptr;
};

/// One unit of queued work. `what` is a static description used in error messages ("copy", "axpy").
struct task {
  task_body body;
  const char* what = "work";
  /// Runs even when earlier work on the stream failed (event markers, collectives); other work is skipped.
  bool runs_after_failure = false;
  std::uint64_t stamp = 0;  // set by stream_state::enqueue (next_stamp)
};

/// Every task queued on any host stream, and every report of a failure, takes the next number of this
/// process-wide count: "queued before the error was reported" is then a comparison.
inline std::uint64_t next_stamp() noexcept {
  static std::atomic<std::uint64_t> count{0};
  return count.fetch_add(1, std::memory_order_acq_rel) + 1;
}

/// A failure kept by a stream: the exception, the sentence that names the stream and the work, and, for a
/// failure taken over by waiting for an event, the failure it came from. A failure is reported once: it fails
/// the work queued before it was reported (or before the failure it came from was reported: the user has seen
/// the error then), and nothing queued after.
struct kept_failure {
  std::exception_ptr error;
  std::string context;
  std::shared_ptr<const kept_failure> origin;
  mutable std::atomic<std::uint64_t> reported_at{0};  // the stamp of its report; 0 while not reported

  kept_failure(std::exception_ptr e, std::string c, std::shared_ptr<const kept_failure> o = nullptr)
      : error(std::move(e)), context(std::move(c)), origin(std::move(o)) {}

  /// True when it fails work stamped `stamp`: work queued before this failure and every failure it came from
  /// were reported.
  [[nodiscard]] bool fails(std::uint64_t stamp) const noexcept {
    for (const kept_failure* f = this; f != nullptr; f = f->origin.get()) {
      const std::uint64_t r = f->reported_at.load(std::memory_order_acquire);
      if (r != 0 && stamp > r) return false;
    }
    return true;
  }
};

class stream_state;

/// Told by a stream when it shuts down, so that memory freed on it (stream-ordered) becomes reusable and
/// device-wide synchronization stops waiting for it.
class stream_observer {
 public:
  virtual void on_stream_shutdown(const stream_state* s) noexcept = 0;

 protected:
  ~stream_observer() = default;
};

class stream_state {
 public:
  /// Starts the worker thread. `label` names the stream in errors, e.g. "host:0 stream 3". With `jitter_us` > 0
  /// (host_strictness::strict), one task in four starts up to that many microseconds late, at random: streams
  /// that no event orders then race as a GPU's do, instead of running in the order they were fed.
  stream_state(int device, std::string label, stream_observer* observer = nullptr, std::uint32_t jitter_us = 0)
      : device_(device),
        label_(std::move(label)),
        thread_name_(thread_name(label_)),
        observer_(observer),
        jitter_us_(jitter_us),
        random_((reinterpret_cast<std::uintptr_t>(this) ^
                 static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count())) | 1),
        worker_([this] { run(); }) {}

  stream_state(const stream_state&) = delete;
  stream_state& operator=(const stream_state&) = delete;

  /// Shuts down (see shutdown()) if the owner did not.
  ~stream_state() { shutdown(); }

  /// Completes all queued work (as cudaStreamDestroy does), stops the worker and tells the device's memory
  /// that blocks freed on this stream are reusable. A pending error is dropped: destruction does not throw.
  /// Idempotent. The object itself lives on while references remain (see add_ref).
  void shutdown() noexcept {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    work_ready_.notify_one();
    if (worker_.joinable()) worker_.join();
    if (observer_) observer_->on_stream_shutdown(this);
  }

  /// Reference counting: the owner holds one reference; memory blocks freed on the stream and not yet
  /// reusable hold one each, so that waiting for them never touches a destroyed stream.
  void add_ref() const noexcept { refs_.fetch_add(1, std::memory_order_relaxed); }
  void drop_ref() const noexcept {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] const std::string& label() const noexcept { return label_; }

  /// Queues `t`; returns its sequence number (1, 2, ...). Never blocks on queued work.
  std::uint64_t enqueue(task t) {
    std::uint64_t seq;
    bool wake;
    {
      std::lock_guard lock(mutex_);
      t.stamp = next_stamp();  // under the lock: stamps increase along the queue
      queue_.push_back(std::move(t));
      seq = ++enqueued_;
      wake = worker_sleeping_;
    }
    if (wake) work_ready_.notify_one();  // a busy worker finds the task without a futex call
    return seq;
  }

  /// Sequence number of the last work queued / completed.
  [[nodiscard]] std::uint64_t enqueued() const {
    std::lock_guard lock(mutex_);
    return enqueued_;
  }
  [[nodiscard]] std::uint64_t completed() const noexcept { return completed_.load(std::memory_order_acquire); }

  /// True when everything queued so far has run.
  [[nodiscard]] bool idle() const {
    std::lock_guard lock(mutex_);
    return completed_.load(std::memory_order_acquire) == enqueued_;
  }

  /// True if the calling thread is this stream's worker (queued work must not wait on its own stream).
  [[nodiscard]] bool on_worker() const noexcept { return std::this_thread::get_id() == worker_.get_id(); }

  /// Blocks until work up to sequence number `seq` has run.
  void wait_for(std::uint64_t seq) const {
    std::unique_lock lock(mutex_);
    wait_done_locked(lock, seq);
  }

  /// Blocks until everything queued when the call began has run, or until `deadline`; true if it ran.
  bool wait_idle_until(std::chrono::steady_clock::time_point deadline) const {
    std::unique_lock lock(mutex_);
    const std::uint64_t seq = enqueued_;
    while (completed_.load(std::memory_order_acquire) < seq) {
      wake_at_ = std::min(wake_at_, seq);
      if (work_done_.wait_until(lock, deadline) == std::cv_status::timeout) {
        return completed_.load(std::memory_order_acquire) >= seq;
      }
    }
    return true;
  }

  /// Blocks until everything queued so far has run, then rethrows a kept error (and clears it).
  void synchronize() {
    LOCKSTEP_EXPECTS(!on_worker(), "synchronize() called from work queued on ", label_,
                     " itself: the stream would wait for itself forever");
    std::unique_lock lock(mutex_);
    wait_done_locked(lock, enqueued_);
    rethrow_locked();
  }

  /// Rethrows a kept error without waiting (used by device-wide synchronization and queries).
  void rethrow_if_failed() {
    std::lock_guard lock(mutex_);
    rethrow_locked();
  }

  /// For work running on this stream's worker (an event marker, a collective): the kept failure that fails it,
  /// if any, without reporting it.
  [[nodiscard]] std::shared_ptr<const kept_failure> failure() {
    std::lock_guard lock(mutex_);
    return failure_for_locked(running_stamp_);
  }

  /// The stamp of the work running on this stream's worker now.
  [[nodiscard]] std::uint64_t running_stamp() const {
    std::lock_guard lock(mutex_);
    return running_stamp_;
  }

  /// Fails the stream with `f` unless it already failed (the first error is the one that explains the others).
  void fail(std::shared_ptr<const kept_failure> f) {
    std::lock_guard lock(mutex_);
    if (failure_for_locked(running_stamp_)) return;
    failure_ = std::move(f);
  }

 private:
  // Blocks (mutex_ held by `lock`) until work up to `seq` has run. The waiter leaves the first sequence number it
  // needs in wake_at_, and the worker notifies when it gets there, not after every task: a synchronize() a few
  // steps behind had been woken (and put back to sleep) once per task, about 200 futex wake-ups per call in the
  // sample's DDP run, on cores the compute streams need.
  void wait_done_locked(std::unique_lock<std::mutex>& lock, std::uint64_t seq) const {
    while (completed_.load(std::memory_order_acquire) < seq) {
      wake_at_ = std::min(wake_at_, seq);
      work_done_.wait(lock);
    }
  }

  // The kept failure if it fails work stamped `stamp`; dropped once it does not (later work has larger stamps).
  std::shared_ptr<const kept_failure> failure_for_locked(std::uint64_t stamp) {
    if (failure_ && !failure_->fails(stamp)) failure_ = nullptr;
    return failure_;
  }

  // Reports the kept failure unless it was reported already (itself, or the failure it came from). It stays kept:
  // work queued before the report and not yet run (a query does not wait) is still skipped, and the first task
  // queued after the report drops it (failure_for_locked).
  void rethrow_locked() {
    const std::shared_ptr<const kept_failure> f = failure_;
    if (!f || !f->fails(std::numeric_limits<std::uint64_t>::max())) return;
    f->reported_at.store(next_stamp(), std::memory_order_release);
    try {
      std::rethrow_exception(f->error);
    } catch (...) {
      std::throw_with_nested(async_error(f->context));
    }
  }

  void run() {
    detail::name_this_thread(thread_name_);
    std::unique_lock lock(mutex_);
    while (true) {
      while (!stopping_ && queue_.empty()) {
        worker_sleeping_ = true;
        work_ready_.wait(lock);
        worker_sleeping_ = false;
      }
      if (queue_.empty()) return;  // stopping, and all work done
      task t = std::move(queue_.front());
      queue_.pop_front();
      running_stamp_ = t.stamp;
      const bool skip = failure_for_locked(t.stamp) != nullptr && !t.runs_after_failure;  // failed: later work does not run
      lock.unlock();
      if (!skip) {
        if (jitter_us_ != 0) delay_at_random();
        try {
          t.body();
        } catch (const std::exception& e) {
          keep_error(t.what, e.what());
        } catch (...) {
          keep_error(t.what, "unknown exception");
        }
      }
      t.body = nullptr;  // release captures before reporting completion
      lock.lock();
      // Every waiter whose work has run leaves; the others set wake_at_ again before they sleep.
      if (completed_.fetch_add(1, std::memory_order_acq_rel) + 1 >= wake_at_) {
        wake_at_ = no_waiter;
        work_done_.notify_all();
      }
    }
  }

  // One call in four sleeps up to jitter_us_ microseconds (xorshift64: cheap, and per stream, so no lock).
  void delay_at_random() {
    random_ ^= random_ << 13;
    random_ ^= random_ >> 7;
    random_ ^= random_ << 17;
    if ((random_ & 3) != 0) return;
    std::this_thread::sleep_for(std::chrono::microseconds((random_ >> 8) % jitter_us_));
  }

  void keep_error(const char* what, const char* message) {
    std::lock_guard lock(mutex_);
    if (failure_for_locked(running_stamp_)) return;  // the first error is the one that explains the others
    const std::exception_ptr original = std::current_exception();
    try {
      failure_ = std::make_shared<const kept_failure>(
          original,
          detail::concat("work queued on ", label_, " failed (", what, "): ", message,
                         " [reported at the next synchronization of the stream; later work on it was skipped]"));
    } catch (...) {
      try {  // out of memory for the sentence: keep the failure without it
        failure_ = std::make_shared<const kept_failure>(original, std::string());
      } catch (...) {
        // nothing can be kept: the failed work is lost, later work runs
      }
    }
  }

  // The worker's name: the label when it fits Linux's 15 bytes ("host:0 stream 3"), else shortened so that the
  // numbers stay ("host:12 stream 104" -> "h12 s104", "host:12 default stream" -> "h12 default").
  static std::string thread_name(std::string name) {
    if (name.size() <= 15) return name;
    constexpr std::pair<std::string_view, std::string_view> shorter[] = {
        {"host:", "h"}, {" default stream", " default"}, {" stream ", " s"}};
    for (const auto& [from, to] : shorter) {
      if (const auto at = name.find(from); at != std::string::npos) name.replace(at, from.size(), to);
    }
    return name;
  }

  const int device_;
  const std::string label_;
  const std::string thread_name_;
  stream_observer* const observer_;
  const std::uint32_t jitter_us_;
  std::uint64_t random_;  // the worker's, for delay_at_random
  mutable std::mutex mutex_;
  std::condition_variable work_ready_;
  mutable std::condition_variable work_done_;
  std::deque<task> queue_;
  std::uint64_t enqueued_ = 0;
  std::atomic<std::uint64_t> completed_{0};
  bool stopping_ = false;
  bool worker_sleeping_ = false;    // the worker waits on work_ready_ (guarded by mutex_)
  static constexpr std::uint64_t no_waiter = std::numeric_limits<std::uint64_t>::max();
  mutable std::uint64_t wake_at_ = no_waiter;  // the least `completed_` a waiter on work_done_ waits for (mutex_)
  std::shared_ptr<const kept_failure> failure_;  // the first failure not yet reported (guarded by mutex_)
  std::uint64_t running_stamp_ = 0;              // of the task the worker runs (guarded by mutex_)
  mutable std::atomic<int> refs_{1};
  std::thread worker_;  // last: starts after every other member is constructed
};

/// State of a host event; reference counted because queued markers outlive the owning `event`.
class event_state {
 public:
  using clock = std::chrono::steady_clock;

  event_state(int device, bool timing) : device_(device), timing_(timing) {}

  void add_ref() noexcept { refs_.fetch_add(1, std::memory_order_relaxed); }
  void drop_ref() noexcept {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] bool timing() const noexcept { return timing_; }

  /// Enqueues a marker on `s`; the event is complete for this record once the marker runs.
  void record(stream_state& s) {
    std::uint64_t gen;
    {
      std::lock_guard lock(mutex_);
      gen = ++recorded_;
    }
    add_ref();
    s.enqueue(task{[this, gen, &s] {
                     complete(gen, s.failure());  // never throws: the generation always completes
                     drop_ref();
                   },
                   "event record", true});
  }

  /// The generation a wait issued now must wait for (0: never recorded, nothing to wait for).
  [[nodiscard]] std::uint64_t current_generation() const {
    std::lock_guard lock(mutex_);
    return recorded_;
  }

  [[nodiscard]] bool is_complete(std::uint64_t gen) const {
    std::lock_guard lock(mutex_);
    return complete_locked(gen);
  }

  /// True when the most recent record has run (or the event was never recorded).
  [[nodiscard]] bool ready() const {
    std::lock_guard lock(mutex_);
    return complete_locked(recorded_);
  }

  void wait(std::uint64_t gen) const {
    std::unique_lock lock(mutex_);
    wait_locked(lock, gen);
  }

  /// Waits for the most recent record.
  void synchronize() const {
    std::unique_lock lock(mutex_);
    wait_locked(lock, recorded_);
  }

  /// Enqueues on `s` a wait for the record current now (cudaStreamWaitEvent). When that record ran on a failed
  /// stream, `s` fails too, with the original error.
  void enqueue_wait(stream_state& s) {
    const std::uint64_t gen = current_generation();
    if (gen == 0) return;
    add_ref();
    s.enqueue(task{[this, gen, &s] {
                     wait(gen);
                     // a failure reported after this wait was queued still fails it (and what follows it)
                     if (auto f = failure_of(gen); f && f->fails(s.running_stamp())) {
                       try {
                         s.fail(std::make_shared<const kept_failure>(
                             f->error,
                             detail::concat("work queued on ", s.label(),
                                            " waited for an event recorded after failed work: ", f->context),
                             f));
                       } catch (...) {
                         s.fail(f);  // out of memory for the sentence: the original failure itself
                       }
                     }
                     drop_ref();
                   },
                   "wait for event", true});
  }

  /// The failure carried by record `gen`, if it ran on a failed stream.
  [[nodiscard]] std::shared_ptr<const kept_failure> failure_of(std::uint64_t gen) const {
    std::lock_guard lock(mutex_);
    const auto it = failures_.find(gen);
    return it == failures_.end() ? nullptr : it->second;
  }

  /// Time at which the most recent record ran; precondition: ready() and timing().
  [[nodiscard]] clock::time_point stamp() const {
    std::lock_guard lock(mutex_);
    return stamp_;
  }

 private:
  void wait_locked(std::unique_lock<std::mutex>& lock, std::uint64_t gen) const {
    if (complete_locked(gen)) return;
    ++waiters_;
    done_.wait(lock, [&] { return complete_locked(gen); });
    --waiters_;
  }

  bool complete_locked(std::uint64_t gen) const {
    return gen <= done_through_ || done_out_of_order_.count(gen) != 0;
  }

  void complete(std::uint64_t gen, std::shared_ptr<const kept_failure> failure) noexcept {
    bool wake;
    {
      std::lock_guard lock(mutex_);
      if (failure) {
        try {
          while (!failures_.empty() && failures_.size() >= max_failures) {
            failures_.erase(failures_.begin());  // the oldest of too many
          }
          failures_.emplace(gen, std::move(failure));
        } catch (...) {
          // out of memory: the generation completes without its failure rather than never
        }
      }
      if (timing_ && gen >= stamp_gen_) {
        stamp_ = clock::now();
        stamp_gen_ = gen;
      }
      done_out_of_order_.insert(gen);
      while (done_out_of_order_.count(done_through_ + 1) != 0) {
        done_out_of_order_.erase(done_through_ + 1);
        ++done_through_;
      }
      wake = waiters_ != 0;
    }
    if (wake) done_.notify_all();
  }

  const int device_;
  const bool timing_;
  std::atomic<int> refs_{1};
  mutable std::mutex mutex_;
  mutable std::condition_variable done_;
  mutable int waiters_ = 0;  // threads waiting on done_ (guarded by mutex_)
  std::uint64_t recorded_ = 0;
  std::uint64_t done_through_ = 0;              // every generation <= this has completed
  std::set<std::uint64_t> done_out_of_order_;   // completed generations above done_through_
  static constexpr std::size_t max_failures = 64;
  std::map<std::uint64_t, std::shared_ptr<const kept_failure>> failures_;  // records that ran on failed streams
  clock::time_point stamp_{};
  std::uint64_t stamp_gen_ = 0;
};

}  // namespace lockstep::host_backend
