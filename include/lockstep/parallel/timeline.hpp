// lockstep/parallel/timeline.hpp — where a device's time goes: computing, communicating, or idle.
//
// Phases are bracketed by timing events recorded on the device's streams, so measuring never makes the host
// wait for a device: finished brackets are harvested when their events are ready (queried, not waited for),
// and only the report waits for the last ones. Events are pooled, so a steady-state step creates none.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <optional>
#include <utility>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/runtime/memory.hpp"
#include "lockstep/runtime/stream.hpp"

LOCKSTEP_ABI_BEGIN

/// What a stretch of a device's time was spent on.
enum class phase : std::uint8_t { compute, communication };

/// Time and memory of one device over a run.
struct device_report {
  lockstep::device device;
  std::uint64_t peak_bytes = 0;   // peak bytes in use (memory statistics since the last reset)
  // The peak before the first reset: the memory that building the model and the wrapper, initializing and loading
  // a checkpoint took. A device needs max(peak_bytes, setup_peak_bytes).
  std::uint64_t setup_peak_bytes = 0;
  double compute_ms = 0;          // forward, backward, loss and optimizer work
  double communication_ms = 0;    // broadcasts, scatters, gathers, reductions, all-reduces
  double wall_ms = 0;             // from the first measured work to the last
  double idle_ms = 0;             // wall - compute - communication (waiting for other devices or the host)
  // What the model's training state holds on this device (0: not reported): the values forward reads and the
  // fp32 master values, the gradients (with the buffers they are reduced in), the optimizer's state.
  std::uint64_t parameter_bytes = 0;
  std::uint64_t gradient_bytes = 0;
  std::uint64_t optimizer_bytes = 0;
  // ZeRO-3: the most bytes of whole values held gathered at once (the buckets' buffers, part of peak_bytes).
  std::uint64_t gathered_peak_bytes = 0;
};

class timeline {
 public:
  explicit timeline(device d) : device_(d) {}

  /// Starts a bracket of phase `p` on stream `s` (of this device).
  void begin(phase p, stream_ref s) {
    harvest();
    open_.push_back(bracket{p, take(), std::nullopt});
    open_.back().start->record(s);
  }
  /// Ends the most recent bracket, on stream `s`.
  void end(stream_ref s) {
    LOCKSTEP_EXPECTS(!open_.empty() && !open_.back().stop, "timeline::end without begin");
    open_.back().stop = take();
    open_.back().stop->record(s);
  }

  /// Totals so far; waits for the brackets still running (call it at the end of a run).
  [[nodiscard]] device_report report() {
    for (auto& b : open_) {
      if (b.stop) b.stop->synchronize();
    }
    harvest();
    device_report r;
    r.device = device_;
    r.compute_ms = compute_ms_;
    r.communication_ms = communication_ms_;
    r.wall_ms = wall_ms_;
    r.idle_ms = std::max(0.0, wall_ms_ - compute_ms_ - communication_ms_);
    r.peak_bytes = get_memory_stats(device_).peak_bytes_in_use;
    r.setup_peak_bytes = setup_peak_bytes_.value_or(0);
    return r;
  }

  /// Forgets the totals and starts a new measurement window. The device's memory peak is reset too (for every
  /// user of the device's statistics); the peak before the first reset is kept as the setup peak.
  void reset() {
    compute_ms_ = communication_ms_ = wall_ms_ = 0;
    first_.reset();
    if (!setup_peak_bytes_) setup_peak_bytes_ = get_memory_stats(device_).peak_bytes_in_use;
    reset_memory_stats(device_);
  }

 private:
  struct bracket {
    phase p;
    std::optional<event> start;
    std::optional<event> stop;
  };

  std::optional<event> take() {
    if (!pool_.empty()) {
      std::optional<event> e = std::move(pool_.back());
      pool_.pop_back();
      return e;
    }
    return std::optional<event>(std::in_place, device_, event_timing::enabled);
  }

  void harvest() {
    while (!open_.empty() && open_.front().stop && open_.front().stop->ready()) {
      bracket b = std::move(open_.front());
      open_.pop_front();
      const double ms = elapsed_ms(*b.start, *b.stop);
      (b.p == phase::compute ? compute_ms_ : communication_ms_) += ms;
      // wall time: from the first bracket's start, extended by each bracket's length past the previous end
      if (!first_) {
        first_ = std::move(b.start);
        wall_ms_ = ms;
      } else {
        wall_ms_ = std::max(wall_ms_, static_cast<double>(elapsed_ms(*first_, *b.stop)));
        pool_.push_back(std::move(b.start));
      }
      pool_.push_back(std::move(b.stop));
    }
  }

  device device_;
  std::deque<bracket> open_;
  std::vector<std::optional<event>> pool_;
  std::optional<event> first_;  // start of the window
  double compute_ms_ = 0, communication_ms_ = 0, wall_ms_ = 0;
  std::optional<std::uint64_t> setup_peak_bytes_;  // the memory peak before the first reset
};

/// Calls f() (work it queues on `s`) inside a bracket of phase `p` of `t`, closed also when f throws; returns
/// what f returns. Brackets do not nest: f must not open brackets of `t` itself.
template <class F>
decltype(auto) timed(timeline& t, phase p, stream_ref s, F&& f) {
  struct closer {
    timeline& t;
    stream_ref s;
    int unwinding = std::uncaught_exceptions();
    ~closer() noexcept(false) {
      if (std::uncaught_exceptions() == unwinding) {
        t.end(s);
        return;
      }
      try {  // f threw: close the bracket if the stream still takes it, and let f's exception through
        t.end(s);
      } catch (...) {
      }
    }
  };
  t.begin(p, s);
  const closer close{t, s};
  return std::forward<F>(f)();
}

LOCKSTEP_ABI_END
