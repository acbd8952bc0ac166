// lockstep/lockstep.hpp — the public surface of lockstep in one include.
//
// Compiled by nvcc, it carries both backends (GPUs and host devices); compiled by a plain C++ compiler, the
// host backend alone. Multi-process support (comm/mpi.hpp) comes with it when the program links lockstep::mpi
// (LOCKSTEP_WITH_MPI=1).
#pragma once

#include "lockstep/config.hpp"

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/random.hpp"
#include "lockstep/core/shape.hpp"
#include "lockstep/core/units.hpp"

#include "lockstep/device/device.hpp"
#include "lockstep/device/device_guard.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/device/host_platform.hpp"
#include "lockstep/device/query.hpp"
#include "lockstep/device/visibility.hpp"

#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/memory.hpp"
#include "lockstep/runtime/pinned_buffer.hpp"
#include "lockstep/runtime/stream.hpp"
#include "lockstep/runtime/tensor.hpp"

#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/kernels/multi_tensor.hpp"
#include "lockstep/kernels/reduce.hpp"

#include "lockstep/blas/blas_handle.hpp"
#include "lockstep/blas/gemm.hpp"

#include "lockstep/nn/activation.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/conv2d.hpp"
#include "lockstep/nn/deterministic.hpp"
#include "lockstep/nn/dropout.hpp"
#include "lockstep/nn/flatten.hpp"
#include "lockstep/nn/gradient_check.hpp"
#include "lockstep/nn/graph.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/nn/layer_norm.hpp"
#include "lockstep/nn/linear.hpp"
#include "lockstep/nn/loss.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/nn/pool.hpp"
#include "lockstep/nn/sequential.hpp"
#include "lockstep/nn/state_dict.hpp"
#include "lockstep/nn/summary.hpp"

#include "lockstep/optim/adamw.hpp"
#include "lockstep/optim/clip.hpp"
#include "lockstep/optim/lr_schedule.hpp"
#include "lockstep/optim/sgd.hpp"

#include "lockstep/data/data_loader.hpp"
#include "lockstep/data/dataset.hpp"
#include "lockstep/data/idx.hpp"
#include "lockstep/data/sampler.hpp"

#include "lockstep/comm/coalesced.hpp"
#include "lockstep/comm/comm.hpp"

#include "lockstep/amp/loss_scaler.hpp"
#include "lockstep/amp/precision.hpp"

#include "lockstep/io/checkpoint.hpp"
#include "lockstep/io/json.hpp"
#include "lockstep/io/preemption.hpp"
#include "lockstep/io/safetensors.hpp"
#include "lockstep/io/sha256.hpp"

#include "lockstep/parallel/data_parallel.hpp"
#include "lockstep/parallel/distributed_data_parallel.hpp"
#include "lockstep/parallel/host_collectives.hpp"
