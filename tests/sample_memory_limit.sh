#!/usr/bin/env bash
# Under a device memory limit that plain DDP exceeds (it fails with the out-of-memory sentence), ZeRO-2 builds,
# trains and hashes the model to the weights_sha256 that plain DDP reaches with enough memory: the wrapper's
# construction holds no second copy of the gradients, and the hash streams the master values bucket by bucket.
#   sample_memory_limit.sh MLP_TRAIN LIMIT -- OPTIONS...   (OPTIONS: a DDP run on 4 host devices, without --zero)
set -uo pipefail
sample=$1 limit=$2
shift 3
export LOCKSTEP_HOST_DEVICES=4
hash_of() { grep -o '"weights_sha256":"[0-9a-f]*"' <<<"$1"; }
fail() { echo "FAIL: $1"; tail -c 800 <<<"$2"; echo; exit 1; }

ddp=$("$sample" "$@" --zero 0 --json 2>&1) || fail "plain DDP without a limit" "$ddp"
limited=$(LOCKSTEP_HOST_DEVICE_MEMORY=$limit "$sample" "$@" --zero 0 --json 2>&1) &&
  fail "plain DDP fits in $limit: the test needs a limit it exceeds" "$limited"
grep -q "is out of memory: tried to allocate" <<<"$limited" || fail "plain DDP failed otherwise" "$limited"
zero=$(LOCKSTEP_HOST_DEVICE_MEMORY=$limit "$sample" "$@" --zero 2 --json 2>&1) || fail "ZeRO-2 under $limit" "$zero"
[[ -n "$(hash_of "$ddp")" && "$(hash_of "$ddp")" == "$(hash_of "$zero")" ]] ||
  fail "ZeRO-2 under $limit ends with $(hash_of "$zero"), plain DDP with $(hash_of "$ddp")" "$zero"
echo "PASS: plain DDP runs out of memory under $limit per device; ZeRO-2 trains there to DDP's $(hash_of "$ddp")"
