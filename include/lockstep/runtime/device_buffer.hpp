// lockstep/runtime/device_buffer.hpp — typed device memory: the owner `device_buffer<T>` and the view
// `device_span<T>`.
//
// A device_buffer is allocated and freed in stream order on the stream given at construction (RMM's
// `device_uvector` contract, without its trap): the buffer may outlive the `stream` object it was allocated
// on. A host stream's state is reference-counted and stays, shut down, until its last buffer is freed; a GPU
// stream's handle goes back to a per-device pool when its `stream` is destroyed, so it is still a valid
// stream to free on. Its contents are uninitialized; fill them with a copy or a kernel.
#pragma once

#include <cstddef>
#include <type_traits>

#include "lockstep/config.hpp"
#include "lockstep/core/unique_handle.hpp"
#include "lockstep/runtime/memory.hpp"
#include "lockstep/runtime/stream.hpp"

LOCKSTEP_ABI_BEGIN

/// A view of `size` elements of type T in the memory of `device`. Cheap to copy; never owns.
template <class T>
class device_span {
 public:
  using element_type = T;
  constexpr device_span() noexcept = default;
  constexpr device_span(T* data, std::size_t size, device dev) noexcept : data_(data), size_(size), dev_(dev) {}
  /// A span of T converts to a span of const T.
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  constexpr device_span(const device_span<U>& other) noexcept  // NOLINT(google-explicit-constructor)
      : data_(other.data()), size_(other.size()), dev_(other.get_device()) {}

  [[nodiscard]] constexpr T* data() const noexcept { return data_; }
  [[nodiscard]] constexpr std::size_t size() const noexcept { return size_; }
  [[nodiscard]] constexpr std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  [[nodiscard]] constexpr bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] constexpr device get_device() const noexcept { return dev_; }

  /// Elements [offset, offset + count); throws precondition_error when out of range.
  [[nodiscard]] device_span subspan(std::size_t offset, std::size_t count) const {
    LOCKSTEP_EXPECTS(offset <= size_ && count <= size_ - offset, "subspan(", offset, ", ", count,
                     ") is out of range of a span of ", size_, " elements on ", dev_.str());
    return device_span(data_ + offset, count, dev_);
  }
  [[nodiscard]] device_span first(std::size_t count) const { return subspan(0, count); }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
  device dev_{};
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN
/// The handle an allocation keeps of its stream; a host stream's state gets a reference (see the file comment).
inline native_handle retain_stream(stream_ref s) noexcept {
  if (s.get_device().is_host()) s.host_state().add_ref();
  return {s.get_device(), s.native_handle()};
}
inline void release_stream(native_handle h) noexcept {
  if (h.dev.is_host() && h.ptr != nullptr) static_cast<host_backend::stream_state*>(h.ptr)->drop_ref();
}
struct allocation {
  void* ptr;
  std::size_t bytes;
  native_handle stream;  // the deallocation stream
};
struct allocation_traits {
  using handle_type = allocation;
  static constexpr handle_type null() noexcept { return {nullptr, 0, {device{}, nullptr}}; }
  static bool is_null(const handle_type& h) noexcept { return h.ptr == nullptr; }
  static void release(handle_type h) noexcept;
};
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// `n` elements of T in the memory of a device, owned. Move-only.
template <class T>
class device_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "device memory holds trivially copyable elements only");

 public:
  using value_type = T;

  /// An empty buffer (no device, no memory).
  device_buffer() = default;

  /// `n` uninitialized elements on the device of `s`, allocated in stream order on `s` (usable by work
  /// queued on `s`; other streams must wait for an event recorded on `s` after this call). Throws
  /// out_of_memory_error when the device is full.
  device_buffer(std::size_t n, stream_ref s) : size_(n), dev_(s.get_device()) {
    if (n == 0) return;
    void* p = detail::allocate(n * sizeof(T), s);
    h_ = unique_handle<detail::allocation_traits>(detail::allocation{p, n * sizeof(T), detail::retain_stream(s)});
  }

  device_buffer(device_buffer&& other) noexcept
      : h_(std::move(other.h_)), size_(std::exchange(other.size_, 0)), dev_(other.dev_) {}
  device_buffer& operator=(device_buffer&& other) noexcept {
    h_ = std::move(other.h_);
    size_ = std::exchange(other.size_, 0);
    dev_ = other.dev_;
    return *this;
  }

  [[nodiscard]] T* data() noexcept { return static_cast<T*>(h_.get().ptr); }
  [[nodiscard]] const T* data() const noexcept { return static_cast<const T*>(h_.get().ptr); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] device get_device() const noexcept { return dev_; }

  /// The stream the memory will be freed on.
  [[nodiscard]] stream_ref stream() const {
    LOCKSTEP_EXPECTS(h_.get().stream.ptr != nullptr, "an empty device_buffer has no stream");
    return stream_of(h_.get().stream);
  }
  /// Frees on `s` instead (for a buffer handed to work on another stream that outlives the first).
  void set_stream(stream_ref s) {
    LOCKSTEP_EXPECTS(s.get_device() == dev_ || empty(), "set_stream: a buffer of ", dev_.str(),
                     " cannot be freed on a stream of ", s.get_device().str());
    auto a = h_.release();
    const detail::native_handle previous = a.stream;
    a.stream = detail::retain_stream(s);
    detail::release_stream(previous);
    h_ = unique_handle<detail::allocation_traits>(a);
  }

  [[nodiscard]] device_span<T> span() noexcept { return {data(), size_, dev_}; }
  [[nodiscard]] device_span<const T> span() const noexcept { return {data(), size_, dev_}; }
  // NOLINTNEXTLINE(google-explicit-constructor)
  operator device_span<T>() noexcept { return span(); }
  // NOLINTNEXTLINE(google-explicit-constructor)
  operator device_span<const T>() const noexcept { return span(); }

 private:
  static stream_ref stream_of(detail::native_handle h);

  unique_handle<detail::allocation_traits> h_;
  std::size_t size_ = 0;
  device dev_{};
};
static_assert(!std::is_copy_constructible_v<device_buffer<float>>);
static_assert(std::is_nothrow_move_constructible_v<device_buffer<float>>);

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN
/// Rebuilds a stream view from a stored handle (the owning stream or default stream is still alive).
inline stream_ref stream_from_native(native_handle h) {
  if (h.dev.is_host()) return stream_ref::from_native_handle(h.dev, static_cast<host_backend::stream_state*>(h.ptr));
#if LOCKSTEP_HAS_CUDA
  return stream_ref::from_native_handle(h.dev, static_cast<cudaStream_t>(h.ptr));
#else
  throw device_error("unreachable: no CUDA stream in a host-only translation unit");
#endif
}
inline void allocation_traits::release(handle_type h) noexcept {
  try {
    deallocate(h.ptr, h.bytes, stream_from_native(h.stream));
  } catch (...) {
    // Unreachable for a handle built by device_buffer; a destructor must not throw either way.
  }
  release_stream(h.stream);
}
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN
template <class T>
stream_ref device_buffer<T>::stream_of(detail::native_handle h) {
  return detail::stream_from_native(h);
}
LOCKSTEP_ABI_END
