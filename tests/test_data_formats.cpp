// Tests of the data layer's file formats, datasets and samplers: IDX reading (plain and gzip, good and every
// kind of bad file), mnist_dataset and Fashion-MNIST, in_memory_dataset, and the three samplers.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <new>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/data/dataset.hpp"
#include "lockstep/data/idx.hpp"
#include "lockstep/data/sampler.hpp"
#include "test_support.hpp"

// The largest single allocation made through operator new since the last reset, so that a test can check that
// a corrupt header did not make the reader allocate what the header claims. nvcc treats a replaced global
// operator new as __host__ __device__ (and rejects its host-only body), so the replacement and the check exist
// only when this file is compiled as plain C++, which is how the test is built; under nvcc it still checks the
// headers compile and the errors are thrown.
#if defined(__CUDACC__)
namespace {
std::atomic<std::size_t> largest_allocation{0};
std::atomic<std::size_t> large_allocations{0};
constexpr bool tracks_allocations = false;
}  // namespace
#else
namespace {
std::atomic<std::size_t> largest_allocation{0};
std::atomic<std::size_t> large_allocations{0};  // of 1 MiB or more
constexpr bool tracks_allocations = true;

void note_allocation(std::size_t n) noexcept {
  if (n >= (std::size_t{1} << 20)) large_allocations.fetch_add(1, std::memory_order_relaxed);
  std::size_t seen = largest_allocation.load(std::memory_order_relaxed);
  while (n > seen && !largest_allocation.compare_exchange_weak(seen, n, std::memory_order_relaxed)) {
  }
}

void* allocate(std::size_t n) {
  note_allocation(n);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
}  // namespace

// Not inlined: GCC would otherwise see free() of a pointer from operator new and warn (-Wmismatched-new-delete),
// not knowing that this operator new is malloc.
[[gnu::noinline]] void* operator new(std::size_t n) { return allocate(n); }
[[gnu::noinline]] void* operator new[](std::size_t n) { return allocate(n); }
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
#endif

namespace {

namespace fs = std::filesystem;
using lockstep::dtype;
using lockstep_test::message_of;

std::vector<std::byte> bytes(std::initializer_list<unsigned> values) {
  std::vector<std::byte> out;
  for (unsigned v : values) out.push_back(static_cast<std::byte>(v));
  return out;
}

void append(std::vector<std::byte>& to, const std::vector<std::byte>& more) { to.insert(to.end(), more.begin(), more.end()); }

void append_be32(std::vector<std::byte>& to, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) to.push_back(static_cast<std::byte>((v >> shift) & 0xFF));
}

/// An IDX file's bytes: magic (0, 0, type code, rank), big-endian dims, then `payload` as given.
std::vector<std::byte> idx_file(unsigned type_code, const std::vector<std::uint32_t>& dims,
                                const std::vector<std::byte>& payload) {
  std::vector<std::byte> out = bytes({0, 0, type_code, static_cast<unsigned>(dims.size())});
  for (std::uint32_t d : dims) append_be32(out, d);
  append(out, payload);
  return out;
}

/// `n` bytes that do not compress to nothing: a small linear congruential sequence.
std::vector<std::byte> noisy_bytes(std::size_t n) {
  std::vector<std::byte> out(n);
  std::uint32_t x = 12345;
  for (auto& b : out) {
    x = x * 1103515245u + 12345u;
    b = static_cast<std::byte>((x >> 16) % 7 == 0 ? (x >> 24) : (x >> 29));
  }
  return out;
}

void write_plain(const fs::path& path, const std::vector<std::byte>& data) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

void write_gz(const fs::path& path, const std::vector<std::byte>& data) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << "cannot open " << path;
  if (!data.empty()) {
    ASSERT_EQ(gzwrite(f, data.data(), static_cast<unsigned>(data.size())), static_cast<int>(data.size()));
  }
  ASSERT_EQ(gzclose(f), Z_OK);
}

std::vector<std::byte> read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(chars.size());
  std::memcpy(out.data(), chars.data(), chars.size());
  return out;
}

/// Expects `message` to contain every one of `parts`.
void expect_contains(const std::string& message, std::initializer_list<std::string> parts) {
  for (const std::string& part : parts) {
    EXPECT_NE(message.find(part), std::string::npos) << "missing \"" << part << "\" in: " << message;
  }
}

/// A fresh directory per test, removed afterwards.
class data_files : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("lockstep_test_data_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  fs::path plain(const std::string& name, const std::vector<std::byte>& data) {
    fs::path p = dir_ / name;
    write_plain(p, data);
    return p;
  }
  fs::path gz(const std::string& name, const std::vector<std::byte>& data) {
    fs::path p = dir_ / name;
    write_gz(p, data);
    return p;
  }
  /// Reads `path`, expecting a data_error whose message names the file and contains `parts`.
  std::string expect_idx_error(const fs::path& path, std::initializer_list<std::string> parts) {
    const std::string msg = message_of<lockstep::data_error>([&] { (void)lockstep::read_idx(path); });
    expect_contains(msg, {path.filename().string()});
    expect_contains(msg, parts);
    return msg;
  }

  fs::path dir_;
};

// ---------------------------------------------------------------------------------------------------------------
// read_idx: good files

using idx_good = data_files;

TEST_F(idx_good, reads_u8_rank3_plain_and_gzip) {
  std::vector<std::byte> payload(2 * 3 * 4);
  for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i * 10 + 1);
  const auto file = idx_file(0x08, {2, 3, 4}, payload);
  for (const fs::path& p : {plain("u8.idx", file), gz("u8.idx.gz", file)}) {
    SCOPED_TRACE(p.string());
    const lockstep::idx_array a = lockstep::read_idx(p);
    EXPECT_EQ(a.type, dtype::u8);
    EXPECT_EQ(a.dims, (std::vector<std::size_t>{2, 3, 4}));
    EXPECT_EQ(a.element_count(), 24u);
    EXPECT_EQ(a.data, payload);
    EXPECT_EQ(a.element<std::uint8_t>(23), 231);
  }
}

TEST_F(idx_good, gzip_is_recognized_by_content_not_name) {
  const auto file = idx_file(0x08, {3}, bytes({7, 8, 9}));
  const fs::path zipped_without_suffix = gz("looks_plain.idx", file);
  const fs::path plain_with_suffix = plain("looks_zipped.gz", file);
  EXPECT_EQ(lockstep::read_idx(zipped_without_suffix).data, bytes({7, 8, 9}));
  EXPECT_EQ(lockstep::read_idx(plain_with_suffix).data, bytes({7, 8, 9}));
}

TEST_F(idx_good, converts_big_endian_i32) {
  // 0x01020304, -2, INT32_MIN, 0x7F000001 written byte by byte, most significant first.
  const auto payload = bytes({0x01, 0x02, 0x03, 0x04, 0xFF, 0xFF, 0xFF, 0xFE, 0x80, 0x00, 0x00, 0x00, 0x7F, 0x00,
                              0x00, 0x01});
  const auto file = idx_file(0x0C, {4}, payload);
  for (const fs::path& p : {plain("i32.idx", file), gz("i32.idx.gz", file)}) {
    SCOPED_TRACE(p.string());
    const lockstep::idx_array a = lockstep::read_idx(p);
    EXPECT_EQ(a.type, dtype::i32);
    EXPECT_EQ(a.dims, (std::vector<std::size_t>{4}));
    ASSERT_EQ(a.data.size(), 16u);
    EXPECT_EQ(a.element<std::int32_t>(0), 16909060);
    EXPECT_EQ(a.element<std::int32_t>(1), -2);
    EXPECT_EQ(a.element<std::int32_t>(2), INT32_MIN);
    EXPECT_EQ(a.element<std::int32_t>(3), 0x7F000001);
  }
}

TEST_F(idx_good, converts_big_endian_f32_rank2_and_rank4) {
  // 1.0f = 3F800000, -2.5f = C0200000, 0.15625f = 3E200000, 65504.0f = 477FE000.
  const auto payload = bytes({0x3F, 0x80, 0x00, 0x00, 0xC0, 0x20, 0x00, 0x00, 0x3E, 0x20, 0x00, 0x00, 0x47, 0x7F,
                              0xE0, 0x00});
  for (const auto& dims : {std::vector<std::uint32_t>{2, 2}, std::vector<std::uint32_t>{1, 2, 1, 2}}) {
    const auto file = idx_file(0x0D, dims, payload);
    for (const fs::path& p : {plain("f32.idx", file), gz("f32.idx.gz", file)}) {
      SCOPED_TRACE(p.string() + " rank " + std::to_string(dims.size()));
      const lockstep::idx_array a = lockstep::read_idx(p);
      EXPECT_EQ(a.type, dtype::f32);
      EXPECT_EQ(a.dims, std::vector<std::size_t>(dims.begin(), dims.end()));
      EXPECT_EQ(a.element<float>(0), 1.0f);
      EXPECT_EQ(a.element<float>(1), -2.5f);
      EXPECT_EQ(a.element<float>(2), 0.15625f);
      EXPECT_EQ(a.element<float>(3), 65504.0f);
    }
  }
}

TEST_F(idx_good, element_checks_type_and_index) {
  const lockstep::idx_array a = lockstep::read_idx(plain("u8.idx", idx_file(0x08, {2}, bytes({1, 2}))));
  expect_contains(message_of<lockstep::precondition_error>([&] { (void)a.element<float>(0); }),
                  {"holds u8", "read as f32"});
  expect_contains(message_of<lockstep::precondition_error>([&] { (void)a.element<std::uint8_t>(2); }),
                  {"index 2", "2 elements"});
}

TEST_F(idx_good, reads_a_large_gzip_payload_in_several_chunks) {
  // 2 MiB + 5 bytes: more than the reader's first 1 MiB step, and not a multiple of it.
  const std::vector<std::byte> payload = noisy_bytes((std::size_t{2} << 20) + 5);
  const fs::path p = gz("big.idx.gz", idx_file(0x08, {static_cast<std::uint32_t>(payload.size())}, payload));
  EXPECT_EQ(lockstep::read_idx(p).data, payload);
}

TEST_F(idx_good, a_gzip_payload_its_file_can_hold_is_read_into_one_buffer) {
  // 9 MiB + 5 bytes, filled in several steps: the buffer is reserved once for the header's size (the compressed
  // file can decompress to that much), so it is never moved while it fills (Fashion-MNIST's 47 MB of training
  // images were read in 8 growing buffers, 1.6 times slower).
  const std::vector<std::byte> payload = noisy_bytes((std::size_t{9} << 20) + 5);
  const fs::path p = gz("one_buffer.idx.gz", idx_file(0x08, {static_cast<std::uint32_t>(payload.size())}, payload));
  largest_allocation = 0;
  large_allocations = 0;
  const lockstep::idx_array a = lockstep::read_idx(p);
  if (tracks_allocations) {
    EXPECT_EQ(large_allocations.load(), 1u);
    EXPECT_EQ(largest_allocation.load(), payload.size());
  }
  EXPECT_EQ(a.data, payload);
}

// ---------------------------------------------------------------------------------------------------------------
// read_idx: bad files

using idx_bad = data_files;

TEST_F(idx_bad, missing_file) { expect_idx_error(dir_ / "nothing_here.idx", {"does not exist"}); }

TEST_F(idx_bad, directory) {
  fs::create_directories(dir_ / "a_directory.idx");
  expect_idx_error(dir_ / "a_directory.idx", {"not a regular file"});
}

TEST_F(idx_bad, empty_file) {
  expect_idx_error(plain("empty.idx", {}), {"the file is empty"});
  expect_idx_error(gz("empty.idx.gz", {}), {"decompresses to nothing"});
}

TEST_F(idx_bad, wrong_magic) {
  const auto file = bytes({0x01, 0x02, 0x08, 0x01, 0, 0, 0, 1, 42});
  expect_idx_error(plain("magic.idx", file), {"wrong magic number 0x01 0x02 0x08 0x01", "two zero bytes"});
  expect_idx_error(gz("magic.idx.gz", file), {"wrong magic number 0x01 0x02"});
}

TEST_F(idx_bad, unknown_type_code) {
  expect_idx_error(plain("type.idx", idx_file(0x0A, {1}, bytes({0}))), {"unknown type code 0x0A"});
}

TEST_F(idx_bad, unsupported_type_codes) {
  expect_idx_error(plain("i8.idx", idx_file(0x09, {1}, bytes({0}))), {"type code 0x09 (i8)", "not supported"});
  expect_idx_error(plain("i16.idx", idx_file(0x0B, {1}, bytes({0, 0}))), {"type code 0x0B (i16)", "not supported"});
  expect_idx_error(plain("f64.idx", idx_file(0x0E, {1}, std::vector<std::byte>(8))),
                   {"type code 0x0E (f64)", "not supported"});
}

TEST_F(idx_bad, rank_0_and_5) {
  expect_idx_error(plain("rank0.idx", idx_file(0x08, {}, bytes({1}))), {"rank 0", "rank 1 to 4"});
  expect_idx_error(plain("rank5.idx", idx_file(0x08, {1, 1, 1, 1, 1}, bytes({1}))), {"rank 5", "rank 1 to 4"});
}

TEST_F(idx_bad, zero_dimension) {
  expect_idx_error(plain("zero.idx", idx_file(0x08, {3, 0, 2}, {})), {"dimension 1 of [3, 0, 2] is 0"});
}

TEST_F(idx_bad, truncated_header) {
  expect_idx_error(plain("short_magic.idx", bytes({0, 0, 8})), {"header is truncated", "needs 4 bytes, found 3"});
  auto file = idx_file(0x08, {5, 6, 7}, {});
  file.resize(4 + 4 + 2);  // magic, one dimension, half of the next
  expect_idx_error(plain("short_dims.idx", file), {"header is truncated", "needs 16 bytes, found 10"});
  expect_idx_error(gz("short_dims.idx.gz", file), {"header is truncated", "needs 16 bytes, found 10"});
}

TEST_F(idx_bad, truncated_payload_plain) {
  expect_idx_error(plain("short.idx", idx_file(0x08, {10}, noisy_bytes(7))),
                   {"payload is truncated", "need 10 bytes", "found 7"});
  expect_idx_error(plain("short_f32.idx", idx_file(0x0D, {2, 3}, noisy_bytes(23))),
                   {"payload is truncated", "[2, 3] of f32 need 24 bytes", "found 23"});
}

TEST_F(idx_bad, truncated_payload_gzip) {
  // A complete gzip stream whose content is short.
  expect_idx_error(gz("short.idx.gz", idx_file(0x08, {10}, noisy_bytes(7))),
                   {"payload is truncated", "need 10 bytes", "found 7"});

  // A gzip file cut in the middle of its compressed data.
  const std::vector<std::byte> payload = noisy_bytes(200000);
  const fs::path whole = gz("whole.idx.gz", idx_file(0x08, {200000}, payload));
  std::vector<std::byte> cut = read_all(whole);
  ASSERT_GT(cut.size(), 1000u);
  cut.resize(cut.size() / 2);
  expect_idx_error(plain("cut.idx.gz", cut), {"payload is truncated", "need 200000 bytes", "gzip stream itself is cut off"});
}

TEST_F(idx_bad, gzip_trailer_missing) {
  // The payload decompresses completely but the CRC and length trailer are gone, so it cannot be verified.
  const fs::path whole = gz("whole.idx.gz", idx_file(0x08, {1000}, noisy_bytes(1000)));
  std::vector<std::byte> cut = read_all(whole);
  cut.resize(cut.size() - 8);
  expect_idx_error(plain("no_trailer.idx.gz", cut), {"payload is complete", "before the gzip trailer", "cut off"});
}

TEST_F(idx_bad, oversized_payload) {
  expect_idx_error(plain("long.idx", idx_file(0x08, {4}, noisy_bytes(6))),
                   {"oversized", "need 4 bytes", "found 6", "2 extra bytes"});
  expect_idx_error(gz("long.idx.gz", idx_file(0x08, {4}, noisy_bytes(6))), {"oversized", "need 4 bytes", "2 extra bytes"});
}

TEST_F(idx_bad, gzip_corrupt_in_the_middle) {
  const std::vector<std::byte> payload = noisy_bytes(300000);
  const fs::path whole = gz("whole.idx.gz", idx_file(0x08, {300000}, payload));
  std::vector<std::byte> broken = read_all(whole);
  ASSERT_GT(broken.size(), 2000u);
  for (std::size_t i = broken.size() / 2; i < broken.size() / 2 + 64; ++i) broken[i] ^= std::byte{0x5A};
  expect_idx_error(plain("corrupt.idx.gz", broken), {"gzip stream is corrupt", "zlib"});

  // The first deflate block header (after the 10-byte gzip header) with the reserved block type 11.
  std::vector<std::byte> bad_block = read_all(whole);
  bad_block[10] = std::byte{0x07};  // BFINAL = 1, BTYPE = 11
  expect_idx_error(plain("bad_block.idx.gz", bad_block), {"gzip stream is corrupt", "invalid block type"});
}

TEST_F(idx_bad, absurd_dimensions_fail_before_allocating) {
  // Products that overflow 64 bits, and that exceed the 16 GiB cap, are rejected from the header alone.
  largest_allocation = 0;
  expect_idx_error(plain("overflow.idx", idx_file(0x08, {0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF}, bytes({1}))),
                   {"more than 2^64 bytes", "header is corrupt"});
  expect_idx_error(gz("overflow.idx.gz", idx_file(0x0D, {0xFFFFFFFF, 0xFFFFFFFF, 2}, bytes({1}))),
                   {"more than 2^64 bytes", "header is corrupt"});
  expect_idx_error(plain("huge.idx", idx_file(0x08, {65536, 65536, 16}, bytes({1}))),
                   {"68719476736 bytes", "17179869184 bytes (16 GiB)", "header is corrupt"});
  // Under the cap (8 GiB) but absent from the file: a plain file is checked against its length, a gzip file
  // is read into a buffer that grows with the data actually there.
  expect_idx_error(plain("big_claim.idx", idx_file(0x08, {0x80000000u, 4}, noisy_bytes(100))),
                   {"payload is truncated", "need 8589934592 bytes", "found 100"});
  expect_idx_error(gz("big_claim.idx.gz", idx_file(0x08, {0x80000000u, 4}, noisy_bytes(100))),
                   {"payload is truncated", "need 8589934592 bytes", "found 100"});
  if (tracks_allocations) {
    EXPECT_LT(largest_allocation.load(), std::size_t{4} << 20) << "a corrupt header made the reader allocate";
  }
}

// ---------------------------------------------------------------------------------------------------------------
// mnist_dataset

using mnist = data_files;

TEST_F(mnist, fetch_scales_pixels_and_writes_labels) {
  // Two 2x3 images.
  const auto pixels = bytes({255, 0, 51, 102, 204, 1, 10, 20, 30, 40, 50, 60});
  const fs::path images = gz("images.gz", idx_file(0x08, {2, 2, 3}, pixels));
  const fs::path labels = plain("labels", idx_file(0x08, {2}, bytes({9, 3})));
  const lockstep::mnist_dataset ds(images, labels);
  static_assert(lockstep::dataset<lockstep::mnist_dataset>);
  EXPECT_EQ(ds.size(), 2u);
  EXPECT_EQ(ds.rows(), 2u);
  EXPECT_EQ(ds.cols(), 3u);
  EXPECT_EQ(ds.layout(), (lockstep::sample_layout{{6}, dtype::f32, {}, dtype::i32}));
  EXPECT_EQ(ds.layout().input_bytes(), 24u);
  EXPECT_EQ(ds.layout().target_bytes(), 4u);

  std::array<float, 6> input{};
  std::int32_t target = -1;
  const lockstep::sample_ref dst{std::as_writable_bytes(std::span(input)),
                                 std::as_writable_bytes(std::span(&target, 1))};
  ds.fetch(0, dst);
  EXPECT_EQ(input[0], 1.0f);
  EXPECT_EQ(input[1], 0.0f);
  EXPECT_EQ(input[2], 0.2f);
  EXPECT_EQ(input[3], 0.4f);
  EXPECT_EQ(input[4], 0.8f);
  EXPECT_EQ(input[5], 1.0f / 255.0f);
  EXPECT_EQ(target, 9);
  ds.fetch(1, dst);
  EXPECT_EQ(input[0], 10.0f / 255.0f);
  EXPECT_EQ(input[5], 60.0f / 255.0f);
  EXPECT_EQ(target, 3);
  EXPECT_EQ(ds.label(1), 3);
}

TEST_F(mnist, fetch_checks_index_and_spans) {
  const lockstep::mnist_dataset ds(plain("images", idx_file(0x08, {5, 1, 2}, noisy_bytes(10))),
                                   plain("labels", idx_file(0x08, {5}, bytes({0, 1, 2, 3, 4}))));
  std::array<float, 2> input{};
  std::int32_t target = 0;
  const lockstep::sample_ref good{std::as_writable_bytes(std::span(input)),
                                  std::as_writable_bytes(std::span(&target, 1))};
  expect_contains(message_of<lockstep::precondition_error>([&] { ds.fetch(5, good); }),
                  {"sample index 5", "5 samples"});
  const lockstep::sample_ref short_input{std::as_writable_bytes(std::span(input)).first(7), good.target};
  expect_contains(message_of<lockstep::precondition_error>([&] { ds.fetch(0, short_input); }),
                  {"input span of sample 0 holds 7 bytes", "8 bytes"});
  const lockstep::sample_ref no_target{good.input, {}};
  expect_contains(message_of<lockstep::precondition_error>([&] { ds.fetch(0, no_target); }),
                  {"target span of sample 0 holds 0 bytes", "4 bytes"});
}

TEST_F(mnist, concurrent_fetch_matches_serial_fetch) {
  // The data loader's workers fetch different indices of one dataset at once, into slots of one batch.
  constexpr std::size_t n = 64, pixels = 16;
  std::vector<std::byte> labels(n);
  for (std::size_t i = 0; i < n; ++i) labels[i] = static_cast<std::byte>(i % 10);
  const lockstep::mnist_dataset ds(plain("images", idx_file(0x08, {n, 4, 4}, noisy_bytes(n * pixels))),
                                   plain("labels", idx_file(0x08, {n}, labels)));
  const auto slot = [](std::vector<float>& in, std::vector<std::int32_t>& out, std::size_t i) {
    return lockstep::sample_ref{std::as_writable_bytes(std::span(in)).subspan(i * pixels * 4, pixels * 4),
                                std::as_writable_bytes(std::span(out)).subspan(i * 4, 4)};
  };
  std::vector<float> serial_in(n * pixels), parallel_in(n * pixels);
  std::vector<std::int32_t> serial_out(n, -1), parallel_out(n, -1);
  for (std::size_t i = 0; i < n; ++i) ds.fetch(i, slot(serial_in, serial_out, i));
  std::vector<std::thread> workers;
  for (std::size_t w = 0; w < 4; ++w) {
    workers.emplace_back([&, w] {
      for (std::size_t i = w; i < n; i += 4) ds.fetch(i, slot(parallel_in, parallel_out, i));
    });
  }
  for (auto& t : workers) t.join();
  EXPECT_EQ(parallel_in, serial_in);
  EXPECT_EQ(parallel_out, serial_out);
  EXPECT_EQ(serial_out[13], 3);
  EXPECT_GT(*std::max_element(serial_in.begin(), serial_in.end()), 0.0f);
}

TEST_F(mnist, mismatched_counts_name_both_files) {
  const fs::path images = plain("five-images", idx_file(0x08, {5, 2, 2}, noisy_bytes(20)));
  const fs::path labels = plain("four-labels", idx_file(0x08, {4}, bytes({0, 1, 2, 3})));
  const std::string msg = message_of<lockstep::data_error>([&] { lockstep::mnist_dataset ds(images, labels); });
  expect_contains(msg, {"five-images", "four-labels", "5 images", "4 labels"});
}

TEST_F(mnist, label_out_of_range) {
  const fs::path images = plain("images", idx_file(0x08, {4, 1, 1}, bytes({1, 2, 3, 4})));
  const fs::path labels = plain("bad-labels", idx_file(0x08, {4}, bytes({1, 2, 10, 11})));
  expect_contains(message_of<lockstep::data_error>([&] { lockstep::mnist_dataset ds(images, labels); }),
                  {"bad-labels", "label 10 at index 2", "0 to 9"});

  const fs::path three = plain("three-labels", idx_file(0x08, {4}, bytes({0, 2, 3, 1})));
  expect_contains(message_of<lockstep::data_error>([&] { lockstep::mnist_dataset ds(images, three, 3); }),
                  {"label 3 at index 2", "0 to 2 for 3 classes"});
  EXPECT_EQ(lockstep::mnist_dataset(images, three, 4).num_classes(), 4u);
  expect_contains(message_of<lockstep::precondition_error>([&] { lockstep::mnist_dataset ds(images, three, 0); }),
                  {"num_classes must be 1 to 256", "got 0"});
}

TEST_F(mnist, wrong_type_or_rank) {
  const fs::path labels = plain("labels", idx_file(0x08, {2}, bytes({0, 1})));
  const fs::path flat = plain("flat-images", idx_file(0x08, {2, 4}, noisy_bytes(8)));
  expect_contains(message_of<lockstep::data_error>([&] { lockstep::mnist_dataset ds(flat, labels); }),
                  {"flat-images", "u8 of shape [2, 4]", "[n, rows, cols]"});
  const fs::path wide = plain("i32-labels", idx_file(0x0C, {2}, noisy_bytes(8)));
  const fs::path images = plain("images", idx_file(0x08, {2, 1, 1}, bytes({0, 1})));
  expect_contains(message_of<lockstep::data_error>([&] { lockstep::mnist_dataset ds(images, wide); }),
                  {"i32-labels", "i32 of shape [2]", "u8 of shape [n]"});
}

TEST_F(mnist, load_fashion_mnist_missing_directory) {
  const fs::path nowhere = dir_ / "no-such-dir";
  const std::string msg =
      message_of<lockstep::data_error>([&] { (void)lockstep::load_fashion_mnist(nowhere, lockstep::mnist_split::train); });
  expect_contains(msg, {(nowhere / "train-images-idx3-ubyte.gz").string(), "dataset-fashion-mnist",
                        "does not exist", "pass the directory"});
}

TEST_F(mnist, load_fashion_mnist_accepts_uncompressed_names) {
  plain("t10k-images-idx3-ubyte", idx_file(0x08, {3, 2, 2}, noisy_bytes(12)));
  plain("t10k-labels-idx1-ubyte", idx_file(0x08, {3}, bytes({4, 5, 6})));
  const lockstep::mnist_dataset ds = lockstep::load_fashion_mnist(dir_, lockstep::mnist_split::test);
  EXPECT_EQ(ds.size(), 3u);
  EXPECT_EQ(ds.label(2), 6);
  // The labels of the train split are missing: the message names the file that is.
  expect_contains(message_of<lockstep::data_error>(
                      [&] { (void)lockstep::load_fashion_mnist(dir_, lockstep::mnist_split::train); }),
                  {"train-images-idx3-ubyte.gz", "dataset-fashion-mnist"});
}

TEST(fashion_mnist, real_files_at_the_default_directory) {
  const fs::path dir{lockstep::default_fashion_mnist_dir};
  if (!fs::is_directory(dir)) {
    GTEST_SKIP() << dir << " is missing; install the Debian package dataset-fashion-mnist to run this test";
  }
  struct expectation {
    lockstep::mnist_split split;
    std::size_t size;
  };
  for (const expectation& e : {expectation{lockstep::mnist_split::train, 60000},
                               expectation{lockstep::mnist_split::test, 10000}}) {
    const lockstep::mnist_dataset ds = lockstep::load_fashion_mnist(dir, e.split);
    EXPECT_EQ(ds.size(), e.size);
    EXPECT_EQ(ds.rows(), 28u);
    EXPECT_EQ(ds.cols(), 28u);
    EXPECT_EQ(ds.layout().input_elements(), 784u);
    std::array<std::size_t, 10> per_class{};
    for (std::size_t i = 0; i < ds.size(); ++i) {
      const std::int32_t label = ds.label(i);
      ASSERT_GE(label, 0);
      ASSERT_LT(label, 10);
      ++per_class[static_cast<std::size_t>(label)];
    }
    for (std::size_t c = 0; c < 10; ++c) EXPECT_EQ(per_class[c], e.size / 10) << "class " << c;

    // A sample is not all zeros, and every pixel is in [0, 1].
    std::vector<float> input(784);
    std::int32_t target = -1;
    ds.fetch(0, {std::as_writable_bytes(std::span(input)), std::as_writable_bytes(std::span(&target, 1))});
    EXPECT_EQ(target, ds.label(0));
    EXPECT_GT(*std::max_element(input.begin(), input.end()), 0.0f);
    EXPECT_LE(*std::max_element(input.begin(), input.end()), 1.0f);
    EXPECT_GE(*std::min_element(input.begin(), input.end()), 0.0f);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// in_memory_dataset and sample_layout

TEST(sample_layout, elements_and_bytes) {
  const lockstep::sample_layout scalar_target{{3, 4}, dtype::f32, {}, dtype::i32};
  EXPECT_EQ(scalar_target.input_elements(), 12u);
  EXPECT_EQ(scalar_target.input_bytes(), 48u);
  EXPECT_EQ(scalar_target.target_elements(), 1u);
  EXPECT_EQ(scalar_target.target_bytes(), 4u);
  const lockstep::sample_layout u8_target{{5}, dtype::f16, {2, 3}, dtype::u8};
  EXPECT_EQ(u8_target.input_bytes(), 10u);
  EXPECT_EQ(u8_target.target_bytes(), 6u);
}

TEST(in_memory_dataset, classification_fetch) {
  const lockstep::in_memory_dataset ds({1, 2, 3, 4, 5, 6}, {2}, {7, -1, 3});
  EXPECT_EQ(ds.size(), 3u);
  EXPECT_EQ(ds.layout(), (lockstep::sample_layout{{2}, dtype::f32, {}, dtype::i32}));
  std::array<float, 2> input{};
  std::int32_t label = 0;
  ds.fetch(2, {std::as_writable_bytes(std::span(input)), std::as_writable_bytes(std::span(&label, 1))});
  EXPECT_EQ(input, (std::array<float, 2>{5, 6}));
  EXPECT_EQ(label, 3);
  ds.fetch(1, {std::as_writable_bytes(std::span(input)), std::as_writable_bytes(std::span(&label, 1))});
  EXPECT_EQ(input, (std::array<float, 2>{3, 4}));
  EXPECT_EQ(label, -1);
}

TEST(in_memory_dataset, regression_fetch_to_unaligned_bytes) {
  const lockstep::in_memory_dataset ds({1, 2, 3, 4, 5, 6}, {3}, {0.5f, 1.5f, 2.5f, 3.5f}, {2});
  EXPECT_EQ(ds.size(), 2u);
  EXPECT_EQ(ds.layout(), (lockstep::sample_layout{{3}, dtype::f32, {2}, dtype::f32}));
  // Destination at an odd address: datasets must not assume alignment.
  std::array<std::byte, 12 + 8 + 1> raw{};
  const lockstep::sample_ref dst{std::span(raw).subspan(1, 12), std::span(raw).subspan(13, 8)};
  ds.fetch(1, dst);
  std::array<float, 3> input{};
  std::array<float, 2> target{};
  std::memcpy(input.data(), raw.data() + 1, 12);
  std::memcpy(target.data(), raw.data() + 13, 8);
  EXPECT_EQ(input, (std::array<float, 3>{4, 5, 6}));
  EXPECT_EQ(target, (std::array<float, 2>{2.5f, 3.5f}));
}

TEST(in_memory_dataset, rejects_disagreeing_sizes) {
  expect_contains(message_of<lockstep::precondition_error>(
                      [] { lockstep::in_memory_dataset ds({1, 2, 3, 4, 5, 6}, {2}, {0, 1}); }),
                  {"inputs hold 3 samples", "labels hold 2 labels"});
  expect_contains(message_of<lockstep::precondition_error>(
                      [] { lockstep::in_memory_dataset ds({1, 2, 3, 4, 5}, {2}, {0, 1}); }),
                  {"inputs hold 5 floats", "not a whole number of samples of shape [2]"});
  expect_contains(message_of<lockstep::precondition_error>(
                      [] { lockstep::in_memory_dataset ds({1, 2, 3, 4}, {2}, {1, 2, 3}, {2}); }),
                  {"targets hold 3 floats", "not a whole number"});
  expect_contains(message_of<lockstep::precondition_error>(
                      [] { lockstep::in_memory_dataset ds({1, 2, 3, 4}, {2}, {1, 2, 3}, {}); }),
                  {"inputs hold 2 samples", "targets hold 3 samples"});
  expect_contains(message_of<lockstep::precondition_error>(
                      [] { lockstep::in_memory_dataset ds({1, 2}, {2, 0}, {0}); }),
                  {"dimension 1 of the input shape [2, 0] is 0"});
  expect_contains(message_of<lockstep::precondition_error>([] { lockstep::in_memory_dataset ds({}, {2}, {}); }),
                  {"at least one sample"});
}

TEST(in_memory_dataset, fetch_out_of_range) {
  const lockstep::in_memory_dataset ds({1, 2, 3}, {1}, {0, 1, 2});
  std::array<float, 1> input{};
  std::int32_t label = 0;
  expect_contains(message_of<lockstep::precondition_error>([&] {
                    ds.fetch(3, {std::as_writable_bytes(std::span(input)), std::as_writable_bytes(std::span(&label, 1))});
                  }),
                  {"sample index 3 is out of range for a dataset of 3 samples"});
}

// ---------------------------------------------------------------------------------------------------------------
// samplers

bool is_permutation_of_range(std::vector<std::size_t> v, std::size_t n) {
  if (v.size() != n) return false;
  std::sort(v.begin(), v.end());
  for (std::size_t i = 0; i < n; ++i) {
    if (v[i] != i) return false;
  }
  return true;
}

TEST(sampler, splitmix64_matches_the_reference_generator) {
  // The first outputs of Vigna's splitmix64.c seeded with 0.
  lockstep::detail::splitmix64 rng(0);
  EXPECT_EQ(rng.next(), 0xE220A8397B1DCDAFULL);
  EXPECT_EQ(rng.next(), 0x6E789E6AA1B965F4ULL);
  EXPECT_EQ(rng.next(), 0x06C45D188009454FULL);
}

TEST(sampler, bounded_draw_stays_in_range_and_hits_every_value) {
  lockstep::detail::splitmix64 rng(42);
  std::array<int, 7> seen{};
  for (int i = 0; i < 7000; ++i) {
    const std::uint64_t v = rng.below(7);
    ASSERT_LT(v, 7u);
    ++seen[v];
  }
  for (int count : seen) {
    EXPECT_GT(count, 850);
    EXPECT_LT(count, 1150);
  }
  EXPECT_EQ(rng.below(1), 0u);
}

TEST(sampler, sequential_order) {
  lockstep::sequential_sampler s(5);
  static_assert(lockstep::sampler<lockstep::sequential_sampler>);
  EXPECT_EQ(s.size(), 5u);
  EXPECT_EQ(s.indices(), (std::vector<std::size_t>{0, 1, 2, 3, 4}));
  s.set_epoch(3);
  EXPECT_EQ(s.indices(), (std::vector<std::size_t>{0, 1, 2, 3, 4}));
}

TEST(sampler, random_is_a_permutation_fixed_by_seed_and_epoch) {
  for (std::size_t n : {1u, 2u, 3u, 100u, 101u, 102u}) {
    lockstep::random_sampler s(n, 7);
    EXPECT_EQ(s.size(), n);
    for (std::uint64_t epoch = 0; epoch < 3; ++epoch) {
      s.set_epoch(epoch);
      EXPECT_TRUE(is_permutation_of_range(s.indices(), n)) << "n " << n << " epoch " << epoch;
    }
  }
  lockstep::random_sampler a(100, 7), b(100, 7), other_seed(100, 8);
  EXPECT_EQ(a.indices(), b.indices());
  EXPECT_NE(a.indices(), other_seed.indices());
  const auto epoch0 = a.indices();
  a.set_epoch(1);
  EXPECT_NE(a.indices(), epoch0);
  b.set_epoch(1);
  EXPECT_EQ(a.indices(), b.indices());
  a.set_epoch(0);
  EXPECT_EQ(a.indices(), epoch0);
}

TEST(sampler, random_golden_values) {
  // Computed from the algorithm documented at detail::shuffled_indices by an independent implementation; if
  // this fails on a new platform or compiler, the order is no longer portable.
  lockstep::random_sampler s10(10, 0);
  EXPECT_EQ(s10.indices(), (std::vector<std::size_t>{6, 3, 2, 9, 8, 1, 4, 7, 0, 5}));
  s10.set_epoch(1);
  EXPECT_EQ(s10.indices(), (std::vector<std::size_t>{2, 1, 8, 4, 9, 6, 5, 7, 3, 0}));
  EXPECT_EQ(lockstep::random_sampler(10, 1).indices(), (std::vector<std::size_t>{7, 4, 3, 8, 5, 9, 2, 0, 6, 1}));
  const auto first = lockstep::random_sampler(1000, 0).indices();
  EXPECT_EQ(std::vector<std::size_t>(first.begin(), first.begin() + 8),
            (std::vector<std::size_t>{501, 996, 135, 909, 733, 285, 707, 923}));
}

std::vector<std::vector<std::size_t>> all_ranks(std::size_t n, int world, lockstep::sample_order order,
                                                std::uint64_t seed, lockstep::tail_policy tail,
                                                std::uint64_t epoch = 0) {
  std::vector<std::vector<std::size_t>> out;
  for (int r = 0; r < world; ++r) {
    lockstep::distributed_sampler s(n, r, world, order, seed, tail);
    s.set_epoch(epoch);
    EXPECT_EQ(s.indices().size(), s.size());
    out.push_back(s.indices());
  }
  return out;
}

// A resumed epoch (set_start) on the same number of ranks visits exactly what the uninterrupted epoch had left,
// padding included, whether or not the dataset divides over the ranks; on another number of ranks it covers
// every index that was left.
TEST(distributed_sampler, set_start_resumes_an_epoch_on_any_number_of_ranks) {
  for (std::size_t n : {10u, 11u, 12u, 13u}) {
    for (int world = 1; world <= 4; ++world) {
      for (std::size_t batch : {1u, 2u}) {
        for (std::size_t steps = 0; steps * batch * static_cast<std::size_t>(world) <= n + 3; ++steps) {
          const std::size_t first = steps * batch * static_cast<std::size_t>(world);
          for (int r = 0; r < world; ++r) {
            lockstep::distributed_sampler whole(n, r, world, lockstep::sample_order::shuffled, 5);
            whole.set_epoch(2);
            const auto all = whole.indices();
            lockstep::distributed_sampler resumed(n, r, world, lockstep::sample_order::shuffled, 5);
            resumed.set_epoch(2);
            resumed.set_start(first);
            const auto rest = resumed.indices();
            const std::size_t skip = std::min(steps * batch, all.size());
            EXPECT_EQ(rest, std::vector<std::size_t>(all.begin() + static_cast<std::ptrdiff_t>(skip), all.end()))
                << "n " << n << ", world " << world << ", rank " << r << ", first " << first;
            EXPECT_EQ(resumed.size(), rest.size());
          }
          // another world size: the ranks together cover every entry left
          for (int other = 1; other <= 4; ++other) {
            std::vector<std::size_t> seen;
            for (int r = 0; r < other; ++r) {
              lockstep::distributed_sampler s(n, r, other, lockstep::sample_order::shuffled, 5);
              s.set_epoch(2);
              s.set_start(first);
              for (auto i : s.indices()) seen.push_back(i);
            }
            lockstep::distributed_sampler order(n, 0, 1, lockstep::sample_order::shuffled, 5);
            order.set_epoch(2);
            const auto full = order.indices();
            for (std::size_t k = first; k < n; ++k) {
              EXPECT_NE(std::find(seen.begin(), seen.end(), full[k]), seen.end()) << "entry " << k << " lost";
            }
          }
        }
      }
    }
  }
}

TEST(distributed_sampler, pad_covers_every_index_with_ceil_per_rank) {
  static_assert(lockstep::sampler<lockstep::distributed_sampler>);
  for (auto order : {lockstep::sample_order::sequential, lockstep::sample_order::shuffled}) {
    const auto ranks = all_ranks(10, 3, order, 5, lockstep::tail_policy::pad);
    std::vector<std::size_t> all;
    for (const auto& r : ranks) {
      EXPECT_EQ(r.size(), 4u);
      all.insert(all.end(), r.begin(), r.end());
    }
    ASSERT_EQ(all.size(), 12u);
    std::set<std::size_t> distinct(all.begin(), all.end());
    EXPECT_EQ(distinct.size(), 10u);  // every index, two of them twice
    EXPECT_EQ(*distinct.rbegin(), 9u);
    // The repeats are the first two entries of the order.
    const auto base = order == lockstep::sample_order::shuffled ? lockstep::random_sampler(10, 5).indices()
                                                                : lockstep::sequential_sampler(10).indices();
    EXPECT_EQ(std::count(all.begin(), all.end(), base[0]), 2);
    EXPECT_EQ(std::count(all.begin(), all.end(), base[1]), 2);
  }
  // Sequential: rank r takes r, r+3, ... of 0..9,0,1.
  const auto seq = all_ranks(10, 3, lockstep::sample_order::sequential, 0, lockstep::tail_policy::pad);
  EXPECT_EQ(seq[0], (std::vector<std::size_t>{0, 3, 6, 9}));
  EXPECT_EQ(seq[1], (std::vector<std::size_t>{1, 4, 7, 0}));
  EXPECT_EQ(seq[2], (std::vector<std::size_t>{2, 5, 8, 1}));
}

TEST(distributed_sampler, drop_gives_floor_per_rank_and_disjoint_ranks) {
  const auto ranks = all_ranks(10, 3, lockstep::sample_order::shuffled, 5, lockstep::tail_policy::drop);
  std::set<std::size_t> distinct;
  for (const auto& r : ranks) {
    EXPECT_EQ(r.size(), 3u);
    distinct.insert(r.begin(), r.end());
  }
  EXPECT_EQ(distinct.size(), 9u);
  // The dropped index is the last entry of the shuffled order.
  const auto base = lockstep::random_sampler(10, 5).indices();
  EXPECT_EQ(distinct.count(base[9]), 0u);
  lockstep::distributed_sampler s(10, 0, 3, lockstep::sample_order::shuffled, 5, lockstep::tail_policy::drop);
  EXPECT_EQ(s.total_size(), 9u);
}

TEST(distributed_sampler, divisible_ranks_are_disjoint_and_follow_one_permutation) {
  for (std::uint64_t epoch : {0u, 1u, 2u}) {
    const auto ranks = all_ranks(12, 4, lockstep::sample_order::shuffled, 9, lockstep::tail_policy::pad, epoch);
    lockstep::random_sampler whole(12, 9);
    whole.set_epoch(epoch);
    const auto base = whole.indices();
    std::vector<std::size_t> all;
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      ASSERT_EQ(ranks[r].size(), 3u);
      for (std::size_t k = 0; k < 3; ++k) EXPECT_EQ(ranks[r][k], base[r + 4 * k]) << "rank " << r << " entry " << k;
      all.insert(all.end(), ranks[r].begin(), ranks[r].end());
    }
    EXPECT_TRUE(is_permutation_of_range(all, 12));
  }
}

TEST(distributed_sampler, set_epoch_changes_the_permutation) {
  lockstep::distributed_sampler s(100, 1, 4, lockstep::sample_order::shuffled, 3);
  const auto epoch0 = s.indices();
  s.set_epoch(1);
  EXPECT_NE(s.indices(), epoch0);
  s.set_epoch(0);
  EXPECT_EQ(s.indices(), epoch0);
  lockstep::distributed_sampler other_seed(100, 1, 4, lockstep::sample_order::shuffled, 4);
  EXPECT_NE(other_seed.indices(), epoch0);
}

TEST(distributed_sampler, fewer_samples_than_ranks) {
  const auto padded = all_ranks(3, 4, lockstep::sample_order::sequential, 0, lockstep::tail_policy::pad);
  EXPECT_EQ(padded, (std::vector<std::vector<std::size_t>>{{0}, {1}, {2}, {0}}));
  const auto shuffled = all_ranks(3, 4, lockstep::sample_order::shuffled, 11, lockstep::tail_policy::pad);
  std::set<std::size_t> distinct;
  for (const auto& r : shuffled) {
    ASSERT_EQ(r.size(), 1u);
    distinct.insert(r[0]);
  }
  EXPECT_EQ(distinct.size(), 3u);
  EXPECT_EQ(shuffled[3][0], shuffled[0][0]);
  for (const auto& r : all_ranks(3, 4, lockstep::sample_order::shuffled, 11, lockstep::tail_policy::drop)) {
    EXPECT_TRUE(r.empty());
  }
  // Also n = 1 with many ranks.
  EXPECT_EQ(all_ranks(1, 5, lockstep::sample_order::shuffled, 0, lockstep::tail_policy::pad),
            (std::vector<std::vector<std::size_t>>(5, std::vector<std::size_t>{0})));
}

TEST(distributed_sampler, preconditions) {
  expect_contains(message_of<lockstep::precondition_error>([] { lockstep::distributed_sampler s(10, 4, 4); }),
                  {"rank 4 is out of range for world_size 4", "0 to 3"});
  expect_contains(message_of<lockstep::precondition_error>([] { lockstep::distributed_sampler s(10, -1, 4); }),
                  {"rank -1 is out of range for world_size 4"});
  expect_contains(message_of<lockstep::precondition_error>([] { lockstep::distributed_sampler s(10, 0, 0); }),
                  {"world_size must be at least 1, got 0"});
  expect_contains(message_of<lockstep::precondition_error>([] { lockstep::distributed_sampler s(0, 0, 1); }),
                  {"at least one sample, got n = 0"});
}

}  // namespace
