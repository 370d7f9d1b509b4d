#!/usr/bin/env bash
# On a host with two GPUs: a 1B (or given) checkpoint saved by GPU ranks (np 2, ep 2), then
# resumed by them; the save and load lines (bytes, seconds, GB/s) land in $OUT/*.log.
#   launch/dev/gpu-checkpoint-check.sh [config] [checkpoint dir]
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build-gpu/launch
out=${OUT:-/tmp/moeut-gpu-checkpoint}
config=${1:-$root/configs/1B.cfg}
dir=${2:-/tmp/moeut-checkpoints}
mkdir -p "$out"
. "$root/launch/dev/gpu-step.sh"
show_source "$root/build-gpu"
rm -rf "$dir"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
common=(--config "$config" --train_data "$root/data/brown/train.bin" --val_data "$root/data/brown/val.bin"
        --batch_size 16 --micro_batch_size 8 --warmup_steps 100 --eval_every 0 --device cuda --ep 2
        --checkpoint_dir "$dir" --metrics "$out/checkpoint.jsonl" --out_weights "$out/weights.h5")
for phase in "save --steps 2" "resume --steps 4 --resume latest"; do
  read -r name args <<< "$phase"
  echo "== $name: $args"
  # shellcheck disable=SC2086
  if mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE "$bin/moeut-train" "${common[@]}" $args > "$out/$name.log" 2>&1; then
    echo "   ok"
  else
    echo "   FAILED"; failed=$((failed + 1))
  fi
  grep -E "checkpoint step|resumed from|step +[0-9]+/|error" "$out/$name.log"
done
du -sh "$dir"/step_* 2>/dev/null
exit $failed
