#!/usr/bin/env bash
# Runs a command that must fail: a non-zero exit status and REGEX (grep -E) in what it prints.
#   expect_failure.sh REGEX COMMAND...
# With MAKE_MISMATCHED_DATA=DIR in the environment, first makes DIR a Fashion-MNIST directory whose test images
# are 14x14 (the training files are links to Debian's dataset-fashion-mnist).
set -uo pipefail
regex=$1
shift
if [[ -n "${MAKE_MISMATCHED_DATA:-}" ]]; then
  d=$MAKE_MISMATCHED_DATA src=/usr/share/datasets/fashion-mnist
  rm -rf "$d" && mkdir -p "$d"
  ln -s "$src/train-images-idx3-ubyte.gz" "$d/" && ln -s "$src/train-labels-idx1-ubyte.gz" "$d/"
  { printf '\x00\x00\x08\x03\x00\x00\x00\x0a\x00\x00\x00\x0e\x00\x00\x00\x0e'; head -c 1960 /dev/zero; } > "$d/t10k-images-idx3-ubyte"
  { printf '\x00\x00\x08\x01\x00\x00\x00\x0a'; head -c 10 /dev/zero; } > "$d/t10k-labels-idx1-ubyte"
fi
out=$("$@" 2>&1)
status=$?
printf '%s\n' "$out" | tail -n 5
(( status != 0 )) || { echo "FAIL: exited 0"; exit 1; }
grep -qE -- "$regex" <<< "$out" || { echo "FAIL: no match for: $regex"; exit 1; }
echo "PASS (exit status $status)"
