// One rank per process, chosen by device kind (comm/processes.hpp): under `mpirun -np N` every process takes
// process_device() and make_process_communicator() for it. Compiled by nvcc when the CUDA backend is on, so that on
// a machine with GPUs each process takes GPU local_rank and talks through NCCL (the id sent over MPI); elsewhere
// host:0 and MPI. Either way: all-reduce, all-gather and broadcast of 4 MiB, and a GPU refused clearly where there
// is none (or the translation unit has no GPU backend). With fewer GPUs than processes on the node, process_device
// refuses (NCCL cannot use one GPU as two ranks): checked, and nothing more runs then.
//
//   mpirun -np 2 --allow-run-as-root --oversubscribe ./test_processes_mpi
//
// Exit status 0 on every rank when every check passed on every rank.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "lockstep/comm/comm.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/device_buffer.hpp"

#if !defined(LOCKSTEP_WITH_MPI) || !LOCKSTEP_WITH_MPI
#error "test_processes_mpi is built with lockstep::mpi (LOCKSTEP_WITH_MPI=1)"
#endif

namespace {

int failures = 0;
int world_rank = 0;

void check(bool ok, const std::string& what) {
  std::printf("[rank %d] %s — %s\n", world_rank, what.c_str(), ok ? "ok" : "FAILED");
  if (!ok) ++failures;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lockstep;
  mpi_session session(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  int world_size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  // Every rank exits with the same status: non-zero when a check failed on any rank.
  const auto finish = [] {
    int failed = failures > 0 ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return failed;
  };
  try {
    const bool gpus = LOCKSTEP_HAS_CUDA && cuda_available();
    if (gpus && device_count(device_kind::cuda) == 1 && local_size() > 1) {
      // One GPU seen by several processes: each was given its own (CUDA_VISIBLE_DEVICES), or they share one, which
      // NCCL refuses itself. Either way cuda:0; the collectives need a GPU per process.
      check(process_device() == device{device_kind::cuda, 0}, "one visible GPU is cuda:0");
      std::printf("[rank %d] one GPU visible to %d processes: the collectives are not run\n", world_rank, local_size());
      return finish();
    }
    if (gpus && local_size() > device_count(device_kind::cuda)) {
      std::string message;
      try {
        (void)process_device();
      } catch (const device_error& e) {
        message = e.what();
      }
      check(message.find("NCCL cannot use one GPU as two ranks") != std::string::npos,
            "more processes than GPUs on the node are refused: \"" + message + "\"");
      return finish();
    }
    const device dev = process_device();
    const device expected = gpus ? device{device_kind::cuda, local_rank()} : device{device_kind::host, 0};
    check(dev == expected, "process_device() is " + dev.str() + ", expected " + expected.str());

    communicator comm = make_process_communicator(dev);
    check(comm.rank() == world_rank && comm.size() == world_size && comm.get_device() == dev,
          "make_process_communicator(" + dev.str() + ") is rank " + std::to_string(comm.rank()) + " of " +
              std::to_string(comm.size()) + " on " + comm.get_device().str());
    stream s(dev);
    constexpr std::size_t n = std::size_t{1} << 20;  // 4 MiB of f32
    auto values = to_device(std::vector<float>(n, static_cast<float>(world_rank + 1)), s);
    comm.all_reduce(values.span(), reduce_op::sum, s);
    auto mine = to_device(std::vector<float>(n, static_cast<float>(world_rank)), s);
    device_buffer<float> all(n * static_cast<std::size_t>(world_size), s);
    comm.all_gather(mine.data(), all.data(), n, dtype::f32, s);
    auto root = to_device(std::vector<float>(n, world_rank == world_size - 1 ? 7.0f : -1.0f), s);
    comm.broadcast(root.span(), world_size - 1, s);
    comm.synchronize(s);
    const float sum = static_cast<float>(world_size * (world_size + 1) / 2);
    check(to_vector(device_span<const float>(values.span()), s) == std::vector<float>(n, sum),
          "all_reduce of 4 MiB gives " + std::to_string(sum) + " everywhere");
    const auto gathered = to_vector(device_span<const float>(all.span()), s);
    bool in_order = true;
    for (std::size_t i = 0; i < gathered.size(); ++i) in_order = in_order && gathered[i] == static_cast<float>(i / n);
    check(in_order, "all_gather of 4 MiB per rank puts rank k's block at k");
    check(to_vector(device_span<const float>(root.span()), s) == std::vector<float>(n, 7.0f),
          "broadcast of 4 MiB from the last rank");

    if (!gpus) {  // a GPU where there is none, or where this program has no GPU backend: refused, naming why
      std::string message;
      try {
        (void)make_process_communicator(device{device_kind::cuda, 0});
      } catch (const device_error& e) {
        message = e.what();
      }
      const std::string why = LOCKSTEP_HAS_CUDA ? "cuda:0" : "compiled without nvcc and has no GPU backend";
      check(message.find(why) != std::string::npos, "a GPU without one is refused: \"" + message + "\"");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] test_processes_mpi: %s\n", world_rank, e.what());
    abort_mpi_job("test_processes_mpi", e);
    return 1;
  }
  return finish();
}
