#!/usr/bin/env bash
# --lr, --momentum and --weight-decay on --resume (issue 27, item 5): without them the run goes on with the
# checkpoint's values (and --json reports those); with them the new values replace the checkpoint's from the next
# step on, the run says so, --json reports what was used, and the next checkpoint's manifest records it.
#   sample_resume_hyperparameters.sh MLP_TRAIN
set -euo pipefail
mlp_train=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
common=(--devices host:0 --hidden 32 --batch 256 --epochs 1 --max-steps 8 --print-every 1000)
json() {  # json FILE KEY: the value of KEY in the last line of FILE
  python3 -c 'import json,sys; v=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]).get(sys.argv[2]); print(json.dumps(v))' "$1" "$2"
}
fail() { echo "FAIL: $*"; exit 1; }

"$mlp_train" "${common[@]}" --lr 0.1 --momentum 0.5 --save "$dir/a" --stop-after 4 --json > "$dir/a.json"
# 1. no hyperparameter given: the checkpoint's (not the defaults 0.05 / 0.9)
"$mlp_train" "${common[@]}" --resume "$dir/a" --json > "$dir/b.json"
[[ $(json "$dir/b.json" lr) == 0.10000000149011612 ]] || fail "resumed without --lr: lr $(json "$dir/b.json" lr), expected the checkpoint's 0.1"
[[ $(json "$dir/b.json" changed_on_resume) == null ]] || fail "nothing was changed, yet: $(json "$dir/b.json" changed_on_resume)"
# the same as the run that was never stopped
"$mlp_train" "${common[@]}" --lr 0.1 --momentum 0.5 --json > "$dir/straight.json"
[[ $(json "$dir/b.json" weights_sha256) == $(json "$dir/straight.json" weights_sha256) ]] || fail "the resumed run is not the straight run"
# 2. --lr and --momentum given: applied, said, reported and recorded
"$mlp_train" "${common[@]}" --resume "$dir/a" --lr 0.2 --momentum 0.5 --save "$dir/c" > "$dir/c.txt"
grep -q 'resumed with --lr 0.2 (the checkpoint had 0.1), from step 5 on' "$dir/c.txt" || { cat "$dir/c.txt"; fail "no notice of the new rate"; }
if grep -q 'resumed with --momentum' "$dir/c.txt"; then fail "--momentum 0.5 is the checkpoint's: no change to report"; fi
manifest=$(ls -d "$dir"/c/step-* | tail -n 1)/manifest.json
python3 - "$manifest" <<'PY' || fail "the manifest does not record the change"
import json, sys
user = json.load(open(sys.argv[1]))["user"]
assert abs(user["lr"] - 0.2) < 1e-6, user
assert user["changed_on_resume"] == ["--lr 0.2 (the checkpoint had 0.1)"], user
PY
"$mlp_train" "${common[@]}" --resume "$dir/a" --lr 0.2 --json > "$dir/d.json"
[[ $(json "$dir/d.json" lr) == 0.20000000298023224 ]] || fail "resumed with --lr 0.2: lr $(json "$dir/d.json" lr)"
[[ $(json "$dir/d.json" weights_sha256) != $(json "$dir/b.json" weights_sha256) ]] || fail "--lr 0.2 changed nothing"
echo "PASS"
