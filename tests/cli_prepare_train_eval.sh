#!/usr/bin/env bash
# The executables as a user chains them: prepare data from text, train, evaluate the exported
# weights; the evaluation must print the training's final validation loss again; plot the
# metrics. Also checks that bad data input is refused with a message naming the file.
# Usage: cli_prepare_train_eval.sh BIN_DIR WORK_DIR
set -euo pipefail
bin=$1 work=$2
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$work" && mkdir -p "$work"

. "$(dirname "$0")/cli_common.sh"
tiny_text "$work/text.txt"

if "$bin/moeut-prepare-data" --input "$work/missing.txt" --out_dir "$work/data" 2> "$work/err.txt"; then
  echo "FAIL: a missing input file was accepted"; exit 1
fi
grep -q "missing.txt" "$work/err.txt" || { echo "FAIL: error does not name the file:"; cat "$work/err.txt"; exit 1; }

"$bin/moeut-prepare-data" --input "$work/text.txt" --out_dir "$work/data" --vocab_size 48 --threads 1 | tee "$work/prep.txt"
grep -q "unigram perplexity (validation):" "$work/prep.txt"

"$bin/moeut-train" "${small_model[@]}" --steps 4 --batch_size 4 \
  --micro_batch_size 2 --eval_every 2 --eval_batches 1 --threads 1 \
  --train_data "$work/data/train.bin" --val_data "$work/data/val.bin" \
  --out_weights "$work/weights.h5" --metrics "$work/metrics.jsonl" | tee "$work/train.txt"
[ "$(grep -c '"step"' "$work/metrics.jsonl")" -eq 6 ] || { echo "FAIL: metrics file lines"; exit 1; }

trained=$(sed -n 's/^final validation .*val_loss \([0-9.]*\).*/\1/p' "$work/train.txt")
"$bin/moeut-eval" --weights "$work/weights.h5" --data "$work/data/val.bin" --context 32 --threads 1 | tee "$work/eval.txt"
evaluated=$(sed -n 's/^eval .*| loss \([0-9.]*\) .*/\1/p' "$work/eval.txt")
[ -n "$trained" ] && [ "$trained" = "$evaluated" ] || { echo "FAIL: training said '$trained', eval said '$evaluated'"; exit 1; }

if "$bin/moeut-eval" --weights "$work/weights.h5" --data "$work/text.txt" --context 32 2> "$work/err.txt"; then
  echo "FAIL: a text file was accepted as token data"; exit 1
fi
grep -q "text.txt: bad magic" "$work/err.txt" || { echo "FAIL: unclear error:"; cat "$work/err.txt"; exit 1; }
# --grad_jump_factor: the steps it reports are exactly those whose norm exceeds the factor times the
# median of the (up to 20) steps before, once 10 are there, each with every tensor's norm, which
# together make the step's norm.
"$bin/moeut-train" "${small_model[@]}" --steps 24 --batch_size 4 \
  --micro_batch_size 2 --eval_every 0 --threads 1 --grad_jump_factor 1.5 --lr 1e-1 \
  --train_data "$work/data/train.bin" --val_data "$work/data/val.bin" \
  --out_weights "$work/jumps.h5" --metrics "$work/jumps.jsonl" > "$work/jumps.txt"
python3 - "$work/jumps.jsonl" "$work/jumps.txt" <<'PY'
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
norms = {r["step"]: r["grad_norm"] for r in rows if "loss" in r}
reported = {r["step"]: r for r in rows if "grad_norm_jump" in r}
steps = sorted(norms)
def median(values):  # the upper one of an even count, as the trainer takes it
    return sorted(values)[len(values) // 2]
expected = {s for i, s in enumerate(steps) if i >= 10 and norms[s] > 1.5 * median([norms[t] for t in steps[max(0, i - 20):i]])}
assert set(reported) == expected and expected, f"reported {sorted(reported)}, rule gives {sorted(expected)}"
for s, r in reported.items():
    total = math.sqrt(sum(v * v for v in r["tensor_grad_norms"].values()))
    assert abs(total - norms[s]) <= 1e-5 * norms[s], f"step {s}: tensors {total}, step {norms[s]}"
# Each step's parts (forwards, backwards, update) are measured and fit inside the step.
for r in rows:
    if "loss" in r:
        parts = r["forward_s"] + r["backward_s"] + r["update_s"]
        assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["update_s"] > 0, r
        assert parts <= r["step_s"] * 1.0001, f"step {r['step']}: parts {parts} s, step {r['step_s']} s"
printed = sum(line.startswith("gradient norm jump at step") for line in open(sys.argv[2]))
assert printed == len(expected), f"{printed} lines printed for {len(expected)} jumps"
print(f"gradient jumps reported at steps {sorted(reported)}")
PY
# launch/moeut-plot draws both runs' metrics; a missing file is refused, named.
if "$python" -c "import matplotlib" 2> /dev/null; then
  "$python" "$root/launch/moeut-plot" "$work/metrics.jsonl" "$work/jumps.jsonl" --labels short jumps \
    --out "$work/plots" > "$work/plot.txt" || { echo "FAIL: moeut-plot"; cat "$work/plot.txt"; exit 1; }
  for png in loss optimizer throughput step_time residual; do
    is_png "$work/plots/$png.png" || { echo "FAIL: $png.png is not a PNG"; exit 1; }
  done
else
  echo "skipped: the plots (no matplotlib for $python)"
fi
if "$python" "$root/launch/moeut-plot" "$work/none.jsonl" --out "$work/plots" 2> "$work/err.txt"; then
  echo "FAIL: moeut-plot accepted a missing metrics file"; exit 1
fi
grep -q "none.jsonl: no such file" "$work/err.txt" || { echo "FAIL: unclear error:"; cat "$work/err.txt"; exit 1; }
echo "PASS: validation loss $trained reproduced by moeut-eval"
