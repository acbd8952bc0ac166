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

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include <oneapi/dnnl/dnnl.h>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"

LOCKSTEP_DETAIL_BEGIN

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

/// Makes oneDNN compute on the calling thread alone, once per thread: with an OpenMP build it would start a
/// team of one thread per core inside every call (the OpenMP setting is per thread). Looked up at run time,
/// so that a program links no OpenMP runtime of its own; a oneDNN built without OpenMP has nothing to set.
inline void onednn_one_thread_here() noexcept {
  thread_local bool done = false;
  if (done) return;
  done = true;
  using set_fn = void (*)(int);
  if (void* f = dlsym(RTLD_DEFAULT, "omp_set_num_threads")) reinterpret_cast<set_fn>(f)(1);
}

/// The shape, layout and scalars of one GEMM: what a matmul is created for. Compared and hashed by its bytes
/// (alpha and beta by their bits): make() zero-fills the padding.
struct onednn_matmul_key {
  std::int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;
  dtype type;
  bool ta, tb;

  static onednn_matmul_key make(dtype type, bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k,
                                std::int64_t lda, std::int64_t ldb, std::int64_t ldc, float alpha,
                                float beta) noexcept {
    onednn_matmul_key key;
    std::memset(static_cast<void*>(&key), 0, sizeof key);
    key.m = m, key.n = n, key.k = k, key.lda = lda, key.ldb = ldb, key.ldc = ldc;
    key.alpha = alpha, key.beta = beta, key.type = type, key.ta = ta, key.tb = tb;
    return key;
  }
  friend bool operator==(const onednn_matmul_key& x, const onednn_matmul_key& y) noexcept {
    return std::memcmp(&x, &y, sizeof x) == 0;
  }
};

struct onednn_matmul_key_hash {
  std::size_t operator()(const onednn_matmul_key& key) const noexcept {
    const auto* b = reinterpret_cast<const unsigned char*>(&key);
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the key's bytes
    for (std::size_t i = 0; i < sizeof key; ++i) h = (h ^ b[i]) * 1099511628211ull;
    return static_cast<std::size_t>(h);
  }
};

/// One created matmul with its memory objects (whose buffers are set before each run) and its stream. Runs
/// on one stream's worker at a time.
class onednn_matmul {
 public:
  explicit onednn_matmul(const onednn_matmul_key& key) {
    const std::lock_guard lock(onednn_lifetime_mutex());
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

    dnnl_primitive_attr_t attr = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_attr_create(&attr), "creating matmul attributes");
    std::unique_ptr<dnnl_primitive_attr, decltype(&dnnl_primitive_attr_destroy)> attr_owner(
        attr, &dnnl_primitive_attr_destroy);
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user),
                          "asking for a user scratchpad");
    if (key.alpha != 1.0f) {
      LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_attr_set_output_scales(attr, 1, 0, &key.alpha), "setting alpha");
    }
    if (key.beta != 0.0f) {  // beta == 0: C is not read (no sum post-op), as BLAS promises
      dnnl_post_ops_t ops = nullptr;
      LOCKSTEP_ONEDNN_CHECK(dnnl_post_ops_create(&ops), "creating post-ops");
      std::unique_ptr<dnnl_post_ops, decltype(&dnnl_post_ops_destroy)> ops_owner(ops, &dnnl_post_ops_destroy);
      LOCKSTEP_ONEDNN_CHECK(dnnl_post_ops_append_sum(ops, key.beta), "adding beta * C");
      LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_attr_set_post_ops(attr, ops), "setting post-ops");
    }
    dnnl_primitive_desc_t pd = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_desc_create(&pd, &desc, attr, onednn_engine(), nullptr),
                          "creating a ", name_of(key.type), " matmul (m = ", key.m, ", n = ", key.n, ", k = ", key.k,
                          ")");
    std::unique_ptr<dnnl_primitive_desc, decltype(&dnnl_primitive_desc_destroy)> pd_owner(
        pd, &dnnl_primitive_desc_destroy);
    const char* impl = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl), "naming the kernel");
    implementation_ = impl ? impl : "";
    scratchpad_bytes_ = dnnl_memory_desc_get_size(dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0));
    dnnl_primitive_t prim = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_create(&prim, pd), "generating the code of a ", name_of(key.type),
                          " matmul (m = ", key.m, ", n = ", key.n, ", k = ", key.k, ")");
    primitive_.reset(prim);
    make_memory(a_, a_md);
    make_memory(b_, b_md);
    make_memory(c_, c_md);
    if (scratchpad_bytes_ > 0) {
      make_memory(scratchpad_, *dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0));
    }
    dnnl_stream_t st = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_stream_create(&st, onednn_engine(), dnnl_stream_default_flags),
                          "creating a oneDNN stream");
    stream_.reset(st);
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

  /// oneDNN's name of the kernel ("brg:avx512_core_bf16", ...). A name that starts with "ref" is its
  /// reference loop, a hundred times slower than a GEMM kernel: gemm() does not use it.
  [[nodiscard]] const std::string& implementation() const noexcept { return implementation_; }
  [[nodiscard]] bool is_reference() const noexcept { return implementation_.rfind("ref", 0) == 0; }
  /// Bytes of scratchpad memory a run needs (given to run()).
  [[nodiscard]] std::size_t scratchpad_bytes() const noexcept { return scratchpad_bytes_; }

  /// Runs the matmul on the calling thread (a stream's worker): C = alpha op(A) op(B) + beta C.
  void run(const void* a, const void* b, void* c, void* scratchpad) const {
    onednn_one_thread_here();
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

 private:
  using memory_owner = std::unique_ptr<dnnl_memory, decltype(&dnnl_memory_destroy)>;
  static void make_memory(memory_owner& m, const dnnl_memory_desc_t& md) {
    dnnl_memory_t mem = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_create(&mem, &md, onednn_engine(), DNNL_MEMORY_NONE),
                          "creating a oneDNN memory object");
    m.reset(mem);
  }

  std::unique_ptr<dnnl_primitive, decltype(&dnnl_primitive_destroy)> primitive_{nullptr, &dnnl_primitive_destroy};
  std::unique_ptr<dnnl_stream, decltype(&dnnl_stream_destroy)> stream_{nullptr, &dnnl_stream_destroy};
  memory_owner a_{nullptr, &dnnl_memory_destroy}, b_{nullptr, &dnnl_memory_destroy};
  memory_owner c_{nullptr, &dnnl_memory_destroy}, scratchpad_{nullptr, &dnnl_memory_destroy};
  std::string implementation_;
  std::size_t scratchpad_bytes_ = 0;
};

/// A blas_handle's matmuls by shape. Used by the thread that queues GEMMs on the handle; queued work holds
/// its matmul by shared_ptr, so dropping the cache (it is cleared when it holds `capacity` shapes) never
/// frees a matmul that is still to run.
class onednn_matmuls {
 public:
  static constexpr std::size_t capacity = 64;

  /// The matmul for `key`, created on first use (0.2-0.4 ms). Throws lockstep::error when oneDNN cannot create
  /// it.
  std::shared_ptr<const onednn_matmul> get(const onednn_matmul_key& key) {
    if (auto it = map_.find(key); it != map_.end()) return it->second;
    if (map_.size() >= capacity) map_.clear();
    auto made = std::make_shared<const onednn_matmul>(key);
    map_.emplace(key, made);
    return made;
  }
  [[nodiscard]] std::size_t size() const noexcept { return map_.size(); }

 private:
  std::unordered_map<onednn_matmul_key, std::shared_ptr<const onednn_matmul>, onednn_matmul_key_hash> map_;
};

LOCKSTEP_DETAIL_END

#endif  // LOCKSTEP_HAS_ONEDNN
