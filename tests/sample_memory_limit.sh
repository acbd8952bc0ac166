#!/usr/bin/env bash
# Under a device memory limit that plain DDP exceeds (it fails with the out-of-memory sentence), ZeRO-2 builds and
# trains the model, saves a checkpoint after STOP_AFTER steps, resumes from it and ends with the weights_sha256
# that plain DDP reaches with enough memory: the wrapper's construction holds no second copy of the gradients, the
# save and the hash stream whole tensors to the host in chunks, and the load writes each rank's range.
#   sample_memory_limit.sh MLP_TRAIN LIMIT STOP_AFTER -- OPTIONS...   (OPTIONS: a DDP run on 4 host devices, without --zero)
set -uo pipefail
sample=$1 limit=$2 stop_after=$3
shift 4
export LOCKSTEP_HOST_DEVICES=4
hash_of() { grep -o '"weights_sha256":"[0-9a-f]*"' <<<"$1"; }
fail() { echo "FAIL: $1"; tail -c 800 <<<"$2"; echo; exit 1; }

ddp=$("$sample" "$@" --zero 0 --json 2>&1) || fail "plain DDP without a limit" "$ddp"
limited=$(LOCKSTEP_HOST_DEVICE_MEMORY=$limit "$sample" "$@" --zero 0 --json 2>&1) &&
  fail "plain DDP fits in $limit: the test needs a limit it exceeds" "$limited"
grep -q "is out of memory: tried to allocate" <<<"$limited" || fail "plain DDP failed otherwise" "$limited"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
stopped=$(LOCKSTEP_HOST_DEVICE_MEMORY=$limit "$sample" "$@" --zero 2 --stop-after "$stop_after" --save "$dir/ck" --json 2>&1) ||
  fail "ZeRO-2 under $limit, stopped after $stop_after steps with a checkpoint" "$stopped"
zero=$(LOCKSTEP_HOST_DEVICE_MEMORY=$limit "$sample" "$@" --zero 2 --resume "$dir/ck" --json 2>&1) ||
  fail "ZeRO-2 under $limit, resumed" "$zero"
[[ -n "$(hash_of "$ddp")" && "$(hash_of "$ddp")" == "$(hash_of "$zero")" ]] ||
  fail "ZeRO-2 under $limit ends with $(hash_of "$zero"), plain DDP with $(hash_of "$ddp")" "$zero"
echo "PASS: plain DDP runs out of memory under $limit per device; ZeRO-2 trains, saves, resumes there to DDP's $(hash_of "$ddp")"
