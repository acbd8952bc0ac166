#!/usr/bin/env bash
# A rank that fails during DDP training ends the whole run, promptly, with its message, and no rank completes a
# step after the fault. The last rank fails (LOCKSTEP_FAULT) at step 1, at a middle step and at the last step
# (while the others wait in its all-reduce), with LOCKSTEP_COMM_TIMEOUT=3:
#   sample_faults.sh KIND RANKS MLP_TRAIN [MPIRUN...]
# SAMPLE_FAULT_ARGS (optional): more options for the sample (e.g. --host-collectives compute).
# KIND: throw, oom, comm, kill, stop or stall (stall: processes only); RANKS: the number of ranks; with MPIRUN (the launcher and its options)
# the ranks are processes, else threads of one process (host devices). Checks, for each fault step:
#   - the run exits non-zero within LOCKSTEP_COMM_TIMEOUT + 5 s of the fault (the time the rank printed);
#   - the failing rank's own message (or, for kill and stop, the sentence that names it) is printed;
#   - rank 0's progress (printed after each step's loss was read) stops before the fault's step.
set -uo pipefail
kind=$1 ranks=$2 mlp_train=$3
shift 3
timeout_s=3
steps=12
last=$((ranks - 1))
out=$(mktemp)
trap 'rm -f "$out"' EXIT

case $kind in
  throw) expect="LOCKSTEP_FAULT: an injected failure at step" ;;
  oom)   expect="host:[0-9] is out of memory: tried to allocate" ;;
  comm)  expect="LOCKSTEP_FAULT: an injected failure on the communication stream" ;;
  kill)  expect="rank $last with PID [0-9]* on node .* exited on signal 9" ;;
  stop)  expect="rank $last did not reach it within $timeout_s s" ;;
  stall) expect="rank $last did not answer within .* when asked where it is" ;;
  *) echo "usage: sample_faults.sh throw|oom|comm|kill|stop|stall RANKS MLP_TRAIN [MPIRUN...]"; exit 2 ;;
esac

failures=0
for at in 1 $((steps / 2)) last; do
  fault_step=$at
  [[ $at == last ]] && fault_step=$steps
  args=(--mode ddp --hidden 64 --epochs 1 --batch 120 --max-steps $steps --print-every 1 ${SAMPLE_FAULT_ARGS:-})
  start=$(date +%s.%N)
  if (( $# > 0 )); then
    LOCKSTEP_COMM_TIMEOUT=$timeout_s timeout 120 "$@" -np "$ranks" -x LOCKSTEP_COMM_TIMEOUT \
      -x LOCKSTEP_FAULT="$last:$at:$kind" "$mlp_train" "${args[@]}" >"$out" 2>&1
  else
    devices=$(seq -s, -f "host:%g" 0 $((ranks - 1)))
    LOCKSTEP_HOST_DEVICES=$ranks LOCKSTEP_COMM_TIMEOUT=$timeout_s LOCKSTEP_FAULT="$last:$at:$kind" \
      timeout 120 "$mlp_train" "${args[@]}" --devices "$devices" >"$out" 2>&1
  fi
  status=$?
  end=$(date +%s.%N)
  echo "---- rank $last fails by $kind at step $at: exit status $status after $(printf %.1f "$(echo "$end - $start" | bc)") s"
  tr '\r' '\n' <"$out" | grep -v "^epoch\|^ *$\|^-----*$" | cut -c1-400 | head -n 8
  fault_time=$(grep -o "LOCKSTEP_FAULT: $kind at step [0-9]* (t=[0-9.]*)" "$out" | head -n 1 | sed 's/.*t=\([0-9.]*\))/\1/')
  problem=""
  if (( status == 0 )); then
    problem="the run exited 0"
  elif (( status == 124 )); then
    problem="the run hung (killed after 120 s)"
  elif [[ -z $fault_time ]]; then
    problem="the fault was not injected"
  else
    after=$(echo "$end - $fault_time" | bc)
    echo "     ended $(printf %.2f "$after") s after the fault"
    if (( $(echo "$after > $timeout_s + 5" | bc) )); then problem="ended $after s after the fault (limit $timeout_s + 5 s)"; fi
    if ! grep -q -- "$expect" "$out"; then problem="the output lacks '$expect'"; fi
    # rank 0's progress lines, "step N/M": none at or after the fault's step
    done_step=$(tr '\r' '\n' <"$out" | grep -o "^epoch 1/1  step [0-9]*/" | sed 's/.*step \([0-9]*\)\//\1/' | sort -n | tail -n 1)
    if [[ -n $done_step ]] && (( done_step >= fault_step )); then
      problem="rank 0 completed step $done_step, at or after the fault at step $fault_step"
    fi
  fi
  if [[ -n $problem ]]; then
    echo "FAIL: $problem"
    failures=$((failures + 1))
  fi
done
(( failures == 0 )) && echo PASS
exit $(( failures == 0 ? 0 : 1 ))
