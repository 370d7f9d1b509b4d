#!/usr/bin/env bash
# Preemption and requeue as a scheduler does them, on two CPU ranks (ep 2):
# - SIGTERM to both ranks mid-run: every rank finishes the step it is in, a complete checkpoint
#   of that step is saved, no weights file is written, and the run exits with status 75;
# - --resume auto continues from it to the end with the step losses and weights of a run never
#   interrupted;
# - --resume auto on an empty checkpoint_dir starts fresh;
# - --time_limit stops a run that would outlast it, with a checkpoint and status 75;
# - ranks that mpirun binds to one core each are warned about at start-up.
# Usage: cli_preemption.sh BIN_DIR MPIEXEC WORK_DIR
set -euo pipefail
bin=$1 mpiexec=$2 work=$3
. "$(dirname "$0")/cli_common.sh"
fresh_corpus "$bin" "$work"

train() {
  # shellcheck disable=SC2086  # MOEUT_MPI_BIND: mpirun options, split into words
  "$mpiexec" -np 2 --oversubscribe ${MOEUT_MPI_BIND:---bind-to none} "$bin/moeut-train" "${small_model[@]}" \
    --steps "${steps:-1500}" --batch_size 4 --micro_batch_size 2 --eval_every 0 --threads 1 --ep 2 --device cpu \
    --train_data "$work/data/train.bin" --val_data "$work/data/val.bin" "$@"
}
steps_logged() { losses "$1" 2> /dev/null | wc -l; }

MOEUT_MPI_BIND="--bind-to core" train --out_weights "$work/straight.h5" --metrics "$work/straight.jsonl" > "$work/straight.txt"
grep -q "ranks are each bound to a single CPU" "$work/straight.txt" || fail "no warning for ranks bound to one core each"

train --checkpoint_dir "$work/ckpt" --out_weights "$work/stopped.h5" --metrics "$work/stopped.jsonl" \
  > "$work/stopped.txt" 2>&1 &
run=$!
for _ in $(seq 1 600); do [ "$(steps_logged "$work/stopped.jsonl")" -ge 20 ] && break; sleep 0.05; done
# The ranks themselves, as SLURM signals a job step's tasks (mpirun's own SIGTERM kills them).
ranks=0
for p in $(pgrep -x moeut-train); do
  if tr '\0' ' ' < "/proc/$p/cmdline" 2> /dev/null | grep -q -- "--checkpoint_dir $work/ckpt "; then
    kill -TERM "$p" && ranks=$((ranks + 1))
  fi
done
[ "$ranks" = 2 ] || fail "found $ranks ranks to signal"
status=0
wait "$run" || status=$?
[ "$status" = 75 ] || fail "the stopped run exited $status, not 75 ($(tail -3 "$work/stopped.txt"))"
last=$(losses "$work/stopped.jsonl" | tail -1 | cut -d' ' -f1)
[ "$last" -lt 1500 ] || fail "the run was not stopped early"
[ -f "$work/ckpt/step_$(printf %08d "$last")/manifest.h5" ] || fail "no complete checkpoint of step $last ($(ls "$work/ckpt"))"
grep -q "stopped after step $last: a stop signal reached" "$work/stopped.txt" || fail "no stop message"
[ ! -e "$work/stopped.h5" ] || fail "a stopped run wrote its weights"

train --checkpoint_dir "$work/ckpt" --resume auto --out_weights "$work/resumed.h5" --metrics "$work/resumed.jsonl" \
  > "$work/resumed.txt"
grep -q "resumed from $work/ckpt/step_$(printf %08d "$last")" "$work/resumed.txt" || fail "--resume auto did not resume"
diff <(losses "$work/straight.jsonl" | awk -v s="$last" '$1 > s') <(losses "$work/resumed.jsonl" | awk -v s="$last" '$1 > s') \
  > /dev/null || fail "resumed losses differ from the uninterrupted run's"
h5diff "$work/straight.h5" "$work/resumed.h5" || fail "resumed weights differ from the uninterrupted run's"

# An older checkpoint resumed into a finished run's metrics: each step once, one final row.
steps=6 train --checkpoint_dir "$work/older" --checkpoint_every 3 --out_weights "$work/older.h5" \
  --metrics "$work/older.jsonl" > /dev/null
mkdir -p "$work/again" && cp -r "$work/older/step_00000003" "$work/again/"
steps=6 train --checkpoint_dir "$work/again" --resume auto --out_weights "$work/again.h5" --metrics "$work/older.jsonl" \
  > "$work/again.txt"
[ "$(losses "$work/older.jsonl" | cut -d' ' -f1 | tr '\n' ' ')" = "1 2 3 4 5 6 " ] ||
  fail "a resumed run's metrics hold steps $(losses "$work/older.jsonl" | cut -d' ' -f1 | tr '\n' ' ')"
[ "$(grep -c '"final": true' "$work/older.jsonl")" = 1 ] || fail "a resumed run's metrics hold $(grep -c '"final": true' "$work/older.jsonl") final rows"

steps=5 train --checkpoint_dir "$work/fresh" --resume auto --out_weights "$work/fresh.h5" \
  --metrics "$work/fresh.jsonl" > "$work/fresh.txt"
grep -q "no complete checkpoint in $work/fresh, starting fresh" "$work/fresh.txt" || fail "--resume auto, empty dir"
[ -f "$work/fresh/step_00000005/manifest.h5" ] || fail "the fresh run saved no checkpoint"

status=0
steps=100000000 train --time_limit 2 --checkpoint_dir "$work/limit" --out_weights "$work/limit.h5" \
  --metrics "$work/limit.jsonl" > "$work/limit.txt" 2>&1 || status=$?
[ "$status" = 75 ] || fail "the time-limited run exited $status, not 75 ($(tail -3 "$work/limit.txt"))"
grep -q "the time limit of 2 s" "$work/limit.txt" || fail "no time-limit message"
last=$(losses "$work/limit.jsonl" | tail -1 | cut -d' ' -f1)
[ -f "$work/limit/step_$(printf %08d "$last")/manifest.h5" ] || fail "no checkpoint of the time-limited run's step $last"
echo "PASS: stopped at step $(losses "$work/stopped.jsonl" | tail -1 | cut -d' ' -f1) by SIGTERM and resumed exactly; time limit stopped at step $last"
