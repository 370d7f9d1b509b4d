#!/usr/bin/env bash
# The main job on the embedded default: install, build, fetch and prepare the Brown corpus,
# train the tiny profile on the CPU, evaluate the exported weights, draw the run's plots, and
# print the validation perplexity beside the unigram baseline. Extra arguments go to moeut-train (e.g. --steps 50).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
start=$(date +%s)

launch/build.sh moeut-prepare-data moeut-train moeut-eval
bin=build/launch

if [ ! -f data/brown/val.bin ]; then
  launch/fetch-brown.sh data/brown.txt
  "$bin/moeut-prepare-data" --input data/brown.txt --out_dir data/brown
fi
unigram=$(cat data/brown/unigram_ppl.txt)

"$bin/moeut-train" --config configs/tiny.cfg --train_data data/brown/train.bin \
  --val_data data/brown/val.bin --out_weights runs/tiny/weights.h5 \
  --metrics runs/tiny/metrics.jsonl "$@"
context=$(sed -n 's/^context *= *//p' configs/tiny.cfg)
for a in "$@"; do [ "${prev:-}" = "--context" ] && context=$a; prev=$a; done
result=$("$bin/moeut-eval" --weights runs/tiny/weights.h5 --data data/brown/val.bin --context "$context")
echo "$result"
ppl=$(echo "$result" | sed -n 's/.*| ppl \([0-9.]*\).*/\1/p')
# Debian's python3 has matplotlib (launch/install-deps.sh); another python3 first on PATH may not.
python=python3
/usr/bin/python3 -c "import matplotlib" 2> /dev/null && python=/usr/bin/python3
"$python" launch/moeut-plot runs/tiny/metrics.jsonl --labels tiny --out runs/tiny/plots ||
  echo "plots left out (launch/moeut-plot needs matplotlib: python3-matplotlib)"

echo
echo "validation perplexity: tiny MoEUT $ppl | unigram baseline $unigram | ratio $(awk -v a="$ppl" -v b="$unigram" 'BEGIN { printf "%.3f", a / b }')"
echo "wall time: $(( $(date +%s) - start )) s"
