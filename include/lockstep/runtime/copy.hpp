// lockstep/runtime/copy.hpp — asynchronous copies in every direction, and zero fills.
//
//   copy(device_span dst, device_span src, s)  device to device, same device or peer (cudaMemcpyPeerAsync)
//   copy(device_span dst, std::span src, s)    host memory to device
//   copy(std::span dst, device_span src, s)    device to host memory
//
// All are stream-ordered on `s`, which must belong to one of the devices involved, and return before the
// copy runs: host memory must stay valid (and, for a source, unchanged) until the stream has passed the copy.
// Use pinned_buffer for host memory on GPUs: pageable memory makes CUDA copy synchronously.
#pragma once

#include <cstring>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/cuda_check.hpp"
#include "lockstep/core/units.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/stream.hpp"

LOCKSTEP_DETAIL_BEGIN

/// Queues a host callable on a host stream. Work with `runs_after_failure` (collectives) runs even when earlier
/// work on the stream failed; other work is then skipped (see host_stream.hpp).
template <class F>
void enqueue_host(stream_ref s, F&& f, const char* what, bool runs_after_failure = false) {
  s.host_state().enqueue(host_backend::task{host_backend::task_body(std::forward<F>(f)), what, runs_after_failure});
}

inline std::string where(const std::optional<device>& d) { return d ? d->str() : std::string("host memory"); }

/// The one copy routine; `dst_dev`/`src_dev` are nullopt for ordinary host memory.
inline void copy_bytes(void* dst, std::optional<device> dst_dev, const void* src, std::optional<device> src_dev,
                       std::size_t bytes, stream_ref s) {
  if (bytes == 0) return;
  const device sd = s.get_device();
  LOCKSTEP_EXPECTS((dst_dev && *dst_dev == sd) || (src_dev && *src_dev == sd), "a copy from ", where(src_dev),
                   " to ", where(dst_dev), " cannot run on a stream of ", sd.str(),
                   ": use a stream of the source or the destination device");
  LOCKSTEP_EXPECTS(dst != nullptr && src != nullptr, "copy of ", bytes, " B from ", where(src_dev), " to ",
                   where(dst_dev), " with a null pointer");
  const bool any_cuda = (dst_dev && dst_dev->is_cuda()) || (src_dev && src_dev->is_cuda());
  // strict host devices: the spans' devices are where their memory lives (nothing is asked for GPU memory)
  if (dst_dev) strict_expect_memory_of(*dst_dev, dst, bytes, "copy destination");
  if (src_dev) strict_expect_memory_of(*src_dev, src, bytes, "copy source");
  if (sd.is_host()) {
    if (!any_cuda) {
      enqueue_host(s, [dst, src, bytes] { std::memcpy(dst, src, bytes); }, "copy");
      return;
    }
#if LOCKSTEP_HAS_CUDA
    // A host device's memory is ordinary host memory: a copy between it and a GPU, ordered on the host
    // stream, runs a synchronous cudaMemcpy on the stream's worker. It is not ordered after GPU work on lockstep's
    // (non-blocking) streams: record an event there and make this host stream wait for it (stream_ref::wait
    // takes events of either kind).
    std::optional<device> gpu = (dst_dev && dst_dev->is_cuda()) ? dst_dev : src_dev;
    enqueue_host(
        s,
        [dst, src, bytes, gpu] {
          device_guard guard(*gpu);
          LOCKSTEP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "copying ", format_bytes(bytes),
                              " between a host device and ", gpu->str());
        },
        "copy to or from a GPU");
    return;
#endif
  }
#if LOCKSTEP_HAS_CUDA
  device_guard guard(sd);
  if (dst_dev && src_dev && dst_dev->is_cuda() && src_dev->is_cuda() && *dst_dev != *src_dev) {
    LOCKSTEP_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_dev->index, src, src_dev->index, bytes, s.cuda_stream()),
                        "copying ", format_bytes(bytes), " from ", src_dev->str(), " to ", dst_dev->str());
    return;
  }
  LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s.cuda_stream()), "copying ",
                      format_bytes(bytes), " from ", where(src_dev), " to ", where(dst_dev));
#endif
}

template <class A, class B>
void expect_same_size(const A& dst, const B& src) {
  LOCKSTEP_EXPECTS(dst.size() == src.size(), "copy between ranges of different sizes: destination holds ", dst.size(),
                   " elements, source ", src.size());
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Copies `src` to `dst` (same size) between two devices, or within one, in stream order on `s`.
template <class T>
void copy(device_span<T> dst, device_span<const std::type_identity_t<T>> src, stream_ref s) {
  detail::expect_same_size(dst, src);
  detail::copy_bytes(dst.data(), dst.get_device(), src.data(), src.get_device(), src.size_bytes(), s);
}

/// Copies host memory `src` to the device range `dst` (same size) in stream order on `s`.
template <class T>
void copy(device_span<T> dst, std::span<const std::type_identity_t<T>> src, stream_ref s) {
  detail::expect_same_size(dst, src);
  detail::copy_bytes(dst.data(), dst.get_device(), src.data(), std::nullopt, src.size_bytes(), s);
}

/// Copies the device range `src` to host memory `dst` (same size) in stream order on `s`.
template <class T>
void copy(std::span<T> dst, device_span<const std::type_identity_t<T>> src, stream_ref s) {
  detail::expect_same_size(dst, src);
  detail::copy_bytes(dst.data(), std::nullopt, src.data(), src.get_device(), src.size_bytes(), s);
}

/// Sets every byte of `dst` to zero in stream order on `s` (a stream of dst's device).
template <class T>
void fill_zero(device_span<T> dst, stream_ref s) {
  if (dst.empty()) return;
  LOCKSTEP_EXPECTS(s.get_device() == dst.get_device(), "fill_zero of memory on ", dst.get_device().str(),
                   " on a stream of ", s.get_device().str());
  if (s.get_device().is_host()) {
    void* p = dst.data();
    const std::size_t n = dst.size_bytes();
    detail::strict_expect_memory_of(dst.get_device(), p, n, "fill_zero");
    detail::enqueue_host(s, [p, n] { std::memset(p, 0, n); }, "fill_zero");
    return;
  }
#if LOCKSTEP_HAS_CUDA
  device_guard guard(dst.get_device());
  LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(dst.data(), 0, dst.size_bytes(), s.cuda_stream()), "zeroing ",
                      format_bytes(dst.size_bytes()), " on ", dst.get_device().str());
#endif
}

/// A copy of the device range in a new vector; synchronizes `s` (this is how a user asks for a value).
template <class T>
std::vector<std::remove_const_t<T>> to_vector(device_span<T> src, stream_ref s) {
  std::vector<std::remove_const_t<T>> out(src.size());
  copy(std::span<std::remove_const_t<T>>(out), device_span<const std::remove_const_t<T>>(src), s);
  s.synchronize();
  return out;
}

/// A device buffer on the device of `s` holding a copy of `values`, allocated and filled in stream order on
/// `s`. Unlike `copy`, the host values may be discarded as soon as this returns: a host stream copies from
/// its own snapshot, and CUDA stages pageable memory before returning.
template <class T>
device_buffer<T> to_device(const std::vector<T>& values, stream_ref s) {
  device_buffer<T> out(values.size(), s);
  if (values.empty()) return out;
  if (s.get_device().is_host()) {
    T* dst = out.data();
    detail::enqueue_host(s, [dst, snapshot = values] { std::memcpy(dst, snapshot.data(), snapshot.size() * sizeof(T)); },
                         "copy to device");
    return out;
  }
  copy(out.span(), std::span<const T>(values), s);
  return out;
}

LOCKSTEP_ABI_END
