// cnn_train — a small CNN (convolutions, batch norm, max pooling, dropout) trained on Fashion-MNIST with lockstep,
// with the options of mlp_train (--mode single|dp|ddp, mpirun, --precision, --zero, --deterministic, --save and
// --resume, --json; --help lists them) and its own: --channels, --hidden, --dropout, --sync-bn.
//
//   cnn_train --epochs 5                                              one device
//   cnn_train --mode ddp --devices host:0,host:1 --sync-bn            DDP, batch statistics of the global batch
//   mpirun -np 2 cnn_train --mode ddp --sync-bn --deterministic       the bits of one device
//
// The model is in model.hpp; the loop, the modes, checkpoints and the report are the samples' runner
// (examples/common/runner.cpp, shared with mlp_train).
#include "model.hpp"

int main(int argc, char** argv) { return sample::run(argc, argv, cnn_sample::recipe()); }
