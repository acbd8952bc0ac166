// lockstep/comm/communicator.hpp — the communicator: one rank's endpoint of a group of devices that run
// collectives together.
//
// `communicator` owns one rank's endpoint and `communicator_ref` views one (the pair of STYLE.md; APIs take the
// view by value). Three backends implement it:
//
//   make_host_clique   (comm/host_clique.hpp)  host devices of one process, exchanging through shared memory
//   make_mpi_communicator (comm/mpi.hpp)       one host device per process, through MPI
//   make_nccl_clique / make_nccl_communicator (comm/nccl.hpp)  GPUs, through NCCL
//
// Every collective is stream-ordered, as in NCCL: it is queued on a stream `s` of the rank's device, waits for
// the work queued on `s` before it, and returns before any data moves. Work queued on `s` after it sees the
// result. Counts are in elements of a dtype. Every rank of the group must issue the same collectives in the
// same order with the same count, dtype, op and root.
//
// A collective never hangs: when a peer does not join within `comm_options::timeout` it fails with a
// timeout_error naming the collective, its sequence number, the rank and the ranks that did not arrive. As
// with any work queued on a stream, the failure surfaces at the next synchronization: `s.synchronize()` on a
// host stream rethrows it as async_error with the collective's own error nested; `comm.synchronize(s)`
// (which also never hangs on a GPU stream) is the portable way to wait.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "lockstep/config.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/unique_handle.hpp"
#include "lockstep/device/device.hpp"
#include "lockstep/kernels/exact.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/stream.hpp"

namespace lockstep {

/// How a reduction combines the ranks' elements. Reductions of f16/bf16 are computed in f32 and rounded once;
/// i64 reductions (sum, max) are exact integer arithmetic (deterministic mode all-reduces exact sums).
/// `mean` is the f32 sum divided by the number of ranks (NCCL's ncclAvg). On host cliques `max` of a NaN is
/// NaN; MPI and NCCL follow their own NaN rules for `max`.
enum class reduce_op : std::uint8_t { sum, mean, max };

/// "sum", "mean", "max".
constexpr std::string_view name_of(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum:
      return "sum";
    case reduce_op::mean:
      return "mean";
    case reduce_op::max:
      return "max";
  }
  return "?";
}

/// The collectives a communicator runs.
/// (all_reduce_exact comes last: MPI's call records carry the number, which the older kinds keep.)
enum class collective_kind : std::uint8_t {
  all_reduce,
  broadcast,
  reduce,
  all_gather,
  reduce_scatter,
  barrier,
  all_reduce_exact,
};

/// "all_reduce", "broadcast", ...
constexpr std::string_view name_of(collective_kind k) noexcept {
  switch (k) {
    case collective_kind::all_reduce:
      return "all_reduce";
    case collective_kind::broadcast:
      return "broadcast";
    case collective_kind::reduce:
      return "reduce";
    case collective_kind::all_gather:
      return "all_gather";
    case collective_kind::reduce_scatter:
      return "reduce_scatter";
    case collective_kind::barrier:
      return "barrier";
    case collective_kind::all_reduce_exact:
      return "all_reduce_exact";
  }
  return "?";
}

namespace detail {

/// Formats a timeout the way people say it: "5 s", "1.5 s", "300 ms".
inline std::string format_duration(std::chrono::milliseconds d) {
  const auto ms = d.count();
  if (ms % 1000 == 0) return concat(ms / 1000, " s");
  if (ms > 1000) return concat(static_cast<double>(ms) / 1000.0, " s");
  return concat(ms, " ms");
}

/// LOCKSTEP_COMM_TIMEOUT in seconds ("300", "0.5"), or 300 s when unset. Throws precondition_error naming the
/// variable when it is not a positive number.
inline std::chrono::milliseconds comm_timeout_from_environment() {
  const char* text = std::getenv("LOCKSTEP_COMM_TIMEOUT");
  if (text == nullptr || *text == '\0') return std::chrono::seconds(300);
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(seconds > 0.0) || seconds > 1e7) {
    throw precondition_error(concat("LOCKSTEP_COMM_TIMEOUT='", text,
                                    "' is not a timeout: expected a positive number of seconds, e.g. 300 or 0.5"));
  }
  const auto ms = static_cast<std::int64_t>(seconds * 1000.0 + 0.5);
  return std::chrono::milliseconds(ms < 1 ? 1 : ms);
}

/// LOCKSTEP_COMM_CHECK: "1" (the default) or "0"; anything else throws precondition_error naming the variable.
inline bool comm_check_from_environment() {
  const char* text = std::getenv("LOCKSTEP_COMM_CHECK");
  if (text == nullptr || *text == '\0' || std::string_view(text) == "1") return true;
  if (std::string_view(text) == "0") return false;
  throw precondition_error(concat("LOCKSTEP_COMM_CHECK='", text, "' is not 0 or 1 (1, the default, checks that all ",
                                  "ranks issue the same collectives)"));
}

/// One collective as a rank called it. `send`/`recv` are the rank's own buffers.
struct collective_call {
  collective_kind kind = collective_kind::barrier;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;  // all_gather: elements sent per rank; reduce_scatter: elements received per rank
  dtype type = dtype::f32;
  reduce_op op = reduce_op::sum;
  int root = 0;
  // all_reduce_exact: the terms per rank (the same on every rank), this rank's distance between its terms, and
  // the ends of the tensors packed in [0, count) (none: one tensor)
  std::size_t terms = 0;
  std::size_t stride = 0;
  const std::size_t* ends = nullptr;
  std::size_t tensors = 0;

  [[nodiscard]] bool is_reduction() const noexcept {
    return kind == collective_kind::all_reduce || kind == collective_kind::reduce ||
           kind == collective_kind::reduce_scatter;
  }
  [[nodiscard]] bool has_root() const noexcept {
    return kind == collective_kind::broadcast || kind == collective_kind::reduce;
  }

  /// "all_reduce(count 1000, f32, sum)", "broadcast(count 4, i32, root 1)", "barrier()".
  [[nodiscard]] std::string signature() const {
    if (kind == collective_kind::barrier) return "barrier()";
    std::string s = concat(name_of(kind), "(count ", count, ", ", name_of(type));
    if (is_reduction()) s += concat(", ", name_of(op));
    if (has_root()) s += concat(", root ", root);
    if (kind == collective_kind::all_reduce_exact) s += concat(", terms ", terms, tensors > 1 ? concat(", tensors ", tensors) : "");
    return s + ')';
  }

  /// What differs between two calls of the same sequence number ("count 10 vs 11"); empty when they match.
  [[nodiscard]] std::string difference(const collective_call& other) const {
    if (kind != other.kind) return concat("collective ", name_of(kind), " vs ", name_of(other.kind));
    if (kind == collective_kind::barrier) return {};
    if (count != other.count) return concat("count ", count, " vs ", other.count);
    if (type != other.type) return concat("dtype ", name_of(type), " vs ", name_of(other.type));
    if (is_reduction() && op != other.op) return concat("op ", name_of(op), " vs ", name_of(other.op));
    if (has_root() && root != other.root) return concat("root ", root, " vs ", other.root);
    if (kind == collective_kind::all_reduce_exact && terms != other.terms) {
      return concat("terms ", terms, " vs ", other.terms);
    }
    if (kind == collective_kind::all_reduce_exact && std::max<std::size_t>(tensors, 1) != std::max<std::size_t>(other.tensors, 1)) {
      return concat("tensors ", std::max<std::size_t>(tensors, 1), " vs ", std::max<std::size_t>(other.tensors, 1));
    }
    return {};
  }
};

/// "rank 1 (host:1)".
inline std::string rank_name(int rank, device d) { return concat("rank ", rank, " (", d.str(), ')'); }

}  // namespace detail

/// Options of a communicator.
struct comm_options {
  /// How long a collective waits for the other ranks before failing with timeout_error. Defaults to
  /// LOCKSTEP_COMM_TIMEOUT (seconds) or 300 s. Must exceed the longest time one rank may run ahead of another.
  std::chrono::milliseconds timeout = detail::comm_timeout_from_environment();
  /// Whether every collective first checks that all ranks issue the same call (kind, count, dtype, op, root,
  /// sequence number), failing on every rank with both calls named when they differ. Host cliques always check
  /// (for free, in their rendezvous); MPI communicators exchange a 32-byte record per collective and peer.
  /// Defaults to LOCKSTEP_COMM_CHECK (1 or 0), or 1.
  bool check_calls = detail::comm_check_from_environment();
};

}  // namespace lockstep

LOCKSTEP_DETAIL_BEGIN

/// Where the other ranks of a multi-process communicator are when a collective times out: what a timeout message
/// needs to name a stopped rank, since neither MPI nor NCCL says which peer a started collective waits for. Each
/// rank records the collectives it entered and completed and answers the others' questions while it waits
/// (answer()); the rank whose collective timed out asks (ask()). Implemented over MPI (mpi.hpp: mpi_comm::census)
/// for MPI communicators and for NCCL communicators made over MPI.
class rank_census {
 public:
  rank_census() = default;
  rank_census(const rank_census&) = delete;
  rank_census& operator=(const rank_census&) = delete;
  virtual ~rank_census() = default;
  virtual void entered(std::uint64_t seq) noexcept = 0;
  virtual void completed(std::uint64_t seq) noexcept = 0;
  /// Answers the questions that arrived; never blocks. Call it often while waiting for a collective.
  virtual void answer() noexcept = 0;
  /// Asks every other rank, waits a short while, and says who is missing from collective `seq` ("rank 2 did not
  /// answer within 750 ms ...; ranks 0, 1 are waiting in it"). Stops early when `stop()` becomes true (the
  /// communicator was aborted), saying so with `why()`. Never throws.
  virtual std::string ask(std::uint64_t seq, const std::function<bool()>& stop,
                          const std::function<std::string()>& why) noexcept = 0;
};

/// What a backend implements. The public types check every argument before calling `enqueue`.
class communicator_impl {
 public:
  communicator_impl() = default;
  communicator_impl(const communicator_impl&) = delete;
  communicator_impl& operator=(const communicator_impl&) = delete;
  virtual ~communicator_impl() = default;

  [[nodiscard]] virtual int rank() const noexcept = 0;
  [[nodiscard]] virtual int size() const noexcept = 0;
  [[nodiscard]] virtual device get_device() const noexcept = 0;
  /// Throws precondition_error when `c` exceeds a limit of this backend (MPI's int counts); the checks common to
  /// every backend are done already.
  virtual void check_limits(const collective_call& c) const { (void)c; }
  /// Whether this backend runs collectives of kind `k` (all_reduce_exact: host cliques and MPI).
  [[nodiscard]] virtual bool supports(collective_kind k) const noexcept { return k != collective_kind::all_reduce_exact; }
  /// Whether f16/bf16 reductions are computed in f32 and rounded once (host cliques, MPI); NCCL adds in the type.
  [[nodiscard]] virtual bool reduces_in_f32() const noexcept { return true; }
  /// How many ranks of the group run on this machine, this one included (host cliques: all of them, in this
  /// process; MPI: the launcher's count of the job's processes on this node, at most size()).
  [[nodiscard]] virtual int ranks_on_this_machine() const noexcept { return size(); }
  /// How many ranks of the group run in this process, this one included (host cliques: all; MPI: one).
  [[nodiscard]] virtual int ranks_in_this_process() const noexcept { return size(); }
  /// Queues `c` on `s` (a stream of get_device()); arguments are already checked.
  virtual void enqueue(const collective_call& c, stream_ref s) = 0;
  /// Fails every pending and future collective of the group with `reason`. Never throws.
  virtual void abort(const std::string& reason) noexcept = 0;
  /// Waits for the work queued on `s` without ever hanging on a collective.
  virtual void synchronize(stream_ref s) { s.synchronize(); }
  /// Throws when the group can no longer run collectives (aborted, timed out, failed). Does not block.
  virtual void rethrow_failure() {}
};

struct communicator_traits {
  using handle_type = communicator_impl*;
  static constexpr handle_type null() noexcept { return nullptr; }
  static bool is_null(handle_type h) noexcept { return h == nullptr; }
  static void release(handle_type h) noexcept { delete h; }
};

/// Checks a collective's arguments NCCL-style (argument, value, valid range) and throws precondition_error.
inline void check_collective(const communicator_impl& comm, const collective_call& c, stream_ref s) {
  const std::string_view what = name_of(c.kind);
  const int rank = comm.rank();
  const int size = comm.size();
  const device dev = comm.get_device();
  LOCKSTEP_EXPECTS(s.get_device() == dev, what, " on ", rank_name(rank, dev), ": the stream belongs to ",
                   s.get_device().str(), ", expected a stream of ", dev.str(),
                   " (collectives are queued on a stream of the communicator's device)");
  if (c.kind == collective_kind::barrier) return;
  LOCKSTEP_EXPECTS(comm.supports(c.kind), what, " on ", rank_name(rank, dev), ": this communicator's backend does not run ",
                   what, " (NCCL communicators do not); ask communicator::supports() first");
  const auto type_index = static_cast<unsigned>(c.type);
  LOCKSTEP_EXPECTS(type_index <= static_cast<unsigned>(dtype::u8), what, " on ", rank_name(rank, dev), ": dtype value ",
                   type_index, " is not a dtype");
  if (c.is_reduction()) {
    LOCKSTEP_EXPECTS(is_floating(c.type) || c.type == dtype::i64, what, " on ", rank_name(rank, dev), ": dtype ",
                     name_of(c.type),
                     " cannot be reduced; valid dtypes for reductions: f32, f16, bf16, and i64 with sum or max "
                     "(broadcast and all_gather also take i32, u8)");
    LOCKSTEP_EXPECTS(static_cast<unsigned>(c.op) <= static_cast<unsigned>(reduce_op::max), what, " on ",
                     rank_name(rank, dev), ": reduce_op value ", static_cast<unsigned>(c.op),
                     " is not an op; valid: sum, mean, max");
    LOCKSTEP_EXPECTS(c.type != dtype::i64 || c.op != reduce_op::mean, what, " on ", rank_name(rank, dev),
                     ": i64 reductions are sum or max (exact integer sums); a mean would round");
  }
  if (c.kind == collective_kind::all_reduce_exact) {
    LOCKSTEP_EXPECTS(is_floating(c.type), what, " on ", rank_name(rank, dev), ": dtype ", name_of(c.type),
                     " is not a float type; valid dtypes: f32, f16, bf16");
    LOCKSTEP_EXPECTS(c.terms >= 1 && c.terms <= static_cast<std::size_t>(kernels::exact_max_terms / size), what, " on ",
                     rank_name(rank, dev), ": terms ", c.terms, " is out of range; valid: 1..",
                     kernels::exact_max_terms / size, " per rank (the exact sums take at most ", kernels::exact_max_terms,
                     " terms)");
    LOCKSTEP_EXPECTS(c.terms == 1 || c.stride >= c.count, what, " on ", rank_name(rank, dev), ": stride ", c.stride,
                     " is smaller than count ", c.count, ": the terms would overlap");
    for (std::size_t i = 0; i < c.tensors; ++i) {
      LOCKSTEP_EXPECTS(c.ends[i] >= (i == 0 ? 0 : c.ends[i - 1]) && (i + 1 < c.tensors || c.ends[i] == c.count), what,
                       " on ", rank_name(rank, dev), ": the tensors' ends must ascend to count ", c.count, ", but end ", i,
                       " is ", c.ends[i], i == 0 ? std::string() : concat(" after ", c.ends[i - 1]));
    }
    LOCKSTEP_EXPECTS(c.tensors <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()), what, " on ",
                     rank_name(rank, dev), ": ", c.tensors, " tensors is too many");
    LOCKSTEP_EXPECTS(c.terms == 1 || c.stride <= std::numeric_limits<std::size_t>::max() / size_of(c.type) / c.terms,
                     what, " on ", rank_name(rank, dev), ": stride ", c.stride, " is too large");
  }
  if (c.has_root()) {
    LOCKSTEP_EXPECTS(c.root >= 0 && c.root < size, what, " on ", rank_name(rank, dev), ": root ", c.root,
                     " is out of range; valid roots: 0..", size - 1, " (the communicator has ", size, " rank",
                     size == 1 ? "" : "s", ')');
  }
  const bool scaled = c.kind == collective_kind::all_gather || c.kind == collective_kind::reduce_scatter;
  const std::size_t limit =
      std::numeric_limits<std::size_t>::max() / size_of(c.type) / static_cast<std::size_t>(scaled ? size : 1);
  LOCKSTEP_EXPECTS(c.count <= limit, what, " on ", rank_name(rank, dev), ": count ", c.count,
                   " is too large; valid counts: 0..", limit, " elements of ", name_of(c.type));
  if (c.count == 0) return;
  const bool send_used = c.kind != collective_kind::broadcast || rank == c.root;
  const bool recv_used = c.kind != collective_kind::reduce || rank == c.root;
  LOCKSTEP_EXPECTS(!send_used || c.send != nullptr, what, " on ", rank_name(rank, dev),
                   ": send buffer is null with count ", c.count);
  LOCKSTEP_EXPECTS(!recv_used || c.recv != nullptr, what, " on ", rank_name(rank, dev),
                   ": recv buffer is null with count ", c.count);
  comm.check_limits(c);
  if (dev.is_host() && host_strict()) {  // the buffers are memory of this rank's device, whole
    const std::size_t bytes = c.count * size_of(c.type), all = bytes * static_cast<std::size_t>(size);
    const std::string name(what);
    const std::size_t send_bytes = c.kind == collective_kind::reduce_scatter     ? all
                                   : c.kind == collective_kind::all_reduce_exact ? (c.terms - 1) * c.stride * size_of(c.type) + bytes
                                                                                 : bytes;
    if (send_used) strict_expect_memory_of(dev, c.send, send_bytes, name.c_str());
    if (recv_used) strict_expect_memory_of(dev, c.recv, c.kind == collective_kind::all_gather ? all : bytes, name.c_str());
  }
}

/// For a collective running on host stream `on`: when earlier work on the stream failed, its buffers hold nothing
/// valid, and the sentence why `where` (the collective, its number and rank) must not run. The caller then fails it
/// on every rank (a clique aborts, MPI breaks the communicator) rather than let the others complete a step with
/// this rank's stale data.
inline std::optional<std::string> reason_not_to_run(host_backend::stream_state& on, std::string_view where) {
  if (auto f = on.failure()) return concat(where, " could not run: earlier work on its stream failed: ", f->context);
  return std::nullopt;
}

/// Checks that a span given to a collective lives on the communicator's device.
template <class T>
void check_span_device(device_span<T> span, const communicator_impl& comm, const char* what, const char* arg) {
  LOCKSTEP_EXPECTS(span.empty() || span.get_device() == comm.get_device(), what, " on ",
                   rank_name(comm.rank(), comm.get_device()), ": ", arg, " buffer is memory of ",
                   span.get_device().str(), ", expected memory of ", comm.get_device().str());
}

/// The operations shared by `communicator` and `communicator_ref`; `Derived::impl()` gives the backend.
template <class Derived>
class communicator_operations {
 public:
  /// This rank, 0..size()-1.
  [[nodiscard]] int rank() const { return impl().rank(); }
  /// Number of ranks of the group.
  [[nodiscard]] int size() const { return impl().size(); }
  /// The device this rank's collectives run on.
  [[nodiscard]] device get_device() const { return impl().get_device(); }

  /// recv[i] = op over the ranks of send[i], for i < count; in place when send == recv. Reductions take f32,
  /// f16, bf16 (computed in f32, rounded once; NCCL adds f16/bf16 in their type: reduces_in_f32()), and i64 with
  /// sum or max (exact). Stream-ordered on `s`, a stream of get_device(). Throws
  /// precondition_error for bad arguments; the collective's own failures (timeout_error, a mismatch between
  /// ranks, abort) surface at the next synchronization of `s`.
  void all_reduce(const void* send, void* recv, std::size_t count, dtype type, reduce_op op, stream_ref s) const {
    run({collective_kind::all_reduce, send, recv, count, type, op, 0}, s);
  }

  /// recv[i] = send[i] of `root`, for i < count on every rank; in place when send == recv. `send` is read on
  /// the root only (it may be null elsewhere). Any dtype.
  void broadcast(const void* send, void* recv, std::size_t count, dtype type, int root, stream_ref s) const {
    run({collective_kind::broadcast, send, recv, count, type, reduce_op::sum, root}, s);
  }

  /// On `root`: recv[i] = op over the ranks of send[i]; `recv` is written on the root only (it may be null
  /// elsewhere). In place when send == recv on the root. Reductions take f32, f16, bf16.
  void reduce(const void* send, void* recv, std::size_t count, dtype type, reduce_op op, int root, stream_ref s) const {
    run({collective_kind::reduce, send, recv, count, type, op, root}, s);
  }

  /// recv[r * send_count + i] = send[i] of rank r: `recv` holds size() * send_count elements, rank-major. In
  /// place when send == recv + rank() * send_count. Any dtype.
  void all_gather(const void* send, void* recv, std::size_t send_count, dtype type, stream_ref s) const {
    run({collective_kind::all_gather, send, recv, send_count, type, reduce_op::sum, 0}, s);
  }

  /// recv[i] = op over the ranks of send[rank() * recv_count + i]: `send` holds size() * recv_count elements.
  /// In place when recv == send + rank() * recv_count. Reductions take f32, f16, bf16.
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, dtype type, reduce_op op,
                      stream_ref s) const {
    run({collective_kind::reduce_scatter, send, recv, recv_count, type, op, 0}, s);
  }

  /// recv[i] = the exact sum of every rank's `terms` terms send[t * stride + i] (t < terms), rounded once to
  /// `type`, for i < count: the same bits for any number of ranks and any split of the terms over them (the
  /// terms are added exactly, kernels/exact.hpp). A term that is not finite or of magnitude 2^32 or more makes
  /// every element of recv NaN. Takes f32, f16, bf16; `terms` (at least 1) is the same on every rank, `stride`
  /// (at least count when terms > 1) is this rank's own. `recv` must not overlap `send`. Host cliques sum in
  /// place (each rank sums a share of the elements, reading its peers' terms); MPI gathers the terms, then sums.
  /// NCCL communicators do not run it (supports()).
  void all_reduce_exact(const void* send, std::size_t terms, std::size_t stride, void* recv, std::size_t count, dtype type,
                        stream_ref s) const {
    all_reduce_exact(send, terms, stride, recv, count, type, {}, s);
  }
  /// all_reduce_exact of several tensors packed in [0, count), tensor j ending at ends[j] (ascending, the last
  /// equal to count; the same on every rank): a term outside the window makes its own tensor NaN, not the others.
  /// `ends` must stay valid until the collective has run, like the buffers.
  void all_reduce_exact(const void* send, std::size_t terms, std::size_t stride, void* recv, std::size_t count, dtype type,
                        std::span<const std::size_t> ends, stream_ref s) const {
    collective_call c{collective_kind::all_reduce_exact, send, recv, count, type, reduce_op::sum, 0};
    c.terms = terms;
    c.stride = stride;
    c.ends = ends.data();
    c.tensors = ends.size();
    run(c, s);
  }

  /// Whether this communicator runs collectives of kind `k` (every kind but all_reduce_exact on every backend).
  [[nodiscard]] bool supports(collective_kind k) const { return impl().supports(k); }
  /// Whether f16/bf16 reductions are computed in f32 and rounded once, as on host cliques and MPI. False on NCCL,
  /// which adds them in their own type at every step of its ring: a caller that needs fp32 sums sends f32.
  [[nodiscard]] bool reduces_in_f32() const { return impl().reduces_in_f32(); }
  /// How many ranks of the group run on this machine, this one included: all of a host clique's; under MPI the
  /// launcher's count of the job's processes on this node (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS,
  /// MV2_COMM_WORLD_LOCAL_SIZE), at most size(), and size() when no launcher says. Asks no other rank.
  [[nodiscard]] int ranks_on_this_machine() const { return impl().ranks_on_this_machine(); }
  /// How many ranks of the group run in this process, this one included: all of a host clique's, one under MPI.
  [[nodiscard]] int ranks_in_this_process() const { return impl().ranks_in_this_process(); }

  /// Work queued on `s` after the barrier runs once every rank's stream has reached it.
  void barrier(stream_ref s) const { run({collective_kind::barrier, nullptr, nullptr, 0, dtype::f32, {}, 0}, s); }

  // ---- typed forms: the element type comes from `send`, counts from the spans --------------------------------

  /// all_reduce of spans of equal size.
  template <class T>
  void all_reduce(device_span<T> send, device_span<std::remove_const_t<T>> recv, reduce_op op, stream_ref s) const {
    check_span_device(send, impl(), "all_reduce", "send");
    check_span_device(recv, impl(), "all_reduce", "recv");
    LOCKSTEP_EXPECTS(send.size() == recv.size(), "all_reduce on ", rank_name(rank(), get_device()), ": send holds ",
                     send.size(), " elements and recv ", recv.size(), "; they must be equal");
    all_reduce(send.data(), recv.data(), recv.size(), dtype_of_v<T>, op, s);
  }
  /// all_reduce in place.
  template <class T>
  void all_reduce(device_span<T> buffer, reduce_op op, stream_ref s) const {
    static_assert(!std::is_const_v<T>, "all_reduce in place writes its buffer");
    all_reduce(device_span<const T>(buffer), buffer, op, s);
  }

  /// broadcast of `send` (read on the root; may be empty elsewhere) into `recv` on every rank.
  template <class T>
  void broadcast(device_span<T> send, device_span<std::remove_const_t<T>> recv, int root, stream_ref s) const {
    check_span_device(send, impl(), "broadcast", "send");
    check_span_device(recv, impl(), "broadcast", "recv");
    LOCKSTEP_EXPECTS(rank() != root || send.size() == recv.size(), "broadcast on ", rank_name(rank(), get_device()),
                     " (the root): send holds ", send.size(), " elements and recv ", recv.size(),
                     "; they must be equal");
    broadcast(send.data(), recv.data(), recv.size(), dtype_of_v<T>, root, s);
  }
  /// broadcast in place.
  template <class T>
  void broadcast(device_span<T> buffer, int root, stream_ref s) const {
    static_assert(!std::is_const_v<T>, "broadcast in place writes its buffer");
    broadcast(device_span<const T>(buffer), buffer, root, s);
  }

  /// reduce of `send` into `recv` on the root (`recv` may be empty elsewhere).
  template <class T>
  void reduce(device_span<T> send, device_span<std::remove_const_t<T>> recv, reduce_op op, int root,
              stream_ref s) const {
    check_span_device(send, impl(), "reduce", "send");
    check_span_device(recv, impl(), "reduce", "recv");
    LOCKSTEP_EXPECTS(rank() != root || send.size() == recv.size(), "reduce on ", rank_name(rank(), get_device()),
                     " (the root): send holds ", send.size(), " elements and recv ", recv.size(),
                     "; they must be equal");
    reduce(send.data(), recv.data(), send.size(), dtype_of_v<T>, op, root, s);
  }

  /// all_gather: recv.size() == size() * send.size().
  template <class T>
  void all_gather(device_span<T> send, device_span<std::remove_const_t<T>> recv, stream_ref s) const {
    check_span_device(send, impl(), "all_gather", "send");
    check_span_device(recv, impl(), "all_gather", "recv");
    LOCKSTEP_EXPECTS(recv.size() == send.size() * static_cast<std::size_t>(size()), "all_gather on ",
                     rank_name(rank(), get_device()), ": recv holds ", recv.size(), " elements, expected size() * ",
                     "send.size() = ", size(), " * ", send.size());
    all_gather(send.data(), recv.data(), send.size(), dtype_of_v<T>, s);
  }

  /// reduce_scatter: send.size() == size() * recv.size().
  template <class T>
  void reduce_scatter(device_span<T> send, device_span<std::remove_const_t<T>> recv, reduce_op op, stream_ref s) const {
    check_span_device(send, impl(), "reduce_scatter", "send");
    check_span_device(recv, impl(), "reduce_scatter", "recv");
    LOCKSTEP_EXPECTS(send.size() == recv.size() * static_cast<std::size_t>(size()), "reduce_scatter on ",
                     rank_name(rank(), get_device()), ": send holds ", send.size(),
                     " elements, expected size() * recv.size() = ", size(), " * ", recv.size());
    reduce_scatter(send.data(), recv.data(), recv.size(), dtype_of_v<T>, op, s);
  }

  /// Blocks until the work queued on `s` has run, like s.synchronize(), but never hangs on a collective: on a
  /// GPU it polls the stream and NCCL's asynchronous error, and after the timeout aborts the communicator and
  /// throws timeout_error. On a host stream it is s.synchronize() (collectives time out by themselves); a
  /// failed collective is rethrown as async_error with its own error nested.
  void synchronize(stream_ref s) const { impl().synchronize(s); }

  /// Makes every pending and future collective of the whole group (every rank of the clique; for MPI, every
  /// process that polls) fail fast with `reason` instead of waiting for the timeout. The communicator cannot be
  /// used afterwards. Used when one rank fails, so that the others stop waiting for it. Never throws.
  void abort(std::string reason) const noexcept { impl().abort(reason); }

  /// Throws (lockstep::error with the reason) when the group can no longer run collectives: it was aborted here or
  /// by another rank, a collective timed out (MPI), or NCCL reported an asynchronous error or its watchdog
  /// aborted it (GPUs). Does not block and costs an atomic load when all is well: distributed_data_parallel
  /// calls it before each backward, so that a rank never goes on computing steps whose all-reduce cannot run.
  void check() const { impl().rethrow_failure(); }

 private:
  [[nodiscard]] communicator_impl& impl() const { return static_cast<const Derived&>(*this).impl(); }
  void run(const collective_call& c, stream_ref s) const {
    check_collective(impl(), c, s);
    impl().enqueue(c, s);
  }
};

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

class communicator;

/// A non-owning view of a communicator. Cheap to copy; the communicator must outlive it. Like an NCCL
/// communicator, one rank's endpoint is used by one thread at a time.
class communicator_ref : public detail::communicator_operations<communicator_ref> {
 public:
  communicator_ref() = delete;

 private:
  friend class communicator;
  friend class detail::communicator_operations<communicator_ref>;
  explicit communicator_ref(detail::communicator_impl* impl) noexcept : impl_(impl) {}
  [[nodiscard]] detail::communicator_impl& impl() const noexcept { return *impl_; }

  detail::communicator_impl* impl_;
};

/// One rank's endpoint of a group, owned. Move-only; made by make_host_clique, make_mpi_communicator or
/// make_nccl_clique / make_nccl_communicator. Destroying it does not wait for queued collectives: they keep
/// the shared state alive until they have run. Synchronize the streams first if their results matter.
class communicator : public detail::communicator_operations<communicator> {
 public:
  /// An empty communicator (moved-from state); using it throws precondition_error.
  communicator() = default;
  /// Takes ownership of a backend's endpoint (the backends' factories call this).
  static communicator from_impl(std::unique_ptr<detail::communicator_impl> impl) {
    LOCKSTEP_EXPECTS(impl != nullptr, "communicator::from_impl: null implementation");
    communicator c;
    c.h_ = unique_handle<detail::communicator_traits>(impl.release());
    return c;
  }

  [[nodiscard]] communicator_ref ref() const { return communicator_ref(&impl()); }
  // NOLINTNEXTLINE(google-explicit-constructor): a communicator is usable wherever a view is expected
  operator communicator_ref() const { return ref(); }
  /// False for an empty (moved-from) communicator.
  [[nodiscard]] explicit operator bool() const noexcept { return static_cast<bool>(h_); }

 private:
  friend class detail::communicator_operations<communicator>;
  [[nodiscard]] detail::communicator_impl& impl() const {
    LOCKSTEP_EXPECTS(h_, "use of an empty communicator (default-constructed or moved from)");
    return *h_.get();
  }

  unique_handle<detail::communicator_traits> h_;
};
static_assert(!std::is_copy_constructible_v<communicator>);
static_assert(std::is_nothrow_move_constructible_v<communicator>);
static_assert(std::is_trivially_copyable_v<communicator_ref>);

LOCKSTEP_ABI_END
