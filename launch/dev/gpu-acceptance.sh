#!/usr/bin/env bash
# On a GPU host: the training checks of the CUDA path, from binaries built by launch/dev/build-gpu.sh
# and the Brown token files (data/brown, carried to the host):
#  - tiny trained on the GPU (its final validation perplexity against the CPU run's, 226.77 in
#    docs/RESULTS.md), its export evaluated by the CPU moeut-eval;
#  - 1B trained 200 steps at batch 16 x 1024 (loss must fall, no NaN), its export evaluated by
#    the CPU moeut-eval over val2.bin, the same windows as the run's final validation;
#  - a summary of those figures, checked against their bounds (RESULTS.md).
# Logs and metrics go under $OUT; the weights (4 GB at 1B) under a scratch folder.
# Exit status: failed steps.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build-gpu/launch
data=$root/data/brown
out=${OUT:-/tmp/moeut-gpu-acceptance}
scratch=${TMPDIR:-/tmp}/moeut-gpu-acceptance
mkdir -p "$out" "$scratch"
. "$root/launch/dev/gpu-step.sh"
show_source "$root/build-gpu" | tee "$out/source.txt"
step_tail=4
step tiny_train "$bin/moeut-train" --config "$root/configs/tiny.cfg" --train_data "$data/train.bin" \
  --val_data "$data/val.bin" --device cuda --out_weights "$scratch/tiny.h5" --metrics "$out/tiny.jsonl"
step tiny_cpu_eval "$bin/moeut-eval" --weights "$scratch/tiny.h5" --data "$data/val.bin" --context 128
step 1B_train "$bin/moeut-train" --config "$root/configs/1B.cfg" --train_data "$data/train.bin" \
  --val_data "$data/val2.bin" --steps 200 --batch_size 16 --micro_batch_size 16 --warmup_steps 100 --eval_every 0 \
  --device cuda --out_weights "$scratch/1B.h5" --metrics "$out/1B.jsonl"
step 1B_cpu_eval "$bin/moeut-eval" --weights "$scratch/1B.h5" --data "$data/val2.bin" --context 1024
# The figures RESULTS.md reports, checked against their bounds (printed, so that they come back
# with the call's output even when its files do not).
python3 - "$out" <<'PY' || failed=$((failed + 1))
import json, math, re, statistics, sys
out, problems = sys.argv[1], []
def metrics(name):
    rows = [json.loads(line) for line in open(f"{out}/{name}.jsonl")]
    return [r for r in rows if "loss" in r], [r for r in rows if r.get("final")][-1]
def cpu_eval(name):
    return float(re.search(r"\| loss ([0-9.]+)", open(f"{out}/{name}_cpu_eval.log").read()).group(1))
def check(ok, what):
    if not ok: problems.append(what)
try:
    cpu_tiny_ppl = 226.77  # RESULTS.md: configs/tiny.cfg trained on the CPU
    tiny, tiny_val = metrics("tiny")
    off = tiny_val["val_ppl"] / cpu_tiny_ppl - 1
    print(f"tiny: validation ppl {tiny_val['val_ppl']:.2f} (loss {tiny_val['val_loss']:.6f}), CPU run {cpu_tiny_ppl}: {100 * off:+.2f}% (bound 2%)")
    check(abs(off) <= 0.02, "tiny perplexity off the CPU run's by more than 2%")
    tiny_eval = cpu_eval("tiny")
    rel = abs(tiny_eval - tiny_val["val_loss"]) / tiny_val["val_loss"]
    print(f"tiny export, CPU eval: loss {tiny_eval:.6f}, {rel:.1e} from the GPU's (bound 1%)")
    check(rel <= 0.01, "tiny export's CPU evaluation off by more than 1%")
    big, big_val = metrics("1B")
    losses = [r["loss"] for r in big]
    medians = [statistics.median(losses[i:i + 40]) for i in range(0, len(losses), 40)]
    norms = [math.inf if r["grad_norm"] is None else r["grad_norm"] for r in big]  # null: overflowed
    finite = all(math.isfinite(r["loss"]) for r in big) and all(math.isfinite(n) for n in norms)
    print(f"1B: {len(big)} steps, finite {finite}, largest gradient norm {max(norms):.2f}, "
          f"median loss per 40 steps {' -> '.join(f'{m:.2f}' for m in medians)}, "
          f"median {statistics.median(r['tokens_per_s'] for r in big[len(big) // 5:]):.0f} tokens/s")
    check(finite, "1B: a loss or gradient norm is not finite")
    check(medians[-1] < medians[0], "1B: the loss did not fall")
    big_eval = cpu_eval("1B")
    rel = abs(big_eval - big_val["val_loss"]) / big_val["val_loss"]
    print(f"1B validation {big_val['val_loss']:.6f} (ppl {big_val['val_ppl']:.2f}); export, CPU eval {big_eval:.6f}: "
          f"{rel:.1e} relative (bound 1%)")
    check(rel <= 0.01, "1B export's CPU evaluation off by more than 1%")
except (OSError, StopIteration, IndexError, AttributeError, ValueError, KeyError) as e:
    problems.append(f"summary: {e!r}")
for p in problems: print("FAILED:", p)
sys.exit(1 if problems else 0)
PY
exit $failed
