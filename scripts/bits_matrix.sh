#!/usr/bin/env bash
# The sample's results over a matrix of parallel configurations, one line each: what a refactoring of the
# parallel layer must leave unchanged, bit for bit. Run it before and after, and diff the outputs:
#   scripts/bits_matrix.sh MLP_TRAIN > before.txt   ...   scripts/bits_matrix.sh MLP_TRAIN > after.txt
#   diff before.txt after.txt
# Each line: the configuration, weights_sha256, final_loss, and the first device's parameter, gradient and
# optimizer bytes (the memory layout is part of the behaviour). Host devices, threads; 6 steps, a small model.
# Also under mpirun (2 processes) when it is installed.
set -euo pipefail
mlp_train=$1
export LOCKSTEP_HOST_DEVICES=4
common=(--hidden 48,40 --max-steps 6 --epochs 1 --print-every 1000 --json)
field() {  # field NAME JSON-LINE: the first occurrence
  sed -n "s/^[^{]*{.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p" <<< "$2" | head -n 1
}
one() {  # one LABEL OPTIONS...
  local label=$1; shift
  local out
  if ! out=$("$@" 2>&1 | tail -n 1); then out="failed"; fi
  printf '%-64s %s loss=%s params=%s grads=%s opt=%s\n' "$label" "$(field weights_sha256 "$out")" \
    "$(field final_loss "$out")" "$(field parameter_bytes "$out")" "$(field gradient_bytes "$out")" \
    "$(field optimizer_bytes "$out")"
}
for n in 1 2 3 4; do
  devices=$(seq -s, -f 'host:%g' 0 $((n - 1)))
  for zero in 0 1 2; do
    for precision in f32 f16 bf16; do
      for optimizer in sgd adamw; do
        for det in none auto accumulators; do
          opts=(--mode ddp --devices "$devices" --zero "$zero" --precision "$precision" --optimizer "$optimizer")
          if [[ $det == none ]]; then
            opts+=(--batch 132)  # DDP splits a batch evenly
          else
            opts+=(--batch 130 --deterministic --chunk-rows 16 --exact-sums "$det")  # uneven chunks
          fi
          one "n$n zero$zero $precision $optimizer det=$det" "$mlp_train" "${common[@]}" "${opts[@]}"
        done
      done
    done
    one "n$n zero$zero f16 adamw clip" "$mlp_train" "${common[@]}" --mode ddp --devices "$devices" --zero "$zero" \
      --precision f16 --optimizer adamw --clip-grad-norm 0.5 --batch 132
    one "n$n zero$zero f32 sgd clip det" "$mlp_train" "${common[@]}" --mode ddp --devices "$devices" --zero "$zero" \
      --clip-grad-norm 0.5 --deterministic
  done
done
if command -v mpirun > /dev/null; then
  for zero in 0 1 2; do
    for precision in f32 bf16; do
      one "mpirun np2 zero$zero $precision adamw" mpirun --allow-run-as-root --oversubscribe -np 2 "$mlp_train" "${common[@]}" \
        --mode ddp --zero "$zero" --precision "$precision" --optimizer adamw --batch 132
      one "mpirun np2 zero$zero $precision det" mpirun --allow-run-as-root --oversubscribe -np 2 "$mlp_train" "${common[@]}" \
        --mode ddp --zero "$zero" --precision "$precision" --deterministic --batch 130
    done
  done
fi
