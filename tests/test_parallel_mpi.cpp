// distributed_data_parallel across processes: under `mpirun -np N` (N = 2, 3), every rank trains the sample's
// small MLP on its chunk of the same global batch for 20 steps, through an MPI communicator on its own host:0,
// and must end with the parameters of single-device training on the whole batch (computed by every rank for
// itself) within 1e-5 relative, and with exactly rank 0's parameters. Batches 64, 130 (uneven chunks) and 3
// (fewer rows than ranks when N = 3 or more: a rank without rows still joins every all-reduce). In deterministic
// mode (chunks of 16 or 1 rows) the parameters must be bit-identical to single-device training. ZeRO-1 and
// ZeRO-2 (f32 SGD, f16 and bf16 AdamW) must stay within 1e-6 of plain DDP; with micro-batches under no_sync
// (f32 AdamW) ZeRO-2, which reduces every micro-batch, within 1e-5.
//
//   mpirun -np 2 --allow-run-as-root --oversubscribe ./test_parallel_mpi
//
// Exit status 0 on every rank when every check passed on every rank.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <utility>
#include <vector>

#include "lockstep/comm/comm.hpp"
#include "parallel_common.hpp"

#if !defined(LOCKSTEP_WITH_MPI) || !LOCKSTEP_WITH_MPI
#error "test_parallel_mpi is built with lockstep::mpi (LOCKSTEP_WITH_MPI=1)"
#endif

int main(int argc, char** argv) {
  using namespace parallel_test;
  lockstep::mpi_session session(&argc, &argv);
  int failed = 0;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    const lockstep::device host0{lockstep::device_kind::host, 0};
    lockstep::communicator comm = lockstep::make_mpi_communicator(host0);
    lockstep::stream compute(host0), comm_stream(host0);
    for (const std::int64_t batch : {std::int64_t{64}, std::int64_t{130}, std::int64_t{3}}) {
      const auto reference = train_single(host0, batch);
      lockstep::context ctx(compute);
      auto mine = train_ddp_rank(ctx, comm, comm_stream, batch);
      const double rel = relative_difference(mine, reference);
      // rank 0's parameters, broadcast: every rank must hold exactly the same
      auto theirs = lockstep::to_device(mine, compute);
      comm.broadcast(theirs.span(), 0, compute);
      comm.synchronize(compute);
      const auto rank0 = lockstep::to_vector(lockstep::device_span<const float>(theirs.span()), compute);
      const bool identical =
          rank0.size() == mine.size() && std::memcmp(rank0.data(), mine.data(), mine.size() * sizeof(float)) == 0;
      const bool ok = rel <= 1e-5 && identical;
      std::printf("[rank %d of %d] batch %3lld: max relative difference to single-device training %.3g%s — %s\n", rank,
                  comm.size(), static_cast<long long>(batch), rel,
                  identical ? "" : ", parameters differ from rank 0's", ok ? "ok" : "FAILED");
      if (!ok) failed = 1;
    }
    // deterministic mode: the same bits as one device, whatever the number of processes and however uneven;
    // exact accumulators all-reduced, or (told the global batch) partial gradients gathered where they fit
    for (const auto& [batch, chunk] : {std::pair<std::int64_t, std::int64_t>{64, 16}, {130, 16}, {3, 1}}) {
      const lockstep::deterministic_options det{.chunk_rows = chunk};
      const auto reference = train_single(host0, batch, det);
      for (const global_batch global : {global_batch::not_told, global_batch::told}) {
        lockstep::context ctx(compute);
        bool gathered = false;
        const auto mine = train_ddp_rank(ctx, comm, comm_stream, batch, {}, det, global, &gathered);
        const std::int64_t slots = ((batch + chunk - 1) / chunk + comm.size() - 1) / comm.size();
        // (MPI runs all_reduce_exact: a rank's bucket holds its own slots only)
        const bool expected = global == global_batch::told && slots * 4 <= 16;
        const bool ok = mine == reference && gathered == expected;
        std::printf("[rank %d of %d] batch %3lld, deterministic (chunks of %lld, %s): %s\n", rank, comm.size(),
                    static_cast<long long>(batch), static_cast<long long>(chunk),
                    gathered ? "partial gradients gathered" : "exact sums all-reduced",
                    ok ? "bit-identical to one device — ok" : "FAILED");
        if (!ok) failed = 1;
      }
    }
    // ZeRO-1 and ZeRO-2 against plain DDP on the same processes: within 1e-6 relative (MPI may sum a
    // reduce-scatter in another order than an all-reduce), and the same on every rank
    for (const auto& r : {recipe{}, recipe{.precision = lockstep::dtype::f16, .adamw = true},
                          recipe{.precision = lockstep::dtype::bf16, .adamw = true},
                          recipe{.adamw = true, .micro_batches = 2}}) {
      for (const std::int64_t batch : {std::int64_t{130}, std::int64_t{3}}) {
        const auto ddp = train_recipe_rank(comm, compute, comm_stream, batch, r);
        for (int zero : {1, 2, 3}) {
          recipe z = r;
          z.zero = zero;
          const auto mine = train_recipe_rank(comm, compute, comm_stream, batch, z);
          const double rel = relative_difference(mine.parameters, ddp.parameters);
          // ZeRO-2 reduces every micro-batch and adds the sums: another rounding order than DDP's
          const bool ok = rel <= (zero == 2 && r.micro_batches > 1 ? 1e-5 : 1e-6);
          std::printf("[rank %d of %d] ZeRO-%d, %s, %s, batch %3lld%s: max relative difference to DDP %.3g — %s\n", rank,
                      comm.size(), zero, lockstep::name_of(r.precision).data(), r.adamw ? "AdamW" : "SGD",
                      static_cast<long long>(batch), r.micro_batches > 1 ? ", 2 micro-batches" : "", rel,
                      ok ? "ok" : "FAILED");
          if (!ok) failed = 1;
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] test_parallel_mpi: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  std::fflush(stdout);
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (failed && rank == 0) std::fprintf(stderr, "test_parallel_mpi: a check failed on at least one rank\n");
  return failed;
}
