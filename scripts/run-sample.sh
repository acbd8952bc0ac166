#!/usr/bin/env bash
# Builds and runs the sample training (examples/mlp_train) with its defaults: a 784-256-256-10 MLP on
# Fashion-MNIST (Debian's dataset-fashion-mnist), 5 epochs, batch 128, SGD momentum 0.9 with lr 0.05 annealed
# to 0 along a cosine — on the GPUs when there are any, else on host virtual devices. Arguments are passed to
# the sample (try --help). With --cnn first, it runs examples/cnn_train instead (a small CNN; the same options
# and its own: --channels, --hidden, --dropout, --sync-bn).
#
# Environment: LOCKSTEP_JOBS (parallel build jobs), LOCKSTEP_BUILD_ROOT (default: ./build).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
build=${LOCKSTEP_BUILD_ROOT:-$root/build}/sample
mkdir -p "$build"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  -DLOCKSTEP_BUILD_TESTS=OFF -DLOCKSTEP_BUILD_BENCHMARKS=OFF >"$build.configure.log" 2>&1 \
  || { cat "$build.configure.log"; exit 1; }
sample=mlp_train
if [[ "${1:-}" == "--cnn" ]]; then
  sample=cnn_train
  shift
fi
cmake --build "$build" -j "${LOCKSTEP_JOBS:-$(nproc)}" --target "$sample" lockstep-info
"$build/tools/lockstep-info" | tail -n 2
exec "$build/examples/$sample/$sample" "$@"
