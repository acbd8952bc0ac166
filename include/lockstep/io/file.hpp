// lockstep/io/file.hpp — the POSIX file operations checkpoints are made of: whole writes and reads that say
// what failed (errno's text, the path, how far it got), fsync of files and directories, and publishing a
// directory or a file by rename so that a reader sees either the old contents or the new, never a mixture.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "lockstep/core/error.hpp"

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

}  // namespace lockstep::detail
