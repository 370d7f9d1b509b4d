#!/usr/bin/env bash
# moeut-prepare-data's inputs and outputs beyond plain text (docs/DATA.md): JSON lines, a reused
# tokenizer, train shards read back through a glob and a list, llm.c and nanoGPT token files; the
# trainer trains on each. Every bad input is refused with exit status 65 and its message.
# Usage: cli_prepare_formats.sh BIN_DIR WORK_DIR
set -euo pipefail
bin=$1 work=$2
. "$(dirname "$0")/cli_common.sh"
fresh_corpus "$bin" "$work"
prep="$bin/moeut-prepare-data"

# refused STATUS MESSAGE COMMAND...: the command must exit with STATUS and print MESSAGE on stderr.
refused() {
  local want=$1 message=$2 status=0
  shift 2
  "$@" > /dev/null 2> "$work/err.txt" || status=$?
  [ "$status" = "$want" ] || fail "exit status $status, not $want: $*"
  grep -qF -- "$message" "$work/err.txt" || fail "message lacks '$message':$(echo; cat "$work/err.txt")"
}

# train DATA...: a few steps of the small model on --train_data DATA (val: the text's val.bin).
train() {
  "$bin/moeut-train" "${small_model[@]}" --steps "${steps:-2}" --batch_size 4 --micro_batch_size 2 --eval_every 0 \
    --eval_batches 1 --threads 1 --train_data "$1" --val_data "$work/data/val.bin" \
    --out_weights "$work/w.h5" --metrics "$work/$2.jsonl" > "$work/$2.txt"
}

# JSON lines: the same text as tiny_corpus's, each line a record among other fields, gives the same
# vocabulary and token files, trained and with the text's model reused (which is copied: a trained
# model differs in the paths it records).
python3 - "$work/text.txt" "$work/text.jsonl" <<'PY'
import json, sys
with open(sys.argv[2], "w") as out:
    for i, line in enumerate(open(sys.argv[1])):
        out.write(json.dumps({"id": i, "meta": {"tags": ["a", None, 1.5]}, "text": line.rstrip("\n")}) + "\n")
PY
"$prep" --input "$work/text.jsonl" --out_dir "$work/jsonl" --vocab_size 48 --threads 1 > /dev/null
"$prep" --input "$work/text.jsonl" --out_dir "$work/reuse" --tokenizer "$work/data/spm.model" --threads 1 > /dev/null
for f in spm.vocab train.bin val.bin; do cmp -s "$work/jsonl/$f" "$work/data/$f" || fail "jsonl/$f differs from the text's"; done
for f in spm.model train.bin val.bin; do cmp -s "$work/reuse/$f" "$work/data/$f" || fail "reuse/$f differs from the text's"; done
[ "$(wc -l < "$work/reuse/spm.vocab")" = 48 ] || fail "reuse/spm.vocab does not list 48 pieces"
train "$work/jsonl/train.bin" jsonl

# Shards: their tokens, in order, are train.bin's, so a glob and a list train exactly as train.bin
# does. A second run with larger shards leaves none of the first run's behind.
"$prep" --input "$work/text.txt" --out_dir "$work/shards" --tokenizer "$work/data/spm.model" --shard_tokens 1000 \
  --threads 1 > /dev/null
"$prep" --input "$work/text.txt" --out_dir "$work/shards" --tokenizer "$work/data/spm.model" --shard_tokens 4000 \
  --threads 1 | tee "$work/shards.txt"
shards=("$work"/shards/train_*.bin)
grep -q "in ${#shards[@]} shards" "$work/shards.txt" || fail "${#shards[@]} shard files, not as printed"
[ "${#shards[@]}" -ge 3 ] || fail "expected at least 3 shards, got ${#shards[@]}"
python3 - "$work/data/train.bin" "${shards[@]}" <<'PY'
import sys
payload = lambda p: open(p, "rb").read()[32:]
assert payload(sys.argv[1]) == b"".join(payload(p) for p in sys.argv[2:]), "shards differ from train.bin"
PY
steps=6 train "$work/data/train.bin" whole
steps=6 train "$work/shards/train_*.bin" glob
list=$(IFS=,; echo "${shards[*]}")
steps=6 train "$list" list
[ -n "$(losses "$work/whole.jsonl")" ] || fail "no step losses in whole.jsonl"
[ "$(losses "$work/glob.jsonl")" = "$(losses "$work/whole.jsonl")" ] || fail "the glob trains unlike train.bin"
[ "$(losses "$work/list.jsonl")" = "$(losses "$work/whole.jsonl")" ] || fail "the list trains unlike train.bin"

# llm.c (1024-byte header) and nanoGPT (headerless) files of train.bin's tokens convert back to it.
python3 - "$work/data/train.bin" "$work" <<'PY'
import struct, sys
tokens = open(sys.argv[1], "rb").read()[32:]
n = len(tokens) // 2
header = struct.pack("<3i", 20240520, 1, n) + bytes(1024 - 12)
open(sys.argv[2] + "/llmc.bin", "wb").write(header + tokens)
open(sys.argv[2] + "/nanogpt.bin", "wb").write(tokens)
bad = bytearray(tokens)
bad[200:202] = struct.pack("<H", 48)  # token 100: one past the vocabulary of 48
open(sys.argv[2] + "/llmc_bad.bin", "wb").write(header + bytes(bad))
open(sys.argv[2] + "/llmc_short.bin", "wb").write(header + tokens[:-2])
open(sys.argv[2] + "/llmc_v7.bin", "wb").write(struct.pack("<3i", 20240520, 7, n) + bytes(1012) + tokens)
open(sys.argv[2] + "/odd.bin", "wb").write(tokens[:-1])
PY
"$prep" --from_llmc "$work/llmc.bin" --vocab_size 48 --out "$work/from_llmc.bin" > "$work/llmc_prep.txt"
"$prep" --from_llmc "$work/nanogpt.bin" --vocab_size 48 --out "$work/from_nanogpt.bin" > "$work/nanogpt_prep.txt"
grep -q "llmc.bin: llm.c header, " "$work/llmc_prep.txt" || fail "the llm.c header was not recognised"
grep -q "nanogpt.bin: no header (nanoGPT)" "$work/nanogpt_prep.txt" || fail "the headerless file was not recognised"
cmp -s "$work/from_llmc.bin" "$work/data/train.bin" || fail "the llm.c file converts to other tokens"
cmp -s "$work/from_nanogpt.bin" "$work/data/train.bin" || fail "the nanoGPT file converts to other tokens"
train "$work/from_llmc.bin" llmc
train "$work/from_nanogpt.bin" nanogpt

# Refusals, each with exit status 65 and the file and problem named.
printf '{"text": "a b"}\n{"text": "c"}\n{"text": "d" "e"}\n' > "$work/bad.jsonl"
refused 65 "bad.jsonl:3: malformed JSON at column 14: expected ',' or '}'" \
  "$prep" --input "$work/bad.jsonl" --out_dir "$work/bad"
refused 65 "text.jsonl:1: no field \"body\"" \
  "$prep" --input "$work/text.jsonl" --out_dir "$work/bad" --text_field body
refused 65 "text.jsonl:1: field \"id\" is a number, not a string" \
  "$prep" --input "$work/text.jsonl" --out_dir "$work/bad" --text_field id
refused 65 "text.txt:1: malformed JSON at column 1: expected '{'" \
  "$prep" --input "$work/text.txt" --format jsonl --out_dir "$work/bad"
refused 65 "spm.model: the model has 48 pieces but --vocab_size is 64" \
  "$prep" --input "$work/text.txt" --out_dir "$work/bad" --tokenizer "$work/data/spm.model" --vocab_size 64
refused 65 "llmc_bad.bin: token out of vocabulary: token 100 (byte offset 1224) is 48 but --vocab_size is 48" \
  "$prep" --from_llmc "$work/llmc.bin" "$work/llmc_bad.bin" --vocab_size 48 --out "$work/bad.bin"
[ ! -e "$work/bad.bin" ] && [ ! -e "$work/bad.bin.tmp" ] || fail "a refused conversion left a file"
refused 65 "llmc_short.bin: llm.c header says" "$prep" --from_llmc "$work/llmc_short.bin" --vocab_size 48 --out "$work/bad.bin"
refused 65 "llmc_v7.bin: llm.c header version 7 is not supported" \
  "$prep" --from_llmc "$work/llmc_v7.bin" --vocab_size 48 --out "$work/bad.bin"
refused 65 "odd.bin: no llm.c header and an odd size" "$prep" --from_llmc "$work/odd.bin" --vocab_size 48 --out "$work/bad.bin"
"$prep" --from_llmc "$work/nanogpt.bin" --vocab_size 50 --out "$work/vocab50.bin" > /dev/null
refused 65 "vocab50.bin: vocab_size 50 differs from ${shards[0]}'s 48" train "${shards[0]},$work/vocab50.bin" mixed
refused 65 "train_9*.bin: no file matches" train "$work/shards/train_9*.bin" none
echo "PASS: JSON lines, a reused tokenizer, shards, llm.c and nanoGPT files prepared and trained on; bad input refused"
