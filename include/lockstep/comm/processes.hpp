// lockstep/comm/processes.hpp — one rank per process (mpirun): this process's device and its communicator, chosen
// by the kind of device in one place, so that the same program runs on host devices and on GPUs.
//
//   lockstep::mpi_session session(&argc, &argv);
//   const lockstep::device dev = lockstep::process_device();                 // cuda:local_rank, else host:0
//   lockstep::communicator comm = lockstep::make_process_communicator(dev);  // NCCL on a GPU, MPI on a host device
//
// Needs lockstep::mpi (LOCKSTEP_WITH_MPI); NCCL needs the translation unit compiled by nvcc (lockstep_use_cuda_for).
#pragma once

#include "lockstep/config.hpp"

#if defined(LOCKSTEP_WITH_MPI) && LOCKSTEP_WITH_MPI

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/mpi.hpp"
#include "lockstep/device/device_set.hpp"

#if LOCKSTEP_HAS_CUDA
#include "lockstep/comm/nccl.hpp"
#endif

LOCKSTEP_ABI_BEGIN

/// The device of this process in a job of one rank per process: when default_devices() finds GPUs, cuda:0 if the
/// process sees one GPU (each process given its own through CUDA_VISIBLE_DEVICES, as Slurm's --gpus-per-task does),
/// else GPU local_rank(); without GPUs host:0 (each process has its own host devices). Every process of the job
/// calls it: without a launcher's variables, local_rank() and local_size() are collective over MPI_COMM_WORLD.
/// Throws device_error when a node runs more processes than the GPUs they all see: NCCL refuses one GPU as two
/// ranks of a communicator ("Duplicate GPU detected"), so processes cannot share them.
inline device process_device() {
  const device_selection selection = default_devices();
  if (selection.devices.kind() != device_kind::cuda) return device{device_kind::host, 0};
  const int gpus = static_cast<int>(selection.devices.size());
  if (gpus == 1) return selection.devices[0];
  const int here = local_size();
  const int rank = local_rank();
  if (here > gpus || rank >= gpus) {
    throw device_error(detail::concat("process_device(): ", here, " processes of this job run on this node (this one is "
                                      "local rank ", rank, ") but ", gpus, " GPUs are visible (",
                                      selection.devices.str(), "): NCCL cannot use one GPU as two ranks; start at "
                                      "most ", gpus, " processes per node (mpirun -np ", gpus,
                                      "), or give each process its own GPU (CUDA_VISIBLE_DEVICES)"));
  }
  return selection.devices[static_cast<std::size_t>(rank)];
}

/// This process's communicator over the processes of `comm`, for its device `local`: make_nccl_communicator for a
/// GPU (rank 0's NCCL id sent over MPI), make_mpi_communicator for a host device. Every process of `comm` calls it,
/// with devices of one kind. Throws device_error for a GPU in a translation unit compiled without nvcc, and what
/// the two factories throw.
inline communicator make_process_communicator(device local, MPI_Comm comm = MPI_COMM_WORLD, comm_options options = {}) {
  if (local.is_host()) return make_mpi_communicator(local, comm, options);
#if LOCKSTEP_HAS_CUDA
  return make_nccl_communicator(local, comm, options);
#else
  (void)comm, (void)options;
  throw device_error(detail::concat("make_process_communicator(", local.str(),
                                    "): this translation unit was compiled without nvcc and has no GPU backend; "
                                    "compile it with nvcc (lockstep_use_cuda_for in CMake) to communicate between "
                                    "GPUs, or use a host device"));
#endif
}

LOCKSTEP_ABI_END

#endif  // LOCKSTEP_WITH_MPI
