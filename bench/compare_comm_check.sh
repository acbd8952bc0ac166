#!/usr/bin/env bash
# The cost of checking that MPI ranks issue the same collectives (comm_options::check_calls): the sample's DDP
# step under mpirun -np 2, with LOCKSTEP_COMM_CHECK=1 and =0 alternated, N pairs of STEPS steps; prints each
# run and the medians.
#   bench/compare_comm_check.sh build/rel/examples/mlp_train/mlp_train [N=12] [STEPS=600]
set -euo pipefail
mlp_train=$1 n=${2:-12} steps=${3:-600}
mpirun=(mpirun --allow-run-as-root --oversubscribe --mca btl self,vader,tcp --mca btl_tcp_if_include lo
        --mca oob_tcp_if_include lo)
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for ((i = 0; i < n; ++i)); do
  for check in 1 0; do
    ms=$("${mpirun[@]}" -np 2 -x LOCKSTEP_COMM_CHECK=$check "$mlp_train" --mode ddp --epochs 1 --max-steps "$steps" \
           --json 2>/dev/null | tail -n 1 |
         /usr/bin/python3 -c 'import json,sys; j=json.load(sys.stdin); print(1000*j["train_seconds"]/j["steps"])')
    echo "check=$check step_ms=$ms" | tee -a "$results"
  done
done
/usr/bin/python3 - "$results" <<'PY'
import re, statistics, sys
runs = {"1": [], "0": []}
for line in open(sys.argv[1]):
    m = re.match(r"check=(\d) step_ms=([\d.]+)", line)
    runs[m.group(1)].append(float(m.group(2)))
on, off = statistics.median(runs["1"]), statistics.median(runs["0"])
print(f"median step: checked {on:.3f} ms, unchecked {off:.3f} ms: the check costs {100 * (on / off - 1):+.1f}%")
PY
