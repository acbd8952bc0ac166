#!/usr/bin/env bash
# Issue 27 item 4: a fresh run (no --resume) whose --save DIR holds another run's checkpoints is refused before it
# trains, naming them, and deletes nothing; the run that resumes from DIR saves there; --overwrite replaces them.
#   sample_other_run.sh MLP_TRAIN DIR
set -uo pipefail
mlp_train=$1 dir=$2
args=(--hidden 32 --batch 100 --print-every 1000)
rm -rf "$dir"
fail() { echo "FAIL: $*"; exit 1; }
"$mlp_train" "${args[@]}" --max-steps 9 --stop-after 6 --save "$dir" --save-every 3 >/dev/null 2>&1 || fail "the first run failed"
[[ -d $dir/step-000000000006 && -d $dir/step-000000000003 ]] || fail "the first run left $(ls "$dir")"
before=$(ls "$dir" | tr '\n' ' ')
out=$("$mlp_train" "${args[@]}" --max-steps 2 --save "$dir" --keep-last 1 2>&1)
status=$?
printf '%s\n' "$out" | tail -n 2 | cut -c1-400
(( status != 0 )) || fail "a fresh run into another run's root exited 0"
grep -q "holds checkpoints of another run (step-000000000006, step-000000000003" <<<"$out" || fail "no refusal naming them"
grep -q "epoch 1/1  step" <<<"$out" && fail "the refused run trained"
[[ $(ls "$dir" | tr '\n' ' ') == "$before" ]] || fail "the refused run changed $dir: $(ls "$dir")"
"$mlp_train" "${args[@]}" --max-steps 9 --save "$dir" --save-every 3 --resume "$dir" >/dev/null 2>&1 \
  || fail "the run resumed from $dir could not save there"
[[ -d $dir/step-000000000009 ]] || fail "the resumed run did not save step 9"
"$mlp_train" "${args[@]}" --max-steps 2 --save "$dir" --overwrite >/dev/null 2>&1 || fail "--overwrite failed"
[[ $(ls "$dir" | tr '\n' ' ') == "step-000000000002 " ]] || fail "--overwrite left $(ls "$dir")"
echo PASS
