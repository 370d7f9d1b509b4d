#!/usr/bin/env bash
# On a GPU host: trains one short recipe over several seeds, as many runs at a time as there are
# GPUs times RUNS_PER_GPU, and gives each seed a verdict (trained / diverged) from its metrics.
# The recipe is the one the official implementation was compared on (docs/RESULTS.md, "Seed
# sweep"): 126M, 500 steps of 16 sequences of 1024, lr 1e-3, warm-up 50, cosine to 0.1, AdamW
# (0.9, 0.999, 1e-8, weight decay 0.01), clip 0.25, on data/brown.
#   launch/gpu-seed-sweep.sh [NAME [moeut-train options that override the recipe's ...]]
# Environment: SEEDS (default "1 2 3 4 5 6 7 8"), PROFILE (126M), STEPS (500), LR (1e-3),
# WARMUP (50), RUNS_PER_GPU (2), GPUS (the GPUs' indices to use, default all), RUN_TIMEOUT
# (seconds a run may take, 3600), BIN (build-gpu),
# DATA (the token files' folder, data/brown), MAX_VAL (4.70: a final validation loss above it
# fails the sweep), RUN_ENV (variables set for every run, e.g. "MOEUT_NO_GRAPHS=1"), OFFICIAL (a
# folder holding the official implementation's `moeut` package: train it instead, through
# launch/official_train.py, with the same recipe; the extra options are then its own, e.g.
# "--start project" to leave from moeut-train's initial weights and batches for each seed).
# Steps whose gradient norm jumps 5x above the recent median are logged with each tensor's norm.
# Each run's log and metrics go under $OUT/NAME/ (packed into $OUT/NAME.tgz, as few files come
# back from a device call), the verdicts to $OUT/NAME.txt and stdout. Exit status: 1 when a seed
# diverged or ended above MAX_VAL.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
name=${1:-sweep}
[ $# -gt 0 ] && shift
bin=${BIN:-$root/build-gpu}/launch
out=${OUT:-/tmp/moeut-seed-sweep}
data=${DATA:-$root/data/brown}
dir=$out/$name
mkdir -p "$dir"
[ -f "$data/train.bin" ] || { echo "gpu-seed-sweep: no $data/train.bin (launch/main-job.sh prepares it)" >&2; exit 2; }
read -r -a gpu_ids <<< "${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader | tr '\n' ' ')}"
gpus=${#gpu_ids[@]}
[ "$gpus" -ge 1 ] || { echo "gpu-seed-sweep: no GPU" >&2; exit 2; }
slots=$((gpus * ${RUNS_PER_GPU:-2}))
recipe=(--config "$root/configs/${PROFILE:-126M}.cfg" --train_data "$data/train.bin" --val_data "$data/val.bin"
        --steps "${STEPS:-500}" --batch_size 16 --micro_batch_size 16 --lr "${LR:-1e-3}"
        --warmup_steps "${WARMUP:-50}" --min_lr_ratio 0.1 --adam_beta1 0.9 --adam_beta2 0.999 --adam_eps 1e-8
        --weight_decay 0.01 --grad_clip 0.25 --eval_every 0 --device cuda --grad_jump_factor 5)
official=(--config "$root/configs/${PROFILE:-126M}.cfg" --train_data "$data/train.bin" --val_data "$data/val.bin"
          --steps "${STEPS:-500}" --batch_size 16 --lr "${LR:-1e-3}" --warmup_steps "${WARMUP:-50}" --min_lr_ratio 0.1
          --weight_decay 0.01 --grad_clip 0.25)
if [ -n "${OFFICIAL:-}" ]; then
  recipe=(python3 "$root/launch/official_train.py" --package "$OFFICIAL" "${official[@]}")
else
  recipe=("$bin/moeut-train" "${recipe[@]}")
fi
echo "sweep $name: $(cat "${BIN:-$root/build-gpu}/source.txt" 2>/dev/null || echo "unknown build") | ${RUN_ENV:-} | ${recipe[*]} $*" \
  | tee "$dir/recipe.txt"
i=0
for seed in ${SEEDS:-1 2 3 4 5 6 7 8}; do
  gpu=${gpu_ids[$((i % gpus))]}
  # shellcheck disable=SC2086  # RUN_ENV is a list of assignments
  env CUDA_VISIBLE_DEVICES=$gpu ${RUN_ENV:-} timeout "${RUN_TIMEOUT:-3600}" "${recipe[@]}" --seed "$seed" \
    --metrics "$dir/seed$seed.jsonl" "$@" > "$dir/seed$seed.log" 2>&1 &
  i=$((i + 1))
  [ $((i % slots)) -eq 0 ] && wait
done
wait
python3 "$root/launch/seed_verdicts.py" --max_val "${MAX_VAL:-4.70}" "$dir" | tee "$out/$name.txt"
status=${PIPESTATUS[0]}
tar -czf "$out/$name.tgz" -C "$out" "$name" && rm -rf "$dir"
exit "$status"
