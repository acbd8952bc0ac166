// lockstep/parallel/detail/replica_groups.hpp — the two implementations of nn/'s replica_group (what a synchronized
// batch norm sums its per-channel numbers over):
//   - communicator_replicas (distributed_data_parallel): an all-reduce on the communicator, on the communication
//     stream between two hand-offs (after the compute stream's work so far; before what it queues next), so that it
//     takes its place among the wrapper's own collectives in the same order on every rank;
//   - thread_replicas (data_parallel): its replicas are threads of one process; a sum stages each replica's numbers
//     to the host, meets the others at a barrier, and adds them in replica order (the same bits whatever the
//     timing); a replica that fails aborts the barrier, so that the others throw instead of waiting forever.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/config.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/parallel/replica_threads.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/stream.hpp"

LOCKSTEP_DETAIL_BEGIN

class communicator_replicas final : public replica_group {
 public:
  /// Sums over `comm`'s ranks, on `comm_stream` (a stream of the rank's device).
  communicator_replicas(communicator_ref comm, stream_ref comm_stream)
      : comm_(comm), comm_stream_(comm_stream), handoff_(comm_stream.get_device()) {}
  void sum(float* data, std::size_t n, stream_ref s) override { run(data, n, dtype::f32, s); }
  void sum(std::int64_t* data, std::size_t n, stream_ref s) override { run(data, n, dtype::i64, s); }
  [[nodiscard]] int size() const noexcept override { return comm_.size(); }
  /// Sums asked for since the last reset_calls(): whether the model's forward used the group.
  [[nodiscard]] std::size_t calls() const noexcept { return calls_; }
  void reset_calls() noexcept { calls_ = 0; }

 private:
  void run(void* data, std::size_t n, dtype type, stream_ref s) {
    ++calls_;
    if (comm_.size() == 1 || n == 0) return;
    handoff_.record(s);  // after the work that wrote the numbers
    comm_stream_.wait(handoff_);
    comm_.all_reduce(data, data, n, type, reduce_op::sum, comm_stream_);
    handoff_.record(comm_stream_);  // before the work that reads the sums
    s.wait(handoff_);
  }

  communicator_ref comm_;
  stream_ref comm_stream_;
  event handoff_;
  std::size_t calls_ = 0;
};

class thread_replicas {
 public:
  explicit thread_replicas(std::size_t replicas) : slots_(replicas) {
    for (std::size_t i = 0; i < replicas; ++i) members_.push_back(std::make_unique<member>(this, i));
  }

  /// Replica i's view of the group (what its context holds).
  [[nodiscard]] replica_group& of(std::size_t i) { return *members_.at(i); }

  /// The replicas that take part in what runs next (a batch smaller than the devices leaves some out); clears an
  /// earlier abort.
  void start(std::size_t used) {
    std::lock_guard lock(mutex_);
    used_ = used;
    arrived_ = 0;
    aborted_ = false;
  }

  /// A replica failed: every sum waiting, or asked for, until the next start() throws.
  void abort() {
    {
      std::lock_guard lock(mutex_);
      aborted_ = true;
    }
    met_.notify_all();
  }

 private:
  struct member final : replica_group {
    member(thread_replicas* g, std::size_t i) : group(g), index(i) {}
    void sum(float* data, std::size_t n, stream_ref s) override { group->sum(index, data, n, s); }
    void sum(std::int64_t* data, std::size_t n, stream_ref s) override { group->sum(index, data, n, s); }
    [[nodiscard]] int size() const noexcept override { return static_cast<int>(group->used_); }
    thread_replicas* group;
    std::size_t index;
  };

  template <class T>
  void sum(std::size_t index, T* data, std::size_t n, stream_ref s) {
    const device d = s.get_device();
    std::vector<T> mine = to_vector(device_span<const T>(data, n, d), s);  // synchronizes s
    slots_[index].resize(n * sizeof(T));
    if (n > 0) std::memcpy(slots_[index].data(), mine.data(), n * sizeof(T));
    meet();  // every replica's numbers are in its slot
    std::vector<T> total(n, T{});
    for (std::size_t r = 0; r < used_; ++r) {
      LOCKSTEP_EXPECTS(slots_[r].size() == n * sizeof(T), "synchronized batch norm: replica ", r, " summed ",
                       slots_[r].size() / sizeof(T), " values where replica ", index, " summed ", n,
                       ": every replica must run the same layers");
      const T* v = reinterpret_cast<const T*>(slots_[r].data());
      for (std::size_t i = 0; i < n; ++i) total[i] += v[i];
    }
    meet();  // every replica has read the slots: the next sum may overwrite them
    copy(device_span<T>(data, n, d), std::span<const T>(total), s);
    s.synchronize();
  }

  // A barrier of the `used_` replicas that throws once a replica aborted.
  void meet() {
    std::unique_lock lock(mutex_);
    if (aborted_) throw secondary_failure("data_parallel: another replica failed during a synchronized batch norm");
    const std::uint64_t generation = generation_;
    if (++arrived_ == used_) {
      arrived_ = 0;
      ++generation_;
      lock.unlock();
      met_.notify_all();
      return;
    }
    met_.wait(lock, [&] { return generation_ != generation || aborted_; });
    if (generation_ == generation) {
      throw secondary_failure("data_parallel: another replica failed during a synchronized batch norm");
    }
  }

  std::vector<std::unique_ptr<member>> members_;
  std::vector<std::vector<std::byte>> slots_;
  std::mutex mutex_;
  std::condition_variable met_;
  std::size_t used_ = 0;
  std::size_t arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
};

LOCKSTEP_DETAIL_END
