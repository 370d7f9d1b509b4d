#!/usr/bin/env bash
# What moeut-train refuses before its first step, and how it stops during training, as users
# run it (docs/RELIABILITY.md, "Before the first step and during training"):
# - output paths that cannot be written, a config that is not a text file, too many threads, a
#   model too large for the memory, an over-long option value, a validation file with a token
#   past the vocabulary: each refused with the path and the problem, its exit status, no step run;
# - a training file with bad tokens over two ranks: exit 65, the file, offset and value printed
#   once, no MPI abort;
# - an update that leaves parameters non-finite: exit 3 naming the step and tensors, nothing
#   saved from that step (no checkpoint, no weights), so --resume latest finds the step before;
# - a metrics file on a full disk: exit 1 with the path and "No space left on device".
# Usage: cli_startup_checks.sh BIN_DIR MPIEXEC WORK_DIR
set -euo pipefail
bin=$(cd "$1" && pwd) mpiexec=$2 work=$3
. "$(dirname "$0")/cli_common.sh"
fresh_corpus "$bin" "$work"
model=("${small_model[@]:2}")  # without --config: some cases give their own
data=(--train_data "$work/data/train.bin" --val_data "$work/data/val.bin")
run=(--steps 4 --batch_size 4 --micro_batch_size 2 --eval_every 0 --device cpu)

# expect STATUS TEXT ARGS...: moeut-train ARGS exits with STATUS, prints TEXT, and trains no step.
expect() {
  local want=$1 text=$2 status=0
  shift 2
  "$bin/moeut-train" "$@" > "$work/out.txt" 2>&1 || status=$?
  [ "$status" = "$want" ] || { cat "$work/out.txt"; fail "exit $status, not $want: $*"; }
  grep -qF -- "$text" "$work/out.txt" || { cat "$work/out.txt"; fail "no '$text': $*"; }
  ! grep -q "^step " "$work/out.txt" || fail "trained before refusing: $*"
  [ "$(wc -c < "$work/out.txt")" -lt 2000 ] || fail "a message of $(wc -c < "$work/out.txt") bytes: $*"
}

touch "$work/file"
mkdir -p "$work/dir"
ok=(--threads 1 "${run[@]}" "${model[@]}" "${data[@]}" --metrics "$work/m.jsonl")
expect 2 "out_weights: '$work/file/w.h5' cannot be written: cannot create the directory '$work/file': Not a directory" \
  "${ok[@]}" --out_weights "$work/file/w.h5"
expect 2 "out_weights: '$work/dir' is a directory" "${ok[@]}" --out_weights "$work/dir"
expect 2 "checkpoint_dir: '$work/file' exists and is not a directory" "${ok[@]}" --checkpoint_dir "$work/file"
expect 2 "metrics: '$work/file/m.jsonl' cannot be written" --threads 1 "${run[@]}" "${model[@]}" "${data[@]}" \
  --metrics "$work/file/m.jsonl"
expect 2 "config file '$work/dir': not a regular file (a directory)" "${ok[@]}" --config "$work/dir"
expect 2 "config file '/dev/zero': not a regular file" "${ok[@]}" --config /dev/zero
printf 'd_model = 32\0\n' > "$work/nul.cfg"
expect 2 "config file '$work/nul.cfg': not a text file (byte 12 is NUL)" "${ok[@]}" --config "$work/nul.cfg"
expect 2 "threads: must be at most the machine's" "${run[@]}" "${model[@]}" "${data[@]}" --threads 100000
expect 2 "memory: a CPU rank of this model needs about" --threads 1 "${run[@]}" --n_tokens 48 "${data[@]}" \
  --d_model 1000000 --out_weights "$work/w.h5" --metrics "$work/m.jsonl"
long=$(head -c 100000 /dev/zero | tr '\0' a)
expect 2 "... (100000 characters in all)') is longer than 4096 characters" "${ok[@]}" --dispatcher "$long"
{ printf 'dispatcher = '; head -c 5000000 /dev/zero | tr '\0' a; echo; } > "$work/long.cfg"
expect 2 "line 1 ('dispatcher = aaa" "${ok[@]}" --config "$work/long.cfg"
# One token past the vocabulary of 48, at token 100 of the validation file.
cp "$work/data/val.bin" "$work/bad_val.bin"
printf '\x30\x00' | dd of="$work/bad_val.bin" bs=1 seek=232 conv=notrunc 2> /dev/null
expect 65 "$work/bad_val.bin: token out of vocabulary: token 100 (byte offset 232) is 48 but vocab_size is 48" \
  --threads 1 "${run[@]}" "${model[@]}" --metrics "$work/m.jsonl" --train_data "$work/data/train.bin" \
  --val_data "$work/bad_val.bin"
[ ! -e "$work/w.h5" ] && [ ! -e "$work/m.jsonl" ] || fail "a refused run left files"

# Every 97th training token past the vocabulary, met by both ranks in the first step.
cp "$work/data/train.bin" "$work/bad_train.bin"
count=$(od -An -t u8 -j 24 -N 8 "$work/bad_train.bin" | tr -d ' ')
for ((i = 0; i < count; i += 97)); do
  printf '\x30\x00' | dd of="$work/bad_train.bin" bs=1 seek=$((32 + 2 * i)) conv=notrunc 2> /dev/null
done
status=0
"$mpiexec" -np 2 --oversubscribe "$bin/moeut-train" --threads 1 "${run[@]}" "${model[@]}" --ep 2 \
  --train_data "$work/bad_train.bin" --val_data "$work/data/val.bin" --out_weights "$work/w.h5" \
  --metrics "$work/m.jsonl" > "$work/np2.txt" 2>&1 || status=$?
[ "$status" = 65 ] || { cat "$work/np2.txt"; fail "bad training tokens over 2 ranks: exit $status, not 65"; }
[ "$(grep -c "bad_train.bin: token out of vocabulary: token [0-9]* (byte offset [0-9]*) is 48" "$work/np2.txt")" = 1 ] ||
  { cat "$work/np2.txt"; fail "the bad token is not reported exactly once"; }
! grep -q "MPI_ABORT" "$work/np2.txt" || fail "an MPI abort"

# Adam's epsilon lost in float with beta2 0: parameters whose gradient is 0 become 0/0 at step 2.
# Step 1 is saved whole (the last step of a first run); the runs resuming it stop at step 2.
nonfinite=(--threads 1 "${run[@]:2}" "${model[@]}" "${data[@]}" --adam_eps 1e-300 --adam_beta2 0 --lr 1
           --checkpoint_dir "$work/ckpt" --checkpoint_every 1 --out_weights "$work/w.h5" --metrics "$work/m.jsonl")
"$bin/moeut-train" "${nonfinite[@]}" --steps 1 > "$work/step1.txt" 2>&1 || { cat "$work/step1.txt"; fail "step 1"; }
rm "$work/w.h5"
for attempt in first second; do
  status=0
  "$bin/moeut-train" "${nonfinite[@]}" --steps 4 --resume latest > "$work/nonfinite.txt" 2>&1 || status=$?
  grep -q "resumed from $work/ckpt/step_00000001" "$work/nonfinite.txt" || fail "$attempt: did not resume from step 1"
  [ "$status" = 3 ] || { cat "$work/nonfinite.txt"; fail "$attempt non-finite update: exit $status, not 3"; }
  grep -q "^moeut-train: step 2: the update left parameters that are not finite (on 1 of 1 ranks): .*ffn.keys" \
    "$work/nonfinite.txt" || { cat "$work/nonfinite.txt"; fail "$attempt: the step and tensors not named"; }
  [ ! -e "$work/ckpt/step_00000002" ] && [ ! -e "$work/ckpt/.step_00000002.tmp" ] && [ ! -e "$work/w.h5" ] ||
    fail "$attempt: saved from non-finite state"
done
# A full disk under the metrics file: the first record's write fails with the system's reason.
status=0
"$bin/moeut-train" --threads 1 "${run[@]}" "${model[@]}" "${data[@]}" --metrics /dev/full \
  --out_weights "$work/w.h5" > "$work/full.txt" 2>&1 || status=$?
[ "$status" = 74 ] && grep -q "/dev/full: cannot write the metrics: No space left on device" "$work/full.txt" ||
  { cat "$work/full.txt"; fail "a full disk under the metrics file: exit $status"; }
echo "startup checks: ok"
