#!/usr/bin/env bash
# The first thing to run on a GPU machine: finds the GPUs, builds lockstep with nvcc and checks it on them. Each
# part gives one or more verdicts (PASS, FAIL or SKIP), and the run ends with one table of them:
#   1. detect: nvidia-smi -L, the driver and the CUDA version it supports, nvcc, NCCL, compute-sanitizer,
#      mpirun, CUDA_VISIBLE_DEVICES; printed BEFORE anything is installed or built. Without a GPU (no
#      nvidia-smi, no device in `nvidia-smi -L`, every GPU hidden by CUDA_VISIBLE_DEVICES) or without nvcc it
#      says what it found and exits 0, having set up, built and run nothing;
#   2. setup: scripts/setup.sh (Debian packages). A failure (no sudo, a package apt cannot find, not Debian) is a
#      FAIL verdict naming the failing step, and the script goes on: each later part then stops only if it
#      lacks what it needs (cmake/Ninja for the build, the data set for the samples, mpirun for its rows).
#      LOCKSTEP_SKIP_SETUP=1 skips it (SKIP), for machines whose packages come from elsewhere;
#   3. build: cmake + Ninja into $LOCKSTEP_BUILD_ROOT/gpu-check, RelWithDebInfo, LOCKSTEP_CUDA=ON (device code
#      with -lineinfo, so that compute-sanitizer names source lines), then lockstep-info (what lockstep sees);
#   4. tests: ctest once, plainly. FAIL when a test fails, or when the GPU instances of the parameterized tests
#      (named ".../cuda...") did not use a GPU: none of them ran, or one skipped with "no GPU: ...". (CTest's
#      mlp_train tests pin host devices: the samples on GPUs are part 5.)
#   5. samples: examples/mlp_train on the GPUs, short runs (--max-steps 50) with --json, next to the same runs on
#      host devices, compared by weights_sha256 where the bits must agree and by test_accuracy otherwise (the
#      rules are below, at part_samples);
#   6. compute-sanitizer: EVERY test program of tests/CMakeLists.txt (its lockstep_add_test lines, in the
#      environment CTest gives each) under memcheck (--leak-check full), racecheck and synccheck: the GPU cases
#      (LOCKSTEP_SANITIZER_FILTER); a program none of whose tests matches the default filter runs whole; the
#      test_*_mpi programs with device code run whole under `mpirun -np 2 compute-sanitizer`. One verdict per
#      tool; SKIP when compute-sanitizer is missing;
#   7. collectives: `nvidia-smi topo -m` / `-p2p r`, then bench_collectives' GPU rows swept from 4 KiB up to 256 MiB
#      (large messages are where peer-access defects show) with NCCL_DEBUG=WARN. FAIL when a row fails, a
#      collective stops short of the largest size, or NCCL printed a warning (counted, the distinct ones
#      named); the busbw of the largest all-reduce is reported next to what the links suggest (NVLink: tens to
#      hundreds of GB/s; PCIe only: about 10-25 GB/s), never failed. Needs 2 GPUs (SKIP with the reason on one);
#   8. the table: "==== gpu-check summary", one row per verdict (part, verdict, detail); the exit status is
#      non-zero when any verdict is FAIL.
# Logs go to <build>/logs (rewritten on every run): detect.log, setup.log, configure.log, build.log,
# lockstep-info.log, ctest.log, sample-<run>.log, sample-resume-<name>.log, sanitizer-<tool>-<program>.log,
# topology.log, bench_collectives.log/.json, summary.log.
#
# Environment: LOCKSTEP_JOBS (parallel build jobs, default: cores), LOCKSTEP_TEST_JOBS (parallel tests, default:
# cores, at most 8: the tests share the GPUs' memory), LOCKSTEP_BUILD_ROOT (default: ./build),
# LOCKSTEP_CUDA_ARCHITECTURES (CMAKE_CUDA_ARCHITECTURES; unset: the project's default, sm_80 and sm_90, which
# covers compute capability 8.x and 9.x — a GPU of another architecture, e.g. a T4 (sm_75), needs
# LOCKSTEP_CUDA_ARCHITECTURES=native), LOCKSTEP_SKIP_SETUP (1: do not run scripts/setup.sh),
# LOCKSTEP_SAMPLE_STEPS (steps per sample run, default 50), LOCKSTEP_SAMPLE_TOLERANCE (largest difference of
# test accuracy where the bits may differ, default 0.02), LOCKSTEP_SAMPLE_TIMEOUT (seconds per sample run,
# default 600), LOCKSTEP_SAMPLE_DATA (the samples' --data; default: theirs, /usr/share/datasets/fashion-mnist),
# LOCKSTEP_SANITIZER_TOOLS (default: "memcheck racecheck synccheck"; add initcheck for uninitialized reads;
# empty: none), LOCKSTEP_SANITIZER_FILTER (the gtest filter under compute-sanitizer, default '*cuda*:*gpu*';
# racecheck and synccheck are slow: narrow it, e.g. '*blas*cuda*:*comm*cuda*'; with a filter of yours, programs
# without a matching test are left out rather than run whole), LOCKSTEP_SANITIZER_TIMEOUT (seconds per tool and
# program, default 3600), LOCKSTEP_BENCH_FILTER (bench_collectives' rows, default '^cuda/'), LOCKSTEP_BENCH_MIN_TIME
# (seconds per row, default 0.2), LOCKSTEP_BENCH_MAX_BYTES (largest message, default 256M).
set -uo pipefail
export LC_NUMERIC=C  # the accuracies are printed and compared with a decimal point
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 1

# ---- 1. detect: what is here, before anything is installed or built ---------------------------------------------
# nvidia-smi, not the CUDA runtime: without a driver, cudaGetDeviceCount fails ("CUDA driver version is
# insufficient for CUDA runtime version"), which only says that there is no GPU here either.
detect_lines=()
say() {  # prints a line of the detection and keeps it for detect.log
  printf '  %s\n' "$*"
  detect_lines+=("$*")
}
version_lt() {  # version_lt A B: A < B (dotted versions)
  [[ "$1" != "$2" && "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1)" == "$1" ]]
}
find_sanitizer() {
  local c
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
      ${nvcc:+"$(dirname "$nvcc")/compute-sanitizer"} "$(command -v compute-sanitizer 2>/dev/null)"; do
    [[ -n "$c" && -x "$c" ]] && { echo "$c"; return 0; }
  done
  return 1
}

echo "==== detect (before any setup or build)"
no_gpu_reason=""
gpu_count=0
gpu_list=""
if ! command -v nvidia-smi >/dev/null; then
  no_gpu_reason="no nvidia-smi on PATH (no NVIDIA driver installed)"
  say "nvidia-smi: not on PATH"
  if [[ -r /proc/driver/nvidia/version ]]; then
    say "kernel module: $(head -n 1 /proc/driver/nvidia/version)"
  else
    say "kernel module: none loaded (/proc/driver/nvidia/version does not exist)"
  fi
elif ! gpu_list=$(nvidia-smi -L 2>&1); then
  no_gpu_reason="'nvidia-smi -L' failed ($(head -n 1 <<< "$gpu_list"))"
  say "nvidia-smi: $(command -v nvidia-smi), but 'nvidia-smi -L' failed: $(head -n 1 <<< "$gpu_list")"
else
  gpu_count=$(grep -cE '^GPU [0-9]+:' <<< "$gpu_list")
  say "nvidia-smi -L: $gpu_count GPU(s)"
  while IFS= read -r line; do
    [[ -n "$line" ]] && say "  $line"
  done <<< "$gpu_list"
  ((gpu_count == 0)) && no_gpu_reason="'nvidia-smi -L' lists no device"
fi
driver="" driver_cuda=""
if ((gpu_count > 0)); then
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
  driver_cuda=$(nvidia-smi 2>/dev/null | grep -oE 'CUDA Version: *[0-9.]+' | grep -oE '[0-9.]+$' | head -n 1)
  say "driver: ${driver:-unknown} (supports CUDA ${driver_cuda:-unknown})"
  gpu_table=$(nvidia-smi --query-gpu=index,name,memory.total,compute_cap,pci.bus_id --format=csv,noheader \
    2>/dev/null) || gpu_table=$(nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id --format=csv,noheader \
    2>/dev/null)
  while IFS= read -r line; do
    [[ -n "$line" ]] && say "  GPU $line"
  done <<< "$gpu_table"
fi
# The GPUs the CUDA runtime will see: all, or those CUDA_VISIBLE_DEVICES lists.
visible=$gpu_count
if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
  if [[ -z "$CUDA_VISIBLE_DEVICES" || "$CUDA_VISIBLE_DEVICES" == "-1" || "$CUDA_VISIBLE_DEVICES" == NoDevFiles ]]; then
    visible=0
  else
    entries=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
    ((entries < visible)) && visible=$entries
  fi
  say "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES': $visible GPU(s) visible to CUDA"
  if ((gpu_count > 0 && visible == 0)) && [[ -z "$no_gpu_reason" ]]; then
    no_gpu_reason="CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' hides every GPU"
  fi
fi
[[ -n "${CUDA_DEVICE_ORDER:-}" ]] && say "CUDA_DEVICE_ORDER=$CUDA_DEVICE_ORDER"
# Identical GPUs: deterministic mode's bits are the same on every rank only then (docs/determinism.md, "What a
# GPU needs"). Judged by name over every GPU nvidia-smi lists (also those CUDA_VISIBLE_DEVICES hides).
gpu_models=""
same_gpus=1
if ((gpu_count > 0)); then
  gpu_models=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | sed -E 's/^ +//')
  (($(grep -c . <<< "$gpu_models") > 1)) && same_gpus=0
fi

# nvcc as CMake finds it (cmake/lockstepDependencies.cmake): $CUDACXX, else /usr/local/cuda/bin/nvcc, else PATH.
nvcc=""
if [[ -n "${CUDACXX:-}" && -x "${CUDACXX:-}" ]]; then
  nvcc=$CUDACXX
elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
  nvcc=/usr/local/cuda/bin/nvcc
else
  nvcc=$(command -v nvcc 2>/dev/null || true)
fi
nvcc_release=""
if [[ -n "$nvcc" ]]; then
  nvcc_release=$("$nvcc" --version 2>/dev/null | grep -oE 'release [0-9]+\.[0-9]+' | grep -oE '[0-9.]+$')
  say "nvcc: $nvcc (CUDA ${nvcc_release:-unknown})"
  if [[ -n "$driver_cuda" && -n "$nvcc_release" ]] && version_lt "$driver_cuda" "$nvcc_release"; then
    say "warning: the driver supports CUDA $driver_cuda, older than the toolkit's $nvcc_release: programs built" \
      "with it fail with cudaErrorInsufficientDriver unless the CUDA forward-compatibility package is installed"
  fi
else
  say "nvcc: none (neither \$CUDACXX, /usr/local/cuda/bin/nvcc nor nvcc on PATH)"
fi
nccl_header=""
for d in ${nvcc:+"$(dirname "$nvcc")/../include"} /usr/local/cuda/include /usr/include; do
  [[ -f "$d/nccl.h" ]] && { nccl_header=$d/nccl.h; break; }
done
if [[ -n "$nccl_header" ]]; then
  nccl_version=$(awk '/#define NCCL_(MAJOR|MINOR|PATCH) / { v = v (v == "" ? "" : ".") $3 } END { print v }' \
    "$nccl_header")
  say "NCCL: $nccl_header (${nccl_version:-version unknown}); library: $(ldconfig -p 2>/dev/null \
    | grep -m 1 -oE '/[^ ]*libnccl\.so[^ ]*' || echo 'not in the ldconfig cache')"
else
  say "NCCL: no nccl.h next to nvcc, in /usr/local/cuda/include or /usr/include (the CUDA build needs it)"
fi
sanitizer=$(find_sanitizer || true)
say "compute-sanitizer: ${sanitizer:-not found}"
mpirun_path=$(command -v mpirun 2>/dev/null || true)
if [[ -n "$mpirun_path" ]]; then
  say "mpirun: $mpirun_path ($("$mpirun_path" --version 2>/dev/null | head -n 1))"
else
  say "mpirun: not on PATH (scripts/setup.sh installs openmpi-bin)"
fi

if [[ -n "$no_gpu_reason" ]]; then
  echo "gpu-check: no GPU to check on this machine: $no_gpu_reason; nothing was set up, built or run."
  exit 0
fi
if [[ -z "$nvcc" ]]; then
  echo "gpu-check: $gpu_count GPU(s) but no nvcc (install the CUDA toolkit into /usr/local/cuda, or set CUDACXX);" \
    "nothing was set up, built or run."
  exit 0
fi
if ((same_gpus)); then
  say "GPU models: one ($(sed -E 's/^[0-9]+ //' <<< "$gpu_models"))"
else
  say "GPU models: several ($(tr '\n' ';' <<< "$gpu_models" | sed 's/;$//')): deterministic runs across them" \
    "are compared by accuracy, not bits"
fi

# ---- settings ----------------------------------------------------------------------------------------------------
jobs=${LOCKSTEP_JOBS:-$(nproc)}
test_jobs=${LOCKSTEP_TEST_JOBS:-$((jobs < 8 ? jobs : 8))}
build_root=${LOCKSTEP_BUILD_ROOT:-$root/build}
build=$build_root/gpu-check
sanitizer_tools=${LOCKSTEP_SANITIZER_TOOLS-memcheck racecheck synccheck}  # empty: none
default_filter='*cuda*:*gpu*'
sanitizer_filter=${LOCKSTEP_SANITIZER_FILTER:-$default_filter}
sanitizer_timeout=${LOCKSTEP_SANITIZER_TIMEOUT:-3600}
bench_filter=${LOCKSTEP_BENCH_FILTER:-^cuda/}
bench_min_time=${LOCKSTEP_BENCH_MIN_TIME:-0.2}
bench_max_bytes=${LOCKSTEP_BENCH_MAX_BYTES:-256M}
bench_timeout=3600
sample_steps=${LOCKSTEP_SAMPLE_STEPS:-50}
tolerance=${LOCKSTEP_SAMPLE_TOLERANCE:-0.02}
sample_timeout=${LOCKSTEP_SAMPLE_TIMEOUT:-600}

# mpirun for one machine: the project's flags (CMakeLists.txt's lockstep_mpirun) with Open MPI, plain otherwise.
mpirun_cmd=()
if [[ -n "$mpirun_path" ]]; then
  mpirun_cmd=("$mpirun_path")
  if "$mpirun_path" --version 2>/dev/null | grep -q 'Open MPI'; then
    # shellcheck disable=SC2054  # self,vader,tcp is one argument
    mpirun_cmd+=(--allow-run-as-root --oversubscribe --mca btl self,vader,tcp --mca btl_tcp_if_include lo
      --mca oob_tcp_if_include lo)
  fi
fi

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
if [[ -n "${LOCKSTEP_CUDA_ARCHITECTURES:-}" ]]; then
  arch_args=("-DCMAKE_CUDA_ARCHITECTURES=$LOCKSTEP_CUDA_ARCHITECTURES")
  arch_label=$LOCKSTEP_CUDA_ARCHITECTURES
else
  arch_args=(-UCMAKE_CUDA_ARCHITECTURES)  # a value cached by an earlier run with the variable set goes away
  arch_label="80;90 (the project's default)"
fi

mkdir -p "$build/logs" || exit 1
build=$(cd "$build" && pwd)  # absolute: the sanitizer runs start in $build/tests
logs=$build/logs
rm -f "$logs"/*.log "$logs"/*.json
printf '%s\n' "${detect_lines[@]}" > "$logs/detect.log"
results=()  # "VERDICT|part|detail"
failed=0
start=$SECONDS

record() {  # record VERDICT PART DETAIL: one row of the table
  results+=("$1|$2|$3")
  [[ "$1" == FAIL ]] && failed=1
  return 0
}
# A part runs between begin_part and end_part and sets `verdict` (PASS, FAIL or SKIP) and `detail` (one line);
# parts with several verdicts call `record` themselves and leave `verdict` empty.
begin_part() {  # begin_part NAME
  part_name=$1
  part_start=$SECONDS
  verdict=FAIL
  detail=""
  echo
  echo "==== $part_name"
}
end_part() {  # prints and records the part's verdict and time
  local took="$((SECONDS - part_start)) s"
  if [[ -z "$verdict" ]]; then
    echo "---- $part_name: done ($took)"
    return 0
  fi
  echo "---- $verdict  $part_name${detail:+: $detail} ($took)"
  record "$verdict" "$part_name" "${detail:+$detail }($took)"
}

detected="$gpu_count GPU(s)"
((visible != gpu_count)) && detected+=", $visible visible"
detected+="; driver ${driver:-?} (CUDA ${driver_cuda:-?}); nvcc ${nvcc_release:-?}"
detected+="; NCCL ${nccl_version:-not found}; compute-sanitizer $([[ -n "$sanitizer" ]] && echo yes || echo no)"
detected+="; mpirun $([[ -n "$mpirun_path" ]] && echo yes || echo no)"
record PASS "detect" "$detected"

# ---- 2. setup ----------------------------------------------------------------------------------------------------
part_setup() {
  if [[ "${LOCKSTEP_SKIP_SETUP:-0}" == 1 ]]; then
    verdict=SKIP
    detail="LOCKSTEP_SKIP_SETUP=1"
    return
  fi
  local log=$logs/setup.log
  echo "bash scripts/setup.sh (log: $log)"
  if bash scripts/setup.sh >"$log" 2>&1; then
    tail -n 3 "$log"
    verdict=PASS
    detail=$(grep -m 1 -E '^setup\.sh: (all|installing)' "$log")
    return
  fi
  tail -n 15 "$log"
  # The failing step: setup.sh's own message, else apt's first error, else the log's last line.
  local step missing
  step=$(grep -m 1 -E '^setup\.sh: (need|unknown)' "$log" || grep -m 1 -E '^E: ' "$log" || grep . "$log" | tail -n 1)
  missing=$(grep -m 1 -oE '^setup\.sh: installing .*' "$log" | sed 's/^setup\.sh: installing //')
  detail="scripts/setup.sh failed: ${step:-no output}${missing:+ (missing: $missing)}; the parts that need a"
  detail+=" missing piece say so below; see $log"
}

# ---- 3. build ----------------------------------------------------------------------------------------------------
built=0
part_build() {
  local tool missing=()
  for tool in cmake ninja; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  if ((${#missing[@]} > 0)); then
    detail="${missing[*]} not found (scripts/setup.sh installs cmake and ninja-build)"
    return
  fi
  echo "nvcc $nvcc, RelWithDebInfo, CUDA architectures $arch_label, into $build"
  if [[ -z "${LOCKSTEP_CUDA_ARCHITECTURES:-}" ]]; then
    local cc
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | sort -u | tr '\n' ' ')
    if grep -qE '(^| )[1-7]\.' <<< "$cc"; then
      echo "warning: compute capability $cc: sm_80/sm_90 code does not run on it;" \
        "rerun with LOCKSTEP_CUDA_ARCHITECTURES=native"
    fi
  fi
  if ! cmake -S "$root" -B "$build" -G Ninja "${launcher[@]}" "${arch_args[@]}" \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_FLAGS_RELWITHDEBINFO="-O2 -g -lineinfo -DNDEBUG" \
      -DLOCKSTEP_CUDA=ON -DLOCKSTEP_TESTS_AT_O1=OFF >"$logs/configure.log" 2>&1; then
    tail -n 40 "$logs/configure.log"
    detail="cmake configuration failed, see $logs/configure.log"
    return
  fi
  grep -E "lockstep:" "$logs/configure.log"
  if ! cmake --build "$build" -j "$jobs" 2>&1 | tee "$logs/build.log"; then
    detail="the build failed, see $logs/build.log"
    return
  fi
  built=1
  verdict=PASS
  detail="CUDA architectures $arch_label"
  # What lockstep itself sees: the GPUs, whether this build has code for them, driver and runtime, NCCL.
  local info=$build/tools/lockstep-info
  if [[ -x "$info" ]]; then
    echo
    "$info" --no-rates 2>&1 | tee "$logs/lockstep-info.log"
    local info_status=${PIPESTATUS[0]}
    ((info_status == 0)) || detail+="; lockstep-info exited with status $info_status, see $logs/lockstep-info.log"
  fi
}

# ---- 4. tests ----------------------------------------------------------------------------------------------------
part_tests() {
  local log=$logs/ctest.log
  echo "ctest -j $test_jobs, output in $log"
  ctest --test-dir "$build" --output-on-failure -j "$test_jobs" --timeout 900 >"$log" 2>&1
  local status=$?
  # ctest's summary: from "NN% tests passed" to the end (the failed and the skipped tests, by name)
  if ! grep -q 'tests failed out of' "$log"; then
    tail -n 20 "$log"  # ctest ended without its summary
  fi
  sed -n '/tests passed, .* tests failed out of/,$p' "$log"
  # One line per test: "  12/579 Test  #12: name ....   Passed    0.10 sec" (or ***Skipped, ***Failed, ...)
  local counts
  counts=$(awk '
    match($0, /Test +#[0-9]+: /) {
      rest = substr($0, RSTART + RLENGTH); name = rest; sub(/ .*/, "", name)
      gpu = (name ~ /\/cuda/)
      if (rest ~ /  Passed/) { ran++; if (gpu) gran++ }
      else if (rest ~ /\*\*\*Skipped|Not Run \(Disabled\)/) { skipped++; if (gpu) gskipped++ }
      else bad++
    }
    END { printf "%d %d %d %d %d\n", ran, skipped, bad, gran, gskipped }' "$log")
  local ran skipped bad gran gskipped
  read -r ran skipped bad gran gskipped <<< "$counts"
  # Why tests skipped: the line after gtest's "file:line: Skipped", from CTest's full log, as "gpu|reason" for the
  # GPU instances and "other|reason" for the rest (some GPU tests are not parameterized: properties.gpus_...).
  local skips="" reasons=""
  if [[ -f "$build/Testing/Temporary/LastTest.log" ]]; then
    skips=$(awk '
      /^[0-9]+\/[0-9]+ Test: / { name = $0; sub(/^[0-9]+\/[0-9]+ Test: /, "", name) }
      prev ~ /: Skipped$/ {
        why = ($0 ~ /^\[  SKIPPED \]/) ? "(no message)" : $0
        print ((name ~ /\/cuda/) ? "gpu" : "other") "|" why
      }
      { prev = $0 }' "$build/Testing/Temporary/LastTest.log")
    reasons=$(grep '^gpu|' <<< "$skips" | cut -d '|' -f 2- | sort | uniq -c | sort -rn)
  fi
  if [[ -n "$reasons" ]]; then
    echo "why GPU instances skipped (count, reason):"
    head -n 8 <<< "$reasons"
  fi
  detail="$ran ran, $skipped skipped, $bad failed; GPU instances (/cuda): $gran ran, $gskipped skipped"
  # On a machine with GPUs no test may skip for want of one, parameterized or not.
  local no_gpu_reason
  no_gpu_reason=$(grep -m 1 -E '^[a-z]+\|no GPU: ' <<< "$skips" | cut -d '|' -f 2-)
  if ((status != 0 || bad > 0)); then
    detail+="; tests failed (ctest exit status $status), see $log"
  elif ((gran + gskipped == 0)); then
    detail+="; no test named .../cuda... was found: the tests were not built for the CUDA backend"
  elif ((gran == 0)); then
    detail+="; no GPU instance ran, so the GPU was not used${no_gpu_reason:+ ($no_gpu_reason)}"
  elif [[ -n "$no_gpu_reason" ]]; then
    detail+="; tests skipped for want of a GPU ($no_gpu_reason)"
  else
    verdict=PASS
  fi
}

# ---- 5. samples on the GPUs --------------------------------------------------------------------------------------
# What must agree, and why (docs/determinism.md):
#   - same bits (weights_sha256): deterministic runs on the GPUs, whatever the GPU count and mode: "the
#     parameters after any number of steps are **bit-identical** ... on 1 to N devices, as one device,
#     `data_parallel` or `distributed_data_parallel` (threads of `run_on_devices`, or processes under `mpirun`,
#     on host cliques, MPI or NCCL), with ZeRO-1 or ZeRO-2 too", in f32, f16 and bf16, and "across a checkpoint: a
#     run of 4 ranks saved at step k and resumed on 3 ranks (or on one device ...) ends as the uninterrupted run
#     does" — but only on identical GPUs: "Mixing GPU models, or host devices with GPUs, gives different GEMM
#     bits" (with several GPU models those runs are compared by accuracy instead).
#   - accuracy within LOCKSTEP_SAMPLE_TOLERANCE (0.02): every GPU run against the same run on host devices. GPU
#     and host bits are not expected to agree, in either mode: "a host device computes both with lockstep's own
#     fma chains instead, so GPU and host bits differ". Ordinary (not deterministic) runs on different device
#     counts differ in their sums' order ("The parallel tests check ordinary runs to a relative 1e-5, not to
#     the bit"), and docs/parallel.md claims ZeRO-1/2 give DDP's bits "on host cliques" and "under mpirun",
#     not on NCCL, so those too are compared by accuracy.
declare -A run_hash=() run_acc=() run_error=()
mlp_train=""
sample_common=()
field() {  # field NAME JSON-LINE
  sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p" <<< "$2"
}
nccl_warnings() {  # nccl_warnings FILE...: the number of "NCCL WARN" lines in the files that exist
  local f n=0 c
  for f in "$@"; do
    [[ -f "$f" ]] || continue
    c=$(grep -c 'NCCL WARN' "$f")
    n=$((n + c))
  done
  echo "$n"
}

run_sample() {  # run_sample NAME [mpirun] -- OPTIONS...: mlp_train with OPTIONS and the common options
  local name=$1
  shift
  local launch=()
  if [[ "$1" == mpirun ]]; then
    launch=("${mpirun_cmd[@]}" -np 2)
    shift
  fi
  [[ "$1" == -- ]] && shift
  local log=$logs/sample-$name.log
  echo "\$ ${launch[*]}${launch[*]:+ }$mlp_train ${sample_common[*]} $*" > "$log"
  # NCCL's warnings go to stdout, into the log, beside the sample's JSON line (found by its "{").
  env LOCKSTEP_HOST_DEVICES=2 LOCKSTEP_COMM_TIMEOUT=120 NCCL_DEBUG=WARN \
    timeout --foreground --kill-after=30 "$sample_timeout" \
    "${launch[@]}" "$mlp_train" "${sample_common[@]}" "$@" >>"$log" 2>&1
  local status=$?
  local json hash acc warns
  json=$(grep -E '^\{.*"weights_sha256"' "$log" | tail -n 1)
  hash=$(field weights_sha256 "$json")
  acc=$(field test_accuracy "$json")
  warns=$(nccl_warnings "$log")
  if ((status != 0)) || [[ -z "$hash" || -z "$acc" ]]; then
    local why="exit status $status"
    ((status == 124)) && why="timed out after $sample_timeout s (LOCKSTEP_SAMPLE_TIMEOUT)"
    local msg
    msg=$(grep -E 'mlp_train: |error|what\(\)' "$log" | grep -v '^\$ ' | head -n 1 | cut -c 1-240)
    [[ -z "$msg" ]] && msg=$(grep . "$log" | tail -n 1 | cut -c 1-240)
    run_error[$name]="$why: $msg (log: $log)"
    printf '   %-22s FAILED  %s\n' "$name" "${run_error[$name]}"
    return 1
  fi
  if ((warns > 0)); then
    run_error[$name]="$warns NCCL WARN line(s), e.g. '$(grep -m 1 'NCCL WARN' "$log" | sed 's/.*NCCL WARN //' \
      | cut -c 1-160)' (log: $log)"
    printf '   %-22s NCCL WARN  %s\n' "$name" "${run_error[$name]}"
    return 1
  fi
  run_hash[$name]=$hash
  run_acc[$name]=$acc
  printf '   %-22s %s  accuracy %.4f  (%s)\n' "$name" "${hash:0:16}" "$acc" "$*"
}

# compare MODE LABEL RUN...: one row. MODE exact: every run has the first run's weights_sha256; MODE accuracy:
# every run's test_accuracy is within $tolerance of the first run's. A run that failed fails the row.
compare() {
  local mode=$1 label=$2
  shift 2
  local row="samples: $label" r
  for r in "$@"; do
    if [[ -n "${run_error[$r]:-}" ]]; then
      record FAIL "$row" "$r failed: ${run_error[$r]}"
      return
    fi
    if [[ -z "${run_hash[$r]:-}" ]]; then
      record FAIL "$row" "$r did not run"
      return
    fi
  done
  local ref=$1 bad=() shown=()
  if [[ "$mode" == exact ]]; then
    for r in "$@"; do
      [[ "${run_hash[$r]}" == "${run_hash[$ref]}" ]] || bad+=("$r ${run_hash[$r]:0:16}")
    done
    if ((${#bad[@]} > 0)); then
      record FAIL "$row" "weights_sha256 differ from $ref's ${run_hash[$ref]:0:16}: ${bad[*]}"
    else
      record PASS "$row" "$*: one weights_sha256, ${run_hash[$ref]:0:16}"
    fi
    return
  fi
  local worst=0.0000 d
  for r in "$@"; do
    d=$(awk -v a="${run_acc[$r]}" -v b="${run_acc[$ref]}" 'BEGIN { d = a - b; printf "%.4f", d < 0 ? -d : d }')
    shown+=("$r $(printf '%.4f' "${run_acc[$r]}")")
    awk -v d="$d" -v w="$worst" 'BEGIN { exit !(d > w) }' && worst=$d
    awk -v d="$d" -v t="$tolerance" 'BEGIN { exit !(d > t) }' && bad+=("$r")
  done
  local text
  text="accuracy $(printf '%s, ' "${shown[@]}" | sed 's/, $//'); largest difference $worst"
  if ((${#bad[@]} > 0)); then
    record FAIL "$row" "$text, more than $tolerance: ${bad[*]}"
  else
    record PASS "$row" "$text (tolerance $tolerance)"
  fi
}

# resume_row NAME LABEL STRAIGHT-OPTIONS RESUME-OPTIONS: tests/sample_resume.sh (as CTest runs it on host devices): the
# straight run, the same stopped after 10 steps with --save, and RESUME-OPTIONS resumed from it, which must end
# with the straight run's weights_sha256 and correct count.
resume_row() {  # resume_row NAME LABEL STRAIGHT-OPTIONS RESUME-OPTIONS
  local name=$1 label=$2 straight=$3 resumed=$4
  local log=$logs/sample-resume-$name.log
  echo "   resume: $straight  ->  $resumed (log: $log)"
  # NCCL's messages to files: sample_resume.sh reads the last line of each run's stdout.
  # shellcheck disable=SC2086  # the options are words
  env LOCKSTEP_HOST_DEVICES=2 LOCKSTEP_COMM_TIMEOUT=120 NCCL_DEBUG=WARN \
    NCCL_DEBUG_FILE="$logs/nccl-sample-resume-$name.%h.%p.log" RESUME_OPTIONS="$resumed" EXPECT=same \
    timeout --foreground --kill-after=30 $((3 * sample_timeout)) \
    bash "$root/tests/sample_resume.sh" "$mlp_train" 10 -- $straight >"$log" 2>&1
  local status=$?
  sed 's/^/      /' "$log" | tail -n 6
  local warns
  warns=$(nccl_warnings "$logs"/nccl-sample-resume-"$name".*.log)
  if ((status == 0)) && [[ "$(tail -n 1 "$log")" == PASS ]] && ((warns == 0)); then
    local sha correct
    sha=$(grep -m 1 '^straight:' "$log" | sed -n 's/.*sha256 \([0-9a-f]*\).*/\1/p')
    correct=$(grep -m 1 '^straight:' "$log" | sed -n 's/.*correct \([0-9]*\).*/\1/p')
    record PASS "samples: $label" \
      "stopped at step 10 and resumed: the straight run's weights_sha256 ${sha:0:16} and $correct correct"
  elif ((status == 0 && warns > 0)); then
    record FAIL "samples: $label" "$warns NCCL WARN line(s), see $logs/nccl-sample-resume-$name.*.log"
  else
    local why
    why=$(grep -m 1 -E 'FAIL|failed|mlp_train: |did not' "$log" | cut -c 1-200)
    record FAIL "samples: $label" "${why:-exit status $status}; see $log"
  fi
}

part_samples() {
  verdict=""  # one row per comparison
  mlp_train=$build/examples/mlp_train/mlp_train
  if [[ ! -x "$mlp_train" ]]; then
    record FAIL "samples" "$mlp_train was not built (LOCKSTEP_BUILD_EXAMPLES off?)"
    return
  fi
  local data=${LOCKSTEP_SAMPLE_DATA:-/usr/share/datasets/fashion-mnist}
  if ! compgen -G "$data/train-images-idx3-ubyte*" >/dev/null; then
    local why="no Fashion-MNIST in $data (Debian package dataset-fashion-mnist, which scripts/setup.sh installs;"
    record SKIP "samples" "$why or set LOCKSTEP_SAMPLE_DATA)"
    return
  fi
  sample_common=(--max-steps "$sample_steps" --print-every 1000 --json)
  [[ -n "${LOCKSTEP_SAMPLE_DATA:-}" ]] && sample_common+=(--data "$LOCKSTEP_SAMPLE_DATA")
  local two=1 two_why=""
  if ((visible < 2)); then
    two=0
    two_why="needs 2 GPUs, $visible visible"
  fi
  # mpirun: each rank takes cuda:local_rank itself (mlp_train refuses --devices under mpirun).
  local mpi_why=""
  if ((!two)); then
    mpi_why=$two_why
  elif [[ -z "$mpirun_path" ]]; then
    mpi_why="no mpirun on PATH (openmpi-bin)"
  elif command -v ldd >/dev/null && ! ldd "$mlp_train" 2>/dev/null | grep -q 'libmpi'; then
    mpi_why="mlp_train was built without MPI (libopenmpi-dev missing when cmake ran?)"
  fi
  echo "mlp_train ${sample_common[*]}; accuracy tolerance $tolerance; logs: $logs/sample-*.log"
  echo "runs (name, weights_sha256, test accuracy, options):"
  local det=(--deterministic)
  local f16_adamw=(--precision f16 --optimizer adamw --lr 0.002)
  run_sample gpu_single -- --mode single --devices cuda:0
  run_sample host_single -- --mode single --devices host:0
  run_sample gpu_f16 -- --mode single --devices cuda:0 --precision f16
  run_sample host_f16 -- --mode single --devices host:0 --precision f16
  run_sample det_gpu_single -- --mode single --devices cuda:0 "${det[@]}"
  run_sample det_gpu_single_again -- --mode single --devices cuda:0 "${det[@]}"
  run_sample det_gpu_ddp_1 -- --mode ddp --devices cuda:0 "${det[@]}"
  run_sample det_host_single -- --mode single --devices host:0 "${det[@]}"
  if ((two)); then
    run_sample gpu_dp -- --mode dp --devices cuda:0,cuda:1
    run_sample host_dp -- --mode dp --devices host:0,host:1
    run_sample gpu_ddp -- --mode ddp --devices cuda:0,cuda:1
    run_sample host_ddp -- --mode ddp --devices host:0,host:1
    run_sample gpu_zero2 -- --mode ddp --devices cuda:0,cuda:1 --zero 2 "${f16_adamw[@]}"
    run_sample host_zero2 -- --mode ddp --devices host:0,host:1 --zero 2 "${f16_adamw[@]}"
    run_sample det_gpu_dp -- --mode dp --devices cuda:0,cuda:1 "${det[@]}"
    run_sample det_gpu_ddp -- --mode ddp --devices cuda:0,cuda:1 "${det[@]}"
    run_sample det_gpu_ddp_accumulators -- --mode ddp --devices cuda:0,cuda:1 "${det[@]}" --exact-sums accumulators
    run_sample det_gpu_zero2 -- --mode ddp --devices cuda:0,cuda:1 --zero 2 "${det[@]}"
    run_sample det16_gpu_single -- --mode single --devices cuda:0 "${f16_adamw[@]}" "${det[@]}"
    run_sample det16_gpu_zero2 -- --mode ddp --devices cuda:0,cuda:1 --zero 2 "${f16_adamw[@]}" "${det[@]}"
    if [[ -z "$mpi_why" ]]; then
      run_sample gpu_mpirun mpirun -- --mode ddp
      run_sample det_gpu_mpirun mpirun -- --mode ddp "${det[@]}"
    fi
  fi

  # Deterministic runs on 2 GPUs against 1: bits when the GPUs are alike, accuracy otherwise.
  local across=exact across_note="same bits"
  if ((!same_gpus)); then
    across=accuracy
    across_note="accuracy: mixed GPU models"
  fi
  echo
  compare accuracy "single, cuda:0 vs host:0 (accuracy)" gpu_single host_single
  compare accuracy "f16, cuda:0 vs host:0 (accuracy)" gpu_f16 host_f16
  compare exact "deterministic, rerun and ddp on cuda:0 (same bits)" det_gpu_single det_gpu_single_again \
    det_gpu_ddp_1
  compare accuracy "deterministic, cuda:0 vs host:0 (accuracy)" det_gpu_single det_host_single
  if [[ -n "${run_hash[det_gpu_single]:-}" && "${run_hash[det_gpu_single]}" == "${run_hash[det_host_single]:-}" ]]; then
    echo "note: the deterministic GPU and host runs have the same weights_sha256; docs/determinism.md says they differ"
  fi
  if ((two)); then
    compare accuracy "dp, 2 GPUs vs 2 host devices (accuracy)" gpu_dp host_dp
    compare accuracy "ddp threads, 2 GPUs vs 2 host devices (accuracy)" gpu_ddp host_ddp
    compare accuracy "ZeRO-2 f16 AdamW, 2 GPUs vs host (accuracy)" gpu_zero2 host_zero2
    local det_runs=(det_gpu_single det_gpu_dp det_gpu_ddp det_gpu_ddp_accumulators det_gpu_zero2)
    local det_label="dp ddp ZeRO-2"
    if [[ -z "$mpi_why" ]]; then
      det_runs+=(det_gpu_mpirun)
      det_label+=" mpirun"
    fi
    compare "$across" "deterministic, 1 vs 2 GPUs: $det_label ($across_note)" "${det_runs[@]}"
    compare "$across" "deterministic f16 AdamW, 1 vs 2 GPUs ZeRO-2 ($across_note)" det16_gpu_single \
      det16_gpu_zero2
  else
    local row
    for row in "dp, 2 GPUs vs 2 host devices" "ddp threads, 2 GPUs vs 2 host devices" \
        "ZeRO-2 f16 AdamW, 2 GPUs vs host" \
        "deterministic, 1 vs 2 GPUs" "deterministic f16 AdamW, 1 vs 2 GPUs ZeRO-2"; do
      record SKIP "samples: $row" "$two_why"
    done
  fi
  if [[ -z "$mpi_why" ]]; then
    compare accuracy "ddp mpirun -np 2 vs host ddp (accuracy)" gpu_mpirun host_ddp
  else
    record SKIP "samples: ddp mpirun -np 2 vs host ddp" "$mpi_why"
  fi

  # A checkpoint across GPU counts (deterministic: the resumed run must end with the straight run's bits).
  local resume_common="--max-steps 20 --print-every 1000 --deterministic"
  [[ -n "${LOCKSTEP_SAMPLE_DATA:-}" ]] && resume_common+=" --data $LOCKSTEP_SAMPLE_DATA"
  echo
  if ((two && same_gpus)); then
    resume_row 2_to_1 "resume, ddp on 2 GPUs -> single cuda:0 (same bits)" \
      "$resume_common --mode ddp --devices cuda:0,cuda:1" "$resume_common --mode single --devices cuda:0"
  else
    resume_row 1_to_1 "resume, ddp on cuda:0 -> single cuda:0 (same bits)" \
      "$resume_common --mode ddp --devices cuda:0" "$resume_common --mode single --devices cuda:0"
    if ((two)); then
      record SKIP "samples: resume, 2 GPUs -> 1 GPU" "GPU models differ: the bits would too"
    else
      record SKIP "samples: resume, 2 GPUs -> 1 GPU" "$two_why"
    fi
  fi
}

# ---- 6. compute-sanitizer on every test program ------------------------------------------------------------------
# The programs and their environment, as tests/CMakeLists.txt declares them: "name VAR=value ..." per line, from
# its lockstep_add_test(name ... ENV VAR=value ...) calls, after CTest's defaults for every program. (The
# programs CTest runs under mpirun, test_*_mpi, are not among them; part_sanitizer finds those in the build.)
test_program_specs() {
  local defaults="LOCKSTEP_HOST_DEVICES= LOCKSTEP_HOST_DEVICE_MEMORY= LOCKSTEP_HOST_STRICT=1"
  local line name envs word found=0
  while IFS= read -r line; do
    name=$(sed -E 's/^[[:space:]]*lockstep_add_test\(([A-Za-z0-9_]+).*/\1/' <<< "$line")
    envs=""
    if [[ "$line" == *" ENV "* ]]; then
      for word in ${line##* ENV }; do
        word=${word%)}
        [[ "$word" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] && envs+=" $word"
      done
    fi
    echo "$name $defaults$envs"
    found=1
  done < <(grep -E '^[[:space:]]*lockstep_add_test\(' "$root/tests/CMakeLists.txt")
  if ((!found)); then  # the file changed shape: the list as of this script
    local p
    for p in test_core test_runtime test_data_loader test_blas test_comm test_zero test_kernels test_nn test_data \
        test_parallel test_amp test_mixed test_io; do
      case $p in
        test_comm) echo "$p $defaults LOCKSTEP_HOST_LLC_BYTES=8388608" ;;
        test_zero | test_parallel | test_amp) echo "$p $defaults LOCKSTEP_HOST_DEVICES=4" ;;
        *) echo "$p $defaults" ;;
      esac
    done
  fi
}

part_sanitizer() {
  verdict=""  # one row per tool
  if [[ -z "$sanitizer" ]]; then
    record SKIP "compute-sanitizer" "not found (neither in /usr/local/cuda/bin, next to nvcc, nor on PATH)"
    return
  fi
  # programs[i] runs as kinds[i]: gtest (alone, with filters[i]: a gtest filter, "*" for all, "" for left out)
  # or mpi (whole, under `mpirun -np 2`), in the environment envs[i].
  local programs=() kinds=() envs=() filters=() not_built=() whole=() left_out=() host_only=()
  local name rest p
  declare -A listed=()
  while read -r name rest; do
    listed[$name]=1
    [[ -x "$build/tests/$name" ]] || { not_built+=("$name"); continue; }
    programs+=("$name")
    kinds+=(gtest)
    envs+=("$rest")
  done < <(test_program_specs)
  # Test programs built but not declared by a lockstep_add_test line (added since): with CTest's defaults.
  for p in "$build"/tests/test_*; do
    name=$(basename "$p")
    [[ -x "$p" && -f "$p" && -z "${listed[$name]:-}" && "$name" != *_mpi ]] || continue
    programs+=("$name")
    kinds+=(gtest)
    envs+=("LOCKSTEP_HOST_DEVICES= LOCKSTEP_HOST_DEVICE_MEMORY= LOCKSTEP_HOST_STRICT=1")
  done
  # The programs CTest runs under mpirun (test_*_mpi): those with device code (a .nv_fatbin section: compiled by
  # nvcc) run whole under `mpirun -np 2 compute-sanitizer ...`, in CTest's environment for them; the host-only
  # ones have nothing for compute-sanitizer to check.
  for p in "$build"/tests/test_*_mpi; do
    name=$(basename "$p")
    [[ -x "$p" && -f "$p" ]] || continue
    if command -v readelf >/dev/null && ! readelf -S --wide "$p" 2>/dev/null | grep -q '\.nv_fatbin'; then
      host_only+=("$name")
      continue
    fi
    if ((${#mpirun_cmd[@]} == 0)); then
      left_out+=("$name (no mpirun)")
      continue
    fi
    programs+=("$name")
    kinds+=(mpi)
    envs+=("ASAN_OPTIONS=detect_leaks=0 OMPI_MCA_rmaps_base_oversubscribe=1 LOCKSTEP_HOST_STRICT=1")
  done
  if ((${#programs[@]} == 0)); then
    record FAIL "compute-sanitizer" "no test program in $build/tests (was GoogleTest found? see $logs/configure.log)"
    return
  fi
  # The filter per gtest program: the GPU cases; a program none of whose tests matches the default filter runs
  # whole (its tests then use the GPUs through the default devices, pinned memory, or not at all).
  local i count env_vars
  for i in "${!programs[@]}"; do
    if [[ "${kinds[$i]}" == mpi ]]; then  # not gtest: whole, unless a filter of the user's narrows the run
      if [[ "$sanitizer_filter" == "$default_filter" ]]; then
        filters+=("*")
      else
        filters+=("")
        left_out+=("${programs[$i]}")
      fi
      continue
    fi
    read -r -a env_vars <<< "${envs[$i]}"
    count=$(cd "$build/tests" && env "${env_vars[@]}" timeout 120 "./${programs[$i]}" --gtest_list_tests \
      --gtest_filter="$sanitizer_filter" 2>/dev/null | grep -c '^  ')
    if ((count > 0)); then
      filters+=("$sanitizer_filter")
    elif [[ "$sanitizer_filter" == "$default_filter" ]]; then
      filters+=("*")
      whole+=("${programs[$i]}")
    else
      filters+=("")
      left_out+=("${programs[$i]}")
    fi
  done
  echo "$sanitizer; --gtest_filter='$sanitizer_filter'; programs: ${programs[*]}"
  ((${#whole[@]} > 0)) && echo "run whole (no test matches the filter): ${whole[*]}"
  ((${#left_out[@]} > 0)) && echo "left out: ${left_out[*]}"
  ((${#not_built[@]} > 0)) && echo "declared in tests/CMakeLists.txt but not built: ${not_built[*]}"
  ((${#host_only[@]} > 0)) && echo "not run (mpirun programs without device code): ${host_only[*]}"
  local note=""
  ((${#whole[@]} > 0)) && note+="; whole: ${whole[*]}"
  ((${#left_out[@]} > 0)) && note+="; left out: ${left_out[*]}"
  ((${#not_built[@]} > 0)) && note+="; not built: ${not_built[*]}"
  local tool
  for tool in $sanitizer_tools; do
    local args=(--tool "$tool" --error-exitcode 1) fails=() t0=$SECONDS ran=0 tests=0
    [[ $tool == memcheck ]] && args+=(--leak-check full)
    echo "-- $tool"
    for i in "${!programs[@]}"; do
      p=${programs[$i]}
      [[ -n "${filters[$i]}" ]] || continue
      read -r -a env_vars <<< "${envs[$i]}"
      local log=$logs/sanitizer-$tool-$p.log p0=$SECONDS command=()
      if [[ "${kinds[$i]}" == mpi ]]; then
        command=("${mpirun_cmd[@]}" -np 2 "$sanitizer" "${args[@]}" "./$p")
      else
        command=("$sanitizer" "${args[@]}" "./$p" --gtest_filter="${filters[$i]}")
      fi
      (cd "$build/tests" && env "${env_vars[@]}" timeout --foreground --kill-after=60 "$sanitizer_timeout" \
        "${command[@]}") >"$log" 2>&1
      local status=$?
      ran=$((ran + 1))
      local passed skipped errors
      passed=$(grep -m 1 -E '^\[  PASSED  \] [0-9]+ test' "$log" | grep -oE '[0-9]+' | head -n 1)
      skipped=$(grep -m 1 -E '^\[  SKIPPED \] [0-9]+ test' "$log" | grep -oE '[0-9]+' | head -n 1)
      # one summary per process (two under mpirun), the distinct ones
      errors=$(grep -E '^========= ERROR SUMMARY: ' "$log" | sed 's/^========= ERROR SUMMARY: //' | sort -u \
        | paste -sd '/' -)
      tests=$((tests + ${passed:-0}))
      if ((status == 0)); then
        printf '   %-18s PASS  %s passed, %s skipped, %s (%d s)\n' "$p" "${passed:-0}" "${skipped:-0}" \
          "${errors:-no error summary}" $((SECONDS - p0))
        continue
      fi
      local why="exit status $status"
      ((status == 124)) && why="timed out after $sanitizer_timeout s (LOCKSTEP_SANITIZER_TIMEOUT)"
      fails+=("$p (${errors:-$why})")
      printf '   %-18s FAIL  %s, %s (%d s); log: %s\n' "$p" "$why" "${errors:-no error summary}" \
        $((SECONDS - p0)) "$log"
      # The first errors: compute-sanitizer's own lines (without its banner and summaries), then the failed
      # tests; when there are neither (a crash, a timeout), the end of the log.
      local first=()
      mapfile -t first < <(
        grep -E '^=========' "$log" \
          | grep -vE '^========= (COMPUTE-SANITIZER|[A-Z]+ SUMMARY)|^=========[[:space:]]*$' | head -n 8
        grep -E '^\[  FAILED  \] ' "$log" | head -n 3)
      ((${#first[@]} > 0)) || mapfile -t first < <(tail -n 5 "$log")
      printf '      %s\n' "${first[@]}"
    done
    local took=$((SECONDS - t0))
    if ((${#fails[@]} > 0)); then
      echo "   $tool: FAIL ($took s): see $logs/sanitizer-$tool-*.log"
      record FAIL "compute-sanitizer $tool" "${#fails[@]} of $ran programs: ${fails[*]}$note ($took s)"
    else
      echo "   $tool: PASS ($took s)"
      record PASS "compute-sanitizer $tool" "$ran programs, $tests gtest tests, no error$note ($took s)"
    fi
  done
  [[ -n "${sanitizer_tools// /}" ]] || record SKIP "compute-sanitizer" "no tool in LOCKSTEP_SANITIZER_TOOLS"
}

# ---- 7. topology and the collectives sweep -----------------------------------------------------------------------
part_collectives() {
  local topo_log=$logs/topology.log bench_log=$logs/bench_collectives.log json=$logs/bench_collectives.json
  local topo_ok=1
  nvidia-smi topo -m 2>&1 | tee "$topo_log" || topo_ok=0
  {
    echo
    echo "peer-to-peer reads (nvidia-smi topo -p2p r; OK = supported):"
    nvidia-smi topo -p2p r 2>&1 || true
    echo
    echo "$gpu_count GPU(s):"
    nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv 2>&1
  } | tee -a "$topo_log"

  # The links between GPUs: the GPU rows of the matrix (colour codes removed), NV# = NVLink.
  local links links_line links_kind
  links=$(sed -E 's/\x1b\[[0-9;]*m//g' "$topo_log" | grep -E '^GPU[0-9]+[[:space:]]')
  if ((!topo_ok)) || [[ -z "$links" ]]; then
    links_kind="links unknown"
    links_line="topology unknown (nvidia-smi topo -m gave no GPU rows): NVLink present would mean all-reduce"
    links_line+=" busbw of tens to hundreds of GB/s, PCIe only ~10-25 GB/s"
  elif grep -qE '(^|[[:space:]])NV[0-9]+([[:space:]]|$)' <<< "$links"; then
    links_kind="NVLink"
    links_line="NVLink present (NV# in topo -m): expect all-reduce busbw of tens to hundreds of GB/s"
  else
    links_kind="PCIe only"
    links_line="PCIe only (PIX/PXB/PHB/NODE/SYS in topo -m, no NV#): expect all-reduce busbw of ~10-25 GB/s"
  fi
  if ((visible < 2)); then
    verdict=SKIP
    detail="needs 2 GPUs, $visible visible (collectives run between GPUs); topology in $topo_log"
    return
  fi

  local bench=$build/bench/bench_collectives
  if [[ ! -x "$bench" ]]; then
    detail="$bench was not built (Google Benchmark missing? see $logs/configure.log); $links_line"
    echo "$detail"
    return
  fi
  echo
  echo "NCCL_DEBUG=WARN LOCKSTEP_BENCH_MAX_BYTES=$bench_max_bytes $bench --benchmark_filter='$bench_filter'" \
    "--benchmark_min_time=$bench_min_time (log: $bench_log)"
  NCCL_DEBUG=WARN LOCKSTEP_BENCH_MAX_BYTES=$bench_max_bytes \
    timeout --foreground --kill-after=60 "$bench_timeout" "$bench" --benchmark_format=console \
    --benchmark_color=false --benchmark_filter="$bench_filter" --benchmark_min_time="$bench_min_time" \
    --benchmark_out="$json" --benchmark_out_format=json 2>&1 | tee "$bench_log"
  local status=${PIPESTATUS[0]}

  # From the JSON rows: the GPU collectives measured, failed and skipped; the largest size registered; each
  # collective's largest size measured; the largest all-reduce (most ranks, then largest size); the first
  # failures with their messages.
  local summary="" measured=0 failures=0 skipped=0 top="" short="" largest="" failed_rows=""
  if [[ -f "$json" ]]; then
    summary=$(awk '
      function bytes(label,   n) {
        n = label + 0
        if (label ~ /GiB$/) return n * 1073741824
        if (label ~ /MiB$/) return n * 1048576
        if (label ~ /KiB$/) return n * 1024
        return n
      }
      function flush(   p, op, ranks, size, b) {
        if (name !~ /^cuda\//) { name = ""; return }
        if (err && msg !~ /^skipped: /) {
          failed++
          if (nf < 4) { fl = fl (fl == "" ? "" : "; ") name ": " msg; nf++ }
        } else if (err) {
          skipped++
        }
        if (name ~ /^cuda\/[a-z_]+\/ranks:[0-9]+\/size:/) {
          split(name, p, "/"); op = p[2]; ranks = substr(p[3], 7) + 0; size = substr(p[4], 6); b = bytes(size)
          if (b > top) { top = b; toplabel = size }
          seen[op] = 1
          if (!err) {
            measured++
            if (b > best[op]) best[op] = b
            if (op == "all_reduce" && (ranks > br || (ranks == br && b >= bb))) {
              br = ranks; bb = b
              line = sprintf("%.1f GB/s (algbw %.1f) at cuda/all_reduce/ranks:%d/size:%s", busbw, algbw, ranks, size)
            }
          }
        } else if (!err) {
          measured++
        }
        name = ""
      }
      /"name": / { flush(); name = $0; sub(/.*"name": "/, "", name); sub(/".*/, "", name)
                   err = 0; msg = ""; algbw = 0; busbw = 0; next }
      /"error_occurred": true/ { err = 1 }
      /"error_message": / { msg = $0; sub(/.*"error_message": "/, "", msg); sub(/",?[[:space:]]*$/, "", msg) }
      /"algbw": / { algbw = $2; sub(/,$/, "", algbw) }
      /"busbw": / { busbw = $2; sub(/,$/, "", busbw) }
      END {
        flush()
        for (op in seen) if (best[op] < top) short = short (short == "" ? "" : ", ") op
        printf "%d|%d|%d|%s|%s|%s|%s\n", measured, failed, skipped, toplabel, short, line, fl
      }' "$json")
    IFS='|' read -r measured failures skipped top short largest failed_rows <<< "$summary"
  fi
  # NCCL's warnings (NCCL_DEBUG=WARN prints "host:pid:tid [rank] NCCL WARN message" to stdout, into the log).
  local warns distinct
  warns=$(nccl_warnings "$bench_log")
  distinct=$(grep 'NCCL WARN' "$bench_log" | sed 's/.*NCCL WARN //' | sort | uniq -c | sort -rn | head -n 3 \
    | sed -E 's/^ *([0-9]+) /\1x /' | tr '\n' ';' | sed 's/;$//')
  local measured_line="no GPU all-reduce was measured"
  [[ -n "$largest" ]] && measured_line="measured busbw $largest"
  echo
  echo "$links_line; $measured_line"
  ((warns > 0)) && echo "NCCL warnings ($warns): $distinct"

  detail="$visible GPUs, $links_kind; ${measured:-0} GPU rows up to ${top:-?}, ${failures:-0} failed"
  detail+="; $warns NCCL warning(s)"
  local problems=()
  ((status == 124)) && problems+=("timed out after $bench_timeout s (a hang? the last rows are in $bench_log)")
  ((status != 0 && status != 124)) && problems+=("bench_collectives exited with status $status")
  ((${failures:-0} > 0)) && problems+=("failed rows: $failed_rows")
  [[ -n "$short" ]] && problems+=("no row at ${top:-the largest size} measured for: $short")
  ((warns > 0)) && problems+=("NCCL WARN: $distinct")
  ((${measured:-0} == 0)) && problems+=("no GPU row was measured (LOCKSTEP_BENCH_FILTER='$bench_filter')")
  if ((${#problems[@]} > 0)); then
    detail+="; $(printf '%s; ' "${problems[@]}" | sed 's/; $//'); see $bench_log"
  else
    verdict=PASS
    detail+="; $measured_line"
  fi
}

# ---- the parts, in order -----------------------------------------------------------------------------------------
begin_part "setup (scripts/setup.sh)"; part_setup; end_part
begin_part "build (nvcc, RelWithDebInfo)"; part_build; end_part
if ((built)); then
  begin_part "tests (ctest)"; part_tests; end_part
  begin_part "samples (mlp_train on the GPUs)"; part_samples; end_part
  begin_part "compute-sanitizer"; part_sanitizer; end_part
  begin_part "collectives (NCCL, up to $bench_max_bytes)"; part_collectives; end_part
else
  for part in "tests (ctest)" "samples" "compute-sanitizer" "collectives"; do
    record SKIP "$part" "the build failed"
  done
fi

# ---- 8. one table of verdicts ------------------------------------------------------------------------------------
{
  echo
  echo "==== gpu-check summary ($((SECONDS - start)) s; logs in $logs)"
  printf '%-66s %-7s %s\n' part verdict detail
  for row in "${results[@]}"; do
    IFS='|' read -r v p d <<< "$row"
    printf '%-66s %-7s %s\n' "$p" "$v" "$d"
  done
} | tee "$logs/summary.log"
exit $failed
