// libFuzzer target: device strings and lists (device/device.hpp, device_set.hpp) and the CUDA_VISIBLE_DEVICES
// parser (device/visibility.hpp) on arbitrary text. Each must parse or throw lockstep::error (a sentence).
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "lockstep/device/device.hpp"
#include "lockstep/device/visibility.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  for (const auto kind : {lockstep::device_kind::cuda, lockstep::device_kind::host}) {
    try {
      const lockstep::device d = lockstep::parse_device(text, kind);
      if (d.index < 0) std::abort();
      if (lockstep::parse_device(d.str(), kind) != d) std::abort();  // what it prints, it reads back
    } catch (const lockstep::error&) {
    }
    try {
      for (const auto& d : lockstep::parse_device_list(text, kind))
        if (d.index < 0) std::abort();
    } catch (const lockstep::error&) {
    }
  }
  try {
    (void)lockstep::parse_cuda_visible_devices(text, 8);
  } catch (const lockstep::error&) {
  }
  return 0;
}
