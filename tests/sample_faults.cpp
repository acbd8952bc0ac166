// mlp_train_faults: mlp_train with failures injected for the failure tests (tests/sample_faults.sh,
// tests/sample_rank_failure.sh, docs/failures.md), through the samples' runner's hooks (sample::run_hooks). The
// sample users copy from has none of this.
#include "../examples/mlp_train/model.hpp"

#include <lockstep/kernels/launch.hpp>
#include <lockstep/runtime/device_buffer.hpp>
#include <lockstep/runtime/memory.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace {

using namespace lockstep;

// LOCKSTEP_FAULT=RANK:STEP:KIND makes rank RANK fail at the start of its step STEP (1-based, or "last"), for the
// failure tests (tests/sample_faults.sh): throw (an exception on the training thread), oom (a real
// out-of-memory error: an allocation larger than the device), comm (an exception on the communication stream,
// where the step's all-reduces then run), kill (SIGKILL), stop (SIGSTOP: a rank that stalls before its step's
// collectives) or stall (SIGSTOP from the communication stream 1 s into the step, when the step's collectives are
// queued and their call records sent: a rank stopped inside a collective; processes only). The rank says so on
// stderr first, with the time, so that the tests can measure how long the others take to end.
class fault_injection {
 public:
  static fault_injection from_environment() {
    fault_injection f;
    const char* text = std::getenv("LOCKSTEP_FAULT");
    if (text == nullptr || *text == '\0') return f;
    const std::string t(text);
    const auto a = t.find(':'), b = a == std::string::npos ? a : t.find(':', a + 1);
    const auto bad = [&] {
      return precondition_error("LOCKSTEP_FAULT='" + t + "' is not RANK:STEP:KIND (e.g. 1:5:throw; STEP a number or "
                                "last; KIND throw, oom, comm, kill, stop or stall)");
    };
    if (b == std::string::npos) throw bad();
    const std::string rank = t.substr(0, a), step = t.substr(a + 1, b - a - 1);
    f.kind_ = t.substr(b + 1);
    if (detail::parse_index(rank.c_str()) < 0) throw bad();
    f.rank_ = detail::parse_index(rank.c_str());
    if (step == "last") {
      f.last_ = true;
    } else if (detail::parse_index(step.c_str()) >= 1) {
      f.step_ = detail::parse_index(step.c_str());
    } else {
      throw bad();
    }
    if (f.kind_ != "throw" && f.kind_ != "oom" && f.kind_ != "comm" && f.kind_ != "kill" && f.kind_ != "stop" &&
        f.kind_ != "stall") {
      throw bad();
    }
    return f;
  }

  /// Throws precondition_error when LOCKSTEP_FAULT names a rank the run does not have (it would never fire), or a
  /// stall in a run of threads (SIGSTOP would stop every rank: nothing would notice).
  void check_rank(int world, bool processes) const {
    if (kind_ == "stall" && !processes) {
      throw precondition_error("LOCKSTEP_FAULT: a stall stops the whole process: inject it under mpirun --mode ddp");
    }
    if (rank_ < world) return;
    throw precondition_error(detail::concat("LOCKSTEP_FAULT names rank ", rank_, ", but this run has ", world,
                                            " rank", world == 1 ? "" : "s", " (0 to ", world - 1, ")"));
  }

  /// At the start of step `step` (1-based) of `last` on rank `rank`: fails as configured, if this is the place.
  void at_step(int rank, std::int64_t step, std::int64_t last, device dev, stream_ref comm_stream) const {
    if (rank != rank_ || step != (last_ ? last : step_)) return;
    const auto now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    std::fprintf(stderr, "mlp_train: rank %d: LOCKSTEP_FAULT: %s at step %lld (t=%.3f)\n", rank, kind_.c_str(),
                 static_cast<long long>(step), now);
    std::fflush(stderr);
    if (kind_ == "throw") throw error("LOCKSTEP_FAULT: an injected failure at step " + std::to_string(step));
    if (kind_ == "oom") {
      const std::uint64_t limit = get_memory_stats(dev).limit;
      device_buffer<std::byte> too_much(static_cast<std::size_t>(limit > 0 ? limit + 1 : std::uint64_t{1} << 60),
                                        comm_stream);
      return;  // not reached: the allocation throws
    }
    if (kind_ == "comm") {
      if (!comm_stream.get_device().is_host()) throw error("LOCKSTEP_FAULT: comm faults are injected on host devices");
      detail::enqueue_host(comm_stream, [] { throw error("LOCKSTEP_FAULT: an injected failure on the communication "
                                                         "stream"); }, "injected fault");
      return;
    }
    if (kind_ == "stall") {
      if (!comm_stream.get_device().is_host()) throw error("LOCKSTEP_FAULT: stall faults are injected on host devices");
      detail::enqueue_host(comm_stream, [] {
        std::this_thread::sleep_for(std::chrono::seconds(1));
        std::raise(SIGSTOP);
      }, "injected stall");
      return;
    }
    std::raise(kind_ == "kill" ? SIGKILL : SIGSTOP);
  }

 private:
  int rank_ = -1;
  std::int64_t step_ = 0;
  bool last_ = false;
  std::string kind_;
};

}  // namespace

int main(int argc, char** argv) {
  sample::run_hooks hooks;
  hooks.usage =
      "\ntest hooks (this is mlp_train_faults, mlp_train for the failure tests):\n"
      "  LOCKSTEP_FAULT              RANK:STEP:KIND: rank RANK fails at the start of step STEP (or \"last\") by\n"
      "                              KIND: throw, oom, comm (an exception where the step's all-reduces run),\n"
      "                              kill (SIGKILL), stop (SIGSTOP) or stall (SIGSTOP inside the step's\n"
      "                              collectives; processes only)\n";
  // read once when DDP's ranks start (as the sample did, on each rank's thread): a malformed value fails the run like
  // any other error
  struct parsed {
    std::once_flag once;
    fault_injection fault;
    std::exception_ptr error;
  };
  auto state = std::make_shared<parsed>();
  hooks.before_training = [state](int world, bool processes) {
    std::call_once(state->once, [&] {
      try {
        state->fault = fault_injection::from_environment();
      } catch (...) {
        state->error = std::current_exception();
      }
    });
    if (state->error) std::rethrow_exception(state->error);
    state->fault.check_rank(world, processes);
  };
  hooks.before_step = [state](int rank, std::int64_t step, std::int64_t last, device dev, stream_ref comm_stream) {
    state->fault.at_step(rank, step, last, dev, comm_stream);
  };
  return sample::run(argc, argv, mlp_sample::recipe(), hooks);
}
