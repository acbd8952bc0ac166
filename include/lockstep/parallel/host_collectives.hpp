// lockstep/parallel/host_collectives.hpp — which stream runs the collectives of a data-parallel rank on a host
// device: its communication stream (overlapping the rest of backward, as on a GPU) or its compute stream.
//
// A host device computes on the CPU's cores: its compute stream's worker keeps one core busy, and a second worker
// per rank for the collectives helps only where a core is free for it. On a machine with fewer cores than that the
// two workers of a rank take turns on one core, and every collective costs a thread hand-off each way; running
// the collectives on the compute stream, in order with the kernels, saves those. The collectives, their order and
// their results are the same either way.
#pragma once

#include <cstdint>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/config.hpp"
#include "lockstep/device/host_platform.hpp"
#include "lockstep/runtime/stream.hpp"

LOCKSTEP_ABI_BEGIN

/// Where a rank on a host device runs its collectives. (A GPU's run on the communication stream, always: its
/// collectives run on the GPU's own units beside the compute stream's kernels, not on the CPU's cores.) The
/// collectives and their results are the same either way; what changes is which worker thread runs them.
enum class host_collective_stream : std::uint8_t {
  /// On the compute stream when the cores this process may run on are fewer than two per rank sharing them (every
  /// rank's compute stream keeps a core busy, so a second worker thread per rank only takes turns with it and adds
  /// a thread hand-off to every collective; see detail::collectives_on_compute), else on the communication stream.
  /// Strict host devices (LOCKSTEP_HOST_STRICT=1) imitate GPUs and always use the communication stream, so that
  /// tests see the two streams' ordering.
  automatic,
  /// On the communication stream given to the wrapper: collectives overlap the rest of backward on cores the
  /// compute streams do not use.
  communication_stream,
  /// On the rank's compute stream, in order with its kernels: no overlap, no hand-off.
  compute_stream,
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

/// host_collective_stream::automatic's rule: true (the compute stream) when the `mask` cores this process may run
/// on are fewer than two per rank that shares them. A process whose affinity mask covers all the machine's `online`
/// cores shares them with every rank on the machine; one bound to fewer (mpirun binds each process to cores,
/// taskset) shares its own only with the ranks in the process.
[[nodiscard]] constexpr bool collectives_on_compute(int mask, int online, int ranks_in_process,
                                                    int ranks_on_machine) noexcept {
  return mask < 2 * (mask < online ? ranks_in_process : ranks_on_machine);
}

/// The stream a rank on `compute`'s device runs its collectives on, given `where` and the communication stream
/// `comm_stream`: on a GPU always `comm_stream`; on a host device as host_collective_stream says.
inline stream_ref collective_stream(host_collective_stream where, stream_ref compute, communicator_ref comm,
                                    stream_ref comm_stream) {
  if (!compute.get_device().is_host()) return comm_stream;
  switch (where) {
    case host_collective_stream::communication_stream: return comm_stream;
    case host_collective_stream::compute_stream: return compute;
    case host_collective_stream::automatic: break;
  }
  if (host_platform_configuration().strictness == host_strictness::strict) return comm_stream;
  return collectives_on_compute(host_cores(), online_cores(), comm.ranks_in_this_process(), comm.ranks_on_this_machine())
             ? compute
             : comm_stream;
}

LOCKSTEP_DETAIL_END
