// libFuzzer target: lockstep's JSON (io/json.hpp) on arbitrary text. Every input must be parsed or rejected with
// json_error; a parsed value must dump (compact and indented) to text that parses back to an equal value and dumps
// to the same text again. Anything else (a crash, another exception, a difference) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "lockstep/io/json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  lockstep::json_value v;
  try {
    v = lockstep::json_value::parse(text);
  } catch (const lockstep::json_error&) {
    return 0;
  }
  for (const int indent : {-1, 1}) {
    const std::string once = v.dump(indent);
    const lockstep::json_value back = lockstep::json_value::parse(once);
    if (!(back == v)) std::abort();
    if (back.dump(indent) != once) std::abort();
  }
  return 0;
}
