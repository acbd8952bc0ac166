// bench/bench_mpi_allreduce.cpp — the MPI side of bench_collectives' comparison: an all-reduce between the
// processes of an mpirun job, timed in the processes themselves.
//
//   mpirun -np 2 --allow-run-as-root --oversubscribe bench_mpi_allreduce <bytes> <min_seconds> [mpi|lockstep]
//
//   mpi       MPI_Allreduce(send, recv, bytes / 4, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD), out of place, blocking
//   lockstep  lockstep's MPI backend (comm/mpi.hpp): all_reduce of a device_buffer<float> on host:0 of each
//             process, out of place, followed by comm.synchronize (as bench_collectives times a host clique)
//
// After a warm-up, the all-reduce runs in batches of doubling size until one batch takes at least
// `min_seconds` on the slowest process (the batch time is the maximum over the processes, so every process
// takes the same decision). Rank 0 prints one line that bench_collectives parses:
//
//   bench_mpi_allreduce: mode=mpi procs=2 bytes=16777216 iterations=64 seconds_per_iteration=0.00123
//
// Exit status: 0 on success, 1 on a failure (printed), 2 for bad arguments.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/comm/mpi.hpp"  // <mpi.h>, without OpenMPI's C++ bindings
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/stream.hpp"

#if !defined(LOCKSTEP_WITH_MPI) || !LOCKSTEP_WITH_MPI
#error "bench_mpi_allreduce is built with lockstep::mpi (LOCKSTEP_WITH_MPI=1)"
#endif

namespace {

namespace ls = lockstep;

int usage() {
  std::fprintf(stderr, "usage: mpirun -np N bench_mpi_allreduce <bytes> <min_seconds> [mpi|lockstep]\n");
  return 2;
}

double max_over_ranks(double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

/// Calls one_iteration() in batches until a batch lasts min_seconds on the slowest rank; seconds per iteration
/// of that batch, and the batch size.
template <class F>
std::pair<double, long> time_batches(double min_seconds, F&& one_iteration) {
  for (int i = 0; i < 3; ++i) one_iteration();  // warm-up: page faults, MPI's connection setup
  long iterations = 1;
  while (true) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < iterations; ++i) one_iteration();
    const double local = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double elapsed = max_over_ranks(local);
    if ((elapsed >= min_seconds && iterations >= 3) || iterations >= (1L << 24)) {
      return {elapsed / static_cast<double>(iterations), iterations};
    }
    // Aim a little past min_seconds, growing at most 10x per batch.
    const double wanted =
        elapsed > 0 ? 1.2 * min_seconds / elapsed * static_cast<double>(iterations) : 10.0 * iterations;
    iterations = std::max(iterations + 1, std::min(10 * iterations, static_cast<long>(wanted) + 1));
    iterations = std::max(iterations, 3L);
  }
}

int run(int argc, char** argv) {
  if (argc < 3 || argc > 4) return usage();
  char* end = nullptr;
  const unsigned long long bytes = std::strtoull(argv[1], &end, 10);
  if (end == argv[1] || *end != '\0' || bytes < sizeof(float) || bytes > (1ULL << 34)) return usage();
  const double min_seconds = std::strtod(argv[2], &end);
  if (end == argv[2] || *end != '\0' || !(min_seconds >= 0)) return usage();
  const std::string mode = argc == 4 ? argv[3] : "mpi";
  if (mode != "mpi" && mode != "lockstep") return usage();
  const auto count = static_cast<std::size_t>(bytes / sizeof(float));
  const int int_count = static_cast<int>(count);

  std::pair<double, long> timing;
  int rank = 0, procs = 0;
  if (mode == "mpi") {
    // Plain MPI, as an application that uses MPI alone would initialize it.
    int provided = 0;
    if (MPI_Init_thread(&argc, &argv, MPI_THREAD_SINGLE, &provided) != MPI_SUCCESS) {
      std::fprintf(stderr, "bench_mpi_allreduce: MPI_Init_thread failed\n");
      return 1;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &procs);
    std::vector<float> send(count, 1.0f), recv(count, 0.0f);  // written: no untouched (zero-page) memory
    int status = MPI_SUCCESS;
    timing = time_batches(min_seconds, [&] {
      const int rc = MPI_Allreduce(send.data(), recv.data(), int_count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      if (rc != MPI_SUCCESS) status = rc;
    });
    if (status != MPI_SUCCESS) {
      std::fprintf(stderr, "bench_mpi_allreduce: MPI_Allreduce failed with error %d on rank %d\n", status, rank);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (rank == 0 && recv[0] != static_cast<float>(procs)) {
      std::fprintf(stderr, "bench_mpi_allreduce: wrong result %g, expected %d\n", static_cast<double>(recv[0]), procs);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Finalize();
  } else {
    ls::mpi_session session(&argc, &argv);  // MPI_THREAD_MULTIPLE, as lockstep's MPI backend needs
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &procs);
    const ls::device host0{ls::device_kind::host, 0};
    std::optional<ls::stream> s;
    s.emplace(host0);
    {
      ls::communicator comm = ls::make_mpi_communicator(host0);
      ls::device_buffer<float> send(count, *s), recv(count, *s);
      ls::fill(send.span(), 1.0f, *s);
      ls::fill(recv.span(), 0.0f, *s);
      comm.synchronize(*s);
      timing = time_batches(min_seconds, [&] {
        comm.all_reduce(ls::device_span<const float>(send.span()), recv.span(), ls::reduce_op::sum, *s);
        comm.synchronize(*s);
      });
      const auto first = ls::to_vector(ls::device_span<const float>(recv.span()).first(1), *s);
      if (rank == 0 && first[0] != static_cast<float>(procs)) {
        std::fprintf(stderr, "bench_mpi_allreduce: wrong result %g, expected %d\n", static_cast<double>(first[0]),
                     procs);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
    }
    s.reset();
  }
  if (rank == 0) {
    std::printf("bench_mpi_allreduce: mode=%s procs=%d bytes=%llu iterations=%ld seconds_per_iteration=%.9g\n",
                mode.c_str(), procs, static_cast<unsigned long long>(count * sizeof(float)), timing.second,
                timing.first);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_mpi_allreduce: %s\n", e.what());
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}
