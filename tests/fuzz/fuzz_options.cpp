// libFuzzer target: the sample's option parser (examples/mlp_train/options.hpp). The input is split at NUL bytes
// into arguments; every command line must parse or throw usage_error (a sentence).
#include <cstdint>
#include <string>
#include <vector>

#include "../../examples/mlp_train/options.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args{"mlp_train"};
  std::string current;
  for (std::size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      args.push_back(current);
      current.clear();
    } else {
      current += static_cast<char>(data[i]);
    }
  }
  if (!current.empty()) args.push_back(current);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  try {
    (void)parse_options(static_cast<int>(args.size()), argv.data());
  } catch (const usage_error&) {
  }
  return 0;
}
