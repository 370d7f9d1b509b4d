#!/usr/bin/env bash
# Expert-load reports (--log_experts_every) of a run on two CPU ranks at ep 2: every report's
# counts sum to tokens × selections a token × uses for each physical layer and kind; its dead
# experts, usage perplexity and busiest-over-mean agree with the counts; the ranks' FFN
# selections add up to the counts; the dispatch bytes are not zero; launch/moeut-plot draws the
# expert panels.
# Usage: cli_expert_load.sh BIN_DIR MPIEXEC WORK_DIR
set -euo pipefail
bin=$1 mpiexec=$2 work=$3
root=$(cd "$(dirname "$0")/.." && pwd)
. "$(dirname "$0")/cli_common.sh"
fresh_corpus "$bin" "$work"
"$mpiexec" -np 2 --oversubscribe --bind-to none "$bin/moeut-train" "${small_model[@]}" --steps 6 --batch_size 4 \
  --micro_batch_size 2 --eval_every 0 --threads 1 --ep 2 --device cpu --log_experts_every 3 \
  --train_data "$work/data/train.bin" --val_data "$work/data/val.bin" --metrics "$work/metrics.jsonl" > "$work/train.txt"
[ "$(grep -c "^experts, steps " "$work/train.txt")" = 2 ] || fail "no summary lines: $(cat "$work/train.txt")"
grep -q "^experts, steps 4-6: ffn dead [0-9]*/16, usage perplexity" "$work/train.txt" || fail "summary: $(grep experts "$work/train.txt")"
python3 - "$work/metrics.jsonl" "$root/configs/tiny.cfg" <<'PY'
import json, math, sys
cfg = {k.strip(): v.split("#")[0].strip() for k, v in (l.split("=", 1) for l in open(sys.argv[2]) if "=" in l and not l.startswith("#"))}
# small_model's overrides (tests/cli_common.sh) over configs/tiny.cfg.
heads, ff_k, experts_ffn, context = 2, 2, 8, 32
uses = int(cfg["n_layers"]) // int(cfg["group_size"])
per_token = {"ffn": ff_k, "attention_value": heads * int(cfg["att_k"]), "attention_output": heads * int(cfg["att_k"])}
size = {"ffn": experts_ffn, "attention_value": heads * int(cfg["att_n_experts"]), "attention_output": heads * int(cfg["att_n_experts"])}
rows = [json.loads(l) for l in open(sys.argv[1])]
reports = [r for r in rows if "expert_load" in r]
assert [r["step"] for r in reports] == [3, 6], [r["step"] for r in reports]
assert all(r["dispatch_bytes"] > 0 for r in rows if "loss" in r), "dispatch bytes at ep 2 are zero"
for r in reports:
    load = r["expert_load"]
    steps = r["step"] - load["first_step"] + 1
    tokens = steps * 4 * context
    assert len(load["layers"]) == int(cfg["group_size"]) * 3
    ffn_total = 0
    for s in load["layers"]:
        c = s["counts"]
        assert len(c) == s["experts"] == size[s["kind"]], s["kind"]
        assert sum(c) == s["selections"] == tokens * per_token[s["kind"]] * uses, (s["kind"], sum(c), tokens)
        assert s["dead"] == sum(1 for x in c if x == 0)
        p = [x / sum(c) for x in c if x > 0]
        assert abs(s["usage_perplexity"] - math.exp(-sum(q * math.log(q) for q in p))) < 1e-4 * s["usage_perplexity"]
        assert abs(s["max_over_mean"] - max(c) / (sum(c) / len(c))) < 1e-4 * s["max_over_mean"]
        assert 0 < s["mean_weight"] < 1
        if s["kind"] == "ffn":
            ffn_total += sum(c)
    assert abs(load["rank_ffn_selections"]["mean"] * 2 - ffn_total) < 1e-6 * ffn_total, (load["rank_ffn_selections"], ffn_total)
    received = load["rank_rows_received"]
    assert received["max"] >= received["mean"] > 0, received
print(f"expert load: {len(reports)} reports consistent with their counts")
PY
if "$python" -c "import matplotlib" 2> /dev/null; then
  "$python" "$root/launch/moeut-plot" "$work/metrics.jsonl" --out "$work/plots" > /dev/null || fail "moeut-plot"
  is_png "$work/plots/experts.png" || fail "experts.png is not a PNG"
else
  echo "skipped: the plots (no matplotlib for $python)"
fi
echo "expert load: ok"
