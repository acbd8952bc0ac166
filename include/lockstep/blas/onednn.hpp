// lockstep/blas/onednn.hpp — the host GEMM on oneDNN's matmul (only with LOCKSTEP_HAS_ONEDNN).
//
// A row-major GEMM C = alpha op(A) op(B) + beta C is one oneDNN matmul: src op(A) [m, k], weights op(B) [k, n]
// and dst C [m, n], each described by its strides (a transposed operand is the stored matrix read with its
// strides swapped, so nothing is copied), alpha an output scale and beta a sum post-op, both in f32. oneDNN
// accumulates in f32 and rounds to the dst type once, after the post-op: gemm()'s contract.
//
// Creating a matmul costs 0.2-0.4 ms (it generates the kernel's code), about as much as running one of the
// sample's GEMMs, so each blas_handle keeps its matmuls by shape (onednn_matmuls). A matmul is created on the
// thread that queues the GEMM, where the scratchpad it asks for is taken from the handle's scratch memory
// (so it is device memory, accounted like the rest); it runs on the stream's worker. oneDNN is told to use
// one thread per call (Debian's build threads with OpenMP): a host device stands for one GPU, and its work runs
// on its stream's worker alone, as with OpenBLAS (blas_handle.hpp).
#pragma once

#include "lockstep/config.hpp"

#if LOCKSTEP_HAS_ONEDNN
#include <dlfcn.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl_version.h>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/runtime/detail/host_runtime.hpp"

#if DNNL_VERSION_MAJOR != 2
#error "lockstep's host GEMMs use oneDNN 2.x's C API (Debian 12's libdnnl-dev 2.6.3); oneDNN 3 removed the operation descriptors it uses: build with -DLOCKSTEP_ONEDNN=OFF"
#endif

// What is process-wide (the engine, the lock, the per-thread OpenMP setting) lives in the shared lockstep::detail,
// not in the configuration's inline namespace: a program made of nvcc and g++ translation units has one of each.
namespace lockstep::detail {

inline const char* onednn_status_name(dnnl_status_t s) noexcept {
  switch (s) {
    case dnnl_success: return "dnnl_success";
    case dnnl_out_of_memory: return "dnnl_out_of_memory";
    case dnnl_invalid_arguments: return "dnnl_invalid_arguments";
    case dnnl_unimplemented: return "dnnl_unimplemented";
    case dnnl_iterator_ends: return "dnnl_iterator_ends";
    case dnnl_runtime_error: return "dnnl_runtime_error";
    case dnnl_not_required: return "dnnl_not_required";
    default: return "dnnl status";
  }
}

/// Checks a oneDNN call: throws lockstep::error "file:line call: dnnl_x while <what>", with the status as code.
#define LOCKSTEP_ONEDNN_CHECK(call, ...)                                                                     \
  do {                                                                                                       \
    const dnnl_status_t lockstep_dnnl_status_ = (call);                                                      \
    if (lockstep_dnnl_status_ != dnnl_success) [[unlikely]] {                                                \
      throw ::lockstep::error(::lockstep::detail::concat(                                                    \
                                  ::lockstep::detail::short_file(__FILE__), ':', __LINE__, ' ', #call, ": ", \
                                  ::lockstep::detail::onednn_status_name(lockstep_dnnl_status_),             \
                                  " (", static_cast<int>(lockstep_dnnl_status_), ") while ", __VA_ARGS__),   \
                              static_cast<long>(lockstep_dnnl_status_));                                     \
    }                                                                                                        \
  } while (false)

/// The process's one CPU engine.
inline dnnl_engine_t onednn_engine() {
  static const dnnl_engine_t engine = [] {
    dnnl_engine_t e = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_engine_create(&e, dnnl_cpu, 0), "creating oneDNN's CPU engine");
    return e;  // kept for the life of the process, like oneDNN's own global state
  }();
  return engine;
}

/// Held while a matmul is created or destroyed. oneDNN's primitive cache is thread-safe, but ThreadSanitizer
/// cannot see its locking (Debian's libdnnl is not instrumented) and reports its lookups and insertions on two
/// ranks' threads as races; creation is rare (once per shape and handle), so lockstep serializes it instead of
/// suppressing reports from oneDNN. Running a matmul takes no lock.
inline std::mutex& onednn_lifetime_mutex() {
  static std::mutex m;
  return m;
}

/// The OpenMP runtime's omp_get_max_threads / omp_set_num_threads that oneDNN uses, looked up at run time in
/// libdnnl's own dependencies (so that a program links no OpenMP runtime of its own, and another runtime loaded
/// first is not the one set); null for a oneDNN built without OpenMP.
struct onednn_openmp {
  int (*get_max_threads)() = nullptr;
  void (*set_num_threads)(int) = nullptr;

  static const onednn_openmp& get() {
    static const onednn_openmp omp = [] {
      onednn_openmp o;
      void* lib = dlopen("libdnnl.so.2", RTLD_LAZY | RTLD_NOLOAD);
      void* where = lib ? lib : RTLD_DEFAULT;
      o.get_max_threads = reinterpret_cast<int (*)()>(dlsym(where, "omp_get_max_threads"));
      o.set_num_threads = reinterpret_cast<void (*)(int)>(dlsym(where, "omp_set_num_threads"));
      if (!o.get_max_threads || !o.set_num_threads) o = onednn_openmp{};
      return o;  // the handle stays open: libdnnl is linked for the life of the process anyway
    }();
    return omp;
  }
};

/// Makes oneDNN compute on the calling thread alone, once per thread: with an OpenMP build it would start a
/// team of one thread per core inside every call (the OpenMP setting is per thread).
inline void onednn_one_thread_here() noexcept {
  thread_local bool done = false;
  if (done) return;
  done = true;
  if (const auto& omp = onednn_openmp::get(); omp.set_num_threads) omp.set_num_threads(1);
}

/// One OpenMP thread on the calling thread for the guard's lifetime, then the setting it had. oneDNN's matmuls
/// fix their thread count (and scratchpad) when they are created, on the thread that queues the GEMM.
class onednn_one_thread_scope {
 public:
  onednn_one_thread_scope() noexcept {
    const auto& omp = onednn_openmp::get();
    if (!omp.set_num_threads) return;
    previous_ = omp.get_max_threads();
    omp.set_num_threads(1);
  }
  ~onednn_one_thread_scope() {
    if (previous_ > 0) onednn_openmp::get().set_num_threads(previous_);
  }
  onednn_one_thread_scope(const onednn_one_thread_scope&) = delete;
  onednn_one_thread_scope& operator=(const onednn_one_thread_scope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace lockstep::detail

LOCKSTEP_DETAIL_BEGIN

// Owners of oneDNN objects.
struct onednn_memory_deleter {
  void operator()(dnnl_memory_t m) const noexcept { dnnl_memory_destroy(m); }
};
struct onednn_primitive_deleter {
  void operator()(dnnl_primitive_t p) const noexcept { dnnl_primitive_destroy(p); }
};
using onednn_memory_owner = std::unique_ptr<dnnl_memory, onednn_memory_deleter>;
using onednn_primitive_owner = std::unique_ptr<dnnl_primitive, onednn_primitive_deleter>;

using onednn_attr_owner = std::unique_ptr<dnnl_primitive_attr, decltype(&dnnl_primitive_attr_destroy)>;
using onednn_pd_owner = std::unique_ptr<dnnl_primitive_desc, decltype(&dnnl_primitive_desc_destroy)>;
using onednn_stream_owner = std::unique_ptr<dnnl_stream, decltype(&dnnl_stream_destroy)>;

/// FNV-1a over the bytes of `values`: the primitive caches' key hash.
inline std::size_t onednn_key_hash(std::initializer_list<std::uint64_t> values) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  for (std::uint64_t v : values) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ (v & 0xffu)) * 1099511628211ull;
  }
  return static_cast<std::size_t>(h);
}

/// Primitive attributes: a user scratchpad (so that it is device memory, accounted like the rest) when asked, and
/// the sum post-op dst = beta dst + result when beta is not 0.
inline onednn_attr_owner onednn_attributes(bool user_scratchpad, float beta) {
  dnnl_primitive_attr_t attr = nullptr;
  LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_attr_create(&attr), "creating primitive attributes");
  onednn_attr_owner owner(attr, &dnnl_primitive_attr_destroy);
  if (user_scratchpad) {
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user),
                          "asking for a user scratchpad");
  }
  if (beta != 0.0f) {
    dnnl_post_ops_t ops = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_post_ops_create(&ops), "creating post-ops");
    const std::unique_ptr<dnnl_post_ops, decltype(&dnnl_post_ops_destroy)> ops_owner(ops, &dnnl_post_ops_destroy);
    LOCKSTEP_ONEDNN_CHECK(dnnl_post_ops_append_sum(ops, beta), "adding beta times the output");
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_attr_set_post_ops(attr, ops), "setting post-ops");
  }
  return owner;
}

/// A oneDNN stream on the engine (the primitives of one object run on it, on the calling thread).
inline onednn_stream_owner onednn_new_stream() {
  dnnl_stream_t st = nullptr;
  LOCKSTEP_ONEDNN_CHECK(dnnl_stream_create(&st, onednn_engine(), dnnl_stream_default_flags), "creating a oneDNN stream");
  return onednn_stream_owner(st, &dnnl_stream_destroy);
}

/// Whether oneDNN's kernel `implementation` is worth running: not its reference loop (a name starting with "ref",
/// a hundred times slower than a kernel), nor "none" (no kernel).
inline bool onednn_usable(const std::string& implementation) noexcept {
  return implementation != "none" && implementation.rfind("ref", 0) != 0;
}

/// A oneDNN memory object of `md` without a buffer (bound with dnnl_memory_set_data_handle before each run).
inline onednn_memory_owner onednn_memory(const dnnl_memory_desc_t& md) {
  dnnl_memory_t mem = nullptr;
  LOCKSTEP_ONEDNN_CHECK(dnnl_memory_create(&mem, &md, onednn_engine(), DNNL_MEMORY_NONE),
                        "creating a oneDNN memory object");
  return onednn_memory_owner(mem);
}

/// The shape, layout and scalars of one GEMM: what a matmul is created for (alpha and beta by their bits).
struct onednn_matmul_key {
  std::int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  float alpha = 1.0f, beta = 0.0f;
  dtype type = dtype::f32;
  bool ta = false, tb = false;

  static onednn_matmul_key make(dtype type, bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k,
                                std::int64_t lda, std::int64_t ldb, std::int64_t ldc, float alpha,
                                float beta) noexcept {
    return onednn_matmul_key{m, n, k, lda, ldb, ldc, alpha, beta, type, ta, tb};
  }
  friend bool operator==(const onednn_matmul_key& x, const onednn_matmul_key& y) noexcept {
    return x.m == y.m && x.n == y.n && x.k == y.k && x.lda == y.lda && x.ldb == y.ldb && x.ldc == y.ldc &&
           std::bit_cast<std::uint32_t>(x.alpha) == std::bit_cast<std::uint32_t>(y.alpha) &&
           std::bit_cast<std::uint32_t>(x.beta) == std::bit_cast<std::uint32_t>(y.beta) && x.type == y.type &&
           x.ta == y.ta && x.tb == y.tb;
  }
};

struct onednn_matmul_key_hash {
  std::size_t operator()(const onednn_matmul_key& key) const noexcept {
    auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
    return onednn_key_hash({u(key.m), u(key.n), u(key.k), u(key.lda), u(key.ldb), u(key.ldc),
                            std::bit_cast<std::uint32_t>(key.alpha), std::bit_cast<std::uint32_t>(key.beta),
                            static_cast<std::uint64_t>(key.type) | (std::uint64_t{key.ta} << 8) |
                                (std::uint64_t{key.tb} << 9)});
  }
};

/// Registers an exit handler that waits (at most 2 s) until the host streams have run their queued work. Called
/// after each oneDNN primitive is created and after its first run, which is when oneDNN makes its global state
/// (code, profiling hooks) and registers its destruction. At exit, handlers and static objects go in the reverse
/// order of their registration: the wait then comes before any of that state is destroyed, so a program that
/// returns from main while a stream still runs a primitive (a forward nobody synchronized) exits cleanly, as with
/// GPUs, instead of crashing inside oneDNN (seen on an AVX2 CPU, where small GEMMs go to oneDNN). The bound keeps a
/// process that exits after a failure, with a stream blocked for good (waiting for a peer that died), from
/// lingering. Two registrations per primitive; glibc keeps them in blocks of 32.
inline void onednn_wait_at_exit() noexcept {
  (void)std::atexit([] {
    // a runtime made after this registration is destroyed before this runs: its destruction waited for its streams
    if (auto* r = host_backend::runtime::if_alive()) r->wait_for_queued_work(std::chrono::seconds(2));
  });
}

/// One created matmul with its memory objects (whose buffers are set before each run) and its stream. Runs
/// on one stream's worker at a time.
class onednn_matmul {
 public:
  explicit onednn_matmul(const onednn_matmul_key& key) {
    const std::lock_guard lock(onednn_lifetime_mutex());
    const onednn_one_thread_scope one_thread;  // the matmul's thread count is fixed now, on the queuing thread
    const dnnl_data_type_t in = key.type == dtype::bf16 ? dnnl_bf16 : key.type == dtype::f16 ? dnnl_f16 : dnnl_f32;
    const dnnl_dims_t a_dims{key.m, key.k}, b_dims{key.k, key.n}, c_dims{key.m, key.n};
    // op(A)[i, p] is A[i * lda + p], or A[p * lda + i] when transposed; likewise op(B).
    const dnnl_dims_t a_strides{key.ta ? 1 : key.lda, key.ta ? key.lda : 1};
    const dnnl_dims_t b_strides{key.tb ? 1 : key.ldb, key.tb ? key.ldb : 1};
    const dnnl_dims_t c_strides{key.ldc, 1};
    dnnl_memory_desc_t a_md{}, b_md{}, c_md{};
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_desc_init_by_strides(&a_md, 2, a_dims, in, a_strides), "describing op(A)");
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_desc_init_by_strides(&b_md, 2, b_dims, in, b_strides), "describing op(B)");
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_desc_init_by_strides(&c_md, 2, c_dims, in, c_strides), "describing C");
    dnnl_matmul_desc_t desc{};
    LOCKSTEP_ONEDNN_CHECK(dnnl_matmul_desc_init(&desc, &a_md, &b_md, nullptr, &c_md), "describing a matmul");

    // beta == 0: C is not read (no sum post-op), as BLAS promises
    const onednn_attr_owner attr_owner = onednn_attributes(true, key.beta);
    dnnl_primitive_attr_t attr = attr_owner.get();
    if (key.alpha != 1.0f) {
      LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_attr_set_output_scales(attr, 1, 0, &key.alpha), "setting alpha");
    }
    dnnl_primitive_desc_t pd = nullptr;
    const dnnl_status_t made = dnnl_primitive_desc_create(&pd, &desc, attr, onednn_engine(), nullptr);
    if (made == dnnl_unimplemented) {  // no kernel at all for this type or layout (f16 on most CPUs)
      implementation_ = "none";
      return;
    }
    LOCKSTEP_ONEDNN_CHECK(made, "creating a ", name_of(key.type), " matmul (m = ", key.m, ", n = ", key.n,
                          ", k = ", key.k, ")");
    const onednn_pd_owner pd_owner(pd, &dnnl_primitive_desc_destroy);
    const char* impl = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl), "naming the kernel");
    implementation_ = impl ? impl : "";
    scratchpad_bytes_ = dnnl_memory_desc_get_size(dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0));
    dnnl_primitive_t prim = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_create(&prim, pd), "generating the code of a ", name_of(key.type),
                          " matmul (m = ", key.m, ", n = ", key.n, ", k = ", key.k, ")");
    primitive_.reset(prim);
    a_ = onednn_memory(a_md);
    b_ = onednn_memory(b_md);
    c_ = onednn_memory(c_md);
    if (scratchpad_bytes_ > 0) scratchpad_ = onednn_memory(*dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0));
    stream_ = onednn_new_stream();
    warm_up(key);
    onednn_wait_at_exit();
  }

  onednn_matmul(const onednn_matmul&) = delete;
  onednn_matmul& operator=(const onednn_matmul&) = delete;
  ~onednn_matmul() {
    const std::lock_guard lock(onednn_lifetime_mutex());
    primitive_.reset();
    stream_.reset();
    a_.reset();
    b_.reset();
    c_.reset();
    scratchpad_.reset();
  }

  /// oneDNN's name of the kernel ("brg:avx512_core_bf16", ...), or "none" when oneDNN has none for the key.
  [[nodiscard]] const std::string& implementation() const noexcept { return implementation_; }
  /// Whether gemm() runs it: a kernel exists and is not oneDNN's reference loop (an implementation whose name
  /// starts with "ref", a hundred times slower than a GEMM kernel).
  [[nodiscard]] bool usable() const noexcept { return primitive_ && onednn_usable(implementation_); }
  /// Bytes of scratchpad memory a run needs (given to run()).
  [[nodiscard]] std::size_t scratchpad_bytes() const noexcept { return scratchpad_bytes_; }
  /// The scratchpad in floats, rounded up: what to take from a handle's scratch memory (blas_handle::scratch).
  [[nodiscard]] std::size_t scratchpad_floats() const noexcept { return (scratchpad_bytes_ + 3) / 4; }

  /// Runs the matmul on the calling thread (a stream's worker): C = alpha op(A) op(B) + beta C.
  void run(const void* a, const void* b, void* c, void* scratchpad) const {
    onednn_one_thread_here();
    execute(a, b, c, scratchpad);
    if (!ran_.exchange(true, std::memory_order_relaxed)) onednn_wait_at_exit();
  }

 private:
  // The matmul on the calling thread.
  void execute(const void* a, const void* b, void* c, void* scratchpad) const {
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_set_data_handle(a_.get(), const_cast<void*>(a)), "binding op(A)");
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_set_data_handle(b_.get(), const_cast<void*>(b)), "binding op(B)");
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_set_data_handle(c_.get(), c), "binding C");
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, a_.get()}, {DNNL_ARG_WEIGHTS, b_.get()}, {DNNL_ARG_DST, c_.get()}, {}};
    int nargs = 3;
    if (scratchpad_) {
      LOCKSTEP_ONEDNN_CHECK(dnnl_memory_set_data_handle(scratchpad_.get(), scratchpad), "binding the scratchpad");
      args[nargs++] = {DNNL_ARG_SCRATCHPAD, scratchpad_.get()};
    }
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_execute(primitive_.get(), stream_.get(), nargs, args),
                          "running a oneDNN matmul (", implementation_, ")");
    LOCKSTEP_ONEDNN_CHECK(dnnl_stream_wait(stream_.get()), "waiting for a oneDNN matmul");
  }

  // A first run on zeros, here on the creating thread: oneDNN makes some of its global state (a kernel's code,
  // generated once per process) at a primitive's first run and registers its destruction then. Made here, before
  // onednn_wait_at_exit, it outlives the wait at exit; made by a stream's first run while the program exits, the
  // exit could destroy it under that run (a crash in oneDNN's code generator, seen with a forward nobody
  // synchronized before main returned).
  void warm_up(const onednn_matmul_key& key) const {
    if (!usable()) return;
    const auto rows = [](std::int64_t r, std::int64_t ld) { return static_cast<std::size_t>(r * ld); };
    const std::size_t bytes = size_of(key.type);
    std::vector<std::byte> a(rows(key.ta ? key.k : key.m, key.lda) * bytes);
    std::vector<std::byte> b(rows(key.tb ? key.n : key.k, key.ldb) * bytes);
    std::vector<std::byte> c(rows(key.m, key.ldc) * bytes);
    std::vector<std::byte> scratchpad(scratchpad_bytes_);
    execute(a.data(), b.data(), c.data(), scratchpad.data());
  }

  mutable std::atomic<bool> ran_{false};  // run() ran once (a matmul runs on one stream's worker at a time)
  onednn_primitive_owner primitive_;
  onednn_stream_owner stream_{nullptr, &dnnl_stream_destroy};
  onednn_memory_owner a_, b_, c_, scratchpad_;
  std::string implementation_;
  std::size_t scratchpad_bytes_ = 0;
};

/// A blas_handle's oneDNN primitives of one kind (matmuls, convolutions) by key. Used by the thread that queues
/// work on the handle; queued work holds its primitive by shared_ptr, so dropping the cache (it is cleared when it
/// holds `capacity` keys) never frees a primitive that is still to run.
template <class Key, class Hash, class Primitive>
class onednn_cache {
 public:
  static constexpr std::size_t capacity = 64;

  /// The primitive for `key`, created on first use (a fraction of a millisecond: oneDNN generates its code).
  /// Throws lockstep::error when oneDNN cannot create it.
  std::shared_ptr<const Primitive> get(const Key& key) {
    if (auto it = map_.find(key); it != map_.end()) return it->second;
    if (map_.size() >= capacity) map_.clear();
    auto made = std::make_shared<const Primitive>(key);
    map_.emplace(key, made);
    return made;
  }
  [[nodiscard]] std::size_t size() const noexcept { return map_.size(); }

 private:
  std::unordered_map<Key, std::shared_ptr<const Primitive>, Hash> map_;
};

using onednn_matmuls = onednn_cache<onednn_matmul_key, onednn_matmul_key_hash, onednn_matmul>;

LOCKSTEP_DETAIL_END

#endif  // LOCKSTEP_HAS_ONEDNN
