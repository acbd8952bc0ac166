// lockstep/io/preemption.hpp — what a cluster scheduler expects of a job it is about to kill: SIGTERM (or
// Ctrl-C's SIGINT) means "save at a step boundary soon, then stop", not "die mid-write".
//
//   preemption_guard guard;                     handlers installed; the old ones come back at scope exit
//   for (...) {
//     ... one training step ...
//     if (guard.requested(comm, s)) {           every rank agrees (one tiny all-reduce), so all stop at the
//       saver.save(state, s, comm);             same step and save together
//       break;
//     }
//   }
//
// The handler only sets a flag (async-signal-safe); nothing happens until the loop asks.
#pragma once

#include <signal.h>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <optional>
#include <vector>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/runtime/copy.hpp"

namespace lockstep::detail {
inline volatile std::sig_atomic_t preemption_signal = 0;
inline std::atomic<int> preemption_guards{0};
extern "C" inline void record_preemption(int sig) { preemption_signal = sig; }
}  // namespace lockstep::detail

LOCKSTEP_ABI_BEGIN

/// Turns SIGTERM and SIGINT into a request that the training loop polls. One guard at a time per process.
class preemption_guard {
 public:
  /// Installs the handlers (restored by the destructor). Throws precondition_error if another guard lives.
  preemption_guard() {
    int none = 0;
    LOCKSTEP_EXPECTS(detail::preemption_guards.compare_exchange_strong(none, 1),
                     "only one preemption_guard may exist at a time");
    detail::preemption_signal = 0;
    struct sigaction action {};
    action.sa_handler = detail::record_preemption;
    action.sa_flags = SA_RESTART;  // reads and writes in progress go on
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGTERM, &action, &previous_term_);
    ::sigaction(SIGINT, &action, &previous_int_);
  }
  preemption_guard(const preemption_guard&) = delete;
  preemption_guard& operator=(const preemption_guard&) = delete;
  ~preemption_guard() {
    ::sigaction(SIGTERM, &previous_term_, nullptr);
    ::sigaction(SIGINT, &previous_int_, nullptr);
    detail::preemption_guards.store(0);
  }

  /// The signal received (SIGTERM or SIGINT), or 0. Cheap: reads a flag.
  [[nodiscard]] int signal() const noexcept { return detail::preemption_signal; }
  /// Whether this process was asked to stop.
  [[nodiscard]] bool requested() const noexcept { return signal() != 0; }

  /// Whether any rank of `ranks` was asked to stop: the same answer on every rank, so every rank stops at the
  /// same step. Every rank calls it at the same steps (a collective: a max all-reduce of one value, waited for
  /// on `s`). Without a communicator, or with one rank, it is requested().
  [[nodiscard]] bool requested(std::optional<communicator_ref> ranks, stream_ref s) const {
    if (!ranks || ranks->size() < 2) return requested();
    auto flag = to_device(std::vector<float>{requested() ? 1.0f : 0.0f}, s);
    ranks->all_reduce(flag.span(), reduce_op::max, s);
    ranks->synchronize(s);
    return to_vector(device_span<const float>(flag.span()), s)[0] != 0.0f;
  }

 private:
  struct sigaction previous_term_ {};
  struct sigaction previous_int_ {};
};

LOCKSTEP_ABI_END
