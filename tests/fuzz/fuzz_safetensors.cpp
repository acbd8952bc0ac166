// libFuzzer target: the safetensors header parser (io/safetensors.hpp) on arbitrary files. Every input must be
// accepted with a consistent header or rejected with data_error; anything else (a crash, another exception,
// an out-of-bounds read under ASan) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "lockstep/io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  try {
    const auto h = lockstep::parse_safetensors_header(file, size, "fuzz.safetensors");
    // What the parser promises of an accepted file: contiguous tensors that end where the file ends.
    std::uint64_t at = 0;
    for (const auto& t : h.tensors) {
      if (t.begin != at || t.end < t.begin) std::abort();
      if (t.size_bytes() != static_cast<std::uint64_t>(t.numel()) * lockstep::size_of(t.type)) std::abort();
      at = t.end;
    }
    if (h.data_offset + at != size) std::abort();
  } catch (const lockstep::data_error&) {
  }
  return 0;
}
