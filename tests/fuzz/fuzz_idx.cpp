// libFuzzer target: the IDX reader (data/idx.hpp), plain and gzip-compressed, on arbitrary files. The input is
// written to a file in /dev/shm (the reader's real path, file sizes and gzip stream included); every input must
// be read or rejected with data_error.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "lockstep/data/idx.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = "/dev/shm/lockstep_fuzz_idx." + std::to_string(::getpid());
  if (std::FILE* f = std::fopen(path.c_str(), "wb")) {
    if (size > 0) std::fwrite(data, 1, size, f);
    std::fclose(f);
  } else {
    std::abort();
  }
  try {
    const lockstep::idx_array a = lockstep::read_idx(path);
    std::uint64_t n = lockstep::size_of(a.type);
    for (const auto d : a.dims) n *= static_cast<std::uint64_t>(d);
    if (a.data.size() != n) std::abort();  // the payload is exactly what the header says
  } catch (const lockstep::data_error&) {
  }
  return 0;
}
