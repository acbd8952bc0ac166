// lockstep/core/error.hpp — the exception types and the check macros.
//
// Every failure on the host throws a `lockstep::error` subtype that owns its message and keeps the status
// code of the library that failed. Messages are sentences: the file:line, the call, the library's error name
// and text, and what was being done. They are built only on failure.
#pragma once

#include <charconv>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace lockstep {

/// Base of every exception lockstep throws. `code()` is the failing library's status code (0 when the
/// failure is lockstep's own, such as a violated precondition).
class error : public std::runtime_error {
 public:
  explicit error(const std::string& message, long code = 0) : std::runtime_error(message), code_(code) {}
  [[nodiscard]] long code() const noexcept { return code_; }

 private:
  long code_;
};

/// A caller broke a documented precondition (bad argument, wrong device, misuse of an API). The message says
/// what was expected, what was found, and the fix when there is one.
class precondition_error : public error {
 public:
  using error::error;
};

/// Device selection or visibility is wrong: a device string that cannot be parsed, an id out of range, or
/// `CUDA_VISIBLE_DEVICES` changed after the CUDA runtime read it.
class device_error : public precondition_error {
 public:
  using precondition_error::precondition_error;
};

/// A device (or the host platform's accounting for a virtual device) could not satisfy an allocation.
class out_of_memory_error : public error {
 public:
  using error::error;
};

/// The CUDA runtime reported an error; `code()` is the `cudaError_t`.
class cuda_error : public error {
 public:
  using error::error;
};

/// cuBLAS reported an error; `code()` is the `cublasStatus_t`.
class cublas_error : public error {
 public:
  using error::error;
};

/// NCCL reported an error; `code()` is the `ncclResult_t`.
class nccl_error : public error {
 public:
  using error::error;
};

/// MPI reported an error; `code()` is the MPI error code.
class mpi_error : public error {
 public:
  using error::error;
};

/// A collective or a wait did not complete in time (a peer died, threw, or never joined).
class timeout_error : public error {
 public:
  using error::error;
};

/// Work queued on a stream failed. Like CUDA's asynchronous errors it is kept by the stream and rethrown at
/// the next synchronization; the message names the stream, where the work was enqueued and what failed.
class async_error : public error {
 public:
  using error::error;
};

/// Input data is malformed: a truncated or mislabeled file, a corrupt header, a sample that cannot be read.
class data_error : public error {
 public:
  using error::error;
};

/// The operating system refused a file operation (no space left, a read-only directory, a missing file).
/// `code()` is the errno value; the message names the operation, the path and strerror's text.
class io_error : public error {
 public:
  using error::error;
};

/// A numerical problem the caller asked to be told about (a non-finite loss, a diverged run).
class numeric_error : public error {
 public:
  using error::error;
};

namespace detail {

/// Trims an absolute `__FILE__` to the part a reader recognizes: "runtime/device_buffer.hpp" for a library
/// header, "kernels/elementwise.hpp" for a kernel header, the file name otherwise.
constexpr std::string_view short_file(std::string_view path) noexcept {
  constexpr std::string_view marks[] = {"include/lockstep/", "kernels/lockstep/"};
  for (std::string_view mark : marks) {
    if (auto p = path.rfind(mark); p != std::string_view::npos) {
      return path.substr(p + mark.size());
    }
  }
  if (auto p = path.rfind('/'); p != std::string_view::npos) return path.substr(p + 1);
  return path;
}

/// Streams every argument into one string; used only on failure paths.
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

/// The shortest decimal that reads back as `v` exactly ("0.1", "1e-08"): for descriptions compared across
/// processes, where streaming's 6 significant digits would hide a difference.
inline std::string shortest(float v) {
  char text[32];
  const auto r = std::to_chars(text, text + sizeof text, v);
  return std::string(text, r.ptr);
}

/// The function name of a stringized call expression: "cudaMemcpyAsync(dst, ...)" -> "cudaMemcpyAsync".
constexpr std::string_view call_name(std::string_view expr) noexcept {
  auto p = expr.find('(');
  std::string_view name = expr.substr(0, p);
  while (!name.empty() && (name.front() == ' ' || name.front() == ':')) name.remove_prefix(1);
  return name;
}

struct source_site {
  const char* file;
  int line;
};

template <class... What>
[[noreturn]] void throw_precondition(source_site at, const char* condition, What&&... what) {
  std::string msg = concat(short_file(at.file), ':', at.line, ": ", std::forward<What>(what)...);
  if constexpr (sizeof...(What) == 0) msg += concat("precondition failed: ", condition);
  throw precondition_error(msg);
}

}  // namespace detail
}  // namespace lockstep

#define LOCKSTEP_SITE (::lockstep::detail::source_site{__FILE__, __LINE__})

/// Checks a precondition of a public entry point. The message arguments are streamed together only when the
/// condition fails: `LOCKSTEP_EXPECTS(n > 0, "batch must hold at least one sample, got ", n)`.
#define LOCKSTEP_EXPECTS(condition, ...)                                                                     \
  do {                                                                                                       \
    if (!(condition)) [[unlikely]] {                                                                         \
      ::lockstep::detail::throw_precondition(LOCKSTEP_SITE, #condition __VA_OPT__(, ) __VA_ARGS__);          \
    }                                                                                                        \
  } while (false)

/// Throws an exception of type `Type` whose message starts with file:line. Arguments are streamed together.
#define LOCKSTEP_THROW(Type, ...)                                                                            \
  throw Type(::lockstep::detail::concat(::lockstep::detail::short_file(__FILE__), ':', __LINE__, ": ",       \
                                        __VA_ARGS__))
