#!/usr/bin/env bash
# On a host with two GPUs: trains a profile on one GPU and on two GPU ranks (np 2 for each ep
# given), with the same seed and global batch, and compares the losses step by step. Binaries
# from launch/dev/build-gpu.sh, data from launch/fetch-brown.sh (data/brown). Logs under $OUT;
# DISPATCHER=all_gather exchanges tokens through the all-gather dispatcher (default all_to_all).
#   launch/dev/gpu-distributed-check.sh [config] [steps] [global batch] [ep...]
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build-gpu/launch
out=${OUT:-/tmp/moeut-gpu-distributed}
config=${1:-$root/configs/1B.cfg}
steps=${2:-50}
batch=${3:-16}
shift $(( $# < 3 ? $# : 3 ))
eps=("${@:-1 2}")
read -r -a eps <<< "${eps[*]}"
mkdir -p "$out"
. "$root/launch/dev/gpu-step.sh"
show_source "$root/build-gpu"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
common=(--config "$config" --train_data "$root/data/brown/train.bin" --val_data "$root/data/brown/val.bin"
        --steps "$steps" --batch_size "$batch" --warmup_steps 100 --eval_every 0 --device cuda
        --dispatcher "${DISPATCHER:-all_to_all}")
run() {  # run NAME NP EP MICRO
  local name=$1 np=$2 ep=$3 micro=$4
  echo "== $name: np $np, ep $ep, micro-batch $micro"
  if mpirun -np "$np" --bind-to none -x NCCL_NVLS_ENABLE "$bin/moeut-train" "${common[@]}" --ep "$ep" \
       --micro_batch_size "$micro" --metrics "$out/$name.jsonl" --out_weights "$out/$name.h5" > "$out/$name.log" 2>&1; then
    echo "   ok"
  else
    echo "   FAILED"; failed=$((failed + 1))
  fi
  grep -E "topology|model:|step +($steps|1|10)/|final|comm" "$out/$name.log" | head -12
}
# More ranks than the host has GPUs: refused before any work, with exit status 2.
gpus=$(nvidia-smi -L | wc -l)
echo "== $((gpus + 1)) ranks on $gpus GPUs must be refused"
# (A batch that splits over that many ranks, so the configuration check passes first.)
mpirun -np $((gpus + 1)) --oversubscribe "$bin/moeut-train" --config "$config" --train_data "$root/data/brown/train.bin" \
  --val_data "$root/data/brown/val.bin" --steps 1 --batch_size $((gpus + 1)) --micro_batch_size 1 --device cuda \
  > "$out/too_many_ranks.log" 2>&1
status=$?
if [ "$status" -eq 2 ] && grep -q "GPU ranks need one GPU each" "$out/too_many_ranks.log"; then echo "   ok (refused)"
else echo "   FAILED (status $status)"; failed=$((failed + 1)); fi
grep -m1 "moeut-train" "$out/too_many_ranks.log"
run np1 1 1 "$batch"
for ep in "${eps[@]}"; do run "np2_ep$ep" 2 "$ep" $((batch / 2)); done
python3 - "$out" "${eps[@]}" <<'PY'
import json, sys, statistics
out, eps = sys.argv[1], sys.argv[2:]
def load(name):
    rows = [json.loads(l) for l in open(f"{out}/{name}.jsonl")]
    return [r for r in rows if "loss" in r], [r for r in rows if r.get("final")]
ref, ref_val = load("np1")
for ep in eps:
    rows, val = load(f"np2_ep{ep}")
    diffs = [abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(ref, rows)]
    tok = lambda rs: statistics.median(r["tokens_per_s"] for r in rs[len(rs) // 5:])
    print(f"np2 ep{ep}: {len(rows)} steps | loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} "
          f"(one GPU {ref[0]['loss']:.4f} -> {ref[-1]['loss']:.4f}) | max rel diff {max(diffs):.2e} "
          f"(step {diffs.index(max(diffs)) + 1}), last {diffs[-1]:.2e} | val {val[0]['val_loss']:.4f} vs {ref_val[0]['val_loss']:.4f} | "
          f"{tok(rows):.0f} tok/s ({tok(rows) / 2:.0f} per GPU) vs one GPU {tok(ref):.0f}")
PY
exit $failed
