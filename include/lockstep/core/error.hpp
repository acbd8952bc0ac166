// lockstep/core/error.hpp — the exception types and the check macros.
//
// Every failure on the host throws a `lockstep::error` subtype that owns its message and keeps the status
// code of the library that failed. Messages are sentences: the file:line, the call, the library's error name
// and text, and what was being done. They are built only on failure.
#pragma once

#include <charconv>
#include <initializer_list>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#if defined(__GNUC__)
#define LOCKSTEP_COLD __attribute__((cold, noinline))  // failure paths: compiled small, kept out of the caller
#else
#define LOCKSTEP_COLD
#endif

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

/// One argument of an error message: text, a number, or anything with an `operator<<` (held by address until the
/// message is built, within the full expression that throws). Messages are lists of pieces so that the code that
/// formats them exists once (`format_message`), not once per call site's argument types: that code is most of
/// what an error path costs to compile.
class message_piece {
 public:
  message_piece(const char* text) noexcept : kind_(kind::text), text_(text != nullptr ? text : "(null)") {}
  message_piece(std::string_view text) noexcept : kind_(kind::text), text_(text) {}
  message_piece(const std::string& text) noexcept : kind_(kind::text), text_(text) {}
  message_piece(char c) noexcept : kind_(kind::character), char_(c) {}
  message_piece(bool b) noexcept : kind_(kind::boolean), bool_(b) {}
  message_piece(float v) noexcept : kind_(kind::floating), double_(v) {}
  message_piece(double v) noexcept : kind_(kind::floating), double_(v) {}
  /// Integers print as numbers; one-byte integers (signed and unsigned char) as characters, as streams print them.
  template <class T>
    requires(std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>)
  message_piece(T v) noexcept {
    if constexpr (sizeof(T) == 1) {
      kind_ = kind::character;
      char_ = static_cast<char>(v);
    } else if constexpr (std::is_signed_v<T>) {
      kind_ = kind::signed_integer;
      signed_ = v;
    } else {
      kind_ = kind::unsigned_integer;
      unsigned_ = v;
    }
  }
  /// Anything else a stream prints (a path, a device, an enum, a pointer): printed by its own operator<<.
  template <class T>
    requires(!std::is_arithmetic_v<T> && !std::is_convertible_v<const T&, std::string_view> &&
             requires(std::ostream& os, const T& v) { os << v; })
  message_piece(const T& v) noexcept
      : kind_(kind::streamed), object_(&v),
        print_([](std::ostream& os, const void* p) { os << *static_cast<const T*>(p); }) {}

  void print(std::ostream& os) const {
    switch (kind_) {
      case kind::text: os << text_; break;
      case kind::character: os << char_; break;
      case kind::boolean: os << bool_; break;
      case kind::signed_integer: os << signed_; break;
      case kind::unsigned_integer: os << unsigned_; break;
      case kind::floating: os << double_; break;
      case kind::streamed: print_(os, object_); break;
    }
  }

 private:
  enum class kind : unsigned char { text, character, boolean, signed_integer, unsigned_integer, floating, streamed };
  kind kind_{kind::text};
  std::string_view text_;
  union {
    char char_;
    bool bool_;
    long long signed_;
    unsigned long long unsigned_;
    double double_;
    const void* object_;
  };
  void (*print_)(std::ostream&, const void*) = nullptr;
};

/// A message: its pieces in order.
using message = std::initializer_list<message_piece>;

/// The pieces printed one after another into `os`, as streaming them would.
LOCKSTEP_COLD inline void print_message(std::ostream& os, message pieces) {
  for (const message_piece& piece : pieces) piece.print(os);
}

/// The pieces printed one after another into one string; used only on failure paths.
LOCKSTEP_COLD inline std::string format_message(message pieces) {
  std::ostringstream os;
  print_message(os, pieces);
  return os.str();
}

/// Streams every argument into one string; used only on failure paths.
template <class... Args>
std::string concat(const Args&... args) {
  return format_message(message{message_piece(args)...});
}

/// "file:line: " and the message (the start of every message LOCKSTEP_EXPECTS and LOCKSTEP_THROW build).
LOCKSTEP_COLD inline std::string site_message(const char* file, int line, message what) {
  std::ostringstream os;
  os << short_file(file) << ':' << line << ": ";
  print_message(os, what);
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

/// "file:line call: STATUS while <what>" ("while" and `what` only when `what` has pieces): the message of a
/// library call that failed (CUDA, cuBLAS, NCCL, MPI), `status` naming the library's status and its text.
LOCKSTEP_COLD inline std::string call_failure_message(source_site at, const char* call, std::string_view status,
                                                      message what) {
  std::ostringstream os;
  os << short_file(at.file) << ':' << at.line << ' ' << call_name(call) << ": " << status;
  if (what.size() > 0) {
    os << " while ";
    print_message(os, what);
  }
  return os.str();
}

[[noreturn]] LOCKSTEP_COLD inline void throw_precondition(source_site at, const char* condition, message what) {
  if (what.size() == 0) {
    throw precondition_error(site_message(at.file, at.line, message{"precondition failed: ", condition}));
  }
  throw precondition_error(site_message(at.file, at.line, what));
}

}  // namespace detail
}  // namespace lockstep

#define LOCKSTEP_SITE (::lockstep::detail::source_site{__FILE__, __LINE__})

/// Checks a precondition of a public entry point. The message arguments are streamed together only when the
/// condition fails: `LOCKSTEP_EXPECTS(n > 0, "batch must hold at least one sample, got ", n)`.
#define LOCKSTEP_EXPECTS(condition, ...)                                                                     \
  do {                                                                                                       \
    if (!(condition)) [[unlikely]] {                                                                         \
      ::lockstep::detail::throw_precondition(LOCKSTEP_SITE, #condition,                                      \
                                             ::lockstep::detail::message{__VA_ARGS__});                      \
    }                                                                                                        \
  } while (false)

/// Throws an exception of type `Type` whose message starts with file:line. Arguments are streamed together.
#define LOCKSTEP_THROW(Type, ...)                                                                            \
  throw Type(::lockstep::detail::site_message(__FILE__, __LINE__, ::lockstep::detail::message{__VA_ARGS__}))
