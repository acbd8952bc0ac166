// lockstep/parallel/ddp_options.hpp — the options of distributed_data_parallel
// (parallel/distributed_data_parallel.hpp, whose file comment explains them): how gradients are combined and
// travel, what ZeRO shards, the buckets, deterministic mode, buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "lockstep/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/nn/context.hpp"  // deterministic_options
#include "lockstep/parallel/host_collectives.hpp"

LOCKSTEP_ABI_BEGIN

/// How gradients are combined across ranks (see distributed_data_parallel.hpp's file comment).
enum class gradient_reduction : std::uint8_t { sum, mean };

/// The precision gradients travel in. `none` sums in fp32 whatever the gradients' storage type (f16/bf16 in their own
/// type on communicators that sum them in fp32 and round once, in an fp32 bucket on NCCL);
/// `fp16` / `bf16` halve the bytes on the wire: gradients are rounded to that type, all-reduced (sums in fp32,
/// rounded once) and restored into the gradients' own type.
enum class comm_hook : std::uint8_t { none, fp16, bf16 };

/// What ZeRO shards over the ranks, by stage number: `none` (0, plain DDP: every rank holds everything),
/// `optimizer_state` (1: the optimizer state and the fp32 master values), `gradients` (2: those and the
/// gradients), `parameters` (3: those and the values forward reads, gathered whole for the step). See
/// distributed_data_parallel.hpp's file comment.
enum class zero_stage : std::uint8_t { none = 0, optimizer_state = 1, gradients = 2, parameters = 3 };

/// The stage numbered `n` (as DeepSpeed numbers them). Throws precondition_error for another number.
[[nodiscard]] inline zero_stage to_zero_stage(int n) {
  LOCKSTEP_EXPECTS(n >= 0 && n <= 3, "ZeRO stage must be 0 (plain DDP), 1 (optimizer state sharded), 2 "
                   "(gradients too) or 3 (parameters too), got ", n);
  return static_cast<zero_stage>(n);
}

struct ddp_options {
  /// Gradient buckets close past bucket_bytes (the first one past first_bucket_bytes, so that communication starts
  /// early). ZeRO-3 on a graph or sequential, gathered layer by layer, never splits a layer and closes a bucket at the
  /// first layer's end past first_bucket_bytes: a layer, or a few small ones, is gathered at a time.
  std::size_t bucket_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  gradient_reduction reduction = gradient_reduction::sum;
  comm_hook hook = comm_hook::none;
  /// Deterministic mode (nn/deterministic.hpp), set on the context by the constructor; without it the wrapper
  /// follows the context's own setting. The buckets then hold exact accumulators, all-reduced as i64 sums.
  std::optional<deterministic_options> deterministic = std::nullopt;
  /// What ZeRO shards (see distributed_data_parallel.hpp's file comment).
  zero_stage zero = zero_stage::none;
  /// Before each forward outside no_sync(), rank 0's buffers (batch norm's running statistics) to every rank, as
  /// PyTorch's broadcast_buffers: every replica normalizes evaluation batches alike and checkpoints (written by rank
  /// 0) hold what every rank uses. Off: each rank keeps its own.
  bool broadcast_buffers = true;
  /// Under ZeRO, the device memory through which visit_whole_state and visit_master_values (checkpoints,
  /// weights_sha256) gather whole tensors: every rank's part of one chunk of a bucket (at least a float per rank);
  /// and the chunks in which the constructor streams rank 0's initial values of a model built under
  /// deferred_master_values into the shards. Smaller: less memory, more collectives.
  std::size_t visit_chunk_bytes = std::size_t{4} << 20;
  /// On host devices, the stream the collectives run on (see host_collective_stream; ignored on GPUs).
  host_collective_stream host_collectives = host_collective_stream::automatic;
};

LOCKSTEP_ABI_END
