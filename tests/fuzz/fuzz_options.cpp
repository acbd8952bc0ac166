// libFuzzer target: the samples' option parser (examples/common/options.hpp) with the models' own options of
// mlp_train and cnn_train (their recipes). The input's first byte chooses the sample; the rest is split at NUL bytes
// into arguments; every command line must parse or throw usage_error (a sentence).
#include <cstdint>
#include <string>
#include <vector>

#include "../../examples/cnn_train/model.hpp"
#include "../../examples/mlp_train/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  static const sample::model_recipe models[] = {mlp_sample::recipe(), cnn_sample::recipe()};
  const sample::model_recipe& model = models[data[0] % 2];
  std::vector<std::string> args{model.program};
  std::string current;
  for (std::size_t i = 1; i < size; ++i) {
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
    (void)sample::parse_options(static_cast<int>(args.size()), argv.data(), model.parse);
  } catch (const sample::usage_error&) {
  }
  return 0;
}
