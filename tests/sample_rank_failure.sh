#!/usr/bin/env bash
# Under mpirun, a rank that fails ends the whole job at once, its message printed: rank 1 of 2 runs out of device
# memory while rank 0 waits for it in a collective (with LOCKSTEP_COMM_TIMEOUT at 300 s). The job must exit
# non-zero within 60 s and print rank 1's out-of-memory message.
#   sample_rank_failure.sh MLP_TRAIN MPIRUN...
set -uo pipefail
mlp_train=$1
shift
out=$(mktemp)
trap 'rm -f "$out"' EXIT
args=(--mode ddp --hidden 256 --epochs 1 --max-steps 20)
start=$(date +%s)
LOCKSTEP_COMM_TIMEOUT=300 timeout 120 "$@" -np 1 "$mlp_train" "${args[@]}" : \
  -np 1 -x LOCKSTEP_HOST_DEVICE_MEMORY=256K "$mlp_train" "${args[@]}" >"$out" 2>&1
status=$?
elapsed=$(( $(date +%s) - start ))
grep -v "^epoch" "$out" | head -n 20
echo "exit status $status after $elapsed s"
(( status != 0 )) || { echo "FAIL: the job exited 0"; exit 1; }
(( status != 124 )) || { echo "FAIL: the job hung (killed by timeout after 120 s)"; exit 1; }
(( elapsed <= 60 )) || { echo "FAIL: the job took $elapsed s to end"; exit 1; }
grep -q "mlp_train: rank 1: .*out of memory\|mlp_train: rank 1: .*could not allocate" "$out" || {
  echo "FAIL: rank 1's message is missing"; exit 1; }
echo PASS
