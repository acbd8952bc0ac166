#!/usr/bin/env bash
# ZeRO: the sample ends with DDP's weights_sha256 under --zero 1 and --zero 2, on 2, 3 and 4 host devices
# (threads; the same reduction order, so the same bits), and its per-device report shows the state split:
#   sample_zero.sh MLP_TRAIN -- OPTIONS...
# Every run gets OPTIONS --mode ddp --json and a batch that splits evenly (128, 129 on 3 devices; needs
# LOCKSTEP_HOST_DEVICES=4). Under --mpirun the comparison is tests/test_parallel_mpi's (within 1e-6).
set -euo pipefail
mlp_train=$1
shift
[[ "${1:-}" == "--" ]] && shift
options=("$@")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

field() {  # field NAME JSON-LINE: the first occurrence
  sed -n "s/^[^{]*{.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p" <<< "$2" | head -n 1
}
run() {  # run NAME COMMAND...: the run's last line
  local name=$1; shift
  local out
  if ! out=$("$@" 2>"$dir/$name.err"); then
    { echo "$name failed:"; cat "$dir/$name.err"; echo "$out"; } >&2; exit 1
  fi
  tail -n 1 <<< "$out"
}

failed=0
for n in 2 3 4; do
  devices=$(seq -s, -f 'host:%g' 0 $((n - 1)))
  batch=$(( n == 3 ? 129 : 128 ))
  reference=""
  for zero in 0 1 2 3; do
    line=$(run "ddp_${n}_zero_$zero" "$mlp_train" "${options[@]}" --mode ddp --devices "$devices" --batch "$batch" \
           --zero "$zero" --json)
    h=$(field weights_sha256 "$line")
    optimizer=$(field optimizer_bytes "$line")
    [[ -z "$reference" ]] && { reference=$h; ddp_optimizer=$optimizer; }
    printf '%d devices, zero %d: %s, optimizer state %s bytes on the first device%s\n' "$n" "$zero" "$h" "$optimizer" \
      "$([[ "$h" == "$reference" ]] || echo "  DIFFERS")"
    [[ "$h" == "$reference" ]] || failed=1
    # the state is split: at most a share of DDP's, with room for padding and the step counters
    if (( zero > 0 && optimizer * n > ddp_optimizer + 65536 * n )); then
      echo "FAIL: ZeRO-$zero keeps $optimizer bytes of optimizer state per device, DDP $ddp_optimizer"; failed=1
    fi
  done
done
[[ $failed == 0 ]] || { echo "FAIL: ZeRO runs differ from DDP's"; exit 1; }
echo "PASS"
