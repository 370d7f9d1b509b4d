#!/usr/bin/env bash
# On a GPU host: the training checks of the CUDA path, from binaries built by launch/build-gpu.sh
# and the Brown token files (data/brown, carried to the host):
#  - tiny trained on the GPU (its final validation perplexity against the CPU run's, 226.77 in
#    docs/RESULTS.md), its export evaluated by the CPU moeut-eval;
#  - 1B trained 200 steps at batch 16 x 1024 (loss must fall, no NaN), its export evaluated by
#    the CPU moeut-eval over val2.bin, the same windows as the run's final validation.
# Logs and metrics go under $OUT; the weights (4 GB at 1B) under a scratch folder.
# Exit status: failed steps.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/build-gpu/launch
data=$root/data/brown
out=${OUT:-/tmp/moeut-gpu-acceptance}
scratch=${TMPDIR:-/tmp}/moeut-gpu-acceptance
mkdir -p "$out" "$scratch"
. "$root/launch/gpu-step.sh"
show_source "$root/build-gpu" | tee "$out/source.txt"
step_tail=4
step tiny_train "$bin/moeut-train" --config "$root/configs/tiny.cfg" --train_data "$data/train.bin" \
  --val_data "$data/val.bin" --device cuda --out_weights "$scratch/tiny.h5" --metrics "$out/tiny.jsonl"
step tiny_cpu_eval "$bin/moeut-eval" --weights "$scratch/tiny.h5" --data "$data/val.bin" --context 128
step 1B_train "$bin/moeut-train" --config "$root/configs/1B.cfg" --train_data "$data/train.bin" \
  --val_data "$data/val2.bin" --steps 200 --batch_size 16 --micro_batch_size 16 --warmup_steps 100 --eval_every 0 \
  --device cuda --out_weights "$scratch/1B.h5" --metrics "$out/1B.jsonl"
step 1B_cpu_eval "$bin/moeut-eval" --weights "$scratch/1B.h5" --data "$data/val2.bin" --context 1024
exit $failed
