// lockstep/runtime/pinned_buffer.hpp — page-locked host memory for staging copies to and from devices.
//
// With a GPU present, memory comes from cudaHostAlloc, so that copies from it are truly asynchronous and run
// at full bus speed. Without one (or in a host-only translation unit) it is page-aligned ordinary memory:
// host devices read it directly. Either way the buffer is what a data loader assembles batches in.
#pragma once

#include <cstddef>
#include <new>
#include <optional>
#include <span>
#include <type_traits>

#include "lockstep/config.hpp"
#include "lockstep/core/cuda_check.hpp"
#include "lockstep/core/unique_handle.hpp"
#include "lockstep/core/units.hpp"
#include "lockstep/device/device_guard.hpp"
#include "lockstep/device/query.hpp"

LOCKSTEP_DETAIL_BEGIN
inline constexpr std::size_t page_size = 4096;
struct pinned_allocation {
  void* ptr;
  bool cuda;     // from cudaHostAlloc
  int gpu = -1;  // the GPU whose context allocated it (cudaHostAlloc)
};
struct pinned_traits {
  using handle_type = pinned_allocation;
  static constexpr handle_type null() noexcept { return {nullptr, false, -1}; }
  static bool is_null(const handle_type& h) noexcept { return h.ptr == nullptr; }
  static void release(handle_type h) noexcept {
#if LOCKSTEP_HAS_CUDA
    if (h.cuda) {
      // Under the context that allocated it: on a thread without a current context (a data loader's or a
      // checkpoint writer's), cudaFreeHost would otherwise create one on GPU 0 (about 0.5 GB in every process of an
      // mpirun job). cudaFreeHost also waits for the device, so lockstep frees pinned memory only at teardown (the
      // loader's buffers) or keeps it for reuse (the checkpoint writer's staging).
      detail::cuda_device_scope current(h.gpu >= 0 ? h.gpu : 0);
      LOCKSTEP_CUDA_IGNORE(cudaFreeHost(h.ptr));
      return;
    }
#endif
    ::operator delete(h.ptr, std::align_val_t{page_size});
  }
};
LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// `n` elements of T in page-locked (or, without a GPU, page-aligned) host memory. Move-only.
template <class T>
class pinned_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "pinned memory holds trivially copyable elements only");

 public:
  pinned_buffer() = default;

  /// Allocates `n` uninitialized elements, page-locked when a GPU is present. Throws out_of_memory_error (or
  /// cuda_error) on failure. Prefer the constructor that names the device the memory stages for.
  explicit pinned_buffer(std::size_t n) : pinned_buffer(n, std::nullopt) {}

  /// Allocates `n` uninitialized elements to stage copies to and from `near`: page-locked, under near's CUDA
  /// context, for a GPU (a thread with no context would otherwise create one on GPU 0, about 0.5 GB in every
  /// process of an mpirun job); ordinary page-aligned memory for a host device, which needs no pinning.
  pinned_buffer(std::size_t n, device near) : pinned_buffer(n, std::optional<device>(near)) {}

  pinned_buffer(pinned_buffer&& other) noexcept : h_(std::move(other.h_)), size_(std::exchange(other.size_, 0)) {}
  pinned_buffer& operator=(pinned_buffer&& other) noexcept {
    h_ = std::move(other.h_);
    size_ = std::exchange(other.size_, 0);
    return *this;
  }

 private:
  pinned_buffer(std::size_t n, std::optional<device> near) : size_(n) {
    (void)near;  // only a CUDA build has a GPU to stage for
    if (n == 0) return;
    const std::size_t bytes = n * sizeof(T);
#if LOCKSTEP_HAS_CUDA
    if ((!near || near->is_cuda()) && cuda_available()) {
      if (near) check_device_exists(*near);
      std::optional<detail::cuda_device_scope> context;
      if (near) context.emplace(near->index);
      int gpu = near ? near->index : 0;
      if (!near && cudaGetDevice(&gpu) != cudaSuccess) {  // the caller's current device
        (void)cudaGetLastError();
        gpu = 0;
      }
      void* p = nullptr;
      LOCKSTEP_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), "allocating ", format_bytes(bytes),
                          " of pinned host memory");
      h_ = unique_handle<detail::pinned_traits>(detail::pinned_allocation{p, true, gpu});
      return;
    }
#endif
    void* p = ::operator new(bytes, std::align_val_t{detail::page_size}, std::nothrow);
    if (!p) {
      throw out_of_memory_error(detail::concat("could not allocate ", format_bytes(bytes), " of host staging memory"));
    }
    h_ = unique_handle<detail::pinned_traits>(detail::pinned_allocation{p, false, -1});
  }

 public:
  [[nodiscard]] T* data() noexcept { return static_cast<T*>(h_.get().ptr); }
  [[nodiscard]] const T* data() const noexcept { return static_cast<const T*>(h_.get().ptr); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// True when the memory is page-locked by CUDA (cudaHostAlloc).
  [[nodiscard]] bool page_locked() const noexcept { return h_.get().cuda; }

  [[nodiscard]] std::span<T> span() noexcept { return {data(), size_}; }
  [[nodiscard]] std::span<const T> span() const noexcept { return {data(), size_}; }
  T& operator[](std::size_t i) noexcept { return data()[i]; }
  const T& operator[](std::size_t i) const noexcept { return data()[i]; }

 private:
  unique_handle<detail::pinned_traits> h_;
  std::size_t size_ = 0;
};
static_assert(!std::is_copy_constructible_v<pinned_buffer<float>>);

LOCKSTEP_ABI_END
