// A fault-injection driver for comm/mpi.hpp, run by CTest under mpirun (see comm_fault_check.cmake):
//
//   LOCKSTEP_COMM_TIMEOUT=3 mpirun -np 2 --allow-run-as-root --oversubscribe ./comm_fault_mpi throw|hang
//
// Every rank all-reduces a buffer for 5 steps. At step 2 rank 1 either throws (and exits through MPI_Abort
// after telling the others through comm.abort), or hangs: it sleeps forever without joining the collective.
// The job must end within the timeout plus a margin, with a non-zero exit status, and print the error:
// "throw": rank 1's own message; "hang": rank 0's timeout_error naming rank 1.
//
// This is what a program should do when a collective fails: report, abort the communicator (so the other
// processes fail fast), and end the job with MPI_Abort, because MPI_Finalize may wait for a stuck process.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/comm.hpp"
#include "lockstep/runtime/copy.hpp"

#if !defined(LOCKSTEP_WITH_MPI) || !LOCKSTEP_WITH_MPI
#error "comm_fault_mpi is built with lockstep::mpi (LOCKSTEP_WITH_MPI=1)"
#endif

namespace {

/// The message of an exception and of the exceptions nested in it.
std::string describe(const std::exception& e) {
  std::string msg = e.what();
  try {
    std::rethrow_if_nested(e);
  } catch (const std::exception& inner) {
    msg += "\n  caused by: " + describe(inner);
  } catch (...) {
    msg += "\n  caused by: an unknown exception";
  }
  return msg;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "throw" && mode != "hang") {
    std::fprintf(stderr, "usage: comm_fault_mpi throw|hang (under mpirun -np 2 or more)\n");
    return 2;
  }
  lockstep::mpi_session session(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const lockstep::device host0{lockstep::device_kind::host, 0};
  std::optional<lockstep::communicator> comm;
  try {
    comm = lockstep::make_mpi_communicator(host0);  // timeout from LOCKSTEP_COMM_TIMEOUT
    lockstep::stream s(host0);
    auto grads = lockstep::to_device(std::vector<float>(1 << 16, static_cast<float>(rank + 1)), s);
    for (int step = 0; step < 5; ++step) {
      if (rank == 1 && step == 2) {
        if (mode == "throw") throw lockstep::numeric_error("rank 1: injected failure at step 2 (loss is NaN)");
        std::fprintf(stderr, "comm_fault_mpi rank 1: hanging at step 2 without joining the collective\n");
        std::fflush(stderr);
        for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
      }
      comm->all_reduce(grads.span(), lockstep::reduce_op::mean, s);
      comm->synchronize(s);
    }
    std::printf("comm_fault_mpi rank %d: all steps done\n", rank);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_fault_mpi rank %d failed: %s\n", rank, describe(e).c_str());
    std::fflush(stderr);
    if (comm) comm->abort(e.what());                              // the other ranks fail fast instead of timing out
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // let them report before the job ends
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  return 3;
}
