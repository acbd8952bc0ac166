// libFuzzer target: the samples' option parser (examples/common/options.hpp) with the models' own options of
// mlp_train and cnn_train (their recipes, made afresh for each input, and their checks). The input is split at NUL
// bytes into arguments; every command line must parse or throw usage_error (a sentence), for both samples.
#include <cstdint>
#include <string>
#include <vector>

#include "../../examples/cnn_train/model.hpp"
#include "../../examples/mlp_train/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args{"sample"};
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
  for (const sample::model_recipe& model : {mlp_sample::recipe(), cnn_sample::recipe()}) {
    try {
      const sample::options o = sample::parse_options(static_cast<int>(args.size()), argv.data(), model.parse);
      if (model.check) model.check(o);
    } catch (const sample::usage_error&) {
    }
  }
  return 0;
}
