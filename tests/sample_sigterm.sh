#!/usr/bin/env bash
# SIGTERM makes the sample save at a step boundary (with several ranks within 10 steps) and stop (exit 0, "stopped by SIGTERM"); resuming
# from that checkpoint ends bit for bit where the uninterrupted run ends, whatever step the signal came at.
#   sample_sigterm.sh MLP_TRAIN OPTIONS...
set -euo pipefail
mlp_train=$1
shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p" <<< "$2"; }

straight=$("$mlp_train" "$@" --json | tail -n 1)
"$mlp_train" "$@" --save "$dir/ck" --print-every 1 > "$dir/out" 2>&1 &
pid=$!
for _ in $(seq 1 600); do  # until the first progress line (at most 60 s)
  grep -q "step " "$dir/out" && break
  sleep 0.1
done
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
cat "$dir/out" | tail -n 3
[[ $status == 0 ]] || { echo "FAIL: exit status $status after SIGTERM"; exit 1; }
grep -q "stopped by SIGTERM at step" "$dir/out" || { echo "FAIL: no 'stopped by SIGTERM'"; exit 1; }
resumed=$("$mlp_train" "$@" --resume "$dir/ck" --json | tail -n 1)
echo "straight: $(field weights_sha256 "$straight")"
echo "resumed:  $(field weights_sha256 "$resumed")"
[[ "$(field weights_sha256 "$resumed")" == "$(field weights_sha256 "$straight")" ]] || { echo "FAIL: weights differ"; exit 1; }
echo PASS
