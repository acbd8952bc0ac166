#!/usr/bin/env bash
# Builds and runs every lockstep test, the way CI does (.ci/run calls this):
#   1. with nvcc, when the CUDA toolkit is present: both backends compiled for sm_80 and sm_90 with warnings as
#      errors; GPU tests skip without a GPU (without the toolkit: a g++ Release build of the host backend);
#   2. with g++ alone, AddressSanitizer and UndefinedBehaviorSanitizer: the host backend (the samples instrumented
#      too, with their smoke runs only: their matrices run in stage 1);
#   3. with g++ and ThreadSanitizer: the stream, event and memory tests;
#   4. with clang: the libFuzzer targets of the parsers (tests/fuzz), each for LOCKSTEP_FUZZ_SECONDS (default 30);
#   5. with clang (the oldest Debian's, 14): a user's training file built and run, so the headers stay portable;
#   6. README.md's install commands, as written: `cmake --install` of a configured tree into a fresh prefix, then
#      examples/consumer built against it and run.
# Prints each ctest summary and a final one; exits non-zero if anything failed.
#
# Environment: LOCKSTEP_JOBS (parallel build jobs, default: cores), LOCKSTEP_BUILD_ROOT (default: ./build).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup.sh --torch || exit 1  # PyTorch: the checkpoint interop test (tools/safetensors_interop.py)

jobs=${LOCKSTEP_JOBS:-$(nproc)}
build_root=${LOCKSTEP_BUILD_ROOT:-$root/build}
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
results=()
failed=0
start=$(date +%s)

stage() {  # stage NAME CMD...: runs a stage, records its outcome and time
  local name=$1; shift
  local t0=$(date +%s)
  echo
  echo "==== $name"
  if "$@"; then
    results+=("PASS  $name ($(( $(date +%s) - t0 )) s)")
  else
    results+=("FAIL  $name ($(( $(date +%s) - t0 )) s)")
    failed=1
  fi
}

configure_build_test() {  # DIR LABEL-REGEX CMAKE-ARGS...
  local dir=$1 labels=$2; shift 2
  cmake -S "$root" -B "$dir" -G Ninja "${launcher[@]}" "$@" >"$dir.configure.log" 2>&1 \
    || { cat "$dir.configure.log"; return 1; }
  grep -E "lockstep:" "$dir.configure.log" || true
  cmake --build "$dir" -j "$jobs" || return 1
  local args=(--test-dir "$dir" --output-on-failure -j "$jobs" --timeout 900)
  [[ -n "$labels" ]] && args+=(-L "$labels")
  ctest "${args[@]}"
}

mkdir -p "$build_root"
if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  stage "nvcc build (cuda + host backends, sm_80;sm_90, -Werror)" \
    configure_build_test "$build_root/cuda" "" -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_CUDA=ON -DLOCKSTEP_BUILD_TESTS=ON
else  # the Release build of stage 1 without CUDA: the samples' matrices run here
  stage "g++ Release build (host backend: no CUDA toolkit in /usr/local/cuda)" \
    configure_build_test "$build_root/release" "" -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_CUDA=OFF -DLOCKSTEP_BUILD_TESTS=ON
fi
# Sanitizer builds: -g1 (line tables, so every report's stack has file:line; no variable locations, whose tracking
# took a third of the compile time). AddressSanitizer's at -O0: instrumented code at -O1 took 2.5 times as long to
# compile (test_amp.cpp: 173 s against 68 s) for tests that ran 1.6 times faster (test_zero: 38 s against 61 s).
# (The samples build at -O0 there too; -Wmaybe-uninitialized and the like need optimization: the nvcc stage's -O1
# tests and -O3 samples have them.) ThreadSanitizer's at -O1: it builds few programs, and its races run long at -O0.
stage "g++ build, AddressSanitizer + UndefinedBehaviorSanitizer (host backend)" \
  configure_build_test "$build_root/asan" "" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-g1 -O0" \
  -DLOCKSTEP_CUDA=OFF -DLOCKSTEP_SANITIZE=address,undefined -DLOCKSTEP_BUILD_BENCHMARKS=OFF -DLOCKSTEP_BUILD_TESTS=ON
stage "g++ build, ThreadSanitizer (streams, events, memory, data loader, blas, host cliques, checkpoints, ZeRO)" \
  configure_build_test "$build_root/tsan" "core|runtime|data|blas|comm|io|parallel" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-g1 -O1" \
  -DLOCKSTEP_CUDA=OFF -DLOCKSTEP_SANITIZE=thread -DLOCKSTEP_BUILD_EXAMPLES=OFF -DLOCKSTEP_BUILD_BENCHMARKS=OFF \
  -DLOCKSTEP_BUILD_TOOLS=OFF -DLOCKSTEP_BUILD_TESTS=ON

if command -v clang++ >/dev/null; then
  stage "clang libFuzzer targets, AddressSanitizer + UndefinedBehaviorSanitizer (${LOCKSTEP_FUZZ_SECONDS:-30} s each)" \
    configure_build_test "$build_root/fuzz" "fuzz" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
    -DLOCKSTEP_CUDA=OFF -DLOCKSTEP_FUZZ=ON -DLOCKSTEP_FUZZ_SECONDS="${LOCKSTEP_FUZZ_SECONDS:-30}" \
    -DLOCKSTEP_BUILD_TESTS=OFF -DLOCKSTEP_BUILD_EXAMPLES=OFF -DLOCKSTEP_BUILD_BENCHMARKS=OFF -DLOCKSTEP_BUILD_TOOLS=OFF
fi

clang_consumer() {  # a user's training file (bench/compile_time/training_file.cpp) built by clang and run
  local dir="$build_root/clang"
  cmake -S "$root" -B "$dir" -G Ninja "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=clang++ \
    -DLOCKSTEP_CUDA=OFF -DLOCKSTEP_BUILD_TESTS=OFF -DLOCKSTEP_BUILD_EXAMPLES=OFF -DLOCKSTEP_BUILD_TOOLS=OFF \
    >"$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; return 1; }
  clang++ --version | head -1
  cmake --build "$dir" --target compile_time_training_file || return 1
  rm -rf "$dir/checkpoints"
  # (printed from a variable: `tee /dev/stderr` reopens the log and truncates it when it is a file)
  local out
  out=$(LOCKSTEP_HOST_DEVICES=2 LOCKSTEP_HOST_STRICT=1 "$dir/bench/compile_time_training_file" "$dir/checkpoints" 2>&1) \
    || { printf '%s\n' "$out"; return 1; }
  printf '%s\n' "$out"
  grep -Eq 'loss [0-9.]+, saved .*step-0+3' <<<"$out"
}
if command -v clang++ >/dev/null; then
  stage "clang build of a user's training file (graph, custom layer, DDP, f16, AdamW, loader, checkpointer), run" \
    clang_consumer
fi

consumer() {  # README.md's install and consumer commands, exactly as written there, with PREFIX a fresh directory
  local commands
  commands=$(awk '/<!-- ci: install -->/ {found = 1; next} found && /^```sh/ {inside = 1; next} inside && /^```/ {exit}
                  inside {print}' README.md)
  [[ -n "$commands" ]] || { echo "README.md has no install commands after <!-- ci: install -->"; return 1; }
  local work
  work=$(realpath -m "$build_root/readme-install")
  rm -rf "$work" && mkdir -p "$work" || return 1
  # a copy of the tree without its build directories (the files git tracks, and new ones it would): the commands use
  # build/ relative to it, as a user's checkout would
  (cd "$root" && git ls-files -z --cached --others --exclude-standard \
     | while IFS= read -r -d '' f; do if [[ -e "$f" ]]; then printf '%s\0' "$f"; fi; done \
     | xargs -0 cp --parents -t "$work") || return 1
  echo "$commands"
  (cd "$work" && PREFIX="$work/prefix" bash -euo pipefail -c "$commands") || return 1
  if [[ -x "$work/build/consumer/consumer_cuda" ]]; then  # built by nvcc when CUDA is found: GPUs when present
    echo "-- consumer_cuda"
    "$work/build/consumer/consumer_cuda" || return 1
  fi
}
stage "README install commands: cmake --install into a fresh prefix, examples/consumer built against it and run" consumer

echo
echo "==== summary ($(( $(date +%s) - start )) s)"
printf '%s\n' "${results[@]}"
exit $failed
