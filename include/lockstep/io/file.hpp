// lockstep/io/file.hpp — the POSIX file operations checkpoints are made of: whole writes and reads that say
// what failed (errno's text, the path, how far it got), fsync of files and directories, and publishing a
// directory or a file by rename so that a reader sees either the old contents or the new, never a mixture.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "lockstep/core/error.hpp"
#include "lockstep/core/unique_handle.hpp"

namespace lockstep::detail {

/// io_error for `what` on `path` with errno `err`: "writing /x/model.safetensors: No space left on device".
[[noreturn]] inline void throw_io(int err, std::string_view what, const std::filesystem::path& path,
                                  std::string_view detail_text = {}) {
  throw io_error(concat(what, " ", path.string(), ": ", std::strerror(err), detail_text.empty() ? "" : " (",
                        detail_text, detail_text.empty() ? "" : ")"),
                 err);
}

/// An open file descriptor, closed by the destructor (errors ignored there: `close()` reports them).
class posix_file {
 public:
  posix_file(const std::filesystem::path& path, int flags, mode_t mode = 0644) : path_(path) {
    do fd_ = ::open(path.c_str(), flags | O_CLOEXEC, mode);
    while (fd_ < 0 && errno == EINTR);
    if (fd_ < 0) throw_io(errno, (flags & (O_WRONLY | O_RDWR)) ? "creating" : "opening", path);
  }
  posix_file(const posix_file&) = delete;
  posix_file& operator=(const posix_file&) = delete;
  ~posix_file() {
    if (fd_ >= 0) ::close(fd_);
  }

  [[nodiscard]] int fd() const noexcept { return fd_; }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

  /// Writes every byte of `data` at the current position.
  void write_all(std::span<const std::byte> data) {
    std::size_t done = 0;
    while (done < data.size()) {
      // Linux writes at most 0x7ffff000 bytes per call.
      const std::size_t chunk = std::min<std::size_t>(data.size() - done, std::size_t{1} << 30);
      const ssize_t n = ::write(fd_, data.data() + done, chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw_io(errno, "writing", path_, concat("after ", done + written_, " bytes"));
      if (n == 0) throw_io(EIO, "writing", path_, "the write made no progress");
      done += static_cast<std::size_t>(n);
    }
    written_ += done;
  }

  /// Reads exactly `out.size()` bytes from the current position; data_error when the file ends first.
  void read_all(std::span<std::byte> out) {
    std::size_t done = 0;
    while (done < out.size()) {
      const std::size_t chunk = std::min<std::size_t>(out.size() - done, std::size_t{1} << 30);
      const ssize_t n = ::read(fd_, out.data() + done, chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw_io(errno, "reading", path_);
      if (n == 0) throw data_error(concat(path_.string(), ": the file ended after ", done, " of ", out.size(), " bytes"));
      done += static_cast<std::size_t>(n);
    }
  }

  [[nodiscard]] std::uint64_t size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) throw_io(errno, "reading the size of", path_);
    return static_cast<std::uint64_t>(st.st_size);
  }

  /// Flushes the file's data and size to the device.
  void sync() {
    if (::fsync(fd_) != 0) throw_io(errno, "syncing", path_);
  }

  /// Closes now, reporting the error a deferred write may only report here.
  void close() {
    const int fd = std::exchange(fd_, -1);
    if (fd >= 0 && ::close(fd) != 0 && errno != EINTR) throw_io(errno, "closing", path_);
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  std::uint64_t written_ = 0;
};

/// A whole file mapped read-only (MAP_POPULATE: the page cache's pages are mapped up front, without a fault per
/// page and without copying them). Move-only; unmapped by the destructor.
class mapped_file {
 public:
  mapped_file() = default;
  explicit mapped_file(const std::filesystem::path& path) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {  // open() succeeds on one and mmap() says "No such device"
      throw_io(EISDIR, "reading", path, "a directory, not a file: give the file in it, e.g. its model.safetensors");
    }
    posix_file f(path, O_RDONLY);
    size_ = f.size();
    if (size_ == 0) return;
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE | MAP_POPULATE, f.fd(), 0);
    if (p == MAP_FAILED) throw_io(errno, "mapping", path);
    data_ = static_cast<const std::byte*>(p);
  }
  mapped_file(mapped_file&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  mapped_file& operator=(mapped_file&& other) noexcept {
    if (this != &other) {
      unmap();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  ~mapped_file() { unmap(); }

  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return {data_, data_ ? size_ : 0}; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }

 private:
  void unmap() noexcept {
    if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
    data_ = nullptr;
  }
  const std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
};

/// fsync of a directory: makes the names created, renamed or removed in it durable.
inline void sync_directory(const std::filesystem::path& dir) {
  posix_file d(dir, O_RDONLY | O_DIRECTORY);
  d.sync();
}

/// rename(2) with a sentence on failure.
inline void rename_path(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    throw_io(errno, "renaming", from, concat("to ", to.string()));
  }
}

/// Creates `dir` and its parents; io_error naming the directory when that fails (read-only, not a directory).
inline void make_directories(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw io_error(concat("creating the directory ", dir.string(), ": ", ec.message()), ec.value());
}

/// A file descriptor as a unique_handle: closed when its owner ends.
struct fd_traits {
  using handle_type = int;
  static constexpr int null() noexcept { return -1; }
  static bool is_null(int fd) noexcept { return fd < 0; }
  static void release(int fd) noexcept { ::close(fd); }
};

/// The name of the lock file a checkpoint root's writer holds.
inline constexpr const char* writer_lock_name = ".lockstep-writer.lock";

/// An exclusive flock(2) on `dir`/.lockstep-writer.lock, held while this object lives: one writer per directory.
/// The kernel drops the lock when its holder ends, however it ends (kill -9 included), so a crashed writer leaves
/// nothing held (on local file systems; NFS keeps a crashed client's lock until its lease ends). The file names its
/// holder (process, host), for the message of the writer refused. A file system without flock (ENOLCK, ENOSYS,
/// EOPNOTSUPP: NFSv3 without lockd, Lustre without flock) gets a warning and no lock: writing still works.
class directory_lock {
 public:
  directory_lock() = default;
  /// Takes the lock, or throws io_error naming `dir` and its holder (`who` names the caller).
  directory_lock(const std::filesystem::path& dir, std::string_view who) {
    const std::filesystem::path path = dir / writer_lock_name;
    auto open_lock = [&](int flags) {
      int fd = -1;
      do fd = ::open(path.c_str(), flags | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0666);
      while (fd < 0 && errno == EINTR);
      return fd;
    };
    int fd = open_lock(O_RDWR);
    const bool named = fd >= 0;
    if (fd < 0 && errno == EACCES) fd = open_lock(O_RDONLY);  // another user's lock file: lock it, name nobody
    if (fd < 0) throw_io(errno, "creating the lock file", path);
    unique_handle<fd_traits> file(fd);
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == ENOLCK || err == ENOSYS || err == EOPNOTSUPP || err == EINVAL) {
        std::fprintf(stderr, "lockstep: %s: %s does not support flock (%s): writing without the one-writer lock\n",
                     std::string(who).c_str(), dir.c_str(), std::strerror(err));
        return;
      }
      if (err != EWOULDBLOCK) throw_io(err, "locking", path);
      char text[256] = {};
      const ssize_t n = ::pread(fd, text, sizeof text - 1, 0);
      const std::string holder = n > 0 ? std::string(text, static_cast<std::size_t>(n)) : "a run that has not said who";
      throw io_error(concat(who, ": ", dir.string(), " is being written by another run (", holder, "): one run writes "
                            "a checkpoint root at a time; save this one under another directory, or resume that "
                            "run's checkpoints once it has ended"),
                     err);
    }
    if (named) {
      char host[256] = {};
      (void)::gethostname(host, sizeof host - 1);
      const std::string me = concat("process ", ::getpid(), " on ", host);
      if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, me.data(), me.size(), 0);  // the name only helps a message
    }
    file_ = std::move(file);
  }
  [[nodiscard]] bool held() const noexcept { return static_cast<bool>(file_); }

 private:
  unique_handle<fd_traits> file_;
};

/// Checks that files can be created in `dir` (created with its parents when missing) by creating and removing a
/// probe file there. io_error naming `dir` and the reason otherwise ("is a regular file", "Permission denied",
/// "Read-only file system"). `who` names the caller.
inline void expect_writable_directory(const std::filesystem::path& dir, std::string_view who) {
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec)) {
    throw io_error(concat(who, ": ", dir.string(), " exists and is not a directory (a regular file?): give a "
                          "directory for the checkpoints"), ENOTDIR);
  }
  try {
    make_directories(dir);
    const std::filesystem::path probe = dir / concat(".lockstep-write-check-", ::getpid(), "-",
                                                     std::hash<std::thread::id>{}(std::this_thread::get_id()));
    { posix_file f(probe, O_WRONLY | O_CREAT | O_EXCL, 0600); }
    ::unlink(probe.c_str());
  } catch (const io_error& e) {
    throw io_error(concat(who, ": cannot write checkpoints under ", dir.string(), " (", e.what(),
                          "); give a directory this process can write"), e.code());
  }
}

}  // namespace lockstep::detail
