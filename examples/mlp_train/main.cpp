// mlp_train — the sample users start from: an MLP trained on Fashion-MNIST with lockstep.
//
//   mlp_train [--data DIR] [--devices SPEC] [--mode single|dp|ddp] [--epochs N] [--batch N] [--lr X]
//             [--lr-schedule cosine|constant] [--momentum X] [--hidden 256,256] [--optimizer sgd|adamw]
//             [--precision f32|f16|bf16] [--seed N] [--workers N] [--json] ...   (--help lists them all)
//
//   single  one device: the first of --devices (default: the first GPU, or host:0 when there is none)
//   dp      data_parallel over --devices (PyTorch's nn.DataParallel): one process, the model on the first
//   ddp     distributed_data_parallel: one thread per device of --devices, or, under `mpirun -np N`, one
//           process per rank, each on its local device
//
// While training it prints a live progress line; at the end a summary: test accuracy, training seconds,
// samples per second, and per device the peak memory and the time spent computing, communicating and idle.
// With --json the last line is one JSON object with those figures.
//
// The model is in model.hpp; the loop, the modes, checkpoints and the report are the samples' runner
// (examples/common/runner.cpp, shared with cnn_train).
#include "model.hpp"

int main(int argc, char** argv) { return sample::run(argc, argv, mlp_sample::recipe()); }
