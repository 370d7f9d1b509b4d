#!/usr/bin/env bash
# launch/moeut-torch and moeut-train --init_weights, without torch:
# - a state dict written in torch.save's zip format (tests/torch_state_dicts.py, Python's own
#   pickle) -> to-h5 -> to-torch gives the same bits back, fp32 and bf16 (wrapped under "model");
#   a trained weights file -> to-torch -> to-h5 gives the same datasets and attributes, and
#   moeut-eval accepts the converted files; bad state dicts are refused naming the tensor;
# - --init_weights: a run started from a file at a learning rate that leaves every weight
#   unchanged (1e-300: each update rounds away in fp32) writes the file's weights back and reports
#   moeut-eval's validation loss of the file, on one rank and on two at --ep 2 (each rank its
#   expert shard); --resume auto takes a checkpoint over the file; another model is refused
#   naming the option and the attribute.
# Usage: cli_torch_interop.sh BIN_DIR MPIEXEC WORK_DIR
set -euo pipefail
bin=$1 mpiexec=$2 work=$3
root=$(cd "$(dirname "$0")/.." && pwd)
. "$(dirname "$0")/cli_common.sh"
fresh_corpus "$bin" "$work"
py=
for p in /usr/bin/python3 python3; do "$p" -c "import h5py, numpy" 2> /dev/null && { py=$p; break; }; done
[ -n "$py" ] || fail "no python3 with h5py and numpy (launch/install-deps.sh installs them)"
convert() { "$py" "$root/launch/moeut-torch" "$@"; }
dicts() { "$py" "$(dirname "$0")/torch_state_dicts.py" "$@"; }
data=(--train_data "$work/data/train.bin" --val_data "$work/data/val.bin")
run=("${small_model[@]}" --batch_size 4 --micro_batch_size 2 --eval_every 0 --threads 1 "${data[@]}")
val_loss() { sed -n 's/^final validation .*val_loss \([0-9.]*\).*/\1/p' "$1"; }
eval_loss() { "$bin/moeut-eval" --weights "$1" --data "$work/data/val.bin" --context 32 --threads 1 |
              sed -n 's/^eval .*| loss \([0-9.]*\) .*/\1/p'; }

"$bin/moeut-train" "${run[@]}" --steps 4 --out_weights "$work/trained.h5" --metrics "$work/trained.jsonl" > /dev/null

# Trained weights -> official state dict -> interchange file: the same file content.
convert to-torch "$work/trained.h5" --out "$work/trained.pt" --config_out "$work/args.json"
convert to-h5 "$work/trained.pt" --config "$work/args.json" --out "$work/back.h5"
dicts same_h5 "$work/trained.h5" "$work/back.h5"
[ "$(eval_loss "$work/back.h5")" = "$(eval_loss "$work/trained.h5")" ] || fail "moeut-eval differs on back.h5"

# State dicts from elsewhere -> interchange file -> state dict: the same bits; moeut-eval takes them.
dicts make "$work/trained.h5" "$work/fp32.pt" "$work/fp32.json"
convert to-h5 "$work/fp32.pt" --config "$work/fp32.json" --out "$work/fp32.h5"
convert to-torch "$work/fp32.h5" --out "$work/fp32_back.pt"
dicts same "$work/fp32.pt" "$work/fp32_back.pt"
dicts make "$work/trained.h5" "$work/bf16.pt" "$work/bf16.json" --bf16 --wrap
convert to-h5 "$work/bf16.pt" --config "$work/bf16.json" --out "$work/bf16.h5"
convert to-torch "$work/bf16.h5" --dtype bf16 --out "$work/bf16_back.pt"
dicts same "$work/bf16.pt" "$work/bf16_back.pt"
for f in fp32 bf16; do [ -n "$(eval_loss "$work/$f.h5")" ] || fail "moeut-eval refused $f.h5"; done

# --dump_logits: the first window's logits give moeut-eval's loss of that window.
"$bin/moeut-eval" --weights "$work/back.h5" --data "$work/data/val.bin" --context 32 --max_windows 1 \
  --micro_batch_size 1 --threads 1 --dump_logits "$work/logits.npy" > "$work/eval1.txt"
"$py" - "$work/logits.npy" "$work/data/val.bin" "$(sed -n 's/^eval .*| loss \([0-9.]*\) .*/\1/p' "$work/eval1.txt")" <<'PY'
import sys
import numpy as np
logits = np.load(sys.argv[1]).astype(np.float64)
raw = open(sys.argv[2], "rb").read()
tokens = np.frombuffer(raw, dtype="<u2", offset=32, count=33).astype(np.int64)
top = logits.max(axis=1)
ce = np.mean(top + np.log(np.exp(logits - top[:, None]).sum(axis=1)) - logits[np.arange(32), tokens[1:]])
assert logits.shape == (32, 48) and abs(ce - float(sys.argv[3])) <= 2e-6, (logits.shape, ce, sys.argv[3])
print(f"dumped logits give the loss {ce:.6f}")
PY

# Refusals name the tensor (or the option) and the problem.
refused() {  # KIND EXPECTED
  dicts make "$work/trained.h5" "$work/bad.pt" "$work/bad.json" --break "$1"
  if convert to-h5 "$work/bad.pt" --config "$work/bad.json" --out "$work/bad.h5" 2> "$work/err.txt"; then
    fail "to-h5 accepted a state dict with a $1 problem"
  fi
  grep -qF "$2" "$work/err.txt" || fail "to-h5 on a $1 problem said: $(cat "$work/err.txt")"
  [ ! -e "$work/bad.h5" ] || fail "to-h5 left bad.h5 behind"
}
refused missing "missing embedding.weight"
refused extra "extra transformer.layers.9.ffn.keys"
refused shape "tensor 'embedding.weight' has shape [2, 48, 32], expected [48, 32]"
refused nan "tensor 'embedding.weight' holds nan at element 3"
refused dtype "tensor 'embedding.weight' is int64"
refused att_n_experts "att_n_experts 1: with one attention expert"

# --init_weights (the file made by to-h5) on one rank and on two at --ep 2: the weights go
# through unchanged and evaluate as moeut-eval evaluates the file.
expected=$(eval_loss "$work/back.h5")
unchanged=(--steps 1 --lr 1e-300 --init_weights "$work/back.h5")
"$bin/moeut-train" "${run[@]}" "${unchanged[@]}" --out_weights "$work/init1.h5" --metrics "$work/init1.jsonl" \
  > "$work/init1.txt"
grep -q "^initial weights from $work/back.h5" "$work/init1.txt" || fail "no initial-weights line: $(cat "$work/init1.txt")"
"$mpiexec" -np 2 --oversubscribe "$bin/moeut-train" "${run[@]}" "${unchanged[@]}" --ep 2 \
  --out_weights "$work/init2.h5" --metrics "$work/init2.jsonl" > "$work/init2.txt"
for n in 1 2; do
  dicts same_h5 "$work/back.h5" "$work/init$n.h5"
  [ "$(val_loss "$work/init$n.txt")" = "$expected" ] ||
    fail "np $n: the run's validation loss $(val_loss "$work/init$n.txt"), moeut-eval's of the file $expected"
done

# A checkpoint that --resume auto finds wins over the file.
auto=(--checkpoint_dir "$work/ckpt" --resume auto --init_weights "$work/back.h5" --metrics "$work/auto.jsonl")
"$bin/moeut-train" "${run[@]}" "${auto[@]}" --steps 2 --out_weights "$work/auto.h5" > "$work/auto1.txt"
grep -q "^initial weights from" "$work/auto1.txt" || fail "the first --resume auto run did not start from the file"
"$bin/moeut-train" "${run[@]}" "${auto[@]}" --steps 3 --out_weights "$work/auto.h5" > "$work/auto2.txt"
grep -q "^--init_weights $work/back.h5 not read: the resumed checkpoint holds the weights" "$work/auto2.txt" ||
  fail "the second --resume auto run did not say the checkpoint wins: $(cat "$work/auto2.txt")"

# Another model, or no file: refused before training, naming the option, file and attribute.
status=0
"$bin/moeut-train" "${run[@]}" --steps 1 --att_n_experts 3 --init_weights "$work/back.h5" \
  --out_weights "$work/x.h5" --metrics "$work/x.jsonl" > /dev/null 2> "$work/err.txt" || status=$?
[ "$status" -eq 2 ] || fail "another model: exit status $status, expected 2"
grep -qF -- "--init_weights $work/back.h5: att_n_experts is 4 in the file, 3 in this run" "$work/err.txt" ||
  fail "another model: $(cat "$work/err.txt")"
status=0
"$mpiexec" -np 2 --oversubscribe "$bin/moeut-train" "${run[@]}" --steps 1 --ep 2 --init_weights "$work/none.h5" \
  --out_weights "$work/x.h5" --metrics "$work/x.jsonl" > /dev/null 2> "$work/err.txt" || status=$?
[ "$status" -eq 2 ] || fail "a missing file: exit status $status, expected 2"
grep -qF -- "--init_weights $work/none.h5: no such file" "$work/err.txt" || fail "a missing file: $(cat "$work/err.txt")"
echo "PASS: conversions bit-exact both ways, refusals named, --init_weights loads exactly on np 1 and np 2 --ep 2"
