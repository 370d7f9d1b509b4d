#!/usr/bin/env bash
# The hang watchdog on two CPU ranks (ep 2): one rank stopped (SIGSTOP) mid-run leaves the other
# waiting in a collective; within --hang_timeout it reports its rank, the operation and the
# group, and the job ends with status 4 instead of spinning forever. A run whose ranks all make
# progress is not ended by it.
# Usage: cli_hang_watchdog.sh BIN_DIR MPIEXEC WORK_DIR
set -euo pipefail
bin=$1 mpiexec=$2 work=$3
. "$(dirname "$0")/cli_common.sh"
fresh_corpus "$bin" "$work"
train() {
  "$mpiexec" -np 2 --oversubscribe --bind-to none "$bin/moeut-train" "${small_model[@]}" --batch_size 4 \
    --micro_batch_size 2 --eval_every 0 --threads 1 --ep 2 --device cpu --hang_timeout 3 \
    --train_data "$work/data/train.bin" --val_data "$work/data/val.bin" "$@"
}

train --steps 40 --metrics "$work/steady.jsonl" --out_weights "$work/steady.h5" > "$work/steady.txt" 2>&1 ||
  fail "a steady run ended $? ($(tail -3 "$work/steady.txt"))"

train --steps 100000000 --metrics "$work/stopped.jsonl" --out_weights "$work/stopped.h5" > "$work/stopped.txt" 2>&1 &
run=$!
for _ in $(seq 1 600); do [ "$(losses "$work/stopped.jsonl" 2> /dev/null | wc -l)" -ge 20 ] && break; sleep 0.05; done
# One of this run's two ranks (their command lines name its metrics file); the other reports.
stopped=""
for p in $(pgrep -x moeut-train); do
  tr '\0' ' ' < "/proc/$p/cmdline" 2> /dev/null | grep -q -- "--metrics $work/stopped.jsonl " && stopped=$p
done
[ -n "$stopped" ] || fail "no rank found to stop"
kill -STOP "$stopped"
start=$(date +%s)
status=0
wait "$run" || status=$?
[ "$status" = 4 ] || fail "the job with a stopped rank ended $status, not 4 ($(tail -5 "$work/stopped.txt"))"
[ $(( $(date +%s) - start )) -le 30 ] || fail "the watchdog took $(( $(date +%s) - start )) s"
grep -qE "^moeut-train: rank [01]: no progress for [0-9]+ s in MPI_[A-Za-z_]+(\([a-z0-9]+\))? on group '(world|expert-parallel)' \(--hang_timeout 3 s\)" \
  "$work/stopped.txt" || fail "no report naming a rank's wait: $(grep -v '^step' "$work/stopped.txt" | head -5)"
echo "PASS: a stopped rank ended the job with status 4 after $(( $(date +%s) - start )) s: $(grep -m1 -o "rank [01]: no progress.*group '[a-z-]*'" "$work/stopped.txt")"
