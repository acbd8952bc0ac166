// lockstep/runtime/detail/host_runtime.hpp — the per-device state of the host backend.
//
// This is the host backend's counterpart of the CUDA driver's process-wide state: one entry per host virtual
// device, holding its memory and its live streams. It starts on first use, sized by the host platform
// configuration, and is shared by every translation unit of the program, whatever it was compiled with.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "lockstep/device/host_platform.hpp"
#include "lockstep/runtime/detail/host_memory.hpp"
#include "lockstep/runtime/detail/host_stream.hpp"

namespace lockstep::host_backend {

class device_runtime final : public stream_observer {
 public:
  device_runtime(int index, std::uint64_t memory_limit, host_strictness strictness)
      : index_(index),
        strict_(strictness == host_strictness::strict),
        memory_(index, memory_limit, strictness) {}
  device_runtime(const device_runtime&) = delete;
  device_runtime& operator=(const device_runtime&) = delete;
  ~device_runtime() {
    if (default_stream_) {
      default_stream_->shutdown();
      default_stream_->drop_ref();
    }
  }

  [[nodiscard]] int index() const noexcept { return index_; }
  [[nodiscard]] device_memory& memory() noexcept { return memory_; }
  /// host_strictness::strict: memory checks on every use, streams that start work late at random.
  [[nodiscard]] bool strict() const noexcept { return strict_; }

  /// A new stream of this device; the caller owns the returned reference (shutdown() + drop_ref()).
  stream_state* create_stream() {
    const auto id = next_stream_id_.fetch_add(1, std::memory_order_relaxed);
    auto* s = new stream_state(index_, detail::concat("host:", index_, " stream ", id), this, jitter());
    std::lock_guard lock(mutex_);
    streams_.push_back(s);
    return s;
  }

  /// The stream that exists for the device's lifetime (stream 0), created on first use.
  stream_state* default_stream() {
    std::call_once(default_once_, [this] {
      auto* s = new stream_state(index_, detail::concat("host:", index_, " default stream"), this, jitter());
      std::lock_guard lock(mutex_);
      streams_.push_back(s);
      default_stream_ = s;
    });
    return default_stream_;
  }

  /// Waits for every stream of the device (cudaDeviceSynchronize) and rethrows the first kept error.
  void synchronize() {
    const stream_snapshot streams(*this);
    std::exception_ptr first;
    for (auto* s : streams.list) {
      try {
        s->wait_for(s->enqueued());
        s->rethrow_if_failed();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  /// Waits until every stream of the device has run what was queued on it when the call began, or until
  /// `deadline`; true when they all did. Kept errors stay kept: nothing throws.
  bool wait_idle_until(std::chrono::steady_clock::time_point deadline) noexcept {
    try {
      const stream_snapshot streams(*this);
      bool idle = true;
      for (auto* s : streams.list) idle = s->wait_idle_until(deadline) && idle;
      return idle;
    } catch (...) {
      return false;
    }
  }

  void on_stream_shutdown(const stream_state* s) noexcept override {
    memory_.on_stream_destroyed(s);
    std::lock_guard lock(mutex_);
    streams_.erase(std::remove(streams_.begin(), streams_.end(), s), streams_.end());
  }

 private:
  // The device's streams when it was made, each held by a reference (a stream destroyed meanwhile lives on until
  // the snapshot is dropped), so that they are waited for without holding the device's lock.
  struct stream_snapshot {
    std::vector<stream_state*> list;
    explicit stream_snapshot(device_runtime& d) {
      std::lock_guard lock(d.mutex_);
      list.reserve(d.streams_.size());
      for (auto* s : d.streams_) {
        s->add_ref();
        list.push_back(s);
      }
    }
    stream_snapshot(const stream_snapshot&) = delete;
    stream_snapshot& operator=(const stream_snapshot&) = delete;
    ~stream_snapshot() {
      for (auto* s : list) s->drop_ref();
    }
  };

  // Up to 200 us of delay before some of a strict device's stream work: long enough to reorder two streams that
  // no event orders (a kernel of a few thousand elements takes microseconds), short enough for test suites.
  [[nodiscard]] std::uint32_t jitter() const noexcept { return strict_ ? 200 : 0; }

  const int index_;
  const bool strict_;
  device_memory memory_;
  std::mutex mutex_;
  std::vector<stream_state*> streams_;  // live streams, not owned
  std::once_flag default_once_;
  stream_state* default_stream_ = nullptr;
  std::atomic<std::uint64_t> next_stream_id_{1};
};

/// All host devices of the process.
class runtime {
 public:
  static runtime& instance() {
    static runtime r(host_platform_configuration());
    return r;
  }
  /// The process's runtime while it exists: null before its first use, and again once exit has destroyed it (for
  /// code that runs at exit, and must neither start the platform nor touch a destroyed runtime).
  [[nodiscard]] static runtime* if_alive() noexcept { return live_.load(std::memory_order_acquire); }

  runtime(const runtime&) = delete;
  runtime& operator=(const runtime&) = delete;
  ~runtime() { live_.store(nullptr, std::memory_order_release); }

  [[nodiscard]] int device_count() const noexcept { return static_cast<int>(devices_.size()); }

  /// host_strictness::strict (the same for every device).
  [[nodiscard]] bool strict() const noexcept { return strict_; }

  /// Peer access, as on GPUs: whether work on host device `from` may touch the memory of host device `to` directly
  /// (a collective reading a peer's buffer). On a GPU that takes cudaDeviceEnablePeerAccess and, for memory of a
  /// stream-ordered pool (all of lockstep's), cudaMemPoolSetAccess; enable_peer_access (runtime/memory.hpp) grants
  /// both, and host devices keep the same grants so that strict mode can refuse what a GPU would fault on. Copies
  /// need no grant (a GPU stages them). Indices are valid device indices (the caller checks).
  void set_peer_access(int from, int to, bool allowed) noexcept {
    auto& bits = peers_[static_cast<std::size_t>(from)];
    const std::uint64_t bit = std::uint64_t{1} << to;
    if (allowed) {
      bits.fetch_or(bit, std::memory_order_acq_rel);
    } else {
      bits.fetch_and(~bit, std::memory_order_acq_rel);
    }
  }
  [[nodiscard]] bool peer_access(int from, int to) const noexcept {
    return from == to ||
           (peers_[static_cast<std::size_t>(from)].load(std::memory_order_acquire) & (std::uint64_t{1} << to)) != 0;
  }

  /// Waits until the streams of every host device have run the work queued on them, for at most `limit` (a stream
  /// blocked for good, waiting for a peer that will not come, must not hang the caller). Nothing throws.
  void wait_for_queued_work(std::chrono::milliseconds limit) noexcept {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (auto& d : devices_) (void)d->wait_idle_until(deadline);
  }

  /// The state of host device `index`; throws device_error naming the visible count when out of range.
  device_runtime& device(int index) {
    if (index < 0 || index >= device_count()) {
      throw device_error(detail::concat("host:", index, " does not exist: ", device_count(),
                                        " host devices are configured (LOCKSTEP_HOST_DEVICES or "
                                        "configure_host_platform), valid ids are 0..",
                                        device_count() - 1));
    }
    return *devices_[static_cast<std::size_t>(index)];
  }

 private:
  explicit runtime(const host_platform_config& config) : strict_(config.strictness == host_strictness::strict) {
    for (int i = 0; i < config.device_count; ++i)
      devices_.push_back(std::make_unique<device_runtime>(i, config.memory_limit(i), config.strictness));
    live_.store(this, std::memory_order_release);
  }

  static inline std::atomic<runtime*> live_{nullptr};  // constant-initialized, never destroyed: see if_alive

  const bool strict_;
  std::vector<std::unique_ptr<device_runtime>> devices_;
  std::array<std::atomic<std::uint64_t>, 64> peers_{};  // peers_[from] bit `to`: set_peer_access
};

}  // namespace lockstep::host_backend
