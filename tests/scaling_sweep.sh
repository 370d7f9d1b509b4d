#!/usr/bin/env bash
# launch/moeut-scaling on CPU ranks: a weak-scaling sweep of the small model over 1 and 2 ranks at
# every ep gives a CSV and a table with every point ok (the one-rank point at efficiency 1), and
# two PNG plots; a GPU point's memory is read from its log; the projection from the 4-H100
# measurements holds each within 10% (within 1% by the line through its ep > 1 points), counts the
# all-gather dispatcher's exchange to every rank and calibrates it without timed collectives, and
# refuses a study mixing dispatchers; an unknown key in a sweep file is refused, naming it.
# Usage: scaling_sweep.sh BIN_DIR WORK_DIR (the sweep launches with the mpirun on PATH)
set -euo pipefail
bin=$1 work=$2
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }
. "$(dirname "$0")/cli_common.sh"
tiny_corpus "$bin" "$work"

cat > "$work/tiny.sweep" <<SWEEP
profile = ${small_model[1]}
train_data = $work/data/train.bin
val_data = $work/data/val.bin
ranks = 1 2
ep = all
sequences_per_rank = 2
scaling = weak
steps = 6
device = cpu
launcher_args = --oversubscribe
train_args = ${small_model[*]:2} --threads 1
bin = $bin
SWEEP
"$python" "$root/launch/moeut-scaling" "$work/tiny.sweep" --out "$work/out" > "$work/sweep.txt" 2>&1 ||
  fail "the sweep failed: $(tail -5 "$work/sweep.txt")"
[ "$(wc -l < "$work/out/points.csv")" = 4 ] || fail "points.csv: $(cat "$work/out/points.csv")"
[ "$(grep -c ',ok$' "$work/out/points.csv")" = 3 ] || fail "not every point ok: $(cat "$work/out/points.csv")"
grep -q "^1,1,1,2,2,6,.*,1,.*,ok$" "$work/out/points.csv" || fail "one-rank point: $(sed -n 2p "$work/out/points.csv")"
grep -q "^| 2 | 2 | 1 | 4 | all_to_all | " "$work/out/table.md" || fail "table.md: $(cat "$work/out/table.md")"
grep -q "^2,1,2,4,2,6,local," "$work/out/points.csv" || fail "ep 1's dispatcher: $(cat "$work/out/points.csv")"
# A study wants timings: its points write no weights file (--out_weights none).
for point in "$work"/out/np*_ep*; do
  grep -q "^no weights file written (out_weights none)$" "$point/log.txt" || fail "$point: $(tail -2 "$point/log.txt")"
done
[ -z "$(find "$work" "$root" -maxdepth 2 -name none)" ] || fail "a file named none was written"
if "$python" -c "import matplotlib" 2> /dev/null; then
  for png in scaling loss; do
    is_png "$work/out/$png.png" || fail "$png.png is not a PNG"
  done
else
  echo "skipped: the plots (no matplotlib for $python)"
fi
# A GPU point's memory comes from its rank 0's start-up line: one point's log given that line.
echo "GPU memory on rank 0: weights 0.01 | total 0.10 GiB (the device reports 1.25 GiB in use)" >> "$work/out/np2_ep2/log.txt"
"$python" "$root/launch/moeut-scaling" --plot "$work/out" > /dev/null 2>&1 || fail "--plot failed"
grep -q "^2,2,1,4,2,6,.*,1.25,.*,ok$" "$work/out/points.csv" || fail "GPU memory: $(cat "$work/out/points.csv")"
grep -q "| 1.2 GiB |" "$work/out/table.md" || fail "GPU memory in table.md: $(cat "$work/out/table.md")"
# The projection from the 1B measurements on 4 H100 (docs/SCALING.md): every measured point within
# 10% of its projection, and the projected layouts written.
mkdir -p "$work/h100"
cat > "$work/h100/points.csv" <<CSV
ranks,ep,dp,batch,micro_batch,steps,tokens_per_s,tokens_per_s_per_rank,efficiency,comm_share,final_val_loss,status
1,1,1,16,16,30,53891,53891,1,0,0,ok
2,1,2,32,16,30,105470,52735,0.979,0.0358,0,ok
2,2,1,32,16,30,85590,42795,0.794,0.1567,0,ok
4,1,4,64,16,30,207952,51988,0.965,0.0508,0,ok
4,2,2,64,16,30,169008,42252,0.784,0.1702,0,ok
4,4,1,64,16,30,135004,33751,0.626,0.2637,0,ok
CSV
"$python" "$root/launch/moeut-scaling" --project "$work/h100" --profile "$root/configs/1B.cfg" --gpus 8 64 512 \
  > "$work/projection.txt" 2>&1 || fail "projection: $(tail -3 "$work/projection.txt")"
grep -q "^| 64 | 1 | " "$work/h100/projection.md" || fail "projection.md has no 64-GPU ep 1 row"
[ "$(grep -c "^512," "$work/h100/projection.csv")" -ge 4 ] || fail "projection.csv: $(cat "$work/h100/projection.csv")"
# The same points as run by the all-gather dispatcher (every row to every rank of the group):
# groups within a node are projected with it, wider ones with the all-to-all that --dispatcher auto
# gives them, whose exchange at ep 64 (InfiniBand-bound) is then the all-to-all study's; and one
# study may not mix dispatchers.
mkdir -p "$work/gather" "$work/mixed"
awk -F, -v OFS=, 'NR == 1 { $5 = $5 ",dispatcher" } NR > 1 { $5 = $5 "," ($2 > 1 ? "all_gather" : "local") } 1' \
  "$work/h100/points.csv" > "$work/gather/points.csv"
"$python" "$root/launch/moeut-scaling" --project "$work/gather" --profile "$root/configs/1B.cfg" --gpus 512 \
  > "$work/gather.txt" 2>&1 || fail "all-gather projection: $(tail -3 "$work/gather.txt")"
grep -q "token exchange (all_gather)" "$work/gather.txt" || fail "the projection does not name its dispatcher"
grep -q "groups wider than a node: all_to_all" "$work/gather.txt" || fail "the projection hides auto's choice past a node"
# projected FILE GPUS EP COLUMN: that column of projection.csv's row for GPUS GPUs at EP.
projected() {
  awk -F, -v n="$2" -v ep="$3" -v k="$4" 'NR == 1 { for (i = 1; i <= NF; ++i) c[$i] = i } $1 == n && $2 == ep { print $c[k] }' "$1"
}
[ "$(projected "$work/gather/projection.csv" 512 8 dispatcher)" = all_gather ] &&
  [ "$(projected "$work/gather/projection.csv" 512 16 dispatcher)" = all_to_all ] &&
  [ "$(projected "$work/gather/projection.csv" 512 64 dispatcher)" = all_to_all ] ||
  fail "dispatchers projected: $(cat "$work/gather/projection.csv")"
a2a=$(projected "$work/h100/projection.csv" 512 64 exchange_ms) gather=$(projected "$work/gather/projection.csv" 512 64 exchange_ms)
awk -v a="$a2a" -v g="$gather" 'BEGIN { exit !(g > 0.99 * a && g < 1.01 * a) }' ||
  fail "512 GPUs at ep 64: exchange $gather ms from the all-gather study against the all-to-all study's $a2a ms"
sed '$ s/,all_gather,/,all_to_all,/' "$work/gather/points.csv" > "$work/mixed/points.csv"
if "$python" "$root/launch/moeut-scaling" --project "$work/mixed" --profile "$root/configs/1B.cfg" 2> "$work/mixed.txt" > /dev/null; then
  fail "a study mixing dispatchers was projected"
fi
grep -q "mixes dispatchers (all_gather, all_to_all)" "$work/mixed.txt" || fail "unclear error: $(cat "$work/mixed.txt")"
# The all-gather dispatcher's exchange replays inside CUDA graphs, where its collectives are not
# timed (0.9% of the step at np 2 ep 2 on 2 H200): with one ep > 1 point, its whole excess over
# the one-GPU step and its sync is the exchange (taken from the timed share, it came out at
# 5,595 GB/s, and 8 GPUs at ep 8 at 9 ms of exchange). At ep 8, seven peers' rows at ep 2's rate.
mkdir -p "$work/gather1"
cat > "$work/gather1/points.csv" <<CSV
ranks,ep,dp,batch,micro_batch,steps,dispatcher,tokens_per_s,tokens_per_s_per_rank,efficiency,comm_share,final_val_loss,status
1,1,1,16,16,30,local,57735,57735,1,0,0,ok
2,1,2,32,16,30,local,111202,55601,0.963,0.028,0,ok
2,2,1,32,16,30,all_gather,101221,50611,0.877,0.009,0,ok
CSV
"$python" "$root/launch/moeut-scaling" --project "$work/gather1" --profile "$root/configs/1B.cfg" --gpus 8 \
  > "$work/gather1.txt" 2>&1 || fail "one-point all-gather projection: $(tail -3 "$work/gather1.txt")"
grep -q "fixed cost 0.0 ms (none: np 2 ep 2's collectives are not timed)" "$work/gather1.txt" ||
  fail "the all-gather calibration: $(head -1 "$work/gather1.txt")"
awk -v e2="$(projected "$work/gather1/projection.csv" 8 2 exchange_ms)" -v e8="$(projected "$work/gather1/projection.csv" 8 8 exchange_ms)" \
  'BEGIN { exit !(e2 > 30 && e8 > 6.9 * e2 && e8 < 7.1 * e2) }' || fail "all-gather exchange: $(cat "$work/gather1/projection.csv")"
# With two exchange volumes or more (ep 2 and 4), a line through the ep > 1 points gives the rate
# and the fixed cost: every one of the 4-H100 points above is reproduced within 1%.
grep -q "fitted on 3 ep > 1 points" "$work/projection.txt" || fail "no fit: $(head -1 "$work/projection.txt")"
grep -q "largest difference between a measured point and its projection: 0\.[0-9]%" "$work/projection.txt" ||
  fail "4-H100 points: $(tail -1 "$work/projection.txt")"
echo "bogus = 1" >> "$work/tiny.sweep"
if "$python" "$root/launch/moeut-scaling" "$work/tiny.sweep" --out "$work/out2" 2> "$work/err.txt"; then
  fail "a sweep file with an unknown key was accepted"
fi
grep -q "unknown key 'bogus'" "$work/err.txt" || fail "unclear error: $(cat "$work/err.txt")"
echo "scaling sweep: ok ($(grep -c ',ok$' "$work/out/points.csv") points)"
