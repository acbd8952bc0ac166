// lockstep/runtime/stream.hpp — streams and events: ordered, asynchronous work on a device.
//
// `stream` owns a stream and `stream_ref` views one (libcu++'s `cuda::stream` / `cuda::stream_ref`); the same
// pair exists for events. APIs take the views by value. On a GPU they wrap cudaStream_t / cudaEvent_t; on a
// host device they wrap a worker thread and a generation counter with the same semantics:
//
//   - work queued on a stream runs in order, asynchronously to the caller;
//   - `s.wait(e)` makes later work on s wait for the work before the most recent `e.record(...)`;
//   - an error in queued work is kept and rethrown (as async_error, with the original nested) at the next
//     `synchronize()` of that stream or of its device;
//   - events created with event_timing::enabled measure the time between two records.
#pragma once

#include <chrono>
#include <cstddef>
#include <mutex>
#include <utility>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/cuda_check.hpp"
#include "lockstep/core/unique_handle.hpp"
#include "lockstep/device/device.hpp"
#include "lockstep/device/device_guard.hpp"
#include "lockstep/device/query.hpp"
#include "lockstep/runtime/detail/host_runtime.hpp"

LOCKSTEP_DETAIL_BEGIN
/// A stream or event of either backend: the device, and cudaStream_t / cudaEvent_t or the host state.
struct native_handle {
  device dev;
  void* ptr;
};
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

class event_ref;

/// A non-owning view of a stream. Cheap to copy; the stream must outlive it.
class stream_ref {
 public:
  stream_ref() = delete;

  [[nodiscard]] device get_device() const noexcept { return h_.dev; }

  /// cudaStream_t (as void*) for a GPU stream; the host backend's stream state for a host stream.
  [[nodiscard]] void* native_handle() const noexcept { return h_.ptr; }

  /// Blocks until all work queued so far has run; rethrows an error kept from queued work.
  void synchronize() const {
    if (h_.dev.is_host()) return host_state().synchronize();
#if LOCKSTEP_HAS_CUDA
    device_guard guard(h_.dev);
    LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()), "synchronizing a stream of ", h_.dev.str());
#endif
  }

  /// True when all work queued so far has run (cudaStreamQuery). Does not block. Like cudaStreamQuery, it
  /// reports a failure of that work: an error kept from a host stream's work is rethrown (once) when it is done.
  [[nodiscard]] bool ready() const {
    if (h_.dev.is_host()) {
      if (!host_state().idle()) return false;
      host_state().rethrow_if_failed();
      return true;
    }
#if LOCKSTEP_HAS_CUDA
    device_guard guard(h_.dev);
    const cudaError_t e = cudaStreamQuery(cuda_stream());
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    if (e != cudaSuccess) {
      ::lockstep::detail::throw_cuda_error(e, "cudaStreamQuery", LOCKSTEP_SITE,
                                           ::lockstep::detail::message{"querying a stream of ", h_.dev.str()});
    }
    return true;
#else
    return true;
#endif
  }

  /// Work queued on this stream after the call waits for the most recent record of `e` (cudaStreamWaitEvent).
  /// A never-recorded event is already complete. `e` may belong to another device, of either kind: a host stream
  /// may wait for GPU work and a GPU stream for host work (in a translation unit compiled by nvcc). A GPU stream's
  /// wait for host work blocks a CUDA host function: keep host -> GPU waits one way (host work that a GPU stream
  /// waits for must not wait, even indirectly, for a GPU stream that waits for host work), and not in a stream
  /// being captured into a graph (refused).
  void wait(event_ref e) const;

  /// The host backend's state; precondition: a host stream.
  [[nodiscard]] host_backend::stream_state& host_state() const {
    LOCKSTEP_EXPECTS(h_.dev.is_host(), "expected a host stream, got a stream of ", h_.dev.str());
    return *static_cast<host_backend::stream_state*>(h_.ptr);
  }

#if LOCKSTEP_HAS_CUDA
  /// The cudaStream_t; precondition: a GPU stream.
  [[nodiscard]] cudaStream_t cuda_stream() const {
    LOCKSTEP_EXPECTS(h_.dev.is_cuda(), "expected a CUDA stream, got a stream of ", h_.dev.str());
    return static_cast<cudaStream_t>(h_.ptr);
  }

  /// Views a stream created elsewhere (by the user, or another library) on GPU `d`. The legacy default stream
  /// is `default_stream(d)`; 0 and nullptr are rejected at compile time so that it is never named by accident.
  static stream_ref from_native_handle(device d, cudaStream_t s) {
    LOCKSTEP_EXPECTS(d.is_cuda(), "from_native_handle: a cudaStream_t belongs to a CUDA device, not ", d.str());
    return stream_ref(detail::native_handle{d, static_cast<void*>(s)});
  }
#endif
  /// Views a host stream from its state (as kept by an allocation or a foreign owner).
  static stream_ref from_native_handle(device d, host_backend::stream_state* s) {
    LOCKSTEP_EXPECTS(d.is_host() && s != nullptr && s->device() == d.index,
                     "from_native_handle: the host stream state does not belong to ", d.str());
    return stream_ref(detail::native_handle{d, s});
  }
  static stream_ref from_native_handle(device, int) = delete;
  static stream_ref from_native_handle(device, std::nullptr_t) = delete;

  friend bool operator==(const stream_ref& a, const stream_ref& b) noexcept {
    return a.h_.dev == b.h_.dev && a.h_.ptr == b.h_.ptr;
  }

 private:
  friend class stream;
  friend stream_ref default_stream(device d);
  explicit stream_ref(detail::native_handle h) noexcept : h_(h) {}

  detail::native_handle h_;
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN
#if LOCKSTEP_HAS_CUDA
/// GPU streams are never destroyed while the program runs: a destroyed `stream` gives its cudaStream_t back
/// here and the next `stream` of the device takes it. Memory freed in stream order on a stream whose owner is
/// gone is thus still freed on a valid stream (and creating streams in a loop costs nothing).
struct cuda_stream_pool {
  std::mutex mutex;
  std::vector<cudaStream_t> free[64];
  static cuda_stream_pool& instance() {
    static cuda_stream_pool pool;
    return pool;
  }
  cudaStream_t take(int device) {  // device < 64: checked by stream's constructor
    std::lock_guard lock(mutex);
    auto& list = free[device & 63];
    if (list.empty()) return nullptr;
    cudaStream_t s = list.back();
    list.pop_back();
    return s;
  }
  void give_back(int device, cudaStream_t s) noexcept {
    try {
      std::lock_guard lock(mutex);
      free[device & 63].push_back(s);
    } catch (...) {
      LOCKSTEP_CUDA_IGNORE(cudaStreamDestroy(s));  // out of memory for the list: destroy it after all
    }
  }
};
#endif

/// lockstep's per-GPU tables (stream pools, accounting, peer access) have 64 entries: indices 64 and above would
/// alias, so they are refused.
inline void check_cuda_index(device d) {
  LOCKSTEP_EXPECTS(!d.is_cuda() || d.index < 64, d.str(), ": lockstep supports GPU indices 0..63 (its per-device "
                   "tables have 64 entries); restrict the visible GPUs with CUDA_VISIBLE_DEVICES");
}

struct stream_traits {
  using handle_type = native_handle;
  static constexpr handle_type null() noexcept { return {device{}, nullptr}; }
  static bool is_null(const handle_type& h) noexcept { return h.ptr == nullptr; }
  static void release(handle_type h) noexcept {
    if (h.dev.is_host()) {
      auto* s = static_cast<host_backend::stream_state*>(h.ptr);
      s->shutdown();
      s->drop_ref();
      return;
    }
#if LOCKSTEP_HAS_CUDA
    cuda_stream_pool::instance().give_back(h.dev.index, static_cast<cudaStream_t>(h.ptr));
#endif
  }
};
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// An owned stream of one device. Move-only. Destroying a host stream completes the work queued on it first;
/// a GPU stream's handle is returned to a per-device pool (see detail::cuda_stream_pool) with its work still
/// running, as cudaStreamDestroy would let it run.
class stream {
 public:
  /// Creates a stream on `d`; throws device_error when `d` does not exist. A GPU stream is non-blocking
  /// (it does not synchronize with the legacy default stream).
  explicit stream(device d) {
    if (d.is_host()) {
      h_ = unique_handle<detail::stream_traits>(
          detail::native_handle{d, host_backend::runtime::instance().device(d.index).create_stream()});
      return;
    }
#if LOCKSTEP_HAS_CUDA
    check_device_exists(d);
    detail::check_cuda_index(d);
    cudaStream_t s = detail::cuda_stream_pool::instance().take(d.index);
    if (s == nullptr) {
      device_guard guard(d);
      LOCKSTEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "creating a stream on ", d.str());
    }
    h_ = unique_handle<detail::stream_traits>(detail::native_handle{d, static_cast<void*>(s)});
#else
    check_device_exists(d);
#endif
  }

  [[nodiscard]] stream_ref ref() const noexcept { return stream_ref(h_.get()); }
  // NOLINTNEXTLINE(google-explicit-constructor): a stream is usable wherever a view is expected
  operator stream_ref() const noexcept { return ref(); }

  [[nodiscard]] device get_device() const noexcept { return h_.get().dev; }
  void synchronize() const { ref().synchronize(); }
  [[nodiscard]] bool ready() const { return ref().ready(); }
  void wait(event_ref e) const;

 private:
  unique_handle<detail::stream_traits> h_;
};
static_assert(!std::is_copy_constructible_v<stream>);
static_assert(std::is_nothrow_move_constructible_v<stream>);

/// The stream that exists for the whole life of device `d`: the legacy default stream of a GPU, the default
/// worker of a host device. Throws device_error when `d` does not exist.
inline stream_ref default_stream(device d) {
  if (d.is_host()) {
    return stream_ref(detail::native_handle{d, host_backend::runtime::instance().device(d.index).default_stream()});
  }
  check_device_exists(d);
#if LOCKSTEP_HAS_CUDA
  detail::check_cuda_index(d);
  return stream_ref(detail::native_handle{d, static_cast<void*>(cudaStreamLegacy)});
#else
  throw device_error("unreachable: no CUDA device in a host-only translation unit");
#endif
}

/// Blocks until all work on every stream of `d` has run (cudaDeviceSynchronize); rethrows the first error
/// kept by a host stream of the device.
inline void synchronize(device d) {
  if (d.is_host()) return host_backend::runtime::instance().device(d.index).synchronize();
#if LOCKSTEP_HAS_CUDA
  device_guard guard(d);
  LOCKSTEP_CUDA_CHECK(cudaDeviceSynchronize(), "synchronizing ", d.str());
#endif
}

/// Whether an event records time stamps (cudaEventDisableTiming when disabled, which makes waits cheaper).
enum class event_timing : std::uint8_t { disabled, enabled };

/// A non-owning view of an event.
class event_ref {
 public:
  event_ref() = delete;

  [[nodiscard]] device get_device() const noexcept { return h_.dev; }
  [[nodiscard]] void* native_handle() const noexcept { return h_.ptr; }

  /// Captures the work queued on `s` so far; `s` must be a stream of the event's device.
  void record(stream_ref s) const {
    LOCKSTEP_EXPECTS(s.get_device() == h_.dev, "an event of ", h_.dev.str(), " cannot be recorded on a stream of ",
                     s.get_device().str(), ": create the event on the stream's device");
    if (h_.dev.is_host()) return host_state().record(s.host_state());
#if LOCKSTEP_HAS_CUDA
    device_guard guard(h_.dev);
    LOCKSTEP_CUDA_CHECK(cudaEventRecord(cuda_event(), s.cuda_stream()), "recording an event on ", h_.dev.str());
#endif
  }

  /// Blocks until the work captured by the most recent record has run.
  void synchronize() const {
    if (h_.dev.is_host()) return host_state().synchronize();
#if LOCKSTEP_HAS_CUDA
    device_guard guard(h_.dev);
    LOCKSTEP_CUDA_CHECK(cudaEventSynchronize(cuda_event()), "waiting for an event of ", h_.dev.str());
#endif
  }

  /// True when the work captured by the most recent record has run (or the event was never recorded).
  [[nodiscard]] bool ready() const {
    if (h_.dev.is_host()) return host_state().ready();
#if LOCKSTEP_HAS_CUDA
    device_guard guard(h_.dev);
    const cudaError_t e = cudaEventQuery(cuda_event());
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    if (e != cudaSuccess) {
      ::lockstep::detail::throw_cuda_error(e, "cudaEventQuery", LOCKSTEP_SITE,
                                           ::lockstep::detail::message{"querying an event of ", h_.dev.str()});
    }
    return true;
#else
    return true;
#endif
  }

  [[nodiscard]] host_backend::event_state& host_state() const {
    LOCKSTEP_EXPECTS(h_.dev.is_host(), "expected a host event, got an event of ", h_.dev.str());
    return *static_cast<host_backend::event_state*>(h_.ptr);
  }

#if LOCKSTEP_HAS_CUDA
  [[nodiscard]] cudaEvent_t cuda_event() const {
    LOCKSTEP_EXPECTS(h_.dev.is_cuda(), "expected a CUDA event, got an event of ", h_.dev.str());
    return static_cast<cudaEvent_t>(h_.ptr);
  }
  static event_ref from_native_handle(device d, cudaEvent_t e) {
    LOCKSTEP_EXPECTS(d.is_cuda(), "from_native_handle: a cudaEvent_t belongs to a CUDA device, not ", d.str());
    return event_ref(detail::native_handle{d, static_cast<void*>(e)});
  }
  static event_ref from_native_handle(device, int) = delete;
  static event_ref from_native_handle(device, std::nullptr_t) = delete;
#endif

 private:
  friend class event;
  explicit event_ref(detail::native_handle h) noexcept : h_(h) {}
  detail::native_handle h_;
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN
struct event_traits {
  using handle_type = native_handle;
  static constexpr handle_type null() noexcept { return {device{}, nullptr}; }
  static bool is_null(const handle_type& h) noexcept { return h.ptr == nullptr; }
  static void release(handle_type h) noexcept {
    if (h.dev.is_host()) {
      static_cast<host_backend::event_state*>(h.ptr)->drop_ref();
      return;
    }
#if LOCKSTEP_HAS_CUDA
    LOCKSTEP_CUDA_IGNORE(cudaEventDestroy(static_cast<cudaEvent_t>(h.ptr)));
#endif
  }
};
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// An owned event of one device. Move-only. Destroying an event whose record is still queued is fine.
class event {
 public:
  explicit event(device d, event_timing timing = event_timing::disabled) {
    check_device_exists(d);
    if (d.is_host()) {
      h_ = unique_handle<detail::event_traits>(
          detail::native_handle{d, new host_backend::event_state(d.index, timing == event_timing::enabled)});
      return;
    }
#if LOCKSTEP_HAS_CUDA
    device_guard guard(d);
    cudaEvent_t e = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing == event_timing::enabled ? cudaEventDefault
                                                                                      : cudaEventDisableTiming),
                        "creating an event on ", d.str());
    h_ = unique_handle<detail::event_traits>(detail::native_handle{d, static_cast<void*>(e)});
#endif
  }

  [[nodiscard]] event_ref ref() const noexcept { return event_ref(h_.get()); }
  // NOLINTNEXTLINE(google-explicit-constructor)
  operator event_ref() const noexcept { return ref(); }

  [[nodiscard]] device get_device() const noexcept { return h_.get().dev; }
  void record(stream_ref s) const { ref().record(s); }
  void synchronize() const { ref().synchronize(); }
  [[nodiscard]] bool ready() const { return ref().ready(); }

 private:
  unique_handle<detail::event_traits> h_;
};
static_assert(!std::is_copy_constructible_v<event>);

LOCKSTEP_ABI_END

#if LOCKSTEP_HAS_CUDA
LOCKSTEP_DETAIL_BEGIN
/// A host stream waits for GPU work: the record of `e` current now is captured in a private event (a pooled stream
/// of e's device waits for `e` and records it), and a task on `host` blocks on that private event when the stream
/// reaches it. Runs even when earlier host work failed (as every wait does), so the private event is always freed.
inline void host_stream_waits_for_cuda_event(stream_ref host, event_ref e) {
  const device gpu = e.get_device();
  cudaEvent_t captured = nullptr;
  {
    device_guard guard(gpu);
    LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&captured, cudaEventDisableTiming), "creating an event on ", gpu.str());
    cudaStream_t helper = cuda_stream_pool::instance().take(gpu.index);
    cudaError_t status = helper == nullptr ? cudaStreamCreateWithFlags(&helper, cudaStreamNonBlocking) : cudaSuccess;
    if (status == cudaSuccess) status = cudaStreamWaitEvent(helper, e.cuda_event(), 0);
    if (status == cudaSuccess) status = cudaEventRecord(captured, helper);
    if (helper != nullptr) cuda_stream_pool::instance().give_back(gpu.index, helper);
    if (status != cudaSuccess) {
      LOCKSTEP_CUDA_IGNORE(cudaEventDestroy(captured));
      throw_cuda_error(status, "cudaStreamWaitEvent/cudaEventRecord", LOCKSTEP_SITE,
                       ::lockstep::detail::message{"capturing an event of ", gpu.str(), " for ",
                                                   host.get_device().str(), " to wait for"});
    }
  }
  try {
    host.host_state().enqueue(host_backend::task{[captured, gpu] {
                                                   // the worker has no context: use the GPU's, create none on GPU 0
                                                   cuda_device_scope current(gpu.index);
                                                   const cudaError_t waited = cudaEventSynchronize(captured);
                                                   LOCKSTEP_CUDA_IGNORE(cudaEventDestroy(captured));
                                                   LOCKSTEP_CUDA_CHECK(waited, "waiting for an event of ", gpu.str());
                                                 },
                                                 "wait for a GPU event", true});
  } catch (...) {
    LOCKSTEP_CUDA_IGNORE(cudaEventDestroy(captured));
    throw;
  }
}

/// A GPU stream waits for host work: a host function on the GPU stream blocks until the record of the host event
/// current now has run. (A failure carried by that record is not passed on: a GPU stream cannot be failed from the
/// host; the host stream reports it.) CUDA may run host functions one at a time, so while this one blocks, the
/// host functions of other GPU streams wait too: host work that this wait depends on must not itself depend, even
/// through other streams, on a GPU stream's wait for a host event (order host -> GPU dependencies one way).
inline void cuda_stream_waits_for_host_event(stream_ref gpu, event_ref e) {
  auto& state = e.host_state();
  struct pending {
    host_backend::event_state* state;
    std::uint64_t generation;
  };
  const std::uint64_t generation = state.current_generation();
  if (generation == 0) return;  // never recorded: nothing to wait for
  device_guard guard(gpu.get_device());
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  LOCKSTEP_CUDA_CHECK(cudaStreamIsCapturing(gpu.cuda_stream(), &capture), "asking whether a stream of ",
                      gpu.get_device().str(), " is being captured");
  LOCKSTEP_EXPECTS(capture == cudaStreamCaptureStatusNone, "a stream of ", gpu.get_device().str(),
                   " that is being captured into a CUDA graph cannot wait for an event of ", e.get_device().str(),
                   " (the wait is a one-time host function)");
  auto* w = new pending{&state, generation};
  state.add_ref();
  const cudaError_t status = cudaLaunchHostFunc(
      gpu.cuda_stream(),
      [](void* p) {
        auto* self = static_cast<pending*>(p);
        self->state->wait(self->generation);
        self->state->drop_ref();
        delete self;
      },
      w);
  if (status != cudaSuccess) {
    state.drop_ref();
    delete w;
    throw_cuda_error(status, "cudaLaunchHostFunc", LOCKSTEP_SITE,
                     ::lockstep::detail::message{"making a stream of ", gpu.get_device().str(),
                                                 " wait for an event of ", e.get_device().str()});
  }
}
LOCKSTEP_DETAIL_END
#endif

LOCKSTEP_ABI_BEGIN

inline void stream_ref::wait(event_ref e) const {
  if (e.get_device().kind != h_.dev.kind) {
    // A host device and a GPU in one program (staging on host devices, a model on GPUs): ordered like two GPUs.
#if LOCKSTEP_HAS_CUDA
    if (h_.dev.is_host()) return detail::host_stream_waits_for_cuda_event(*this, e);
    return detail::cuda_stream_waits_for_host_event(*this, e);
#else
    throw precondition_error(detail::concat("a stream of ", h_.dev.str(), " cannot wait for an event of ",
                                            e.get_device().str(), " in a translation unit compiled without nvcc"));
#endif
  }
  if (h_.dev.is_host()) return e.host_state().enqueue_wait(host_state());
#if LOCKSTEP_HAS_CUDA
  device_guard guard(h_.dev);
  LOCKSTEP_CUDA_CHECK(cudaStreamWaitEvent(cuda_stream(), e.cuda_event(), 0), "making a stream of ", h_.dev.str(),
                      " wait for an event of ", e.get_device().str());
#endif
}

inline void stream::wait(event_ref e) const { ref().wait(e); }

/// Milliseconds between the most recent records of `start` and `stop` (cudaEventElapsedTime). Both must be
/// timing events of the same device whose records have run; throws precondition_error otherwise.
inline float elapsed_ms(event_ref start, event_ref stop) {
  LOCKSTEP_EXPECTS(start.get_device() == stop.get_device(), "elapsed_ms: events of ", start.get_device().str(),
                   " and ", stop.get_device().str(), " are on different devices");
  if (start.get_device().is_host()) {
    auto& a = start.host_state();
    auto& b = stop.host_state();
    LOCKSTEP_EXPECTS(a.timing() && b.timing(), "elapsed_ms needs events created with event_timing::enabled");
    LOCKSTEP_EXPECTS(a.current_generation() > 0 && b.current_generation() > 0,
                     "elapsed_ms: both events must have been recorded");
    LOCKSTEP_EXPECTS(a.ready() && b.ready(), "elapsed_ms: the events' records have not run yet; synchronize the stop "
                                             "event first");
    return std::chrono::duration<float, std::milli>(b.stamp() - a.stamp()).count();
  }
#if LOCKSTEP_HAS_CUDA
  float ms = 0;
  LOCKSTEP_CUDA_CHECK(cudaEventElapsedTime(&ms, start.cuda_event(), stop.cuda_event()), "measuring time between events of ",
                      start.get_device().str());
  return ms;
#else
  return 0.0f;
#endif
}

LOCKSTEP_ABI_END
