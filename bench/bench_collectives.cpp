// bench/bench_collectives.cpp — microbenchmarks of lockstep's collectives on every backend of the build, with
// nccl-tests' bandwidth definitions, next to the references they are judged against (a single-threaded memcpy
// and OpenMPI's MPI_Allreduce between two processes), and the gradient synchronization of real models three
// ways (DataParallel's copies, one all-reduce per tensor, DDP's buckets overlapped with backward).
//
//   bench_collectives [--max_bytes=256M] [--min_bytes=4K] [--max_ranks=N] [--bucket_bytes=25M]
//                     [--first_bucket_bytes=1M] [Google Benchmark flags]
//
// Rows (see docs/benchmarks.md for how to read them):
//
//   memcpy/size:S                               std::memcpy of S bytes between two buffers, one thread
//   <backend>/<collective>/ranks:K/size:S       one collective over K devices (backend host, or cuda when the
//                                               program was compiled by nvcc), f32, timed from the first rank's
//                                               call to the completion of every rank's stream
//   mpi/MPI_Allreduce/procs:2/size:S            MPI_Allreduce between 2 processes (mpirun, same machine)
//   mpi/lockstep_mpi_all_reduce/procs:2/size:S  lockstep's MPI backend between 2 processes
//   <backend>/grad_sync/mlp:M/ranks:K/<how>     synchronizing the f32 gradients of model M (communication only)
//   <backend>/fwd_bwd/mlp:M/batch:B/ranks:K/<mode>  forward + backward of model M on a global batch of B with
//                                               the real data_parallel and distributed_data_parallel
//
// Collectives: broadcast, reduce (root 0), all_reduce (out of place), all_reduce_in_place, all_gather,
// reduce_scatter (comm/communicator.hpp), and scatter / gather — DataParallel's row copies (scatter_rows and
// gather_rows of comm/coalesced.hpp). Counters: algbw = bytes / time and busbw = algbw * factor in GB/s
// (1e9 B/s), with bytes and factors as nccl-tests defines them: all_reduce 2(n-1)/n; all_gather,
// reduce_scatter, scatter and gather (n-1)/n with bytes the total size (n x the per-rank part); broadcast and
// reduce 1.
//
// Sizes run from --min_bytes (4 KiB) to --max_bytes (256 MiB; or LOCKSTEP_BENCH_MAX_BYTES) in powers of 4;
// ranks from 2 to the number of host devices (LOCKSTEP_HOST_DEVICES) or GPUs, capped by --max_ranks. Models
// whose gradients exceed --max_bytes are left out. The MPI rows launch
//
//   mpirun -np 2 --allow-run-as-root --oversubscribe ... bench_mpi_allreduce <bytes> <min_time> mpi|lockstep
//
// (mpirun found at configure time, or LOCKSTEP_BENCH_MPIRUN) and report the time per all-reduce it measured;
// they are skipped when the build has no MPI. CUDA rows skip (not fail) without enough GPUs.
//
// After the run a summary puts side by side what the targets compare: host all_reduce of 2 devices at 16 MiB
// against memcpy and MPI_Allreduce, and the three ways of synchronizing gradients. The exit status is 1 when
// a benchmark failed (Google Benchmark itself exits 0 after an error) or nothing matched the filter.
#include <sys/wait.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.hpp"
#include "bench_model.hpp"
#include "lockstep/comm/coalesced.hpp"
#include "lockstep/comm/comm.hpp"
#include "lockstep/device/device_guard.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/nn/loss.hpp"
#include "lockstep/parallel/data_parallel.hpp"
#include "lockstep/parallel/distributed_data_parallel.hpp"
#include "lockstep/parallel/replica_threads.hpp"

namespace {

namespace ls = lockstep;
namespace lb = lockstep_bench;
using lb::clock_type;

// ---- configuration ---------------------------------------------------------------------------------------------

struct config {
  std::size_t min_bytes = std::size_t{4} << 10;
  std::size_t max_bytes = std::size_t{256} << 20;
  int max_ranks = 64;
  ls::ddp_options ddp;    // bucket sizes of the bucketed rows and of DDP (--bucket_bytes, --first_bucket_bytes)
  double min_time = 0.5;  // Google Benchmark's --benchmark_min_time, also given to the MPI helper
  std::string mpirun;     // empty when the MPI comparison cannot run
  std::string mpi_helper;
  std::string mpi_missing;  // why it cannot
};

config& cfg() {
  static config c;
  return c;
}

std::vector<std::size_t> message_sizes() {
  std::vector<std::size_t> out;
  for (std::size_t s = cfg().min_bytes; s <= cfg().max_bytes; s *= 4) out.push_back(s);
  return out;
}

std::string kind_name(ls::device_kind k) { return std::string(ls::name_of(k)); }

// ---- groups of devices: a clique, one stream per rank, one thread per rank ---------------------------------------

class rank_group {
 public:
  rank_group(ls::device_kind backend, int ranks) : kind(backend), k(ranks) {
    std::vector<ls::device> list;
    for (int r = 0; r < k; ++r) list.push_back(ls::device{kind, r});
    devices = ls::device_set(list);
    comms = ls::detail::make_clique(devices, ls::comm_options{});
    for (int r = 0; r < k; ++r) streams.emplace_back(list[static_cast<std::size_t>(r)]);
    for (const auto& s : streams) refs.push_back(s.ref());
    threads = std::make_unique<ls::detail::replica_threads>(static_cast<std::size_t>(k));
  }

  /// Queues f(r) for every rank. Host devices: from this thread, rank after rank (collectives are stream-ordered,
  /// so one thread may queue every rank's part; make_host_clique documents it). GPUs: one thread per rank, as
  /// NCCL requires without group calls.
  void on_ranks(const std::function<void(int)>& f) {
    if (kind == ls::device_kind::host) {
      for (int r = 0; r < k; ++r) f(r);
    } else {
      on_rank_threads(f);
    }
  }

  /// f(r) on rank r's own thread, all ranks at once (for code that waits for its peers, like DDP's constructor).
  void on_rank_threads(const std::function<void(int)>& f) {
    threads->run(
        static_cast<std::size_t>(k),
        [&](std::size_t r) {
          ls::device_guard guard(devices[r]);
          f(static_cast<int>(r));
        },
        [&](std::size_t r) { return devices[r].str(); });
  }

  /// Waits for every rank's stream (through the communicator: never hangs on a collective).
  void synchronize() const {
    for (std::size_t r = 0; r < streams.size(); ++r) comms[r].synchronize(streams[r]);
  }

  ls::device_kind kind;
  int k;
  ls::device_set devices;
  std::vector<ls::communicator> comms;
  std::vector<ls::stream> streams;
  std::vector<ls::stream_ref> refs;
  std::unique_ptr<ls::detail::replica_threads> threads;
};

std::map<std::pair<int, int>, std::unique_ptr<rank_group>>& group_cache() {
  static std::map<std::pair<int, int>, std::unique_ptr<rank_group>> cache;
  return cache;
}

/// The group of the first k devices of `kind`, made once and reused by every benchmark.
rank_group& group(ls::device_kind kind, int k) {
  auto& slot = group_cache()[{static_cast<int>(kind), k}];
  if (!slot) slot = std::make_unique<rank_group>(kind, k);
  return *slot;
}

/// Runs a benchmark body; after a failure the cached groups are dropped (a failed clique may be aborted).
template <class F>
void run_guarded(benchmark::State& st, const std::string& name, F&& body) {
  const std::size_t before = lb::failures().size();
  lb::guarded(st, name, std::forward<F>(body));
  if (lb::failures().size() != before) group_cache().clear();
}

/// False (and the benchmark skipped) when fewer than k devices of `kind` exist.
bool have_devices(benchmark::State& st, ls::device_kind kind, int k) {
  const int n = ls::device_count(kind);
  if (n >= k) return true;
  if (kind == ls::device_kind::cuda) {
    lb::skip(st, "needs " + std::to_string(k) + (k == 1 ? " GPU, " : " GPUs, ") + std::to_string(n) + " visible" +
                     (n == 0 ? " (" + ls::cuda_status().reason() + ")" : std::string()));
  } else {
    lb::skip(st, "needs " + std::to_string(k) + " host devices, " + std::to_string(n) +
                     " configured (LOCKSTEP_HOST_DEVICES)");
  }
  return false;
}

/// Times `once` (which must include waiting for completion) per benchmark iteration, after one untimed run that
/// allocates and faults in everything; returns the total time.
template <class F>
double time_iterations(benchmark::State& st, F&& once) {
  once();
  double total = 0;
  for (auto _ : st) {
    const auto t0 = clock_type::now();
    once();
    const double s = lb::seconds_since(t0);
    st.SetIterationTime(s);
    total += s;
  }
  return total;
}

// ---- the collectives ---------------------------------------------------------------------------------------------

enum class collective : std::uint8_t {
  broadcast,
  reduce,
  all_reduce,
  all_reduce_in_place,
  all_gather,
  reduce_scatter,
  scatter,
  gather
};

struct collective_info {
  collective op;
  const char* name;
};

constexpr collective_info collectives[] = {
    {collective::broadcast, "broadcast"},   {collective::reduce, "reduce"},
    {collective::all_reduce, "all_reduce"}, {collective::all_reduce_in_place, "all_reduce_in_place"},
    {collective::all_gather, "all_gather"}, {collective::reduce_scatter, "reduce_scatter"},
    {collective::scatter, "scatter"},       {collective::gather, "gather"},
};

/// nccl-tests' bus bandwidth factors.
double bus_factor(collective op, int k) {
  const double n = k;
  switch (op) {
    case collective::all_reduce:
    case collective::all_reduce_in_place:
      return 2.0 * (n - 1) / n;
    case collective::all_gather:
    case collective::reduce_scatter:
    case collective::scatter:
    case collective::gather:
      return (n - 1) / n;
    case collective::broadcast:
    case collective::reduce:
      return 1.0;
  }
  return 1.0;
}

std::string collective_name(ls::device_kind kind, const char* op, int k, std::size_t bytes) {
  return kind_name(kind) + "/" + op + "/ranks:" + std::to_string(k) + "/size:" + lb::size_label(bytes);
}

/// broadcast, reduce, all_reduce, all_gather, reduce_scatter through the communicators of a clique.
void bm_comm(benchmark::State& st, const std::string& name, ls::device_kind kind, int k, collective op,
             std::size_t nominal) {
  run_guarded(st, name, [&] {
    if (!have_devices(st, kind, k)) return;
    rank_group& g = group(kind, k);
    const auto ranks = static_cast<std::size_t>(k);
    const std::size_t elements = nominal / sizeof(float);
    std::size_t send_count = elements, recv_count = elements;
    if (op == collective::all_gather) {
      send_count = elements / ranks;  // per rank; every rank receives all of them
      recv_count = send_count * ranks;
    } else if (op == collective::reduce_scatter) {
      recv_count = elements / ranks;
      send_count = recv_count * ranks;
    } else if (op == collective::all_reduce_in_place) {
      recv_count = 0;
    }
    const std::size_t total = std::max(send_count, recv_count);  // nccl-tests' size: the larger side
    std::vector<ls::device_buffer<float>> send, recv;
    for (std::size_t r = 0; r < ranks; ++r) {
      // Written (zeros), so that no buffer is untouched memory mapped to the zero page; sums of zeros stay
      // zeros, so repeated in-place reductions never overflow.
      send.emplace_back(send_count, g.refs[r]);
      ls::fill_zero(send.back().span(), g.refs[r]);
      recv.emplace_back(recv_count, g.refs[r]);
      ls::fill_zero(recv.back().span(), g.refs[r]);
    }
    g.synchronize();
    const auto issue = [&](int r) {
      const auto u = static_cast<std::size_t>(r);
      const ls::communicator& c = g.comms[u];
      const ls::stream_ref s = g.refs[u];
      float* sp = send[u].data();
      float* rp = recv_count > 0 ? recv[u].data() : sp;
      switch (op) {
        case collective::broadcast:
          c.broadcast(sp, rp, elements, ls::dtype::f32, 0, s);
          break;
        case collective::reduce:
          c.reduce(sp, rp, elements, ls::dtype::f32, ls::reduce_op::sum, 0, s);
          break;
        case collective::all_reduce:
        case collective::all_reduce_in_place:
          c.all_reduce(sp, rp, elements, ls::dtype::f32, ls::reduce_op::sum, s);
          break;
        case collective::all_gather:
          c.all_gather(sp, rp, send_count, ls::dtype::f32, s);
          break;
        case collective::reduce_scatter:
          c.reduce_scatter(sp, rp, recv_count, ls::dtype::f32, ls::reduce_op::sum, s);
          break;
        case collective::scatter:
        case collective::gather:
          break;
      }
    };
    const double seconds = time_iterations(st, [&] {
      g.on_ranks(issue);
      g.synchronize();
    });
    lb::set_bandwidth(st, name, static_cast<double>(total * sizeof(float)), bus_factor(op, k), seconds);
  });
}

/// DataParallel's scatter (rows of a tensor on device 0 copied to every device) and gather (the reverse), as
/// data_parallel::forward runs them: scatter_rows and gather_rows of comm/coalesced.hpp, rows of 64 bytes.
void bm_rows(benchmark::State& st, const std::string& name, ls::device_kind kind, int k, collective op,
             std::size_t nominal) {
  run_guarded(st, name, [&] {
    if (!have_devices(st, kind, k)) return;
    rank_group& g = group(kind, k);
    constexpr std::int64_t cols = 16;
    const auto rows = static_cast<std::int64_t>(nominal / (cols * sizeof(float)));
    const std::vector<ls::row_range> ranges = ls::chunk_rows(rows, static_cast<std::size_t>(k));
    const double bytes = static_cast<double>(rows * cols) * sizeof(float);
    std::function<void()> once;
    ls::tensor input, output;
    std::vector<ls::tensor> parts(ranges.size());
    std::vector<ls::event> ready;
    std::vector<ls::event_ref> ready_refs;
    std::vector<ls::tensor_view> part_views;
    if (op == collective::scatter) {
      input = ls::tensor(ls::shape{rows, cols}, ls::dtype::f32, g.refs[0]);
      ls::fill_zero(input.span<float>(), g.refs[0]);
      ready.emplace_back(g.devices[0]);
      once = [&] {
        ready[0].record(g.refs[0]);
        ls::scatter_rows(input.view(), ready[0], ranges, parts, g.refs);
        g.synchronize();
      };
    } else {
      for (std::size_t i = 0; i < ranges.size(); ++i) {
        parts[i] = ls::tensor(ls::shape{ranges[i].rows, cols}, ls::dtype::f32, g.refs[i]);
        ls::fill_zero(parts[i].span<float>(), g.refs[i]);
        ready.emplace_back(g.devices[i]);
      }
      for (std::size_t i = 0; i < ranges.size(); ++i) {
        part_views.push_back(parts[i].view());
        ready_refs.push_back(ready[i].ref());
      }
      once = [&] {
        for (std::size_t i = 0; i < ranges.size(); ++i) ready[i].record(g.refs[i]);
        ls::gather_rows(part_views, ready_refs, output, g.refs[0]);
        g.synchronize();
      };
    }
    g.synchronize();
    const double seconds = time_iterations(st, once);
    lb::set_bandwidth(st, name, bytes, bus_factor(op, k), seconds);
  });
}

// ---- the references: memcpy and MPI ---------------------------------------------------------------------------------

void bm_memcpy(benchmark::State& st, const std::string& name, std::size_t bytes) {
  run_guarded(st, name, [&] {
    std::vector<unsigned char> src(bytes, 1), dst(bytes, 0);  // written: real pages, not the zero page
    const double seconds = time_iterations(st, [&] {
      std::memcpy(dst.data(), src.data(), bytes);
      benchmark::DoNotOptimize(dst.data());
      benchmark::ClobberMemory();
    });
    lb::set_bandwidth(st, name, static_cast<double>(bytes), 1.0, seconds);
  });
}

/// Runs the MPI helper under mpirun once and reports the time per all-reduce it measured (one benchmark
/// iteration whose manual time is that figure; the helper's own iteration count is a counter).
void bm_mpi(benchmark::State& st, const std::string& name, std::size_t bytes, const char* mode) {
  run_guarded(st, name, [&] {
    if (cfg().mpirun.empty()) {
      lb::skip(st, cfg().mpi_missing);
      return;
    }
    char min_time[32];
    std::snprintf(min_time, sizeof min_time, "%g", std::max(0.01, cfg().min_time));
    // Processes of one job on one machine: root in containers, loopback only, shared memory between them.
    const std::string command = cfg().mpirun +
                                " -np 2 --allow-run-as-root --oversubscribe --mca btl self,vader,tcp"
                                " --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo '" +
                                cfg().mpi_helper + "' " + std::to_string(bytes) + " " + min_time + " " + mode +
                                " </dev/null 2>&1";
    FILE* pipe = ::popen(command.c_str(), "r");
    if (pipe == nullptr) {
      lb::fail(st, name, "could not start: " + command);
      return;
    }
    std::string output;
    char chunk[4096];
    while (const std::size_t n = std::fread(chunk, 1, sizeof chunk, pipe)) output.append(chunk, n);
    const int status = ::pclose(pipe);
    double per_iteration = 0;
    long iterations = 0;
    const auto at = output.find("bench_mpi_allreduce: mode=");
    const bool parsed =
        at != std::string::npos &&
        std::sscanf(output.c_str() + at,
                    "bench_mpi_allreduce: mode=%*s procs=%*d bytes=%*u iterations=%ld seconds_per_iteration=%lf",
                    &iterations, &per_iteration) == 2 &&
        per_iteration > 0;
    if (status != 0 || !parsed) {
      const std::string tail = output.size() > 1500 ? "..." + output.substr(output.size() - 1500) : output;
      lb::fail(st, name,
               "`" + command + "` failed (exit status " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) +
                   "): " + tail);
      return;
    }
    for (auto _ : st) st.SetIterationTime(per_iteration);
    lb::set_bandwidth(st, name, static_cast<double>(bytes), bus_factor(collective::all_reduce, 2),
                      per_iteration * static_cast<double>(st.iterations()));
    st.counters["mpi_iterations"] = static_cast<double>(iterations);
  });
}

// ---- gradient synchronization of a model, communication only ------------------------------------------------------

struct model_entry {
  const char* label;  // for the summary
  lb::mlp_spec spec;
  bool train;  // also measured with forward + backward (small enough to compute in a benchmark)
};

std::vector<model_entry> models() {
  return {{"small", {{784, 128, 128, 10}}, true},
          {"sample-like, wide", {{784, 2048, 2048, 10}}, true},
          {"bigger", {{784, 4096, 4096, 4096, 10}}, false}};
}

enum class sync_method : std::uint8_t { dp_reduce_add_broadcast, all_reduce_per_tensor, bucketed_all_reduce };

std::string sync_name(sync_method m) {
  switch (m) {
    case sync_method::dp_reduce_add_broadcast:
      return "dp_reduce_add_broadcast";
    case sync_method::all_reduce_per_tensor:
      return "all_reduce_per_tensor";
    case sync_method::bucketed_all_reduce:
      return "bucketed_all_reduce_" + lb::size_label(cfg().ddp.bucket_bytes);
  }
  return "?";
}

std::string grad_sync_name(ls::device_kind kind, const lb::mlp_spec& m, int k, sync_method how) {
  return kind_name(kind) + "/grad_sync/mlp:" + m.name() + "/ranks:" + std::to_string(k) + "/" + sync_name(how);
}

/// DDP's bucketing (distributed_data_parallel.hpp): parameters in reverse order, the first bucket 1 MiB, the
/// others 25 MiB (unless --first_bucket_bytes / --bucket_bytes say otherwise). Returns the parameter indices of
/// each bucket.
std::vector<std::vector<std::size_t>> ddp_buckets(const std::vector<ls::shape>& shapes) {
  const ls::ddp_options& defaults = cfg().ddp;
  std::vector<std::vector<std::size_t>> out(1);
  std::size_t limit = defaults.first_bucket_bytes, bytes = 0;
  for (std::size_t i = shapes.size(); i-- > 0;) {
    const std::size_t n = static_cast<std::size_t>(shapes[i].numel()) * sizeof(float);
    if (!out.back().empty() && bytes + n > limit) {
      out.emplace_back();
      bytes = 0;
      limit = defaults.bucket_bytes;
    }
    out.back().push_back(i);
    bytes += n;
  }
  return out;
}

/// The f32 gradients of model `m` on each of k devices summed (or averaged) over the devices, three ways:
///   dp_reduce_add_broadcast  DataParallel: coalesced_reduce_add onto device 0 (one packed copy per device, added
///                            there), then coalesced_broadcast of the result back (one packed copy per device)
///   all_reduce_per_tensor    one in-place all_reduce per gradient tensor, in backward's (reverse) order
///   bucketed_all_reduce      DDP's buckets without backward to overlap: one all_reduce per bucket buffer (DDP keeps
///                            the gradients inside their bucket's buffer, so there is nothing to pack or unpack)
void bm_grad_sync(benchmark::State& st, const std::string& name, ls::device_kind kind, int k, const lb::mlp_spec& m,
                  sync_method how) {
  run_guarded(st, name, [&] {
    if (!have_devices(st, kind, k)) return;
    rank_group& g = group(kind, k);
    const auto ranks = static_cast<std::size_t>(k);
    const std::vector<ls::shape> shapes = m.parameter_shapes();
    std::vector<std::vector<ls::tensor>> grads(ranks);
    std::vector<std::vector<ls::tensor_view>> views(ranks);
    for (std::size_t r = 0; r < ranks; ++r) {
      for (const auto& s : shapes) {
        grads[r].emplace_back(s, ls::dtype::f32, g.refs[r]);
        ls::fill_zero(grads[r].back().span<float>(), g.refs[r]);
        views[r].push_back(grads[r].back().view());
      }
    }
    std::function<void()> once;
    ls::coalesced_reduce_add reduce_add;
    ls::coalesced_broadcast broadcast;
    std::vector<std::vector<ls::tensor_view>> others(views.begin() + 1, views.end());
    std::vector<ls::stream_ref> other_streams(g.refs.begin() + 1, g.refs.end());
    const auto buckets = ddp_buckets(shapes);
    std::vector<std::vector<ls::device_buffer<float>>> flat(ranks);
    switch (how) {
      case sync_method::dp_reduce_add_broadcast:
        once = [&] {
          reduce_add(others, other_streams, views[0], g.refs[0]);
          broadcast(views[0], g.refs[0], others, other_streams);
          g.synchronize();
        };
        break;
      case sync_method::all_reduce_per_tensor:
        once = [&] {
          g.on_ranks([&](int r) {
            const auto u = static_cast<std::size_t>(r);
            for (std::size_t j = shapes.size(); j-- > 0;) {
              g.comms[u].all_reduce(grads[u][j].span<float>(), ls::reduce_op::sum, g.refs[u]);
            }
          });
          g.synchronize();
        };
        break;
      case sync_method::bucketed_all_reduce:
        for (std::size_t r = 0; r < ranks; ++r) {
          for (const auto& b : buckets) {
            std::size_t n = 0;
            for (std::size_t j : b) n += static_cast<std::size_t>(shapes[j].numel());
            flat[r].emplace_back(n, g.refs[r]);
            ls::fill_zero(flat[r].back().span(), g.refs[r]);
          }
        }
        once = [&] {
          g.on_ranks([&](int r) {
            const auto u = static_cast<std::size_t>(r);
            const ls::stream_ref s = g.refs[u];
            for (auto& bucket : flat[u]) g.comms[u].all_reduce(bucket.span(), ls::reduce_op::sum, s);
          });
          g.synchronize();
        };
        break;
    }
    g.synchronize();
    const double seconds = time_iterations(st, once);
    lb::set_bandwidth(st, name, static_cast<double>(m.gradient_bytes()), bus_factor(collective::all_reduce, k),
                      seconds);
    st.counters["tensors"] = static_cast<double>(shapes.size());
    if (how == sync_method::bucketed_all_reduce) st.counters["buckets"] = static_cast<double>(buckets.size());
  });
}

// ---- forward + backward with the real data_parallel / distributed_data_parallel ------------------------------------

enum class train_mode : std::uint8_t { single, dp, ddp_no_sync, ddp_overlap };

const char* mode_name(train_mode m) {
  switch (m) {
    case train_mode::single:
      return "single";
    case train_mode::dp:
      return "dp";
    case train_mode::ddp_no_sync:
      return "ddp_no_sync";
    case train_mode::ddp_overlap:
      return "ddp_overlap";
  }
  return "?";
}

constexpr std::int64_t global_batch = 128;
constexpr std::uint64_t seed = 7;

std::string fwd_bwd_name(ls::device_kind kind, const lb::mlp_spec& m, int k, train_mode mode) {
  return kind_name(kind) + "/fwd_bwd/mlp:" + m.name() + "/batch:" + std::to_string(global_batch) +
         "/ranks:" + std::to_string(k) + "/" + mode_name(mode);
}

/// Forward and backward of model m on a global batch of `global_batch` rows (no optimizer step):
///   single       one device, the whole batch
///   dp           data_parallel over k devices: parameters broadcast, batch scattered, outputs gathered, the
///                output gradient scattered, gradients reduce-added onto device 0
///   ddp_no_sync  distributed_data_parallel, k ranks of batch/k rows, inside no_sync(): the same computation
///                with no communication at all
///   ddp_overlap  distributed_data_parallel: buckets all-reduced on the communication stream as backward
///                produces them (the real overlap)
void bm_fwd_bwd(benchmark::State& st, const std::string& name, ls::device_kind kind, int k, const lb::mlp_spec& m,
                train_mode mode) {
  run_guarded(st, name, [&] {
    if (!have_devices(st, kind, k)) return;
    const std::int64_t rows = global_batch / k;  // per rank (DDP); the global batch is rows * k
    const std::int64_t batch = rows * k;
    double seconds = 0;
    if (mode == train_mode::single) {
      const ls::device d{kind, 0};
      ls::stream s(d);
      ls::context ctx(s);
      ls::graph model = lb::build_mlp(m, ctx, seed);
      const ls::tensor x =
          lb::device_tensor(lb::batch_inputs(batch, m.inputs(), seed), ls::shape{batch, m.inputs()}, ls::dtype::f32, s);
      const ls::tensor y = lb::device_labels(lb::batch_labels(batch, m.classes()), s);
      ls::softmax_cross_entropy loss(ls::reduction::mean);
      seconds = time_iterations(st, [&] {
        ls::zero_grad(model);
        loss.forward(model.forward(x, ctx), y, ctx);
        model.backward(loss.backward(ctx), ctx, ls::input_grad::not_required);
        s.synchronize();
      });
    } else if (mode == train_mode::dp) {
      rank_group& g = group(kind, k);
      ls::stream setup(g.devices[0]);
      ls::context build(setup);
      ls::graph model = lb::build_mlp(m, build, seed);
      ls::data_parallel<ls::graph> dp(model, ls::data_parallel_options{.device_ids = g.devices});
      const ls::stream_ref s0 = dp.replica_context(0).stream();
      const ls::tensor x = lb::device_tensor(lb::batch_inputs(batch, m.inputs(), seed), ls::shape{batch, m.inputs()},
                                             ls::dtype::f32, s0);
      const ls::tensor y = lb::device_labels(lb::batch_labels(batch, m.classes()), s0);
      ls::softmax_cross_entropy loss(ls::reduction::mean);
      ls::context& out = dp.output_context();
      seconds = time_iterations(st, [&] {
        ls::zero_grad(model);
        loss.forward(dp.forward(x), y, out);
        dp.backward(loss.backward(out));
        for (const ls::device d : g.devices) ls::synchronize(d);
      });
      const auto reports = dp.report();
      if (!reports.empty() && st.iterations() > 0) {
        st.counters["dev0_comm_ms"] = reports[0].communication_ms / static_cast<double>(st.iterations() + 1);
      }
    } else {
      rank_group& g = group(kind, k);
      std::vector<std::unique_ptr<lb::ddp_rank>> ranks(static_cast<std::size_t>(k));
      g.on_rank_threads([&](int r) {
        ranks[static_cast<std::size_t>(r)] = std::make_unique<lb::ddp_rank>(
            g.devices[static_cast<std::size_t>(r)], m, g.comms[static_cast<std::size_t>(r)], r * rows, rows, seed,
            cfg().ddp);
      });
      const bool sync = mode == train_mode::ddp_overlap;
      const auto step = [&](int r) {
        lb::ddp_rank& d = *ranks[static_cast<std::size_t>(r)];
        ls::zero_grad(d.model);
        d.loss.forward(d.ddp->forward(d.shard), d.y, d.ctx, batch);  // mean over the global batch
        if (sync) {
          d.ddp->backward(d.loss.backward(d.ctx));
        } else {
          auto local = d.ddp->no_sync();
          d.ddp->backward(d.loss.backward(d.ctx));
        }
        g.comms[static_cast<std::size_t>(r)].synchronize(d.ctx.stream());
      };
      g.on_rank_threads(step);  // warm-up, then measure from a clean report
      for (auto& r : ranks) r->ddp->reset_report();
      seconds = time_iterations(st, [&] { g.on_rank_threads(step); });
      if (st.iterations() > 0) {
        const ls::device_report rep = ranks[0]->ddp->report();
        const double n = static_cast<double>(st.iterations() + 1);  // time_iterations adds one untimed run
        st.counters["rank0_compute_ms"] = rep.compute_ms / n;
        st.counters["rank0_comm_ms"] = rep.communication_ms / n;
        st.counters["buckets"] = static_cast<double>(ranks[0]->ddp->bucket_count());
      }
      g.on_rank_threads([&](int r) { ranks[static_cast<std::size_t>(r)].reset(); });
    }
    if (st.iterations() > 0 && seconds > 0) {
      const double per_step = seconds / static_cast<double>(st.iterations());
      st.counters["samples_per_s"] = static_cast<double>(batch) / per_step;
      lb::measurement& r = lb::latest()[name];
      r.seconds_per_iteration = per_step;
      r.samples_per_second = static_cast<double>(batch) / per_step;
    }
  });
}

// ---- registration --------------------------------------------------------------------------------------------------

template <class F>
void add(const std::string& name, F&& f) {
  benchmark::RegisterBenchmark(name.c_str(), [name, f](benchmark::State& st) { f(st, name); })
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

std::vector<int> rank_counts(ls::device_kind kind) {
  const int available = ls::device_count(kind);
  // Without enough GPUs the CUDA rows are still listed once (k = 2), and skip.
  const int top = std::min(cfg().max_ranks, std::max(2, available));
  std::vector<int> out;
  for (int k = 2; k <= top; ++k) out.push_back(k);
  return out;
}

void register_benchmarks() {
  const std::vector<std::size_t> sizes = message_sizes();
  for (const std::size_t s : sizes) {
    add("memcpy/size:" + lb::size_label(s),
        [s](benchmark::State& st, const std::string& name) { bm_memcpy(st, name, s); });
  }
  for (const ls::device_kind kind : lb::backends()) {
    const bool enough = ls::device_count(kind) >= 2;
    for (const auto& c : collectives) {
      for (const int k : rank_counts(kind)) {
        for (const std::size_t s : sizes) {
          if (!enough && s != sizes.front()) continue;  // one skipped row says why
          const collective op = c.op;
          const bool rows = op == collective::scatter || op == collective::gather;
          add(collective_name(kind, c.name, k, s),
              [kind, k, op, s, rows](benchmark::State& st, const std::string& name) {
                rows ? bm_rows(st, name, kind, k, op, s) : bm_comm(st, name, kind, k, op, s);
              });
        }
      }
    }
  }
  for (const char* mode : {"mpi", "lockstep"}) {
    for (const std::size_t s : sizes) {
      if (cfg().mpirun.empty() && s != sizes.front()) continue;  // not available: one skipped row says why
      const std::string label = std::string("mpi/") +
                                (mode == std::string("mpi") ? "MPI_Allreduce" : "lockstep_mpi_all_reduce") +
                                "/procs:2/size:" + lb::size_label(s);
      benchmark::RegisterBenchmark(label.c_str(),
                                   [label, s, mode](benchmark::State& st) { bm_mpi(st, label, s, mode); })
          ->UseManualTime()
          ->Iterations(1)
          ->Unit(benchmark::kMicrosecond);
    }
  }
  for (const ls::device_kind kind : lb::backends()) {
    const bool enough = ls::device_count(kind) >= 2;
    for (const auto& model : models()) {
      if (model.spec.gradient_bytes() > cfg().max_bytes) continue;
      for (const int k : rank_counts(kind)) {
        for (const sync_method how : {sync_method::dp_reduce_add_broadcast, sync_method::all_reduce_per_tensor,
                                      sync_method::bucketed_all_reduce}) {
          const lb::mlp_spec spec = model.spec;
          add(grad_sync_name(kind, spec, k, how), [kind, k, spec, how](benchmark::State& st, const std::string& name) {
            bm_grad_sync(st, name, kind, k, spec, how);
          });
        }
        if (!enough) break;
      }
    }
    for (const auto& model : models()) {
      if (!model.train || model.spec.gradient_bytes() > cfg().max_bytes) continue;
      const lb::mlp_spec spec = model.spec;
      add(fwd_bwd_name(kind, spec, 1, train_mode::single), [kind, spec](benchmark::State& st, const std::string& name) {
        bm_fwd_bwd(st, name, kind, 1, spec, train_mode::single);
      });
      for (const int k : rank_counts(kind)) {
        for (const train_mode mode : {train_mode::dp, train_mode::ddp_no_sync, train_mode::ddp_overlap}) {
          add(fwd_bwd_name(kind, spec, k, mode), [kind, k, spec, mode](benchmark::State& st, const std::string& name) {
            bm_fwd_bwd(st, name, kind, k, spec, mode);
          });
        }
        if (!enough) break;
      }
    }
  }
}

// ---- the summary
// -----------------------------------------------------------------------------------------------------

void print_summary() {
  std::fprintf(lb::summary_out(), "\n==== summary (figures measured in this run; GB/s = 1e9 B/s) ====\n");
  // 1. the targets: host all_reduce of 2 devices at 16 MiB vs memcpy and MPI_Allreduce of 2 processes; also at
  //    64 MiB, where no variant's buffers fit in a last-level cache of tens of MiB.
  const std::string host_ar = "all_reduce", host_ar_ip = "all_reduce_in_place";
  std::vector<std::size_t> target_sizes;
  std::size_t fallback = 0;
  for (const std::size_t s : message_sizes()) {
    if (lb::find_result(collective_name(ls::device_kind::host, "all_reduce", 2, s)) == nullptr) continue;
    if (s <= (std::size_t{16} << 20)) fallback = s;
    if (s == (std::size_t{64} << 20)) target_sizes.push_back(s);
  }
  if (fallback != 0) target_sizes.insert(target_sizes.begin(), fallback);
  if (target_sizes.empty()) {
    std::fprintf(lb::summary_out(), "targets: host/all_reduce/ranks:2 was not measured (filtered out)\n");
  }
  for (const std::size_t at : target_sizes) {
    const std::string size = lb::size_label(at);
    const lb::measurement* copy = lb::find_result("memcpy/size:" + size);
    const lb::measurement* mpi = lb::find_result("mpi/MPI_Allreduce/procs:2/size:" + size);
    const lb::measurement* lmpi = lb::find_result("mpi/lockstep_mpi_all_reduce/procs:2/size:" + size);
    const std::size_t reps = lb::reported_count(collective_name(ls::device_kind::host, "all_reduce", 2, at));
    std::fprintf(
        lb::summary_out(),
        "\nall-reduce of %s f32, targets: host algbw >= 0.5 x memcpy and >= 3 x MPI_Allreduce (2 processes)%s\n",
        size.c_str(), reps > 1 ? "; medians of the repetitions" : "");
    const auto line = [](const char* what, const lb::measurement* m) {
      if (m) {
        std::fprintf(lb::summary_out(), "  %-40s algbw %8.2f GB/s %11.1f us\n", what, m->algbw,
                     m->seconds_per_iteration * 1e6);
      } else {
        std::fprintf(lb::summary_out(), "  %-40s not measured\n", what);
      }
    };
    line("memcpy, 1 thread", copy);
    line("MPI_Allreduce, 2 processes", mpi);
    line("lockstep MPI backend, 2 processes", lmpi);
    for (const std::string* op : {&host_ar, &host_ar_ip}) {
      const lb::measurement* host = lb::find_result(collective_name(ls::device_kind::host, op->c_str(), 2, at));
      const std::string what = "host " + *op + ", 2 devices";
      line(what.c_str(), host);
      if (!host) continue;
      if (copy) {
        const double r = host->algbw / copy->algbw;
        std::fprintf(lb::summary_out(), "  %-40s %.2f x memcpy (target >= 0.5: %s)", "", r,
                     r >= 0.5 ? "met" : "NOT met");
      }
      if (mpi) {
        const double r = host->algbw / mpi->algbw;
        std::fprintf(lb::summary_out(), "%s%.2f x MPI_Allreduce (target >= 3: %s)", copy ? ", " : "  ", r,
                     r >= 3.0 ? "met" : "NOT met");
      }
      if (copy || mpi) std::fprintf(lb::summary_out(), "\n");
    }
    if (!mpi && cfg().mpirun.empty()) std::fprintf(lb::summary_out(), "  (%s)\n", cfg().mpi_missing.c_str());
  }
  // 2. gradient synchronization, communication only
  bool tables = false;
  bool header = false;
  for (const ls::device_kind kind : lb::backends()) {
    for (const auto& model : models()) {
      for (const int k : rank_counts(kind)) {
        const lb::measurement* v[3] = {
            lb::find_result(grad_sync_name(kind, model.spec, k, sync_method::dp_reduce_add_broadcast)),
            lb::find_result(grad_sync_name(kind, model.spec, k, sync_method::all_reduce_per_tensor)),
            lb::find_result(grad_sync_name(kind, model.spec, k, sync_method::bucketed_all_reduce))};
        if (!v[0] && !v[1] && !v[2]) continue;
        if (!header) {
          std::fprintf(lb::summary_out(),
                       "\ngradient synchronization, f32, communication only (ms per synchronization)\n");
          tables = true;
          std::fprintf(lb::summary_out(), "  %-5s %-28s %10s %5s %14s %14s %14s\n", "", "model", "gradients", "ranks",
                       "DP reduce+bcast", "all_reduce/tensor",
                       ("bucketed " + lb::size_label(cfg().ddp.bucket_bytes)).c_str());
          header = true;
        }
        std::fprintf(lb::summary_out(), "  %-5s %-28s %10s %5d", kind_name(kind).c_str(), model.spec.name().c_str(),
                     ls::format_bytes(model.spec.gradient_bytes()).c_str(), k);
        for (const auto* x : v) {
          if (x) {
            std::fprintf(lb::summary_out(), " %14.2f", x->seconds_per_iteration * 1e3);
          } else {
            std::fprintf(lb::summary_out(), " %14s", "-");
          }
        }
        std::fprintf(lb::summary_out(), "\n");
      }
    }
  }
  // 3. forward + backward with DP and DDP
  header = false;
  for (const ls::device_kind kind : lb::backends()) {
    for (const auto& model : models()) {
      const lb::measurement* single = lb::find_result(fwd_bwd_name(kind, model.spec, 1, train_mode::single));
      for (const int k : rank_counts(kind)) {
        const lb::measurement* dp = lb::find_result(fwd_bwd_name(kind, model.spec, k, train_mode::dp));
        const lb::measurement* local = lb::find_result(fwd_bwd_name(kind, model.spec, k, train_mode::ddp_no_sync));
        const lb::measurement* ddp = lb::find_result(fwd_bwd_name(kind, model.spec, k, train_mode::ddp_overlap));
        if (!dp && !local && !ddp) continue;
        if (!header) {
          tables = true;
          std::fprintf(lb::summary_out(),
                       "\nforward + backward, global batch %lld, f32 (ms per step; exposed = DDP - DDP no_sync)\n",
                       static_cast<long long>(global_batch));
          std::fprintf(lb::summary_out(), "  %-5s %-28s %5s %10s %10s %12s %12s %10s\n", "", "model", "ranks", "single",
                       "DP", "DDP no_sync", "DDP overlap", "exposed");
          header = true;
        }
        const auto ms = [](const lb::measurement* x) { return x ? x->seconds_per_iteration * 1e3 : -1.0; };
        std::fprintf(lb::summary_out(), "  %-5s %-28s %5d %10.2f %10.2f %12.2f %12.2f %10.2f\n",
                     kind_name(kind).c_str(), model.spec.name().c_str(), k, ms(single), ms(dp), ms(local), ms(ddp),
                     (ddp && local) ? ms(ddp) - ms(local) : -1.0);
      }
    }
  }
  if (tables) std::fprintf(lb::summary_out(), "(-1 or -: not measured in this run)\n");
}

}  // namespace

int main(int argc, char** argv) {
  config& c = cfg();
  if (const char* env = std::getenv("LOCKSTEP_BENCH_MAX_BYTES"); env != nullptr && *env != '\0') {
    c.max_bytes = lb::parse_size_or_exit("LOCKSTEP_BENCH_MAX_BYTES", env);
  }
  if (auto v = lb::take_flag(argc, argv, "max_bytes")) c.max_bytes = lb::parse_size_or_exit("--max_bytes", *v);
  if (auto v = lb::take_flag(argc, argv, "min_bytes")) c.min_bytes = lb::parse_size_or_exit("--min_bytes", *v);
  if (auto v = lb::take_flag(argc, argv, "max_ranks")) c.max_ranks = std::max(2, std::atoi(v->c_str()));
  if (auto v = lb::take_flag(argc, argv, "bucket_bytes"))
    c.ddp.bucket_bytes = lb::parse_size_or_exit("--bucket_bytes", *v);
  if (auto v = lb::take_flag(argc, argv, "first_bucket_bytes")) {
    c.ddp.first_bucket_bytes = lb::parse_size_or_exit("--first_bucket_bytes", *v);
  }
  if (auto v = lb::peek_flag(argc, argv, "benchmark_min_time")) c.min_time = std::atof(v->c_str());
  if (c.min_bytes < sizeof(float)) c.min_bytes = sizeof(float);
#if defined(LOCKSTEP_BENCH_MPI_HELPER)
  c.mpi_helper = LOCKSTEP_BENCH_MPI_HELPER;
  c.mpirun = LOCKSTEP_BENCH_MPIRUN;
  if (const char* env = std::getenv("LOCKSTEP_BENCH_MPIRUN"); env != nullptr && *env != '\0') c.mpirun = env;
  if (c.mpirun.empty()) c.mpi_missing = "mpirun was not found when the benchmarks were configured";
#else
  c.mpi_missing = "this build has no MPI (lockstep::mpi): the MPI comparison is skipped";
#endif
  lb::launch how(argc, argv);
  benchmark::Initialize(&argc, argv);
  int status = 1;
  try {
    const int host = ls::host_device_count();
    benchmark::AddCustomContext("lockstep_host_devices", std::to_string(host));
    benchmark::AddCustomContext("lockstep_cuda", ls::cuda_available()
                                                     ? std::to_string(ls::device_count(ls::device_kind::cuda)) + " GPUs"
                                                     : ls::cuda_status().reason());
    benchmark::AddCustomContext("lockstep_sizes", lb::size_label(c.min_bytes) + ".." + lb::size_label(c.max_bytes));
    benchmark::AddCustomContext("lockstep_mpi", c.mpirun.empty() ? c.mpi_missing : c.mpirun + " -np 2 " + c.mpi_helper);
    register_benchmarks();
    status = lb::run_benchmarks("bench_collectives", argc, argv, how, print_summary);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collectives: %s\n", lb::describe(e).c_str());
    status = 1;
  }
  group_cache().clear();  // before the host platform's statics go away
  return status;
}
