#!/usr/bin/env bash
# The first thing to run on a GPU machine: builds lockstep with nvcc and checks it on the GPUs, in four parts,
# one verdict each (PASS, FAIL or SKIP):
#   1. build: cmake + Ninja into $LOCKSTEP_BUILD_ROOT/gpu-check, RelWithDebInfo, LOCKSTEP_CUDA=ON (device code
#      with -lineinfo, so that compute-sanitizer names source lines);
#   2. tests: ctest once, plainly. FAIL when a test fails, or when the GPU instances of the parameterized tests
#      (named ".../cuda...") did not use a GPU: none of them ran, or one skipped with "no GPU: ...";
#   3. compute-sanitizer: the GPU cases (--gtest_filter='*cuda*') of test_runtime, test_blas, test_comm,
#      test_kernels, test_nn, test_amp, test_parallel and test_io under memcheck (with --leak-check full),
#      racecheck, synccheck and initcheck, one log per tool and program; SKIP when compute-sanitizer is missing;
#   4. topology and collectives: `nvidia-smi topo -m`, the GPUs, and bench_collectives' GPU rows (algbw, busbw);
#      PASS when it ran, with the busbw of the largest all-reduce next to what the links suggest (NVLink: tens to
#      hundreds of GB/s; PCIe only: about 10-25 GB/s). Speed is reported, never failed.
# Ends with "==== gpu-check summary", one line per part, and exits non-zero if any part FAILED. Logs go to
# <build>/logs (rewritten on every run). Without a GPU (no nvidia-smi, no device in `nvidia-smi -L`, or no
# /usr/local/cuda/bin/nvcc) it says what it found and exits 0.
#
# Environment: LOCKSTEP_JOBS (parallel build jobs, default: cores), LOCKSTEP_TEST_JOBS (parallel tests, default:
# cores, at most 8: the tests share the GPUs' memory), LOCKSTEP_BUILD_ROOT (default: ./build),
# LOCKSTEP_CUDA_ARCHITECTURES (CMAKE_CUDA_ARCHITECTURES; unset: the project's default, sm_80 and sm_90, which
# covers compute capability 8.x and 9.x — a GPU of another architecture, e.g. a T4 (sm_75), needs
# LOCKSTEP_CUDA_ARCHITECTURES=native), LOCKSTEP_SANITIZER_TOOLS (default: "memcheck racecheck synccheck
# initcheck"), LOCKSTEP_SANITIZER_FILTER (the gtest filter under compute-sanitizer, default '*cuda*:*gpu*'; racecheck,
# synccheck and initcheck are slow: narrow it, e.g. '*blas*cuda*:*comm*cuda*'), LOCKSTEP_SANITIZER_TIMEOUT
# (seconds per tool and program, default 3600), LOCKSTEP_BENCH_FILTER (bench_collectives' rows, default
# '^cuda/'), LOCKSTEP_BENCH_MIN_TIME (seconds per row, default 0.2), LOCKSTEP_BENCH_MAX_BYTES (largest message,
# default 256M; read by bench_collectives itself).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 1
bash scripts/setup.sh || exit 1

# ---- is there a GPU? ---------------------------------------------------------------------------------------------
# nvidia-smi, not the CUDA runtime: without a driver, cudaGetDeviceCount fails ("CUDA driver version is
# insufficient for CUDA runtime version"), which only says that there is no GPU here either.
no_gpu() {
  echo "gpu-check: no GPU to check on this machine: $1; nothing was built or run."
  exit 0
}
if ! command -v nvidia-smi >/dev/null; then
  no_gpu "no nvidia-smi on PATH (no NVIDIA driver installed)"
fi
if ! gpu_list=$(nvidia-smi -L 2>&1); then
  no_gpu "'nvidia-smi -L' failed ($(head -n 1 <<< "$gpu_list"))"
fi
gpu_count=$(grep -cE '^GPU [0-9]+:' <<< "$gpu_list")
if ((gpu_count == 0)); then
  no_gpu "'nvidia-smi -L' lists no device"
fi
if [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  no_gpu "nvidia-smi lists $gpu_count GPU(s) but there is no /usr/local/cuda/bin/nvcc (install the CUDA toolkit)"
fi
echo "gpu-check: $gpu_count GPU(s); $(/usr/local/cuda/bin/nvcc --version | tail -n 1)"
echo "$gpu_list"

# ---- settings ----------------------------------------------------------------------------------------------------
jobs=${LOCKSTEP_JOBS:-$(nproc)}
test_jobs=${LOCKSTEP_TEST_JOBS:-$((jobs < 8 ? jobs : 8))}
build_root=${LOCKSTEP_BUILD_ROOT:-$root/build}
build=$build_root/gpu-check
sanitizer_tools=${LOCKSTEP_SANITIZER_TOOLS:-memcheck racecheck synccheck initcheck}
sanitizer_filter=${LOCKSTEP_SANITIZER_FILTER:-*cuda*:*gpu*}
sanitizer_timeout=${LOCKSTEP_SANITIZER_TIMEOUT:-3600}
bench_filter=${LOCKSTEP_BENCH_FILTER:-^cuda/}
bench_min_time=${LOCKSTEP_BENCH_MIN_TIME:-0.2}
bench_timeout=3600
gpu_programs=(test_runtime test_blas test_comm test_kernels test_nn test_amp test_parallel test_io)

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
results=()
failed=0
start=$SECONDS

# A part runs between begin_part and end_part and sets `verdict` (PASS, FAIL or SKIP) and `detail` (one line).
begin_part() {  # begin_part NAME
  part_name=$1
  part_start=$SECONDS
  verdict=FAIL
  detail=""
  echo
  echo "==== $part_name"
}
end_part() {  # prints and records the part's verdict and time
  local line="$verdict  $part_name${detail:+: $detail} ($((SECONDS - part_start)) s)"
  echo "---- $line"
  results+=("$line")
  [[ "$verdict" == FAIL ]] && failed=1
  return 0
}

# ---- 1. build ----------------------------------------------------------------------------------------------------
built=0
part_build() {
  echo "nvcc, RelWithDebInfo, CUDA architectures $arch_label, into $build"
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
      -DLOCKSTEP_CUDA=ON >"$logs/configure.log" 2>&1; then
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
}

# ---- 2. tests ----------------------------------------------------------------------------------------------------
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

# ---- 3. compute-sanitizer ----------------------------------------------------------------------------------------
find_sanitizer() {
  local c
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
      "$(command -v compute-sanitizer 2>/dev/null)"; do
    [[ -n "$c" && -x "$c" ]] && { echo "$c"; return 0; }
  done
  return 1
}

part_sanitizer() {
  local sanitizer
  if ! sanitizer=$(find_sanitizer); then
    verdict=SKIP
    detail="compute-sanitizer not found (neither in /usr/local/cuda/bin nor on PATH)"
    return
  fi
  local programs=() p
  for p in "${gpu_programs[@]}"; do
    [[ -x "$build/tests/$p" ]] && programs+=("$p")
  done
  if ((${#programs[@]} == 0)); then
    detail="none of the test programs (${gpu_programs[*]}) is in $build/tests"
    return
  fi
  echo "$sanitizer; --gtest_filter='$sanitizer_filter'; programs: ${programs[*]}"
  local tool summary="" any_fail=0
  for tool in $sanitizer_tools; do
    local args=(--tool "$tool" --error-exitcode 1) tool_fail=0 t0=$SECONDS
    [[ $tool == memcheck ]] && args+=(--leak-check full)
    echo "-- $tool"
    for p in "${programs[@]}"; do
      local log=$logs/sanitizer-$tool-$p.log p0=$SECONDS
      # The environment tests/CMakeLists.txt gives each program under CTest (host devices as strict as GPUs).
      local env_vars=(LOCKSTEP_HOST_DEVICES= LOCKSTEP_HOST_DEVICE_MEMORY= LOCKSTEP_HOST_STRICT=1)
      case $p in
        test_parallel) env_vars[0]=LOCKSTEP_HOST_DEVICES=4 ;;
        test_amp) env_vars[0]=LOCKSTEP_HOST_DEVICES=3 ;;
        test_comm) env_vars+=(LOCKSTEP_HOST_LLC_BYTES=8388608) ;;
        *) ;;
      esac
      (cd "$build/tests" && env "${env_vars[@]}" timeout --foreground --kill-after=60 "$sanitizer_timeout" \
        "$sanitizer" "${args[@]}" "./$p" --gtest_filter="$sanitizer_filter") >"$log" 2>&1
      local status=$?
      local passed skipped errors
      passed=$(grep -m 1 -E '^\[  PASSED  \] [0-9]+ test' "$log" | grep -oE '[0-9]+' | head -n 1)
      skipped=$(grep -m 1 -E '^\[  SKIPPED \] [0-9]+ test' "$log" | grep -oE '[0-9]+' | head -n 1)
      errors=$(grep -m 1 -E '^========= ERROR SUMMARY: ' "$log" | sed 's/^========= ERROR SUMMARY: //')
      if ((status == 0)); then
        printf '   %-14s PASS  %s passed, %s skipped, %s (%d s)\n' "$p" "${passed:-0}" "${skipped:-0}" \
          "${errors:-no error summary}" $((SECONDS - p0))
        continue
      fi
      tool_fail=1
      local why="exit status $status"
      ((status == 124)) && why="timed out after $sanitizer_timeout s (LOCKSTEP_SANITIZER_TIMEOUT)"
      printf '   %-14s FAIL  %s, %s (%d s); log: %s\n' "$p" "$why" "${errors:-no error summary}" \
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
    if ((tool_fail)); then
      any_fail=1
      summary+="${summary:+, }$tool FAIL"
      echo "   $tool: FAIL ($((SECONDS - t0)) s): see $logs/sanitizer-$tool-*.log"
    else
      summary+="${summary:+, }$tool PASS"
      echo "   $tool: PASS ($((SECONDS - t0)) s)"
    fi
  done
  if [[ -z "$summary" ]]; then
    verdict=SKIP
    detail="no tool in LOCKSTEP_SANITIZER_TOOLS"
    return
  fi
  detail=$summary
  ((any_fail)) || verdict=PASS
}

# ---- 4. topology and collectives ---------------------------------------------------------------------------------
part_topology() {
  local topo_log=$logs/topology.log bench_log=$logs/bench_collectives.log json=$logs/bench_collectives.json
  local topo_ok=1
  nvidia-smi topo -m 2>&1 | tee "$topo_log" || topo_ok=0
  echo | tee -a "$topo_log"
  echo "$gpu_count GPU(s):" | tee -a "$topo_log"
  nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv 2>&1 | tee -a "$topo_log"

  # The links between GPUs: the GPU rows of the matrix (colour codes removed), NV# = NVLink.
  local links links_line links_kind
  links=$(sed -E 's/\x1b\[[0-9;]*m//g' "$topo_log" | grep -E '^GPU[0-9]+[[:space:]]')
  if ((gpu_count < 2)); then
    links_kind="one GPU"
    links_line="one GPU: there is no link between GPUs to judge (the all-reduce rows need 2 GPUs)"
  elif ((!topo_ok)) || [[ -z "$links" ]]; then
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

  local bench=$build/bench/bench_collectives
  if [[ ! -x "$bench" ]]; then
    detail="$bench was not built (Google Benchmark missing? see $logs/configure.log); $links_line"
    echo "$detail"
    return
  fi
  echo
  echo "$bench --benchmark_filter='$bench_filter' --benchmark_min_time=$bench_min_time (log: $bench_log)"
  timeout --foreground --kill-after=60 "$bench_timeout" "$bench" --benchmark_format=console --benchmark_color=false \
    --benchmark_filter="$bench_filter" --benchmark_min_time="$bench_min_time" \
    --benchmark_out="$json" --benchmark_out_format=json 2>&1 | tee "$bench_log"
  local status=${PIPESTATUS[0]}

  # The largest all-reduce (out of place) measured: most ranks, then largest size, from the JSON rows.
  local largest="" measured
  if [[ -f "$json" ]]; then
    largest=$(awk '
      function bytes(label,   n) {
        n = label + 0
        if (label ~ /GiB$/) return n * 1073741824
        if (label ~ /MiB$/) return n * 1048576
        if (label ~ /KiB$/) return n * 1024
        return n
      }
      /"name": / { name = $0; sub(/.*"name": "/, "", name); sub(/".*/, "", name); err = 0; algbw = ""; next }
      /"error_occurred": true/ { err = 1 }
      /"algbw": / { algbw = $2; sub(/,$/, "", algbw) }
      /"busbw": / {
        if (err || name !~ /^cuda\/all_reduce\/ranks:[0-9]+\/size:/) next
        busbw = $2; sub(/,$/, "", busbw)
        split(name, part, "/"); ranks = substr(part[3], 7) + 0; size = substr(part[4], 6)
        if (ranks > best_ranks || (ranks == best_ranks && bytes(size) >= best_bytes)) {
          best_ranks = ranks; best_bytes = bytes(size)
          best = sprintf("%.1f GB/s (algbw %.1f) at cuda/all_reduce/ranks:%d/size:%s", busbw, algbw, ranks, size)
        }
      }
      END { if (best != "") print best }' "$json")
  fi
  if [[ -n "$largest" ]]; then
    measured="measured busbw $largest"
  else
    measured="no GPU all-reduce was measured"
    local why
    why=$(grep -m 1 -oE "skipped: needs [^']*" "$bench_log")
    [[ -n "$why" ]] && measured+=" ($why)"
  fi
  echo
  echo "$links_line; $measured"
  if ((status == 0)); then
    verdict=PASS
    detail="$gpu_count GPU(s), $links_kind; $measured"
  elif ((status == 124)); then
    detail="bench_collectives timed out after $bench_timeout s, see $bench_log"
  else
    detail="bench_collectives exited with status $status, see $bench_log"
  fi
}

begin_part "build (nvcc, RelWithDebInfo)"; part_build; end_part
if ((built)); then
  begin_part "tests"; part_tests; end_part
  begin_part "compute-sanitizer"; part_sanitizer; end_part
  begin_part "topology and collectives"; part_topology; end_part
else
  for part in "tests" "compute-sanitizer" "topology and collectives"; do
    results+=("SKIP  $part: the build failed")
  done
fi

echo
echo "==== gpu-check summary ($((SECONDS - start)) s; logs in $logs)"
printf '%s\n' "${results[@]}"
exit $failed
