// lockstep/comm/host_clique.hpp — collectives between the host devices of one process, through shared memory.
//
// A host clique is k communicators, one per host device. A collective is a task on the rank's stream worker.
// The k tasks of one collective (the n-th collective of every rank: sequence numbers are per clique and per
// rank, assigned when the collective is queued) meet in a rendezvous slot:
//
//   1. arrive: under the clique's mutex, check that this call matches the first rank's (kind, count, dtype, op,
//      root), and publish the send/recv pointers. The last rank to arrive commits the slot.
//   2. wait for the commit: spin briefly on an atomic, then block on a condition variable until the deadline
//      (arrival + timeout). A timeout, a mismatch or an abort fails the slot for every rank, under the mutex,
//      so that either all ranks go on to step 3 or none does.
//   3. work: every rank does its share, reading the others' buffers directly. all_reduce is a fused
//      reduce-scatter + all-gather: rank r reduces chunk r (1/k of the elements) of all k inputs, in f32, and
//      writes the result into chunk r of all k outputs, so every rank reads and writes about 2N bytes in total
//      (like a memcpy of N). reduce and reduce_scatter split the same way; broadcast and all_gather copy.
//      all_reduce_exact splits the same way too: rank r sums chunk r of every rank's terms exactly (copying its
//      peers' terms a piece at a time first) and writes the rounded values into chunk r of every output.
//      The loops work on blocks that stay in L1 (f16/bf16 are widened a block at a time and rounded once) and
//      vectorize; when the buffers cannot stay in the last-level cache the outputs are written with
//      non-temporal stores (see stream_outputs).
//   4. finish: wait until every rank has done its share (peers write into this rank's recv buffer, and read its
//      send buffer, until then), so that later work on the stream sees the final data and may reuse the buffers.
//
// A failed collective throws in the worker and surfaces at the next synchronization of the stream: timeout_error
// when a rank did not arrive in time (naming it), precondition_error when the ranks called different
// collectives (naming the difference), lockstep::error after abort() (with its reason). The clique stays usable
// after a timeout or a mismatch (the sequence numbers stay aligned); after abort() it is not.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/host_reduce.hpp"  // the reduction arithmetic, shared with comm/mpi.hpp
#include "lockstep/device/device_set.hpp"
#include "lockstep/kernels/exact.hpp"
#include "lockstep/kernels/host_loop.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/memory.hpp"  // enable_peer_access
#include "lockstep/runtime/stream.hpp"

LOCKSTEP_DETAIL_BEGIN

namespace host_comm {

/// The shared state of one clique: the rendezvous slots, keyed by sequence number.
class clique_state {
 public:
  clique_state(std::vector<device> devices, std::chrono::milliseconds timeout)
      : devices_(std::move(devices)), timeout_(timeout) {}

  [[nodiscard]] int size() const noexcept { return static_cast<int>(devices_.size()); }
  [[nodiscard]] device device_of(int rank) const { return devices_.at(static_cast<std::size_t>(rank)); }

  /// Runs rank `rank`'s part of collective `seq` (on the rank's stream worker). Throws on failure.
  void run(int rank, std::uint64_t seq, const collective_call& c) {
    const int k = size();
    slot* s = nullptr;
    bool committed_here = false;
    bool failed_here = false;
    {
      std::unique_lock lock(mutex_);
      auto& entry = slots_[seq];
      if (!entry) entry = std::make_unique<slot>();
      s = entry.get();
      const bool was_gathering = s->state.load(std::memory_order_relaxed) == gathering;
      if (was_gathering) {
        if (aborted_) {
          fail_locked(*s, failure::aborted, abort_reason_);
        } else if (s->first_rank < 0) {
          s->first = c;
          s->first_rank = rank;
        } else if (const std::string diff = s->first.difference(c); !diff.empty()) {
          // Name the lower rank first, so the message does not depend on who arrived first.
          const bool first_is_lower = s->first_rank < rank;
          const int lo = first_is_lower ? s->first_rank : rank, hi = first_is_lower ? rank : s->first_rank;
          const collective_call& lo_call = first_is_lower ? s->first : c;
          const collective_call& hi_call = first_is_lower ? c : s->first;
          fail_locked(
              *s, failure::mismatch,
              concat(rank_name(lo, device_of(lo)), " called ", lo_call.signature(), ", ", rank_name(hi, device_of(hi)),
                     " called ", hi_call.signature(), " (", lo_call.difference(hi_call), ')'));
        }
      }
      if (s->state.load(std::memory_order_relaxed) == gathering) {
        const auto r = static_cast<std::size_t>(rank);
        s->send[r] = c.send;
        s->recv[r] = c.recv;
        s->stride[r] = c.stride;
        s->arrived[r] = true;
        if (++s->arrivals == k) {
          s->state.store(committed, std::memory_order_release);
          committed_here = true;
        }
      }
      failed_here = was_gathering && s->state.load(std::memory_order_relaxed) == failed;
    }
    if (committed_here) {
      cv_.notify_all();
    } else {
      if (failed_here) cv_.notify_all();  // wake the ranks waiting for this slot: it failed (mismatch, abort)
      wait_for_commit(rank, seq, *s, c);  // throws (having left the slot) when the collective failed
    }
    if (c.kind != collective_kind::barrier) {
      work(rank, c, *s);
      wait_for_all_finished(rank, seq, *s, c);
      // all_reduce_exact: a term outside the window, in any rank's share, makes its tensor NaN; each rank writes
      // its own recv, now that no peer writes into it any more
      if (c.kind == collective_kind::all_reduce_exact && s->outside.load(std::memory_order_acquire) != 0) {
        std::lock_guard lock(s->outside_mutex);
        poison_exact_tensors(c, s->outside_of);
      }
    }
    std::lock_guard lock(mutex_);
    leave_locked(seq, *s);
  }

  /// Throws lockstep::error with the reason once the clique was aborted.
  void rethrow_failure(int rank) {
    std::lock_guard lock(mutex_);
    if (!aborted_) return;
    throw error(concat("the host clique of ", rank_name(rank, device_of(rank)), " was aborted: ", abort_reason_));
  }

  /// Fails every collective not yet committed, and every later one, with `reason`.
  void abort(const std::string& reason) {
    {
      std::lock_guard lock(mutex_);
      if (!aborted_) {
        aborted_ = true;
        abort_reason_ = reason;
      }
      for (auto& [seq, s] : slots_) {
        if (s->state.load(std::memory_order_relaxed) == gathering) fail_locked(*s, failure::aborted, abort_reason_);
      }
    }
    cv_.notify_all();
  }

 private:
  enum slot_state : int { gathering, committed, failed };
  enum class failure : std::uint8_t { none, mismatch, timeout, aborted };

  struct slot {
    collective_call first;  // the signature every rank must match
    int first_rank = -1;
    std::array<const void*, max_ranks> send{};
    std::array<void*, max_ranks> recv{};
    std::array<std::size_t, max_ranks> stride{};  // all_reduce_exact: each rank's distance between its terms
    std::array<bool, max_ranks> arrived{};
    int arrivals = 0;
    int left = 0;
    std::atomic<int> state{gathering};  // written under the mutex; read by spinning ranks without it
    std::atomic<int> finished{0};       // ranks that have done their share of the work
    // all_reduce_exact: whether any share met terms outside the exact window, and how many in each tensor
    mutable std::atomic<std::int64_t> outside{0};
    mutable std::mutex outside_mutex;
    mutable std::vector<std::int64_t> outside_of;
    failure why = failure::none;
    std::string detail;        // the mismatch, the abort reason
    std::vector<int> missing;  // ranks that had not arrived at a timeout
  };

  void fail_locked(slot& s, failure why, std::string detail) {
    s.why = why;
    s.detail = std::move(detail);
    if (why == failure::timeout) {
      for (int r = 0; r < size(); ++r) {
        if (!s.arrived[static_cast<std::size_t>(r)]) s.missing.push_back(r);
      }
    }
    s.state.store(failed, std::memory_order_release);
  }

  void leave_locked(std::uint64_t seq, slot& s) {
    if (++s.left == size()) slots_.erase(seq);
  }

  /// Builds the error of a failed slot as seen by `rank`, leaves the slot and throws it.
  [[noreturn]] void throw_failure_locked(int rank, std::uint64_t seq, slot& s, const collective_call& c) {
    const std::string where = concat(name_of(c.kind), " #", seq, " on ", rank_name(rank, device_of(rank)));
    const failure why = s.why;
    std::string text;
    if (why == failure::timeout) {
      std::string who;
      bool self_missing = false;
      for (std::size_t i = 0; i < s.missing.size(); ++i) {
        if (s.missing[i] == rank) self_missing = true;
        if (i > 0) who += ", ";
        who += i == 0 && s.missing.size() == 1 ? rank_name(s.missing[i], device_of(s.missing[i]))
                                               : concat(s.missing[i], " (", device_of(s.missing[i]).str(), ')');
      }
      const bool one = s.missing.size() == 1;
      text = concat(where, ": ", one ? "" : "ranks ", who, " did not join within ", format_duration(timeout_), "; ",
                    one ? "it" : "they",
                    " may have failed, exited or be stuck (timeout: comm_options::timeout or "
                    "LOCKSTEP_COMM_TIMEOUT)");
      if (self_missing) text += "; this rank arrived after the others had given up";
    } else if (why == failure::mismatch) {
      text = concat(where, ": the ranks called different collectives: ", s.detail,
                    "; every rank must issue the same collectives in the same order with the same count, dtype, op "
                    "and root");
    } else {
      text = concat(where, " was aborted: ", s.detail);
    }
    leave_locked(seq, s);  // `s` may be destroyed from here on
    if (why == failure::timeout) throw timeout_error(text);
    if (why == failure::mismatch) throw precondition_error(text);
    throw error(text);
  }

  void wait_for_commit(int rank, std::uint64_t seq, slot& s, const collective_call& c) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    if (spin_until([&] { return s.state.load(std::memory_order_acquire) != gathering; }) &&
        s.state.load(std::memory_order_acquire) == committed) {
      return;
    }
    std::unique_lock lock(mutex_);
    while (s.state.load(std::memory_order_relaxed) == gathering) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout &&
          s.state.load(std::memory_order_relaxed) == gathering) {
        fail_locked(s, failure::timeout, {});
        lock.unlock();
        cv_.notify_all();
        lock.lock();
      }
    }
    if (s.state.load(std::memory_order_relaxed) == failed) throw_failure_locked(rank, seq, s, c);
  }

  /// Waits until every rank has done its share. Deliberately deaf to abort(): the peers are in the middle of
  /// plain memory loops that write into this rank's buffers and cannot block, so returning early would let the
  /// caller free or reuse buffers under them. The timeout stays as a guard against a bug.
  void wait_for_all_finished(int rank, std::uint64_t seq, slot& s, const collective_call& c) {
    const int k = size();
    if (s.finished.fetch_add(1, std::memory_order_acq_rel) + 1 == k) {
      { std::lock_guard lock(mutex_); }  // a rank that checked the count under the mutex is now waiting
      cv_.notify_all();
      return;
    }
    if (spin_until([&] { return s.finished.load(std::memory_order_acquire) == k; })) return;
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    std::unique_lock lock(mutex_);
    if (!cv_.wait_until(lock, deadline, [&] { return s.finished.load(std::memory_order_acquire) == k; })) {
      throw timeout_error(concat(name_of(c.kind), " #", seq, " on ", rank_name(rank, device_of(rank)),
                                 ": the other ranks did not finish their share of the copy within ",
                                 format_duration(timeout_), " (a rank's worker thread is stalled)"));
    }
  }

  /// This rank's share of the data movement; runs once every rank has published its pointers.
  void work(int rank, const collective_call& c, const slot& s) const {
    const int k = size();
    const auto r = static_cast<std::size_t>(rank);
    const std::size_t es = size_of(c.type);
    switch (c.kind) {
      case collective_kind::all_reduce:
      case collective_kind::reduce: {
        const auto [begin, end] = chunk_of(c.count, k, rank, es);
        if (begin == end) return;
        std::array<const void*, max_ranks> in{};
        std::array<void*, max_ranks> out{};
        for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) in[j] = advance(s.send[j], begin * es);
        int outputs = 1;
        if (c.kind == collective_kind::all_reduce) {
          for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) out[j] = advance(s.recv[j], begin * es);
          outputs = k;
        } else {
          out[0] = advance(s.recv[static_cast<std::size_t>(c.root)], begin * es);
        }
        std::size_t distinct_outputs = 1;
        if (c.kind == collective_kind::all_reduce) {
          distinct_outputs = 0;
          for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) distinct_outputs += s.recv[j] != s.send[j];
        }
        const std::size_t touched = c.count * es * (static_cast<std::size_t>(k) + distinct_outputs);
        // All-reduce: this rank's own output through the cache, its peers' with streaming stores (see
        // stream_outputs).
        reduce_range(c.type, c.op, in.data(), k, out.data(), outputs, end - begin, stream_outputs(touched),
                     c.kind == collective_kind::all_reduce ? rank : -1);
        return;
      }
      case collective_kind::reduce_scatter: {
        if (c.count == 0) return;
        std::array<const void*, max_ranks> in{};
        for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) in[j] = advance(s.send[j], r * c.count * es);
        void* out = s.recv[r];
        const std::size_t touched = c.count * es * static_cast<std::size_t>(k) * static_cast<std::size_t>(k + 1);
        reduce_range(c.type, c.op, in.data(), k, &out, 1, c.count, stream_outputs(touched));
        return;
      }
      case collective_kind::broadcast: {
        const void* src = s.send[static_cast<std::size_t>(c.root)];
        if (c.count != 0 && s.recv[r] != src) std::memcpy(s.recv[r], src, c.count * es);
        return;
      }
      case collective_kind::all_gather: {
        if (c.count == 0) return;
        for (int j = 0; j < k; ++j) {
          void* dst = advance(s.recv[r], static_cast<std::size_t>(j) * c.count * es);
          const void* src = s.send[static_cast<std::size_t>(j)];
          if (dst != src) std::memcpy(dst, src, c.count * es);
        }
        return;
      }
      case collective_kind::all_reduce_exact: {
        // this rank's share of the elements: every rank's terms summed exactly, rounded once and written into
        // every rank's recv. A piece at a time, the peers' terms first copied into a buffer of this thread: a
        // memcpy streams another core's cache lines twice as fast as the sum's loop reading them in place.
        const auto share = chunk_of(c.count, k, rank, es);
        const std::size_t begin = share.first, end = share.second;  // captured below: no structured binding
        if (begin == end) return;
        std::vector<std::int64_t> outside(std::max<std::size_t>(c.tensors, 1), 0);
        dispatch_floating(c.type, "all_reduce_exact", [&]<class T>() {
          const std::size_t terms = c.terms, peers = static_cast<std::size_t>(k - 1);
          const std::size_t piece = std::max<std::size_t>(16, (std::size_t{256} << 10) / (sizeof(T) * terms * std::max<std::size_t>(peers, 1)));
          thread_local std::vector<std::byte> staging;
          staging.resize(std::min(piece, end - begin) * terms * peers * sizeof(T));
          T* copies = reinterpret_cast<T*>(staging.data());
          for (std::size_t p0 = begin; p0 < end; p0 += piece) {
            const std::size_t len = std::min(piece, end - p0);
            for (std::size_t owner = 0, at = 0; owner < static_cast<std::size_t>(k); ++owner) {
              if (owner == r) continue;
              for (std::size_t t = 0; t < terms; ++t, ++at) {
                std::memcpy(copies + at * len, static_cast<const T*>(s.send[owner]) + t * s.stride[owner] + p0, len * sizeof(T));
              }
            }
            for_each_tensor_run(c, p0, p0 + len, [&](std::size_t tensor, std::size_t b, std::size_t e) {
              auto term = [&](std::size_t t) -> const T* {
                const std::size_t owner = t / terms, i = t % terms;
                if (owner == r) return static_cast<const T*>(s.send[owner]) + i * s.stride[owner] + b;
                return copies + ((owner < r ? owner : owner - 1) * terms + i) * len + (b - p0);
              };
              std::array<T*, max_ranks> out{};  // this rank's own first: the sums are written there, then copied
              for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) {
                out[j] = static_cast<T*>(s.recv[j == 0 ? r : (j <= r ? j - 1 : j)]) + b;
              }
              run_host_loop(e - b, kernels::exact_sums_host_op<T, decltype(term)>{
                                       term, terms * static_cast<std::size_t>(k), out.data(), k, &outside[tensor]});
            });
          }
        });
        if (std::any_of(outside.begin(), outside.end(), [](std::int64_t o) { return o != 0; })) {
          std::lock_guard lock(s.outside_mutex);
          s.outside_of.resize(outside.size(), 0);
          for (std::size_t j = 0; j < outside.size(); ++j) s.outside_of[j] += outside[j];
          s.outside.fetch_add(1, std::memory_order_acq_rel);
        }
        return;
      }
      case collective_kind::barrier:
        return;
    }
  }

  const std::vector<device> devices_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::uint64_t, std::unique_ptr<slot>> slots_;
  bool aborted_ = false;
  std::string abort_reason_;
};

/// One rank's endpoint of a host clique.
class clique_member final : public communicator_impl {
 public:
  clique_member(std::shared_ptr<clique_state> state, int rank) : state_(std::move(state)), rank_(rank) {}

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return state_->size(); }
  [[nodiscard]] device get_device() const noexcept override { return state_->device_of(rank_); }
  [[nodiscard]] bool supports(collective_kind) const noexcept override { return true; }

  void enqueue(const collective_call& c, stream_ref s) override {
    if (c.kind != collective_kind::barrier && host_strict()) expect_peer_access(c);
    const std::uint64_t seq = next_seq_.fetch_add(1, std::memory_order_relaxed) + 1;
    host_backend::stream_state* on = &s.host_state();
    enqueue_host(
        s,
        [state = state_, rank = rank_, seq, c, on] {
          // Work this collective depends on failed: its buffers hold nothing valid. Fail the collective on every
          // rank (abort) rather than let the others complete a step with this rank's stale data.
          if (auto why = reason_not_to_run(*on, concat(name_of(c.kind), " #", seq, " on ",
                                                       rank_name(rank, state->device_of(rank))))) {
            state->abort(*why);
            throw error(*why);
          }
          state->run(rank, seq, c);
        },
        name_of(c.kind).data(), true);
  }

  void rethrow_failure() override { state_->rethrow_failure(rank_); }

  void abort(const std::string& reason) noexcept override {
    try {
      state_->abort(reason);
    } catch (...) {
      // Out of memory while copying the reason: nothing better can be done in a noexcept path.
    }
  }

 private:
  /// Strict mode: every rank's share of a collective reads and writes its peers' buffers directly, as NCCL does
  /// between the GPUs of one process; a GPU faults (cudaErrorIllegalAddress) or hangs on memory of a peer's
  /// stream-ordered pool that it was never given access to, so a clique with a pair of devices without the grant
  /// is refused, on every rank alike (each checks every pair, so none is left waiting for the others).
  void expect_peer_access(const collective_call& c) const {
    auto& host = host_backend::runtime::instance();
    for (int a = 0; a < state_->size(); ++a) {
      for (int b = 0; b < state_->size(); ++b) {
        const device from = state_->device_of(a), to = state_->device_of(b);
        if (host.peer_access(from.index, to.index)) continue;
        throw precondition_error(concat(
            name_of(c.kind), " on ", rank_name(rank_, get_device()), ": ", rank_name(a, from),
            " would read and write the buffers of ", rank_name(b, to), " directly, but ", from.str(),
            " was never given access to the memory of ", to.str(),
            ": on GPUs, NCCL reads peers' memory directly within a process, and memory of a stream-ordered pool "
            "that was not granted (enable_peer_access: cudaDeviceEnablePeerAccess and cudaMemPoolSetAccess) faults "
            "with cudaErrorIllegalAddress or hangs. make_host_clique and make_nccl_clique grant it; call "
            "enable_peer_access(devices) again after disable_peer_access [host_strictness::strict]"));
      }
    }
  }

  std::shared_ptr<clique_state> state_;  // shared with the other ranks and with queued collectives
  int rank_;
  std::atomic<std::uint64_t> next_seq_{0};
};

}  // namespace host_comm

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// One communicator per device of `devices` (host devices of this process), rank i on devices[i]. The ranks
/// exchange through shared memory; see the file comment for the algorithm. Collectives of the returned
/// communicators must be queued on streams of their own devices, one rank per thread or all from one thread
/// (they are stream-ordered, so one thread may queue every rank's part without deadlock). Throws
/// precondition_error when `devices` is empty, not of kind host, or the timeout is not positive.
inline std::vector<communicator> make_host_clique(const device_set& devices, comm_options options = {}) {
  LOCKSTEP_EXPECTS(!devices.empty(), "make_host_clique: the device set is empty");
  LOCKSTEP_EXPECTS(devices.kind() == device_kind::host, "make_host_clique: expected host devices, got ", devices.str(),
                   " (GPUs use make_nccl_clique)");
  LOCKSTEP_EXPECTS(options.timeout.count() > 0, "make_host_clique: comm_options::timeout must be positive, got ",
                   options.timeout.count(), " ms");
  (void)enable_peer_access(devices.devices());  // a rank's share reads its peers' buffers, as NCCL does on GPUs
  auto state = std::make_shared<detail::host_comm::clique_state>(devices.devices(), options.timeout);
  std::vector<communicator> out;
  out.reserve(devices.size());
  for (int r = 0; r < state->size(); ++r) {
    out.push_back(communicator::from_impl(std::make_unique<detail::host_comm::clique_member>(state, r)));
  }
  return out;
}

LOCKSTEP_ABI_END
