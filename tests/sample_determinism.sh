#!/usr/bin/env bash
# Deterministic mode: the sample ends with the same weights_sha256 on one device, with data_parallel on 2, 3 and 4
# host devices, with DDP on 2, 3 and 4 threads (exact sums or gathered partials; ZeRO-1 on 2 and 4, ZeRO-2 on 3)
# and, when a launcher is given, under `mpirun -np 2` and `-np 3` (and ZeRO-1 on 3):
#   sample_determinism.sh MLP_TRAIN [MPIRUN...] -- OPTIONS...
# Every run gets OPTIONS --deterministic --json (and needs LOCKSTEP_HOST_DEVICES=4). As a check that the
# comparison means something, the ordinary runs (without --deterministic) of one device and of dp on 3 must
# differ: in ordinary mode the sums depend on the split.
set -euo pipefail
mlp_train=$1
shift
launcher=()
while [[ $# -gt 0 && "$1" != "--" ]]; do launcher+=("$1"); shift; done
[[ "${1:-}" == "--" ]] && shift
options=("$@")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

field() {  # field NAME JSON-LINE
  sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p" <<< "$2"
}
hash_of() {  # hash_of NAME COMMAND...: the weights_sha256 of the run's last line
  local name=$1; shift
  local out
  if ! out=$("$@" 2>"$dir/$name.err"); then
    { echo "$name failed:"; cat "$dir/$name.err"; echo "$out"; } >&2; exit 1
  fi
  field weights_sha256 "$(tail -n 1 <<< "$out")"
}

declare -A runs=(
  [single]="--mode single --devices host:0"
  [dp_2]="--mode dp --devices host:0,host:1"
  [dp_3]="--mode dp --devices host:0,host:1,host:2"
  [dp_4]="--mode dp --devices host:0,host:1,host:2,host:3"
  [ddp_2]="--mode ddp --devices host:0,host:1"
  [ddp_3]="--mode ddp --devices host:0,host:1,host:2"
  [ddp_4]="--mode ddp --devices host:0,host:1,host:2,host:3"
  [ddp_2_accumulators]="--mode ddp --devices host:0,host:1 --exact-sums accumulators"
  [zero1_2]="--mode ddp --devices host:0,host:1 --zero 1"
  [zero2_3]="--mode ddp --devices host:0,host:1,host:2 --zero 2"
  [zero1_4]="--mode ddp --devices host:0,host:1,host:2,host:3 --zero 1"
)
# shellcheck disable=SC2086  # the mode's options are words
reference=$(hash_of single "$mlp_train" "${options[@]}" ${runs[single]} --deterministic --json)
echo "single:       $reference"
failed=0
for name in dp_2 dp_3 dp_4 ddp_2 ddp_2_accumulators ddp_3 ddp_4 zero1_2 zero2_3 zero1_4; do
  # shellcheck disable=SC2086  # the mode's options are words
  h=$(hash_of "$name" "$mlp_train" "${options[@]}" ${runs[$name]} --deterministic --json)
  printf '%-20s %s%s\n' "$name:" "$h" "$([[ "$h" == "$reference" ]] || echo "  DIFFERS")"
  [[ "$h" == "$reference" ]] || failed=1
done
if [[ ${#launcher[@]} -gt 0 ]]; then
  for np in 2 3; do
    h=$(hash_of "mpirun_np$np" "${launcher[@]}" -np "$np" "$mlp_train" "${options[@]}" --mode ddp --deterministic --json)
    printf '%-20s %s%s\n' "mpirun -np $np:" "$h" "$([[ "$h" == "$reference" ]] || echo "  DIFFERS")"
    [[ "$h" == "$reference" ]] || failed=1
  done
  h=$(hash_of mpirun_np3_zero1 "${launcher[@]}" -np 3 "$mlp_train" "${options[@]}" --mode ddp --zero 1 --deterministic \
      --json)
  printf '%-20s %s%s\n' "mpirun -np 3 --zero 1:" "$h" "$([[ "$h" == "$reference" ]] || echo "  DIFFERS")"
  [[ "$h" == "$reference" ]] || failed=1
fi
# shellcheck disable=SC2086
ordinary_single=$(hash_of ordinary_single "$mlp_train" "${options[@]}" ${runs[single]} --json)
# shellcheck disable=SC2086
ordinary_dp=$(hash_of ordinary_dp_3 "$mlp_train" "${options[@]}" ${runs[dp_3]} --json)
echo "ordinary single $ordinary_single, ordinary dp_3 $ordinary_dp"
if [[ "$ordinary_single" == "$ordinary_dp" ]]; then
  echo "FAIL: the ordinary runs agree too: these options do not show what deterministic mode adds"
  exit 1
fi
[[ $failed == 0 ]] || { echo "FAIL: deterministic runs differ"; exit 1; }
echo "PASS"
