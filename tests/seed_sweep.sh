#!/usr/bin/env bash
# The seed-sweep script (launch/gpu-seed-sweep.sh) and its verdicts (launch/seed_verdicts.py)
# with a stand-in moeut-train and nvidia-smi, so that a broken sweep is found where CI runs, not
# in a device call. Checks: the recipe and extra options reach every run; runs spread over the
# GPUs; a trained, a collapsed, a stopped and a trained-but-high seed each get their verdict and
# the sweep fails; a sweep of trained seeds passes; the runs' files come back packed.
# gpu-check.sh PARTS=seeds runs it and fails with it.
# Usage: seed_sweep.sh WORK_DIR
set -euo pipefail
work=$1
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$work" && mkdir -p "$work/bin/launch" "$work/path" "$work/data"
fail() { echo "FAIL: $*"; exit 1; }
touch "$work/data/train.bin" "$work/data/val.bin"
printf '#!/bin/sh\ncase "$*" in *--query-gpu=index*) printf "0\\n1\\n" ;; *) echo "GPU 0: stand-in"; echo "GPU 1: stand-in" ;; esac\n' > "$work/path/nvidia-smi"
# The stand-in trainer: seed 1 trains, 2 collapses after step 20 as its residual spreads (until
# it overflows: null), 3 stops at step 30 without a final validation, 4 trains but ends above the
# bound, 6 collapses early: its loss stays flat while its residual grows ten times a step. It
# records its GPU and arguments.
cat > "$work/bin/launch/moeut-train" <<'SH'
#!/bin/sh
seed=0 metrics= all="$*"
while [ $# -gt 0 ]; do
  case $1 in --seed) seed=$2 ;; --metrics) metrics=$2 ;; esac
  shift
done
echo "gpu $CUDA_VISIBLE_DEVICES args $all" >> "$(dirname "$metrics")/../../calls.txt"
: > "$metrics"
for s in $(seq 1 60); do
  loss=$(awk -v s="$s" -v seed="$seed" 'BEGIN { l = 9 - s / 10; if (seed == 2 && s > 20) l = 7 + (s - 20) / 20;
    if (seed == 6 && s > 20) l = 7; printf "%.3f", l }')
  std=$(awk -v s="$s" -v seed="$seed" 'BEGIN { x = 1; if (seed == 2 && s > 20) x = s; if (seed == 6) x = 10 ^ (s / 5); printf "%g", x }')
  [ "$seed" = 2 ] && [ "$s" = 59 ] && std=null
  echo "{\"step\": $s, \"loss\": $loss, \"grad_norm\": 1.5, \"residual_std\": $std}" >> "$metrics"
  [ "$seed" = 3 ] && [ "$s" = 30 ] && { echo "step 30: loss is not finite"; exit 1; }
done
val=4.6; [ "$seed" = 2 ] || [ "$seed" = 6 ] && val=6.7; [ "$seed" = 4 ] && val=4.8
echo "{\"step\": 60, \"val_loss\": $val, \"val_ppl\": 100, \"final\": true}" >> "$metrics"
SH
chmod +x "$work/bin/launch/moeut-train" "$work/path/nvidia-smi"
export PATH="$work/path:$PATH" BIN="$work/bin" DATA="$work/data"

status=0
out=$(OUT="$work/out" SEEDS="1 2 3 4" "$root/launch/gpu-seed-sweep.sh" mixed --lr_extra_check 7 2>&1) || status=$?
[ "$status" = 1 ] || fail "a sweep with diverged seeds exits $status, not 1 ($out)"
# verdict SEED: the verdict column (after seed, steps, final val, last loss, max grad norm @step,
# max residual std @step); column SEED N: the row's Nth field.
verdict() { grep -E "^ +$1 " "$work/out/mixed.txt" | awk '{ for (i = 1; i <= 8; ++i) $i = ""; sub(/^ +/, ""); print }'; }
column() { grep -E "^ +$1 " "$work/out/mixed.txt" | awk -v n="$2" '{ print $n }'; }
[ "$(verdict 1)" = "trained" ] || fail "seed 1: $(verdict 1)"
verdict 2 | grep -q "^diverged (loss rose" || fail "seed 2: $(verdict 2)"
[ "$(verdict 3)" = "diverged (stopped)" ] || fail "seed 3: $(verdict 3)"
[ "$(verdict 4)" = "trained, above 4.7" ] || fail "seed 4: $(verdict 4)"
[ "$(column 2 7) $(column 2 8)" = "inf @59" ] && [ "$(column 1 7)" = 1 ] ||
  fail "largest residual std: seed 2 $(column 2 7) $(column 2 8), seed 1 $(column 1 7)"
grep -q "^1 of 4 trained" "$work/out/mixed.txt" || fail "summary line ($(tail -1 "$work/out/mixed.txt"))"
[ "$(grep -c -- "--lr 1e-3 --warmup_steps 50 .*--grad_clip 0.25 .*--lr_extra_check 7" "$work/calls.txt")" = 4 ] ||
  fail "the recipe or the extra options missed a run ($(cat "$work/calls.txt"))"
[ "$(grep -c "^gpu 0 " "$work/calls.txt")" = 2 ] && [ "$(grep -c "^gpu 1 " "$work/calls.txt")" = 2 ] ||
  fail "runs not spread over the two GPUs"
tar -tzf "$work/out/mixed.tgz" > "$work/packed.txt"
grep -q "mixed/seed3.log" "$work/packed.txt" || fail "logs not packed"
[ ! -d "$work/out/mixed" ] || fail "the packed folder was left"

# An early collapse is told by the residual's growth; GPUS picks the GPUs.
OUT="$work/out" SEEDS="6" GPUS="1" "$root/launch/gpu-seed-sweep.sh" early > /dev/null 2>&1 && fail "an early collapse passed"
grep -qE "^ +6 .*collapsed \(residual_std grew 6.3e\+11 times by step 60\)" "$work/out/early.txt" ||
  fail "early collapse: $(cat "$work/out/early.txt")"
[ "$(tail -1 "$work/calls.txt" | cut -d' ' -f2)" = 1 ] || fail "GPUS=1 ran on GPU $(tail -1 "$work/calls.txt" | cut -d' ' -f2)"
OUT="$work/out" SEEDS="1 5" LR=2e-3 "$root/launch/gpu-seed-sweep.sh" good > /dev/null 2>&1 || fail "a sweep of trained seeds failed"
grep -q -- "--lr 2e-3" "$work/calls.txt" || fail "LR did not reach the runs"
grep -q "^2 of 2 trained; final validation median 4.6000" "$work/out/good.txt" || fail "good sweep: $(cat "$work/out/good.txt")"
# gpu-check.sh's "seeds" part runs the sweep from its BIN and fails with it.
status=0
out=$(OUT="$work/check" SEEDS="1 2" PARTS=seeds "$root/launch/dev/gpu-check.sh" 2>&1) || status=$?
[ "$status" = 1 ] || fail "gpu-check seeds: exit status $status with a diverged seed ($out)"
grep -q "^1 of 2 trained" "$work/check/seeds.txt" || fail "gpu-check seeds: no verdicts ($out)"
[ "$(tail -2 "$work/calls.txt" | grep -c -- "--warmup_steps 200 ")" = 2 ] || fail "gpu-check seeds: not warm-up 200"
echo "seed sweep script: ok"
