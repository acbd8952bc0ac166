#!/usr/bin/env bash
# A run of the sample stopped and resumed ends bit for bit where the same run goes straight through:
#   sample_resume.sh MLP_TRAIN STOP_AFTER [RESUME_LAUNCHER] -- OPTIONS...
# runs `MLP_TRAIN OPTIONS --json` (the straight run), then `MLP_TRAIN OPTIONS --stop-after STOP_AFTER --save DIR`
# and `MLP_TRAIN OPTIONS --resume DIR`, and compares the three runs' weights_sha256 and test_correct. When the
# options hold a launcher (mpirun ...) it goes before MLP_TRAIN: give it as LAUNCHER=... in the environment.
# RESUME_OPTIONS (environment) replaces OPTIONS for the resumed run (another device count, say); the hashes must
# then agree only if EXPECT=same (default) — EXPECT=accuracy compares the accuracy within 0.3 points instead.
set -euo pipefail
mlp_train=$1 stop_after=$2
shift 2
[[ "${1:-}" == "--" ]] && shift
options=("$@")
read -r -a launcher <<< "${LAUNCHER:-}"
read -r -a resume_options <<< "${RESUME_OPTIONS:-${options[*]}}"
read -r -a resume_launcher <<< "${RESUME_LAUNCHER:-${LAUNCHER:-}}"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

field() {  # field NAME JSON-LINE
  sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p" <<< "$2"
}
run() {  # run NAME LAUNCHER... -- ARGS...: the last line of the sample's output
  local name=$1; shift
  local out
  if ! out=$("$@" 2>"$dir/$name.err"); then
    { echo "$name failed:"; cat "$dir/$name.err"; echo "$out"; } >&2; exit 1
  fi
  tail -n 1 <<< "$out"
}
straight=$(run straight "${launcher[@]}" "$mlp_train" "${options[@]}" --json)
first=$(run first "${launcher[@]}" "$mlp_train" "${options[@]}" --json --stop-after "$stop_after" --save "$dir/ck")
resumed=$(run resumed "${resume_launcher[@]}" "$mlp_train" "${resume_options[@]}" --json --resume "$dir/ck")
echo "straight: sha256 $(field weights_sha256 "$straight") correct $(field test_correct "$straight")"
echo "first:    sha256 $(field weights_sha256 "$first") stopped $(field stopped "$first") checkpoint $(field checkpoint "$first")"
echo "resumed:  sha256 $(field weights_sha256 "$resumed") correct $(field test_correct "$resumed")"
[[ "$(field stopped "$first")" == "--stop-after" ]] || { echo "the first run did not stop after $stop_after steps"; exit 1; }
[[ "$(field resumed_at_step "$resumed")" == "$stop_after" ]] || {
  echo "the resumed run did not continue from step $stop_after: $(field resumed_at_step "$resumed")"; exit 1; }
[[ "$(field weights_sha256 "$first")" != "$(field weights_sha256 "$straight")" ]] || { echo "the stopped run already has the final weights"; exit 1; }
if [[ "${EXPECT:-same}" == same ]]; then
  [[ "$(field weights_sha256 "$resumed")" == "$(field weights_sha256 "$straight")" ]] || { echo "FAIL: weights differ"; exit 1; }
  [[ "$(field test_correct "$resumed")" == "$(field test_correct "$straight")" ]] || { echo "FAIL: accuracy differs"; exit 1; }
else
  a=$(field test_correct "$straight") b=$(field test_correct "$resumed") n=$(field test_samples "$straight")
  (( (a > b ? a - b : b - a) * 1000 <= 3 * n )) || { echo "FAIL: accuracy $b vs $a of $n differs by more than 0.3 points"; exit 1; }
fi
echo "PASS"
