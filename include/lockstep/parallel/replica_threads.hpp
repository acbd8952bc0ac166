// lockstep/parallel/replica_threads.hpp — one persistent thread per device replica.
//
// DataParallel runs each replica's forward and backward on its own thread, as PyTorch's parallel_apply does:
// a replica's host-side work (queuing kernels, GEMMs, copies) overlaps the others'. The threads live as long
// as the pool; `run` hands each one its job and returns when all are done.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/thread_name.hpp"

namespace lockstep::detail {

/// A replica's failure caused by another's (a barrier the failed one never reached): `run` reports the other.
struct secondary_failure : error {
  using error::error;
};

class replica_threads {
 public:
  explicit replica_threads(std::size_t n) {
    threads_.reserve(n);
    for (std::size_t i = 0; i < n; ++i) threads_.emplace_back([this, i] { loop(i); });
  }
  replica_threads(const replica_threads&) = delete;
  replica_threads& operator=(const replica_threads&) = delete;
  ~replica_threads() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    start_.notify_all();
    for (auto& t : threads_) t.join();
  }

  [[nodiscard]] std::size_t size() const noexcept { return threads_.size(); }

  /// Runs job(i) on thread i for every i < count (count <= size()) and waits for all of them. If jobs throw,
  /// rethrows the first one (by index) that is not a secondary_failure after all have finished, with `what(i)`
  /// naming the replica.
  void run(std::size_t count, const std::function<void(std::size_t)>& job, const std::function<std::string(std::size_t)>& what) {
    LOCKSTEP_EXPECTS(count <= threads_.size(), "replica_threads: ", count, " jobs for ", threads_.size(), " threads");
    {
      std::lock_guard lock(mutex_);
      job_ = &job;
      active_ = count;
      remaining_ = count;
      errors_.assign(count, nullptr);
      ++generation_;
    }
    start_.notify_all();
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return remaining_ == 0; });
    job_ = nullptr;
    // the first failure that is not a consequence of another (else the first)
    std::size_t failed = count;
    for (std::size_t i = 0; i < count; ++i) {
      if (!errors_[i]) continue;
      if (failed == count) failed = i;
      try {
        std::rethrow_exception(errors_[i]);
      } catch (const secondary_failure&) {
        continue;
      } catch (...) {
      }
      failed = i;
      break;
    }
    if (failed == count) return;
    std::exception_ptr e = errors_[failed];
    lock.unlock();
    try {
      std::rethrow_exception(e);
    } catch (const error&) {
      throw;  // already a sentence; the replica's device is in it
    } catch (...) {
      std::throw_with_nested(error(concat(what(failed), " failed")));
    }
  }

 private:
  void loop(std::size_t index) {
    detail::name_this_thread("replica", index);
    std::uint64_t seen = 0;
    while (true) {
      const std::function<void(std::size_t)>* job = nullptr;
      {
        std::unique_lock lock(mutex_);
        start_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
        if (index >= active_) continue;
        job = job_;
      }
      std::exception_ptr failure;
      try {
        (*job)(index);
      } catch (...) {
        failure = std::current_exception();
      }
      {
        std::lock_guard lock(mutex_);
        errors_[index] = failure;
        --remaining_;
      }
      done_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable start_;
  std::condition_variable done_;
  const std::function<void(std::size_t)>* job_ = nullptr;
  std::size_t active_ = 0;
  std::size_t remaining_ = 0;
  std::uint64_t generation_ = 0;
  bool stopping_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;  // last: started after the state above exists
};

}  // namespace lockstep::detail
