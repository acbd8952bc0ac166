// The samples' runner: everything of a training program except its model. mlp_train and cnn_train are each a
// model (a graph of lockstep layers) and their own options, handed to sample::run (examples/common/runner.cpp):
// the command line, the modes (single, dp, ddp on threads or under mpirun), the training loop with the loss scaler,
// clipping and the learning-rate schedule, checkpoints and --resume, evaluation, the progress line and the report.
//
// A new sample is a model_recipe and a main():
//
//   int main(int argc, char** argv) { return sample::run(argc, argv, my_recipe()); }
#pragma once

#include <lockstep/blas/gemm_rate.hpp>
#include <lockstep/nn/context.hpp>
#include <lockstep/io/json.hpp>
#include <lockstep/nn/graph.hpp>
#include <lockstep/runtime/stream.hpp>

#include <cstdint>
#include <functional>
#include <string>

#include "options.hpp"

namespace sample {

/// What makes one sample different from another: its model and the model's options.
struct model_recipe {
  std::string program;  // the program's name, in its usage and messages ("mlp_train")
  std::string usage;    // the model's own options, lines of the usage text ("  --hidden A,B,...  ...\n")
  /// Parses one of the model's options (see parse_options); returns false for an option that is not the model's.
  model_option_parser parse;
  /// Checks the model's options against the common ones, after parsing (throws usage_error); may be empty.
  std::function<void(const options&)> check;
  /// The model for images of `inputs` values (a row each), its parameters initialized from `seed`, for `ctx`.
  std::function<lockstep::graph(std::int64_t inputs, lockstep::context& ctx, std::uint64_t seed)> build;
  /// The model's options as JSON: in --json's line, and in every checkpoint, which a --resume must match.
  std::function<lockstep::json_value()> describe;
  /// The product the host GEMM rate is measured on before training (the first layer's, for `rows` rows).
  std::function<lockstep::gemm_shape(std::int64_t rows, std::int64_t inputs)> first_product;
};

/// Hooks for tests: code the runner calls at fixed points of a run of DDP ranks (tests/sample_faults.cpp injects
/// failures through them). Empty hooks are not called.
struct run_hooks {
  /// Before training, with the number of ranks and whether they are processes (mpirun).
  std::function<void(int world, bool processes)> before_training;
  /// At the start of every step (1-based) of `last`, on rank `rank`, with its device and the stream its collectives
  /// run on (distributed_data_parallel::collective_stream()).
  std::function<void(int rank, std::int64_t step, std::int64_t last, lockstep::device dev,
                     lockstep::stream_ref comm_stream)>
      before_step;
  /// Environment lines added to --help (what the hooks read).
  std::string usage;
};

/// The whole program: parses argv, trains, reports; returns main's exit code (2 for a usage error, 1 for a
/// failure, with its message on stderr; under mpirun a failing rank ends the job).
int run(int argc, char** argv, const model_recipe& model, const run_hooks& hooks = {});

}  // namespace sample
