// lockstep/core/thread_name.hpp — names the library's own threads, as `top -H`, `perf report --sort comm`, gdb's
// `info threads` and /proc/<pid>/task/*/comm show them: "host:0 stream 3", "loader 1", "rank 0", ... instead of the
// program's name for every thread. Plain code (no CUDA, no build configuration); nothing here allocates or throws.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstring>
#include <string_view>

#if defined(__linux__)
#include <pthread.h>
#endif

namespace lockstep::detail {

/// Names the calling thread. Linux keeps 15 bytes of a name: a longer one loses its end. Best effort: a name the
/// system refuses changes nothing else.
inline void name_this_thread(std::string_view name) noexcept {
#if defined(__linux__)
  char text[16];
  const std::size_t n = name.size() < sizeof(text) - 1 ? name.size() : sizeof(text) - 1;
  std::memcpy(text, name.data(), n);
  text[n] = '\0';
  (void)pthread_setname_np(pthread_self(), text);
#else
  (void)name;
#endif
}

/// Names the calling thread `prefix` followed by a space and `number` ("loader 3"), formatted without allocating.
inline void name_this_thread(std::string_view prefix, std::size_t number) noexcept {
  char text[40];
  const std::size_t n = prefix.size() < 16 ? prefix.size() : 16;
  std::memcpy(text, prefix.data(), n);
  text[n] = ' ';
  const auto end = std::to_chars(text + n + 1, text + sizeof(text), number).ptr;
  name_this_thread(std::string_view(text, static_cast<std::size_t>(end - text)));
}

}  // namespace lockstep::detail
