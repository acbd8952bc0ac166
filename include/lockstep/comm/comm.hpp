// lockstep/comm/comm.hpp — the communication layer in one include: the communicator, the host clique,
// run_on_devices, and, when the configuration has them, NCCL (translation units compiled by nvcc) and MPI
// (programs linked with lockstep::mpi, LOCKSTEP_WITH_MPI=1).
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/host_clique.hpp"
#include "lockstep/comm/run_on_devices.hpp"
#include "lockstep/config.hpp"

#if defined(LOCKSTEP_WITH_MPI) && LOCKSTEP_WITH_MPI
#include "lockstep/comm/mpi.hpp"
#include "lockstep/comm/processes.hpp"
#endif

#if LOCKSTEP_HAS_CUDA
#include "lockstep/comm/nccl.hpp"
#endif
