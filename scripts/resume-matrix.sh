#!/usr/bin/env bash
# The checkpoint issue's resume matrix on the full sample: for each mode, precision and optimizer, 3 epochs
# straight against 1 epoch + save + exit (--stop-after, one epoch of steps) + resume for the other 2, compared by
# weights_sha256 and test accuracy; then a 2-rank checkpoint resumed on 1 and on 3 ranks (batch 132, which
# divides over 1, 2 and 3 ranks). Prints one line per case; exits non-zero if any exact case differs.
#   scripts/resume-matrix.sh MLP_TRAIN [extra options...]
set -uo pipefail
mlp_train=$1
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mpirun_cmd="mpirun --allow-run-as-root --oversubscribe --mca btl self,vader,tcp --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo -np 2"
export LOCKSTEP_HOST_DEVICES=4
failed=0
run_case() {  # NAME STOP LAUNCHER -- OPTIONS...
  local name=$1 stop=$2 launcher=$3; shift 4
  local out
  out=$(LAUNCHER="$launcher" bash "$here/tests/sample_resume.sh" "$mlp_train" "$stop" -- "$@" 2>&1)
  local verdict=$(tail -n 1 <<< "$out")
  local straight=$(grep '^straight' <<< "$out") resumed=$(grep '^resumed' <<< "$out")
  printf '%-34s %s | %s | %s\n' "$name" "${straight#straight: }" "${resumed#resumed:  }" "$verdict"
  [[ "$verdict" == PASS ]] || failed=1
}
for mode in single dp ddp mpirun; do
  for precision in f32 f16 bf16; do
    for optimizer in sgd adamw; do
      lr=0.05; [[ $optimizer == adamw ]] && lr=0.001
      case $mode in
        single) args=(--mode single --devices host:0); launcher="" ;;
        dp) args=(--mode dp --devices host:0,host:1); launcher="" ;;
        ddp) args=(--mode ddp --devices host:0,host:1); launcher="" ;;
        mpirun) args=(--mode ddp); launcher=$mpirun_cmd ;;
      esac
      run_case "$mode $precision $optimizer" 469 "$launcher" -- --epochs 3 "${args[@]}" --precision "$precision" \
        --optimizer "$optimizer" --lr "$lr" "$@"
    done
  done
done
for to in "single --devices host:0" "ddp --devices host:0,host:1,host:2"; do
  out=$(RESUME_OPTIONS="--epochs 3 --batch 132 --mode $to $*" EXPECT=accuracy bash "$here/tests/sample_resume.sh" \
        "$mlp_train" 455 -- --epochs 3 --batch 132 --mode ddp --devices host:0,host:1 "$@" 2>&1)
  printf '%-34s %s | %s | %s\n' "ddp 2 ranks -> ${to}" \
    "$(grep '^straight' <<< "$out" | sed 's/^straight: //')" "$(grep '^resumed' <<< "$out" | sed 's/^resumed:  //')" "$(tail -n 1 <<< "$out")"
done
exit $failed
