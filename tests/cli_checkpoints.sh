#!/usr/bin/env bash
# Sharded checkpoints as users run them, each run a fresh mpirun of two ranks (ep 2):
# - a rank killed by SIGKILL in the middle of a save (the last, and one written beside training)
#   leaves the previous checkpoint complete, and no partial one under a step_<N> name;
# - --resume latest continues from it, and the run ends with exactly the weights of a run that
#   was never interrupted (h5diff: no difference), with the same step losses;
# - moeut-export of a checkpoint equals the weights moeut-train exports at that step, and
#   evaluates to the training's final validation loss;
# - the manifest's virtual datasets read (h5dump) the same values after the directory moved;
# - a missing rank file and --resume latest with no checkpoint are refused, naming the file;
# - a checkpoint_dir that is not one directory for every rank is refused at start-up;
# - metrics on a full disk end the run with status 74; a changed manifest byte is refused.
# Usage: cli_checkpoints.sh BIN_DIR MPIEXEC WORK_DIR
set -euo pipefail
bin=$(cd "$1" && pwd) mpiexec=$2 work=$3
rm -rf "$work" && mkdir -p "$work"

. "$(dirname "$0")/cli_common.sh"
tiny_corpus "$bin" "$work"

train() {
  "$mpiexec" -np 2 --oversubscribe "$bin/moeut-train" "${small_model[@]}" \
    --steps 20 --batch_size 4 --micro_batch_size 2 --eval_every 0 --threads 1 --ep 2 --device cpu \
    --train_data "$work/data/train.bin" --val_data "$work/data/val.bin" "$@"
}

train --out_weights "$work/straight.h5" --metrics "$work/straight.jsonl" > "$work/straight.txt"

# Rank 1 kills itself after writing part of its file for step 20.
if MOEUT_TEST_KILL_DURING_SAVE=1:20 train --checkpoint_dir "$work/ckpt" --checkpoint_every 10 \
     --out_weights "$work/killed.h5" --metrics "$work/killed.jsonl" > "$work/killed.txt" 2>&1; then
  fail "the run with a rank killed during the save succeeded"
fi
[ -f "$work/ckpt/step_00000010/manifest.h5" ] || fail "step 10 lost"
[ -d "$work/ckpt/.step_00000020.tmp" ] || fail "the killed save did not start (hook not reached?)"
[ ! -e "$work/ckpt/step_00000020" ] || fail "a partial step 20 is visible"
"$bin/moeut-export" --checkpoint "$work/ckpt/step_00000010" --out "$work/step10.h5" > /dev/null
# Rank 1 killed while step 15's file is written beside training (saves before the last are):
# step 10, finished when step 15's save began, stays whole; step 15 never appears.
if MOEUT_TEST_KILL_DURING_SAVE=1:15 train --checkpoint_dir "$work/ckpt_bg" --checkpoint_every 5 \
     --out_weights "$work/killed_bg.h5" --metrics "$work/killed_bg.jsonl" > "$work/killed_bg.txt" 2>&1; then
  fail "the run with a rank killed during a background save succeeded"
fi
grep -q "checkpoint step 15: state taken in .* written beside training" "$work/killed_bg.txt" ||
  fail "step 15's save was not written in the background"
[ -f "$work/ckpt_bg/step_00000010/manifest.h5" ] || fail "step 10 lost to a kill during step 15's background save"
[ -d "$work/ckpt_bg/.step_00000015.tmp" ] && [ ! -e "$work/ckpt_bg/step_00000015" ] ||
  fail "step 15: no .tmp left, or a partial step directory is visible"

train --checkpoint_dir "$work/ckpt" --checkpoint_every 10 --resume latest \
  --out_weights "$work/resumed.h5" --metrics "$work/resumed.jsonl" > "$work/resumed.txt"
grep -q "resumed from $work/ckpt/step_00000010: step 10" "$work/resumed.txt" || fail "did not resume from step 10"
grep -q "^checkpoint step 20 -> .* | whole after .* s, training waited .* s" "$work/resumed.txt" || fail "no save report"
[ ! -e "$work/ckpt/.step_00000020.tmp" ] || fail "the killed save's directory is left over"
h5diff "$work/straight.h5" "$work/resumed.h5" || fail "resumed weights differ from the uninterrupted run's"
diff <(losses "$work/straight.jsonl" | tail -n 10) <(losses "$work/resumed.jsonl") || fail "losses of steps 11-20 differ"

"$bin/moeut-export" --checkpoint "$work/ckpt/step_00000020" --out "$work/step20.h5"
h5diff "$work/straight.h5" "$work/step20.h5" || fail "the export of step 20 differs from moeut-train's weights"
trained=$(sed -n 's/^final validation .*val_loss \([0-9.]*\).*/\1/p' "$work/straight.txt")
evaluated=$("$bin/moeut-eval" --weights "$work/step20.h5" --data "$work/data/val.bin" --context 32 --threads 1 |
            sed -n 's/^eval .*| loss \([0-9.]*\) .*/\1/p')
[ -n "$trained" ] && [ "$trained" = "$evaluated" ] || fail "training said '$trained', eval of the export '$evaluated'"

mkdir "$work/moved" && mv "$work/ckpt/step_00000020" "$work/moved/"
for name in lm_head.bias transformer.layers.1.ffn.keys; do
  (cd / && h5dump -y -w 0 -d "/$name" -o "$work/virtual.txt" "$work/moved/step_00000020/manifest.h5" > /dev/null)
  h5dump -y -w 0 -d "/$name" -o "$work/plain.txt" "$work/step20.h5" > /dev/null
  cmp -s "$work/virtual.txt" "$work/plain.txt" || fail "virtual dataset $name reads other values"
done

cp -r "$work/ckpt/step_00000010" "$work/broken" && rm "$work/broken/rank_1.h5"
if train --resume "$work/broken" --out_weights "$work/x.h5" --metrics "$work/x.jsonl" > /dev/null 2> "$work/err.txt"; then
  fail "resumed from a checkpoint with a missing rank file"
fi
grep -q "broken/rank_1.h5: missing" "$work/err.txt" || { cat "$work/err.txt"; fail "unclear refusal"; }
if train --checkpoint_dir "$work/empty" --resume latest --out_weights "$work/x.h5" > /dev/null 2> "$work/err.txt"; then
  fail "--resume latest without a checkpoint started"
fi
grep -q "empty: --resume latest: no complete checkpoint" "$work/err.txt" || { cat "$work/err.txt"; fail "unclear refusal"; }
# A relative checkpoint_dir from two working directories: each rank would write into its own.
mkdir -p "$work/rank0" "$work/rank1"
args=("${small_model[@]}" --steps 4 --batch_size 4 --micro_batch_size 2 --eval_every 0 --threads 1 --ep 2 --device cpu
      --train_data "$work/data/train.bin" --val_data "$work/data/val.bin" --checkpoint_dir ckpt
      --out_weights "$work/x.h5" --metrics "$work/x.jsonl")
if "$mpiexec" --oversubscribe -np 1 --wdir "$work/rank0" "$bin/moeut-train" "${args[@]}" : \
     -np 1 --wdir "$work/rank1" "$bin/moeut-train" "${args[@]}" > /dev/null 2> "$work/err.txt"; then
  fail "a checkpoint_dir that is not one directory for every rank was accepted"
fi
grep -q "ckpt: is not the directory rank 0 sees (rank 1 finds no" "$work/err.txt" || { cat "$work/err.txt"; fail "unclear refusal"; }
[ -z "$(ls -A "$work/rank0/ckpt")" ] || fail "the probe file was left behind"
# A metrics file on a full disk ends the run with status 74 and the system's reason.
short=("${small_model[@]}" --steps 2 --batch_size 4 --micro_batch_size 2 --eval_every 0 --threads 1 --ep 2 --device cpu
       --train_data "$work/data/train.bin" --val_data "$work/data/val.bin" --out_weights "$work/x.h5")
status=0
"$mpiexec" -np 2 --oversubscribe "$bin/moeut-train" "${short[@]}" --metrics /dev/full > /dev/null 2> "$work/err.txt" ||
  status=$?
[ "$status" = 74 ] || { cat "$work/err.txt"; fail "metrics on a full disk: exit status $status, not 74"; }
grep -q "write failed: /dev/full: cannot write the metrics: No space left on device" "$work/err.txt" ||
  { cat "$work/err.txt"; fail "unclear metrics failure"; }
# One byte of a manifest changed, the value of optimizer_steps (10 -> 11): refused by its checksum.
cp -r "$work/ckpt/step_00000010" "$work/flipped"
python3 - "$work/flipped/manifest.h5" <<'PY'
import struct, sys
data = bytearray(open(sys.argv[1], "rb").read())
at = data.index(struct.pack("<q", 10), data.index(b"optimizer_steps"))
data[at] = 11
open(sys.argv[1], "wb").write(data)
PY
status=0
train --resume "$work/flipped" --out_weights "$work/x.h5" --metrics "$work/x.jsonl" > /dev/null 2> "$work/err.txt" ||
  status=$?
[ "$status" = 1 ] || fail "a changed manifest: exit status $status, not 1"
grep -q "flipped/manifest.h5: checksum mismatch" "$work/err.txt" || { cat "$work/err.txt"; fail "unclear refusal"; }
echo "PASS: killed save left step 10; resumed bit-exactly; export = training weights; virtual datasets read back"
