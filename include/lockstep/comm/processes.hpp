// lockstep/comm/processes.hpp — one rank per process (mpirun): this process's device and its communicator, chosen
// by the kind of device in one place, so that the same program runs on host devices and on GPUs.
//
//   lockstep::mpi_session session(&argc, &argv);
//   const lockstep::device dev = lockstep::process_device();                 // cuda:(local_rank % GPUs), else host:0
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

/// The device of this process in a job of one rank per process: GPU local_rank() when default_devices() finds
/// GPUs, else host:0 (each process has its own host devices). Choose the job's GPUs with CUDA_VISIBLE_DEVICES.
/// Throws device_error when a node runs more processes than it has GPUs: NCCL refuses one GPU as two ranks of a
/// communicator ("Duplicate GPU detected"), so processes cannot share them.
inline device process_device() {
  const device_selection selection = default_devices();
  if (selection.devices.kind() != device_kind::cuda) return device{device_kind::host, 0};
  const int gpus = static_cast<int>(selection.devices.size());
  const int here = local_size();
  if (here > gpus) {
    throw device_error(detail::concat("process_device(): ", here, " processes of this job run on this node but ", gpus,
                                      " GPU", gpus == 1 ? " is" : "s are", " visible (", selection.devices.str(),
                                      "): NCCL cannot use one GPU as two ranks; start at most ", gpus,
                                      " processes per node (mpirun -np ", gpus, "), or make more GPUs visible"));
  }
  return selection.devices[static_cast<std::size_t>(local_rank())];
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
