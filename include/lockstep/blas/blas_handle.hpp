// lockstep/blas/blas_handle.hpp — the handle every BLAS call goes through, and LOCKSTEP_CUBLAS_CHECK.
//
// A `blas_handle` belongs to one stream, and through it to one device:
//   - on a GPU it owns a cuBLAS handle created on that device and bound to the stream (cublasSetStream), with
//     the pointer mode on the host (alpha and beta are host floats) and the default math mode, so an fp32
//     GEMM stays fp32 (no TF32); reductions stay in fp32 for fp16/bf16 outputs too (see the constructor);
//   - on a host device it owns nothing from cuBLAS; GEMMs run on the stream's worker with the kernels of its
//     host_gemm_plan (host_kernels.hpp: oneDNN or OpenBLAS, chosen from the CPU's instruction sets), and it
//     keeps the oneDNN matmuls it created, by shape (onednn.hpp).
// Either way it owns a scratch workspace on the device, grown on demand in stream order on the stream and
// then kept, so that a steady-state training step allocates nothing. The host fp16/bf16 GEMM converts its
// operands into it (at most 6 MiB), oneDNN's matmuls take their scratchpads from it, and the host convolutions
// (convolution.hpp) their blocked tensors (as large as the largest convolution's input and output seen); no GEMM on
// a GPU uses it (cuBLAS manages its own workspace).
//
// A handle is used with its one stream only, and from one thread at a time (like a cuBLAS handle bound to
// a stream): the workspace is shared by all work the handle queues, which is safe only because that work
// runs in order on that stream. Use one handle per stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

// OpenBLAS's cblas.h (it also declares openblas_set_num_threads). Its openblas_config.h declares a global
// `typedef uint16_t bfloat16;`, which would make `bfloat16` ambiguous for every user who writes
// `using namespace lockstep;`: the name is changed for the duration of the include (to a uint16_t typedef
// that only OpenBLAS's own bf16 routines use). A program that includes cblas.h itself before lockstep
// keeps OpenBLAS's name, as it asked.
#pragma push_macro("bfloat16")
#define bfloat16 lockstep_openblas_bfloat16
#include <cblas.h>
#pragma pop_macro("bfloat16")

#include "lockstep/blas/host_kernels.hpp"
#include "lockstep/blas/onednn.hpp"
#include "lockstep/blas/onednn_conv.hpp"
#include "lockstep/config.hpp"
#include "lockstep/core/cuda_check.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/unique_handle.hpp"
#include "lockstep/device/device.hpp"
#include "lockstep/device/device_guard.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/stream.hpp"

#if LOCKSTEP_HAS_CUDA
#include <cublas_v2.h>
#endif

#if LOCKSTEP_HAS_CUDA
LOCKSTEP_DETAIL_BEGIN

/// Builds "file:line call: CUBLAS_STATUS_X (text) while <what>" and throws cublas_error with the status.
[[noreturn]] LOCKSTEP_COLD inline void throw_cublas_error(cublasStatus_t status, const char* call, source_site at,
                                                        message what) {
  const std::string msg = call_failure_message(
      at, call, concat(cublasGetStatusName(status), " (", cublasGetStatusString(status), ')'), what);
  throw cublas_error(msg, static_cast<long>(status));
}

LOCKSTEP_DETAIL_END

/// Checks a cuBLAS call: `LOCKSTEP_CUBLAS_CHECK(cublasSetStream(h, s), "binding a cuBLAS handle to ", dev)`.
/// The words after the call say what was being done; they are formatted only on failure.
#define LOCKSTEP_CUBLAS_CHECK(call, ...)                                                                     \
  do {                                                                                                       \
    const cublasStatus_t lockstep_cublas_status_ = (call);                                                   \
    if (lockstep_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                                     \
      ::lockstep::detail::throw_cublas_error(lockstep_cublas_status_, #call, LOCKSTEP_SITE,                  \
                                             ::lockstep::detail::message{__VA_ARGS__});                      \
    }                                                                                                        \
  } while (false)
#endif

namespace lockstep::detail {

/// Makes OpenBLAS compute on the calling thread only, once per process. Called when the first host
/// blas_handle is created.
///
/// Why: a host device stands for one GPU, and its GEMMs run on its stream's worker thread. With N host
/// devices training side by side, N workers call OpenBLAS at once; if each call also fanned out to
/// OpenBLAS's own thread pool (by default one thread per core), N devices would fight over the same cores
/// and OpenBLAS would serialize the concurrent callers on its pool. One core per call keeps the devices
/// independent, as GPUs are, and makes a device's throughput not depend on what the others do.
///
/// The setting is process-wide: it also applies to OpenBLAS calls the program makes itself, and it
/// overrides OPENBLAS_NUM_THREADS.
inline void use_single_threaded_openblas() noexcept {
  [[maybe_unused]] static const bool done = [] {
    openblas_set_num_threads(1);
    return true;
  }();
}

}  // namespace lockstep::detail

LOCKSTEP_DETAIL_BEGIN

/// The cuBLAS handle of a GPU blas_handle (`ptr` is a cublasHandle_t), with the device it was created on.
/// Null for a host device, and always null in a translation unit compiled without nvcc.
struct cublas_native {
  device dev;
  void* ptr;
};

struct cublas_handle_traits {
  using handle_type = cublas_native;
  static constexpr handle_type null() noexcept { return {device{}, nullptr}; }
  static bool is_null(const handle_type& h) noexcept { return h.ptr == nullptr; }
  static void release(handle_type h) noexcept {
#if LOCKSTEP_HAS_CUDA
    // cublasDestroy releases resources of the handle's device: make it current, then restore.
    detail::cuda_device_scope current(h.dev.index);
    (void)cublasDestroy(static_cast<cublasHandle_t>(h.ptr));
#else
    (void)h;
#endif
  }
};

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// The context of BLAS calls on one stream (see the file comment). Move-only. The stream must outlive the
/// handle: the workspace is freed in stream order on it.
class blas_handle {
 public:
  /// A handle for the stream `s`. On a GPU, creates a cuBLAS handle with that device current and binds it to
  /// `s`; throws cublas_error when cuBLAS fails (CUBLAS_STATUS_NOT_INITIALIZED, ALLOC_FAILED). On a host
  /// device, makes OpenBLAS single-threaded the first time (see detail::use_single_threaded_openblas).
  /// Throws device_error when the stream's device does not exist.
  explicit blas_handle(stream_ref s) : blas_handle(s, s.get_device().is_host() ? host_gemm_plan::process()
                                                                                  : host_gemm_plan{}) {}

  /// A handle whose host GEMMs run the kernels of `plan` instead of the process's (tests force each kernel
  /// the CPU has this way). `plan` must name oneDNN only in a build with oneDNN (precondition_error).
  blas_handle(stream_ref s, const host_gemm_plan& plan) : stream_(s), plan_(plan) {
    const device d = s.get_device();
    if (d.is_host()) {
      check_device_exists(d);
      LOCKSTEP_EXPECTS(LOCKSTEP_HAS_ONEDNN || (plan.f32 != host_gemm_kernel::onednn &&
                                               plan.bf16 != host_gemm_kernel::onednn &&
                                               plan.f16 != host_gemm_kernel::onednn),
                       "blas_handle: the plan names oneDNN (", plan.str(), "), but this program was built without it");
      detail::use_single_threaded_openblas();
      return;
    }
#if LOCKSTEP_HAS_CUDA
    device_guard guard(d);
    cublasHandle_t h = nullptr;
    LOCKSTEP_CUBLAS_CHECK(cublasCreate(&h), "creating a cuBLAS handle on ", d.str());
    cublas_ = unique_handle<detail::cublas_handle_traits>(detail::cublas_native{d, static_cast<void*>(h)});
    LOCKSTEP_CUBLAS_CHECK(cublasSetStream(h, s.cuda_stream()), "binding a cuBLAS handle to a stream of ", d.str());
    LOCKSTEP_CUBLAS_CHECK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST),
                          "setting the pointer mode of a cuBLAS handle on ", d.str());
    // The default math mode: no TF32 for fp32 (compute type 32F means fp32). cuBLAS may otherwise reduce
    // split-K partial sums of an fp16/bf16 GEMM in the output type; forbidding that keeps the contract of
    // gemm(): accumulation in fp32 and one rounding to the output type, at the end.
    LOCKSTEP_CUBLAS_CHECK(
        cublasSetMathMode(h, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                                       CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
        "setting the math mode of a cuBLAS handle on ", d.str());
#else
    check_device_exists(d);  // throws: no CUDA device in a host-only translation unit
#endif
  }

  blas_handle(blas_handle&&) noexcept = default;
  blas_handle& operator=(blas_handle&&) noexcept = default;
  blas_handle(const blas_handle&) = delete;
  blas_handle& operator=(const blas_handle&) = delete;
  ~blas_handle() = default;

  /// The stream all work of this handle is queued on.
  [[nodiscard]] stream_ref stream() const noexcept { return stream_; }
  /// The device of that stream.
  [[nodiscard]] device get_device() const noexcept { return stream_.get_device(); }
  /// The kernels of this handle's GEMMs on a host device (unused on a GPU).
  [[nodiscard]] const host_gemm_plan& host_plan() const noexcept { return plan_; }

#if LOCKSTEP_HAS_ONEDNN
  /// The oneDNN matmuls this handle created (host devices), by shape; created on first use.
  [[nodiscard]] detail::onednn_matmuls& onednn_cache() {
    if (!onednn_) onednn_ = std::make_unique<detail::onednn_matmuls>();
    return *onednn_;
  }
  /// The oneDNN convolutions this handle created (host devices), by shape and pass; created on first use.
  [[nodiscard]] detail::onednn_convolutions& onednn_conv_cache() {
    if (!onednn_convs_) onednn_convs_ = std::make_unique<detail::onednn_convolutions>();
    return *onednn_convs_;
  }
#endif

#if LOCKSTEP_HAS_CUDA
  /// The cuBLAS handle (bound to stream()); precondition: a GPU handle.
  [[nodiscard]] cublasHandle_t cublas() const {
    LOCKSTEP_EXPECTS(cublas_.get().ptr != nullptr, "blas_handle::cublas(): a handle of ", get_device().str(),
                     " has no cuBLAS handle (only GPU handles do)");
    return static_cast<cublasHandle_t>(cublas_.get().ptr);
  }
#endif

  /// Scratch memory of at least `floats` floats on the handle's device, for work queued on stream() after
  /// this call. Grows (in stream order on stream()) only when `floats` exceeds the current size, then keeps
  /// the memory for later calls: in a steady state this allocates nothing. Memory returned by an earlier call
  /// stays valid for the work queued before a growth (the old block is freed in stream order). Throws
  /// out_of_memory_error when the device is full.
  [[nodiscard]] float* scratch(std::size_t floats) {
    if (floats > workspace_.size()) workspace_ = device_buffer<float>(floats, stream_);
    return workspace_.data();
  }
  /// Floats of scratch memory held now (0 before the first call that needed some).
  [[nodiscard]] std::size_t scratch_size() const noexcept { return workspace_.size(); }

 private:
  stream_ref stream_;
  host_gemm_plan plan_;
#if LOCKSTEP_HAS_ONEDNN
  std::unique_ptr<detail::onednn_matmuls> onednn_;  // (a build with oneDNN has an inline namespace of its own)
  std::unique_ptr<detail::onednn_convolutions> onednn_convs_;
#endif
  unique_handle<detail::cublas_handle_traits> cublas_;
  device_buffer<float> workspace_;  // freed before cublas_ is destroyed (reverse order of declaration)
};
static_assert(!std::is_copy_constructible_v<blas_handle>);
static_assert(std::is_nothrow_move_constructible_v<blas_handle>);

LOCKSTEP_ABI_END
