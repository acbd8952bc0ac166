// lockstep/data/idx.hpp — the IDX file format (MNIST, Fashion-MNIST), plain or gzip-compressed, and the
// MNIST-style dataset read from a pair of IDX files.
//
// An IDX file is a 4-byte magic number (two zero bytes, a type code, the rank), then one big-endian u32 per
// dimension, then the elements in row-major order, multi-byte elements big-endian. The reader trusts nothing:
// the header is checked against the length of the file before anything is allocated, and a gzip stream (whose
// decompressed length cannot be known up front) is read into a buffer that grows with the data actually
// decompressed, never to the size the header claims. Needs zlib (link with -lz).
#pragma once

#include <zlib.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/unique_handle.hpp"
#include "lockstep/data/dataset.hpp"

namespace lockstep {

/// The largest payload `read_idx` accepts: 16 GiB (2^34 bytes). A header describing more is taken to be corrupt
/// and rejected before anything is allocated.
inline constexpr std::uint64_t max_idx_payload_bytes = std::uint64_t{1} << 34;

/// One array read from an IDX file. `data` holds `element_count()` elements of `type`, row-major, in host byte
/// order (multi-byte values have been converted from the file's big-endian order).
struct idx_array {
  dtype type = dtype::u8;
  std::vector<std::size_t> dims;  // outermost first, each >= 1, 1 to 4 of them
  std::vector<std::byte> data;    // [dims...] elements of `type`

  /// Number of elements: the product of `dims`.
  [[nodiscard]] std::size_t element_count() const noexcept { return detail::elements_of(dims); }

  /// Element `flat_index` (row-major) as a `T`. Precondition: `T` is the C++ type of `type` (std::uint8_t,
  /// std::int32_t or float) and `flat_index < element_count()`; throws precondition_error otherwise.
  template <class T>
  [[nodiscard]] T element(std::size_t flat_index) const {
    static_assert(std::is_same_v<T, std::uint8_t> || std::is_same_v<T, std::int32_t> || std::is_same_v<T, float>,
                  "idx_array holds u8, i32 or f32 elements");
    constexpr dtype requested = std::is_same_v<T, std::uint8_t>    ? dtype::u8
                                : std::is_same_v<T, std::int32_t> ? dtype::i32
                                                                  : dtype::f32;
    LOCKSTEP_EXPECTS(type == requested, "idx_array::element: the array holds ", name_of(type),
                     " elements, but they were read as ", name_of(requested));
    LOCKSTEP_EXPECTS(flat_index < element_count(), "idx_array::element: index ", flat_index,
                     " is out of range for an array of ", element_count(), " elements");
    T value;
    std::memcpy(&value, data.data() + flat_index * sizeof(T), sizeof(T));
    return value;
  }
};

namespace detail {

struct stdio_file_traits {
  using handle_type = std::FILE*;
  static constexpr handle_type null() noexcept { return nullptr; }
  static bool is_null(handle_type f) noexcept { return f == nullptr; }
  static void release(handle_type f) noexcept { std::fclose(f); }
};

struct gz_file_traits {
  using handle_type = gzFile;
  static constexpr handle_type null() noexcept { return nullptr; }
  static bool is_null(handle_type f) noexcept { return f == nullptr; }
  static void release(handle_type f) noexcept { gzclose(f); }
};

/// "0x0B".
inline std::string hex_byte(unsigned value) {
  constexpr char digits[] = "0123456789ABCDEF";
  return {'0', 'x', digits[(value >> 4) & 0xF], digits[value & 0xF]};
}

/// The text of an errno value, thread-safe (unlike std::strerror).
inline std::string errno_text(int err) { return std::generic_category().message(err); }

/// zlib's gzerror text for the file `f` opened from `path`, without the "path: " prefix zlib puts in front of it.
inline std::string gz_error_text(gzFile f, const std::string& path, int& errnum) {
  const char* msg = gzerror(f, &errnum);
  if (errnum == Z_ERRNO) return errno_text(errno);
  std::string_view text = msg != nullptr ? msg : "";
  if (text.size() > path.size() + 2 && text.substr(0, path.size()) == path && text.substr(path.size(), 2) == ": ") {
    text.remove_prefix(path.size() + 2);
  }
  return std::string(text);
}

/// Reads and discards up to `limit` bytes from `src`; returns how many there were.
template <class Source>
std::uint64_t skip_bytes(Source& src, std::uint64_t limit) {
  std::array<std::byte, 16384> scratch;
  std::uint64_t total = 0;
  while (total < limit) {
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(scratch.size(), limit - total));
    const std::size_t got = src.read(std::span(scratch.data(), want));
    total += got;
    if (got < want) break;
  }
  return total;
}

/// Reads an uncompressed file whose length is known, so the header can be checked against it.
class idx_plain_source {
 public:
  idx_plain_source(const std::filesystem::path& path, std::uint64_t file_size) : path_(path), size_(file_size) {
    file_ = unique_handle<stdio_file_traits>(std::fopen(path.c_str(), "rb"));
    if (!file_) {
      LOCKSTEP_THROW(data_error, "cannot read IDX file '", path_.string(), "': cannot open it: ", errno_text(errno));
    }
  }

  /// Reads up to `dst.size()` bytes; fewer only at the end of the file. Throws data_error on an I/O error.
  std::size_t read(std::span<std::byte> dst) {
    const std::size_t got = std::fread(dst.data(), 1, dst.size(), file_.get());
    if (got < dst.size() && std::ferror(file_.get())) {
      LOCKSTEP_THROW(data_error, "cannot read IDX file '", path_.string(), "': reading failed after ",
                     consumed_ + got, " bytes: ", errno_text(errno));
    }
    consumed_ += got;
    return got;
  }
  /// Bytes left in the file after what has been read.
  [[nodiscard]] std::optional<std::uint64_t> remaining() const noexcept {
    return size_ > consumed_ ? size_ - consumed_ : 0;
  }
  /// Why the data ended before it was expected to, beyond the bare byte count (nothing for a plain file).
  [[nodiscard]] std::string end_note() const { return {}; }
  /// Counts (and discards) up to `limit` further bytes.
  std::uint64_t drain(std::uint64_t limit) { return skip_bytes(*this, limit); }
  /// What an IDX file with nothing in it is called in a message.
  static constexpr const char* empty_text = "the file is empty";

 private:
  std::filesystem::path path_;
  unique_handle<stdio_file_traits> file_;
  std::uint64_t size_ = 0;
  std::uint64_t consumed_ = 0;
};

/// Reads a gzip-compressed file through zlib. Its decompressed length is unknown until it has been read.
class idx_gzip_source {
 public:
  /// `file_size`: the compressed file's length (it bounds what the stream can decompress to, see `size_bound`).
  idx_gzip_source(const std::filesystem::path& path, std::uint64_t file_size) : path_(path), file_size_(file_size) {
    file_ = unique_handle<gz_file_traits>(gzopen(path.c_str(), "rb"));
    if (!file_) {
      LOCKSTEP_THROW(data_error, "cannot read IDX file '", path_.string(), "': gzopen failed: ", errno_text(errno));
    }
    // A larger input buffer than zlib's 8 KiB default makes the read of a 26 MB image file several times faster.
    gzbuffer(file_.get(), 256 * 1024);
  }

  /// Reads up to `dst.size()` decompressed bytes; fewer only at the end of the stream. A stream that ends
  /// before its gzip trailer is noted (see `end_note`); a corrupt stream or an I/O error throws data_error.
  std::size_t read(std::span<std::byte> dst) {
    std::size_t total = 0;
    while (total < dst.size()) {
      const auto chunk = static_cast<unsigned>(std::min<std::size_t>(dst.size() - total, std::size_t{1} << 30));
      const int got = gzread(file_.get(), dst.data() + total, chunk);
      if (got < 0) {
        int errnum = Z_OK;
        const std::string why = gz_error_text(file_.get(), path_.string(), errnum);
        const char* what = errnum == Z_DATA_ERROR ? "the gzip stream is corrupt"
                           : errnum == Z_MEM_ERROR ? "zlib ran out of memory"
                           : errnum == Z_ERRNO     ? "reading failed"
                                                   : "zlib failed";
        // No byte count here: zlib decompresses ahead into its own buffer, so where it noticed the damage (often
        // only at the CRC check of the trailer) says nothing about how much of the payload we had received.
        LOCKSTEP_THROW(data_error, "cannot read IDX file '", path_.string(), "': ", what, " (zlib: ", why, ")");
      }
      if (got == 0) break;
      total += static_cast<std::size_t>(got);
    }
    if (total < dst.size()) {
      int errnum = Z_OK;
      std::string why = gz_error_text(file_.get(), path_.string(), errnum);
      if (errnum == Z_BUF_ERROR) ended_early_ = std::move(why);
    }
    return total;
  }
  /// Unknown for a gzip stream.
  [[nodiscard]] std::optional<std::uint64_t> remaining() const noexcept { return std::nullopt; }
  /// The most a valid stream of this file can decompress to: deflate expands its input at most 1032 times (a
  /// 258-byte match costs at least 2 bits), and the gzip framing only adds to the input.
  [[nodiscard]] std::uint64_t size_bound() const noexcept {
    constexpr std::uint64_t ratio = 1032;
    return file_size_ > std::numeric_limits<std::uint64_t>::max() / ratio ? std::numeric_limits<std::uint64_t>::max()
                                                                          : file_size_ * ratio;
  }
  /// " (the gzip stream itself is cut off: ...)" when the compressed data ended before the gzip trailer.
  [[nodiscard]] std::string end_note() const {
    if (ended_early_.empty()) return {};
    return concat(" (the gzip stream itself is cut off: zlib says '", ended_early_, "')");
  }
  /// Counts (and discards) up to `limit` further decompressed bytes; throws data_error if the stream is corrupt.
  std::uint64_t drain(std::uint64_t limit) { return skip_bytes(*this, limit); }
  /// What an IDX file with nothing in it is called in a message.
  static constexpr const char* empty_text = "the file decompresses to nothing";

 private:
  std::filesystem::path path_;
  unique_handle<gz_file_traits> file_;
  std::uint64_t file_size_ = 0;
  std::string ended_early_;
};

/// Converts `data` (elements of `elem_size` bytes) from big-endian to host order in place.
inline void big_endian_to_host(std::span<std::byte> data, std::size_t elem_size) noexcept {
  static_assert(std::endian::native == std::endian::little || std::endian::native == std::endian::big,
                "lockstep supports little- and big-endian hosts only");
  if constexpr (std::endian::native == std::endian::little) {
    if (elem_size == 1) return;
    for (std::size_t i = 0; i + elem_size <= data.size(); i += elem_size) {
      std::reverse(data.begin() + static_cast<std::ptrdiff_t>(i),
                   data.begin() + static_cast<std::ptrdiff_t>(i + elem_size));
    }
  }
}

/// Parses an IDX stream from `src` (an idx_plain_source or idx_gzip_source); `path` is for messages.
template <class Source>
idx_array parse_idx(Source& src, const std::filesystem::path& path) {
  const std::string file = path.string();

  std::array<std::byte, 4> magic{};
  std::size_t got = src.read(magic);
  if (got == 0) {
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': ", Source::empty_text, src.end_note(),
                   "; an IDX file starts with a 4-byte magic number");
  }
  if (got < magic.size()) {
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': the header is truncated: the magic number needs ",
                   magic.size(), " bytes, found ", got, src.end_note());
  }
  const auto byte_at = [&](std::size_t i) { return std::to_integer<unsigned>(magic[i]); };
  if (byte_at(0) != 0 || byte_at(1) != 0) {
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': wrong magic number ", hex_byte(byte_at(0)), ' ',
                   hex_byte(byte_at(1)), ' ', hex_byte(byte_at(2)), ' ', hex_byte(byte_at(3)),
                   "; an IDX file starts with two zero bytes, then a type code and the rank");
  }

  idx_array out;
  const unsigned code = byte_at(2);
  switch (code) {
    case 0x08: out.type = dtype::u8; break;
    case 0x0C: out.type = dtype::i32; break;
    case 0x0D: out.type = dtype::f32; break;
    case 0x09:
    case 0x0B:
    case 0x0E:
      LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': type code ", hex_byte(code), " (",
                     code == 0x09 ? "i8" : code == 0x0B ? "i16" : "f64",
                     ") is valid IDX but not supported; lockstep reads type codes 0x08 (u8), 0x0C (i32) and 0x0D "
                     "(f32)");
    default:
      LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': unknown type code ", hex_byte(code),
                     "; IDX type codes are 0x08 (u8), 0x09 (i8), 0x0B (i16), 0x0C (i32), 0x0D (f32) and 0x0E (f64)");
  }

  const unsigned rank = byte_at(3);
  if (rank < 1 || rank > 4) {
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': the header says rank ", rank,
                   "; lockstep reads IDX arrays of rank 1 to 4");
  }

  std::array<std::byte, 16> dim_bytes{};
  const std::size_t dims_size = 4 * std::size_t{rank};
  got = src.read(std::span(dim_bytes.data(), dims_size));
  if (got < dims_size) {
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': the header is truncated: a rank-", rank,
                   " header needs ", 4 + dims_size, " bytes, found ", 4 + got, src.end_note());
  }
  out.dims.resize(rank);
  for (std::size_t i = 0; i < rank; ++i) {
    std::uint32_t d = 0;
    for (std::size_t b = 0; b < 4; ++b) d = (d << 8) | std::to_integer<std::uint32_t>(dim_bytes[4 * i + b]);
    out.dims[i] = d;
  }
  for (std::size_t i = 0; i < rank; ++i) {
    if (out.dims[i] == 0) {
      LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': dimension ", i, " of ", format_dims(out.dims),
                     " is 0; every dimension must be at least 1");
    }
  }

  // Each dimension is below 2^32, so the product can overflow 64 bits only from the third one on.
  const std::size_t elem_size = size_of(out.type);
  std::uint64_t bytes = elem_size;
  bool overflow = false;
  for (std::size_t d : out.dims) {
    if (bytes > std::numeric_limits<std::uint64_t>::max() / d) {
      overflow = true;
      break;
    }
    bytes *= d;
  }
  if (overflow || bytes > max_idx_payload_bytes || bytes > std::numeric_limits<std::size_t>::max()) {
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': the dimensions ", format_dims(out.dims), " of ",
                   name_of(out.type), " describe ", overflow ? std::string("more than 2^64") : std::to_string(bytes),
                   " bytes, more than the ", max_idx_payload_bytes,
                   " bytes (16 GiB) read_idx accepts; the header is corrupt");
  }
  const auto expected = static_cast<std::size_t>(bytes);

  // A plain file's length is known: check the header against it before allocating anything.
  if (const std::optional<std::uint64_t> left = src.remaining()) {
    if (*left < expected) {
      LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': the payload is truncated: the dimensions ",
                     format_dims(out.dims), " of ", name_of(out.type), " need ", expected,
                     " bytes after the header, found ", *left);
    }
    if (*left > expected) {
      LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': the file is oversized: the dimensions ",
                     format_dims(out.dims), " of ", name_of(out.type), " need ", expected,
                     " bytes after the header, found ", *left, " (", *left - expected, " extra bytes at the end)");
    }
  }

  // A plain file's payload is read at once: its length was checked above. A gzip stream's length is known only
  // once it has been read, so its buffer is reserved once, for the header's size if the file can decompress to
  // that much (`size_bound`: deflate's largest expansion of the compressed bytes), and filled in 4 MiB steps (each
  // zeroed by the resize just before zlib writes it, while it is in cache). A header that claims more than the
  // file can hold is corrupt: its buffer grows with the data actually read instead (doubling from 1 MiB), so a
  // small corrupt gzip file cannot make us allocate what its header claims.
  const bool length_known = src.remaining().has_value();
  bool reserved = false;  // reserved for the whole payload (a gzip stream that can decompress to it)
  if constexpr (requires { src.size_bound(); }) {
    if (!length_known && src.size_bound() >= expected) {
      try {
        out.data.reserve(expected);  // address space only: pages are touched as data arrives
        reserved = true;
      } catch (const std::bad_alloc&) {
        // a claim larger than the address space the system grants (a corrupt header, or overcommit refused):
        // grow with the data instead, and say what is wrong once the data ends
      }
    }
  }
  constexpr std::size_t first_chunk = std::size_t{1} << 20, step = std::size_t{4} << 20;
  std::size_t have = 0;
  while (have < expected) {
    const std::size_t target = length_known ? expected
                               : reserved   ? std::min(expected, have + step)
                                            : std::min(expected, std::max(2 * have, first_chunk));
    out.data.reserve(target);  // exactly: a resize past the capacity could allocate twice what is there
    out.data.resize(target);
    const std::size_t n = src.read(std::span(out.data.data() + have, target - have));
    have += n;
    if (have < target) break;
  }
  if (have < expected) {
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': the payload is truncated: the dimensions ",
                   format_dims(out.dims), " of ", name_of(out.type), " need ", expected,
                   " bytes after the header, found ", have, src.end_note());
  }

  // Nothing may follow the payload. For gzip this read also makes zlib check the trailer's CRC and length.
  std::array<std::byte, 1> probe{};
  if (src.read(probe) != 0) {
    constexpr std::uint64_t drain_limit = std::uint64_t{1} << 26;
    const std::uint64_t extra = 1 + src.drain(drain_limit);
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': the file is oversized: the dimensions ",
                   format_dims(out.dims), " of ", name_of(out.type), " need ", expected,
                   " bytes after the header, but ", extra > drain_limit ? "more than " : "", extra,
                   " extra bytes follow them");
  }
  if (const std::string note = src.end_note(); !note.empty()) {
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", file, "': the payload is complete but the file ends before",
                   " the gzip trailer that verifies it", note);
  }

  big_endian_to_host(out.data, elem_size);
  return out;
}

}  // namespace detail

/// Reads the IDX file at `path`, plain or gzip-compressed (recognized by the gzip magic bytes 1f 8b, not by the
/// name). Supports element types u8 (0x08), i32 (0x0C) and f32 (0x0D), ranks 1 to 4, payloads up to
/// `max_idx_payload_bytes`. Throws data_error, naming the file and the problem, when the file is missing or
/// unreadable, empty, has a wrong magic number, an unsupported type code, a rank outside 1..4, a zero
/// dimension, dimensions describing an absurd size, a truncated header or payload (saying how many bytes were
/// expected and found), bytes after the payload ("oversized"), or a corrupt gzip stream. Never allocates more
/// than the header claims, nor more than twice the bytes actually present unless a gzip file's compressed length
/// allows the header's claim (deflate expands at most 1032 times); memory is touched only as data arrives.
inline idx_array read_idx(const std::filesystem::path& path) {
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(path, ec);
  if (status.type() == std::filesystem::file_type::not_found) {
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", path.string(), "': it does not exist");
  }
  if (ec) {
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", path.string(), "': cannot inspect it: ", ec.message());
  }
  if (!std::filesystem::is_regular_file(status)) {
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", path.string(), "': it is not a regular file");
  }
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) {
    LOCKSTEP_THROW(data_error, "cannot read IDX file '", path.string(), "': cannot get its size: ", ec.message());
  }

  bool gzip = false;
  {
    detail::idx_plain_source peek(path, size);
    std::array<std::byte, 2> head{};
    gzip = peek.read(head) == 2 && head[0] == std::byte{0x1f} && head[1] == std::byte{0x8b};
  }
  if (gzip) {
    detail::idx_gzip_source source(path, size);
    return detail::parse_idx(source, path);
  }
  detail::idx_plain_source source(path, size);
  return detail::parse_idx(source, path);
}

/// The two splits of an MNIST-style dataset.
enum class mnist_split : std::uint8_t { train, test };

/// Where Debian's `dataset-fashion-mnist` package installs Fashion-MNIST.
inline constexpr std::string_view default_fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";

/// An MNIST-style image classification dataset (MNIST, Fashion-MNIST, KMNIST) read from an images IDX file
/// (u8, [n, rows, cols]) and a labels IDX file (u8, [n]). Keeps the u8 pixels (a quarter of the f32 size);
/// `fetch` writes the input as f32 of shape {rows * cols} scaled to [0, 1] (pixel / 255.0f) and the target as an
/// i32 scalar. Immutable after construction, so `fetch` is safe to call concurrently.
class mnist_dataset {
 public:
  /// Reads both files (see `read_idx`). Precondition: 1 <= num_classes <= 256 (precondition_error). Throws
  /// data_error when a file cannot be read, when the images are not u8 of rank 3 or the labels not u8 of rank
  /// 1, when the two files hold different numbers of samples (naming both files and both counts), or when a
  /// label is not below `num_classes` (naming the first bad index and its value).
  mnist_dataset(const std::filesystem::path& images_file, const std::filesystem::path& labels_file,
                std::size_t num_classes = 10)
      : num_classes_(num_classes) {
    LOCKSTEP_EXPECTS(num_classes >= 1 && num_classes <= 256, "mnist_dataset: num_classes must be 1 to 256 (labels are ",
                     "u8), got ", num_classes);
    idx_array images = read_idx(images_file);
    idx_array labels = read_idx(labels_file);
    if (images.type != dtype::u8 || images.dims.size() != 3) {
      LOCKSTEP_THROW(data_error, "mnist_dataset: the images file '", images_file.string(), "' holds ",
                     name_of(images.type), " of shape ", detail::format_dims(images.dims),
                     "; MNIST images are u8 of shape [n, rows, cols]");
    }
    if (labels.type != dtype::u8 || labels.dims.size() != 1) {
      LOCKSTEP_THROW(data_error, "mnist_dataset: the labels file '", labels_file.string(), "' holds ",
                     name_of(labels.type), " of shape ", detail::format_dims(labels.dims),
                     "; MNIST labels are u8 of shape [n]");
    }
    if (images.dims[0] != labels.dims[0]) {
      LOCKSTEP_THROW(data_error, "mnist_dataset: the images file '", images_file.string(), "' holds ",
                     images.dims[0], " images but the labels file '", labels_file.string(), "' holds ",
                     labels.dims[0], " labels; the two files do not belong together");
    }
    for (std::size_t i = 0; i < labels.data.size(); ++i) {
      const auto value = std::to_integer<unsigned>(labels.data[i]);
      if (value >= num_classes) {
        LOCKSTEP_THROW(data_error, "mnist_dataset: the labels file '", labels_file.string(), "' has label ", value,
                       " at index ", i, "; labels must be 0 to ", num_classes - 1, " for ", num_classes,
                       " classes");
      }
    }
    size_ = images.dims[0];
    rows_ = images.dims[1];
    cols_ = images.dims[2];
    pixels_ = std::move(images.data);
    labels_ = std::move(labels.data);
    layout_ = sample_layout{{rows_ * cols_}, dtype::f32, {}, dtype::i32};
  }

  /// Number of images.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Input f32 of shape {rows * cols}; target i32 scalar.
  [[nodiscard]] const sample_layout& layout() const noexcept { return layout_; }
  /// Image height.
  [[nodiscard]] std::size_t rows() const noexcept { return rows_; }
  /// Image width.
  [[nodiscard]] std::size_t cols() const noexcept { return cols_; }
  /// Number of classes the labels were checked against.
  [[nodiscard]] std::size_t num_classes() const noexcept { return num_classes_; }
  /// The label of sample `index`. Throws precondition_error when `index >= size()`.
  [[nodiscard]] std::int32_t label(std::size_t index) const {
    LOCKSTEP_EXPECTS(index < size_, "sample index ", index, " is out of range for a dataset of ", size_, " samples");
    return std::to_integer<std::int32_t>(labels_[index]);
  }

  /// Writes sample `index`: rows * cols f32 pixels in [0, 1] and the i32 label. Throws precondition_error when
  /// `index >= size()` (naming both) or when a span's size differs from the layout's. Thread-safe.
  void fetch(std::size_t index, sample_ref dst) const {
    detail::check_fetch(layout_, size_, index, dst);
    const std::size_t pixels = rows_ * cols_;
    const std::byte* src = pixels_.data() + index * pixels;
    std::byte* out = dst.input.data();
    for (std::size_t i = 0; i < pixels; ++i) {
      // A division, not a multiplication by 1/255: it is correctly rounded, so 51 maps to exactly 0.2f.
      const float value = static_cast<float>(std::to_integer<unsigned>(src[i])) / 255.0f;
      std::memcpy(out + i * sizeof(float), &value, sizeof(float));
    }
    const std::int32_t target = std::to_integer<std::int32_t>(labels_[index]);
    std::memcpy(dst.target.data(), &target, sizeof target);
  }

 private:
  std::size_t size_ = 0;
  std::size_t rows_ = 0;
  std::size_t cols_ = 0;
  std::size_t num_classes_ = 10;
  std::vector<std::byte> pixels_;  // [size, rows, cols] u8
  std::vector<std::byte> labels_;  // [size] u8
  sample_layout layout_;
};

static_assert(dataset<mnist_dataset>);

namespace detail {

/// `dir/stem.gz` if it exists, else `dir/stem`; data_error naming both and the fix when neither does.
inline std::filesystem::path find_mnist_file(const std::filesystem::path& dir, const std::string& stem) {
  std::error_code ec;
  const std::filesystem::path gz = dir / (stem + ".gz");
  if (std::filesystem::exists(gz, ec)) return gz;
  const std::filesystem::path plain = dir / stem;
  if (std::filesystem::exists(plain, ec)) return plain;
  const bool dir_exists = std::filesystem::is_directory(dir, ec);
  LOCKSTEP_THROW(data_error, "load_fashion_mnist: found neither '", gz.string(), "' nor '", plain.string(), "'",
                 dir_exists ? "" : concat(" (the directory '", dir.string(), "' does not exist)"),
                 "; install the Debian package dataset-fashion-mnist (it puts the files in ",
                 default_fashion_mnist_dir, ") or pass the directory that holds them");
}

}  // namespace detail

/// Loads one split of Fashion-MNIST from `dir` (usually `default_fashion_mnist_dir`): the files
/// train-images-idx3-ubyte and train-labels-idx1-ubyte, or t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte,
/// each gzipped (".gz", preferred) or not. 60000 training and 10000 test images of 28x28, 10 classes. Throws
/// data_error naming the missing path and the Debian package `dataset-fashion-mnist` when a file is not there,
/// and as `mnist_dataset` when a file is malformed.
inline mnist_dataset load_fashion_mnist(const std::filesystem::path& dir, mnist_split split) {
  const std::string prefix = split == mnist_split::train ? "train" : "t10k";
  const std::filesystem::path images = detail::find_mnist_file(dir, prefix + "-images-idx3-ubyte");
  const std::filesystem::path labels = detail::find_mnist_file(dir, prefix + "-labels-idx1-ubyte");
  return mnist_dataset(images, labels, 10);
}

}  // namespace lockstep
