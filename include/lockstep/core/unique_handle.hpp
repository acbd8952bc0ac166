// lockstep/core/unique_handle.hpp — the one move-only owner every resource type is built on.
//
// A resource (stream, event, allocation, communicator, library handle) is described by a Traits type:
//
//   struct traits {
//     using handle_type = ...;                          // trivially copyable
//     static constexpr handle_type null() noexcept;     // the empty value
//     static bool is_null(const handle_type&) noexcept;
//     static void release(handle_type) noexcept;         // never throws; errors are swallowed here only
//   };
//
// The owner moves with std::exchange, so a field-by-field move bug cannot be written twice.
#pragma once

#include <type_traits>
#include <utility>

namespace lockstep {

template <class Traits>
class unique_handle {
 public:
  using traits_type = Traits;
  using handle_type = typename Traits::handle_type;
  static_assert(std::is_trivially_copyable_v<handle_type>, "a handle must be a plain value");

  constexpr unique_handle() noexcept = default;
  /// Takes ownership of `h`.
  constexpr explicit unique_handle(handle_type h) noexcept : h_(h) {}
  unique_handle(const unique_handle&) = delete;
  unique_handle& operator=(const unique_handle&) = delete;
  unique_handle(unique_handle&& other) noexcept : h_(std::exchange(other.h_, Traits::null())) {}
  unique_handle& operator=(unique_handle&& other) noexcept {
    if (this != &other) {
      reset();
      h_ = std::exchange(other.h_, Traits::null());
    }
    return *this;
  }
  ~unique_handle() { reset(); }

  /// Releases the owned handle, if any.
  void reset() noexcept {
    if (!Traits::is_null(h_)) Traits::release(std::exchange(h_, Traits::null()));
  }
  /// Gives up ownership without releasing.
  [[nodiscard]] handle_type release() noexcept { return std::exchange(h_, Traits::null()); }
  [[nodiscard]] const handle_type& get() const noexcept { return h_; }
  [[nodiscard]] explicit operator bool() const noexcept { return !Traits::is_null(h_); }

 private:
  handle_type h_ = Traits::null();
};

}  // namespace lockstep
