#!/usr/bin/env bash
# Under a device memory limit that plain DDP exceeds (it fails with the out-of-memory sentence), ZeRO stage ZERO
# (default 2) builds and trains the model, saves a checkpoint after STOP_AFTER steps, resumes from it and ends with
# the weights_sha256 that plain DDP reaches with enough memory: the wrapper's construction holds no second copy of
# the gradients, the save and the hash stream whole tensors to the host in chunks, and the load writes each rank's
# range. The stages in OUT_OF_MEMORY (default 0, plain DDP) must run out under the limit.
#   [ZERO=S] [OUT_OF_MEMORY="0 2"] sample_memory_limit.sh MLP_TRAIN LIMIT STOP_AFTER -- OPTIONS...
#   (OPTIONS: a DDP run on 4 host devices, without --zero)
set -uo pipefail
sample=$1 limit=$2 stop_after=$3
shift 4
zero_stage=${ZERO:-2}
export LOCKSTEP_HOST_DEVICES=4
hash_of() { grep -o '"weights_sha256":"[0-9a-f]*"' <<<"$1"; }
fail() { echo "FAIL: $1"; tail -c 800 <<<"$2"; echo; exit 1; }

ddp=$("$sample" "$@" --zero 0 --json 2>&1) || fail "plain DDP without a limit" "$ddp"
for stage in ${OUT_OF_MEMORY:-0}; do
  limited=$(LOCKSTEP_HOST_DEVICE_MEMORY=$limit "$sample" "$@" --zero "$stage" --json 2>&1) &&
    fail "stage $stage fits in $limit: the test needs a limit it exceeds" "$limited"
  grep -q "is out of memory: tried to allocate" <<<"$limited" || fail "stage $stage failed otherwise" "$limited"
done
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
stopped=$(LOCKSTEP_HOST_DEVICE_MEMORY=$limit "$sample" "$@" --zero "$zero_stage" --stop-after "$stop_after" --save "$dir/ck" --json 2>&1) ||
  fail "ZeRO-$zero_stage under $limit, stopped after $stop_after steps with a checkpoint" "$stopped"
zero=$(LOCKSTEP_HOST_DEVICE_MEMORY=$limit "$sample" "$@" --zero "$zero_stage" --resume "$dir/ck" --json 2>&1) ||
  fail "ZeRO-$zero_stage under $limit, resumed" "$zero"
[[ -n "$(hash_of "$ddp")" && "$(hash_of "$ddp")" == "$(hash_of "$zero")" ]] ||
  fail "ZeRO-$zero_stage under $limit ends with $(hash_of "$zero"), plain DDP with $(hash_of "$ddp")" "$zero"
echo "PASS: stages ${OUT_OF_MEMORY:-0} run out of memory under $limit per device; ZeRO-$zero_stage trains, saves, resumes there to DDP's $(hash_of "$ddp")"
