#!/usr/bin/env bash
# On a GPU host with torch and a local copy of the official `moeut` package (never part of this
# repository): the weights go both ways between this project and the official MoEUTLM.
#  (a) train PROFILE (default configs/44M.cfg) for STEPS (200) steps on the GPU on data/brown,
#      convert the weights with `moeut-torch to-torch`, load them into the official MoEUTLM
#      (strict), and compare the mean cross-entropy over 8 validation windows of 1024 with
#      moeut-eval's (1e-4 relative) and the first window's logits with moeut-eval's
#      --dump_logits (bf16 tolerance: 1/128 of the logits' spread);
#  (b) an official MoEUTLM of the same arguments (random init, seed 1) saved with torch.save,
#      converted with `moeut-torch to-h5` and evaluated by moeut-eval against the official
#      model's own loss on the same windows;
#  and launch/moeut-torch's own torch.save reader and writer against torch.load/torch.save.
# Usage: OFFICIAL=DIR [BIN=build] [PROFILE=configs/44M.cfg] [STEPS=200] [OUT=dir]
#        bash launch/dev/torch-check.sh
# DIR holds the official package (DIR/moeut/moeut.py). Prints one PASS or FAIL line per check;
# exit status: the failed checks.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${BIN:-$root/build}/launch
[ -x "$bin/moeut-train" ] || bin=${BIN:-$root/build}
official=${OFFICIAL:?OFFICIAL=DIR: the folder holding the official moeut package}
profile=${PROFILE:-$root/configs/44M.cfg}
steps=${STEPS:-200}
out=${OUT:-/tmp/moeut-torch-check}
data=$root/data/brown
mkdir -p "$out"
[ -f "$official/moeut/moeut.py" ] || { echo "FAIL: no moeut/moeut.py under OFFICIAL=$official"; exit 1; }
[ -f "$data/val.bin" ] || "$root/launch/fetch-brown.sh" || { echo "FAIL: no $data (launch/fetch-brown.sh)"; exit 1; }
failed=0
check() {  # NAME COMMAND...: runs it, a FAIL line when it fails
  "${@:2}" || { echo "FAIL: $1"; failed=$((failed + 1)); }
}
windows=(--context 1024 --max_windows 8 --micro_batch_size 8)

# (a) this project -> official.
"$bin/moeut-train" --config "$profile" --device cuda --steps "$steps" --warmup_steps 50 --lr 1e-3 --eval_every 0 \
  --train_data "$data/train.bin" --val_data "$data/val.bin" --out_weights "$out/trained.h5" \
  --metrics "$out/trained.jsonl" > "$out/train.txt" || { echo "FAIL: moeut-train (see $out/train.txt)"; exit 1; }
"$bin/moeut-eval" --weights "$out/trained.h5" --data "$data/val.bin" "${windows[@]}" \
  --dump_logits "$out/logits.npy" > "$out/eval_trained.txt"
check "to-torch" python3 "$root/launch/moeut-torch" to-torch "$out/trained.h5" --out "$out/trained.pt" \
  --config_out "$out/args.json"
# (b)'s state dict, made by the official constructor.
check "official state dict" python3 "$root/launch/dev/torch_check.py" make --official "$official" \
  --args "$out/args.json" --out "$out/official.pt"
check "to-h5" python3 "$root/launch/moeut-torch" to-h5 "$out/official.pt" --config "$out/args.json" \
  --out "$out/official.h5"
"$bin/moeut-eval" --weights "$out/official.h5" --data "$data/val.bin" "${windows[@]}" > "$out/eval_official.txt"
loss() { sed -n 's/^eval .*| loss \([0-9.]*\) .*/\1/p' "$1"; }
check "compare" python3 "$root/launch/dev/torch_check.py" compare --official "$official" --args "$out/args.json" \
  --data "$data/val.bin" --trained "$out/trained.pt" --trained_loss "$(loss "$out/eval_trained.txt")" \
  --logits "$out/logits.npy" --initial "$out/official.pt" --initial_loss "$(loss "$out/eval_official.txt")"
check "moeut-torch's own torch.save format" python3 "$root/launch/dev/torch_check.py" formats \
  --state_dict "$out/official.pt" --work "$out"
echo "torch-check: $failed failed"
exit "$failed"
