#!/usr/bin/env bash
# The GPU hosts' A/B script (launch/dev/gpu-compare.sh) and check script (launch/dev/gpu-check.sh) with
# stand-in programs, so that what they run, from which folder and with which variable, is checked
# where CI runs: a broken script costs a call of the scarce device time. Checks:
# - both folder layouts (a build folder: launch/, tests/; a pack: the programs at its top);
# - the --env form sets the variable for A only; CVMM_ARGS and CVMM_TOKENS reach the kernel
#   benchmark; the batch-32 steps run with their configs;
# - a program that hangs ends at STEP_LIMIT, and no benchmark runs after B's tests fail;
# - with three variants and a filter, the one whose tests fail is left out of the benchmarks
#   and the others run;
# - the step logs come folded into one file a kind, and summary.txt holds each run's timings
#   (the device tool brings back 8 files at most), each as its step ends: a call killed at the
#   device's limit keeps what ran before;
# - gpu-check.sh runs every step from BIN and the four training steps into one log, and with
#   PARTS="tests steps" only those two, from a pack too; an unknown part is refused.
# Usage: gpu_scripts.sh WORK_DIR
set -euo pipefail
work=$1
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$work" && mkdir -p "$work/build/launch" "$work/build/tests" "$work/pack" "$work/hang"
fail() { echo "FAIL: $*"; exit 1; }

# stand_in DIR PROGRAM [BODY]: a program that prints its path, arguments and MOEUT_TEST_VAR.
stand_in() {
  printf '#!/bin/sh\n%s\necho "ran $0 $* var=${MOEUT_TEST_VAR:-unset}"\n' "${3:-}" > "$1/$2"
  chmod +x "$1/$2"
}
# The benchmarks print a line of each kind that summary.txt reads.
cvmm_line='echo "  o dX    [m,1536]x[1536,128]  +dw            0.222 ms   347.6 TFLOP/s"; echo "  v       [m,1536]x[1536,128]  gather+sums    0.221 ms"'
step_line='echo "loss 0.6742 (ce 0.9476) | step 341.1 ms: forward 123.5"; echo "48031 tokens/s | 202.5 TFLOP/s"'
for dir in "$work/build/launch" "$work/pack" "$work/hang"; do
  stand_in "$dir" moeut-bench "$step_line"
  stand_in "$dir" moeut-bench-cvmm "$cvmm_line"
done
stand_in "$work/build/tests" moeut_gpu_tests
stand_in "$work/pack" moeut_gpu_tests
stand_in "$work/hang" moeut_gpu_tests "sleep 30"
echo "stand-in" > "$work/pack/source.txt"
# No GPU here: nvidia-smi answers as a stand-in too.
mkdir -p "$work/path" && stand_in "$work/path" nvidia-smi
export PATH="$work/path:$PATH"

out=$(OUT="$work/out1" ROUNDS=1 CVMM_ARGS="--stride-routing" "$root/launch/dev/gpu-compare.sh" "$work/pack" "$work/build" 2>&1) ||
  fail "two folders: exit status $? ($out)"
grep -q "ran $work/build/tests/moeut_gpu_tests --gtest_filter=" <<< "$out" || fail "B's tests not from build/tests"
grep -q "ran $work/pack/moeut-bench-cvmm 16384 --stride-routing" <<< "$out" ||
  fail "A's kernel benchmark not from the pack, or without CVMM_ARGS"
grep -q "ran $work/build/launch/moeut-bench --config $root/configs/1B.cfg --batch 16" <<< "$out" ||
  fail "B's 1B benchmark not from build/launch"
[ "$(ls "$work/out1")" = "$(printf 'bench_1B.log\ncvmm.log\nsummary.txt\ntests.log')" ] || fail "logs not folded ($(ls "$work/out1"))"
grep -qx "tests b: passed" "$work/out1/summary.txt" || fail "summary: B's tests"
grep -qx "cvmm b 1: o dX 0.222 | v 0.221" "$work/out1/summary.txt" || fail "summary: B's kernels ($(cat "$work/out1/summary.txt"))"
grep -qx "bench_1B a 1: step 341.1 ms | 48031 tokens/s" "$work/out1/summary.txt" || fail "summary: A's step"
grep -q "^== cvmm_a_1" "$work/out1/cvmm.log" || fail "cvmm.log without A's run"

out=$(OUT="$work/out2" ROUNDS=1 BENCHES=1B "$root/launch/dev/gpu-compare.sh" --env MOEUT_TEST_VAR "$work/pack" 2>&1) ||
  fail "--env: exit status $? ($out)"
# section LOG NAME: step NAME's lines of a folded log.
section() { awk -v h="== $2" '$0 == h { on = 1; next } /^== / { on = 0 } on' "$1"; }
section "$work/out2/bench_1B.log" bench_1B_a_1 | grep -q "var=1" || fail "--env: A without the variable"
section "$work/out2/bench_1B.log" bench_1B_b_1 | grep -q "var=unset" || fail "--env: B with the variable"

# The batch-32 steps and the kernel benchmark's tokens, each benchmark in its own log.
out=$(OUT="$work/out6" ROUNDS=1 BENCHES="cvmm 1B_b32 244M 244M_b32" CVMM_TOKENS=65536 "$root/launch/dev/gpu-compare.sh" \
  "$work/pack" "$work/build" 2>&1) || fail "batch 32: exit status $? ($out)"
grep -q "ran $work/pack/moeut-bench-cvmm 65536 var" <<< "$out" || fail "CVMM_TOKENS not passed"
grep -q "ran $work/build/launch/moeut-bench --config $root/configs/244M.cfg --batch 32" <<< "$out" || fail "244M b32 not run"
grep -q "ran $work/build/launch/moeut-bench --config $root/configs/244M.cfg --batch 16" <<< "$out" || fail "244M b16 not run"
[ "$(ls "$work/out6")" = "$(printf 'bench_1B_b32.log\nbench_244M.log\nbench_244M_b32.log\ncvmm.log\nsummary.txt\ntests.log')" ] ||
  fail "batch 32: logs ($(ls "$work/out6"))"
grep -qx "bench_244M_b32 b 1: step 341.1 ms | 48031 tokens/s" "$work/out6/summary.txt" ||
  fail "summary: B's 244M b32 step ($(cat "$work/out6/summary.txt"))"

start=$SECONDS
if out=$(OUT="$work/out3" STEP_LIMIT=2 "$root/launch/dev/gpu-compare.sh" "$work/pack" "$work/hang" 2>&1); then
  fail "a hanging test passed ($out)"
fi
(( SECONDS - start < 20 )) || fail "the hanging test was not stopped at STEP_LIMIT"
grep -q "tests of B failed: no benchmarks" <<< "$out" || fail "no message for failed tests ($out)"
! ls "$work/out3" | grep -q bench || fail "benchmarks ran after failed tests"
grep -qx "tests b: failed" "$work/out3/summary.txt" || fail "summary: B's failed tests"

start=$SECONDS
if out=$(OUT="$work/out4" STEP_LIMIT=2 ROUNDS=1 "$root/launch/dev/gpu-compare.sh" "$work/pack" "$work/build" "$work/hang" \
  '*Pairs*' 2>&1); then
  fail "three variants: a hanging test passed ($out)"
fi
(( SECONDS - start < 20 )) || fail "three variants: the hanging test was not stopped at STEP_LIMIT"
grep -q "ran $work/build/tests/moeut_gpu_tests --gtest_filter=\*Pairs\*" <<< "$out" || fail "three variants: B's tests without the filter"
grep -q "^== bench_1B_a_1" "$work/out4/bench_1B.log" && grep -q "^== cvmm_b_1" "$work/out4/cvmm.log" &&
  grep -q "^== bench_1B_b_1" "$work/out4/bench_1B.log" || fail "three variants: A and B not benchmarked ($(ls "$work/out4"))"
! grep -q "_c_" "$work/out4/bench_1B.log" "$work/out4/cvmm.log" || fail "three variants: C benchmarked after its tests failed"
# Killed (as the device tool kills a call past its limit) while B's 1B benchmark runs: the steps
# before it are in the summary and the folded logs (the one it was in stays as its own log).
mkdir -p "$work/slow" && cp "$work/pack/moeut_gpu_tests" "$work/pack/moeut-bench-cvmm" "$work/slow/"
stand_in "$work/slow" moeut-bench "sleep 30"
OUT="$work/out5" ROUNDS=1 "$root/launch/dev/gpu-compare.sh" "$work/pack" "$work/slow" > /dev/null 2>&1 &
killed=$!
for _ in $(seq 100); do grep -qs "^bench_1B a 1:" "$work/out5/summary.txt" && break; sleep 0.1; done
sleep 0.5
kill -KILL -- "$killed" 2> /dev/null || true
wait "$killed" 2> /dev/null || true
pkill -KILL -f "$work/slow/moeut-bench" 2> /dev/null || true
grep -qx "tests b: passed" "$work/out5/summary.txt" && grep -qx "cvmm b 1: o dX 0.222 | v 0.221" "$work/out5/summary.txt" &&
  grep -qx "bench_1B a 1: step 341.1 ms | 48031 tokens/s" "$work/out5/summary.txt" ||
  fail "killed: the finished steps not in the summary ($(cat "$work/out5/summary.txt" 2> /dev/null))"
grep -q "^== cvmm_b_1" "$work/out5/cvmm.log" && grep -q "^== bench_1B_a_1" "$work/out5/bench_1B.log" ||
  fail "killed: the finished steps' logs not folded ($(ls "$work/out5"))"
echo "gpu-compare.sh: folders, --env, time limit, three variants, folded logs and summary, a killed call: ok"

# gpu-check.sh on a build folder of stand-ins: every step runs from BIN, the training steps at the
# four points of the PERFORMANCE table go into one log, and the logs fit the 8 files that come back.
mkdir -p "$work/checkbuild/launch" "$work/checkbuild/tests"
for program in moeut-bench moeut-bench-cvmm moeut-bench-scatter-floor; do
  stand_in "$work/checkbuild/launch" "$program" "$step_line"
done
stand_in "$work/checkbuild/tests" moeut_gpu_tests
echo "stand-in" > "$work/checkbuild/source.txt"
out=$(OUT="$work/check" BIN="$work/checkbuild" "$root/launch/dev/gpu-check.sh" 2>&1) || fail "gpu-check: exit status $? ($out)"
[ "$(ls "$work/check")" = "$(printf '%s\n' bench_cvmm_16k.log bench_cvmm_64k.log bench_steps.log gpu_tests.log \
  scatter_floor_16k.log scatter_phases_16k.log)" ] || fail "gpu-check: logs ($(ls "$work/check"))"
for point in "244M.cfg --batch 16" "244M.cfg --batch 32" "1B.cfg --batch 16" "1B.cfg --batch 32"; do
  grep -q "ran $work/checkbuild/launch/moeut-bench --config $root/configs/$point" "$work/check/bench_steps.log" ||
    fail "gpu-check: no step at $point"
done
grep -q "ran $work/checkbuild/tests/moeut_gpu_tests" "$work/check/gpu_tests.log" || fail "gpu-check: tests not from BIN"
# PARTS="tests steps" on a pack (the programs at its top): the tests and the table alone.
out=$(OUT="$work/check2" BIN="$work/pack" PARTS="tests steps" "$root/launch/dev/gpu-check.sh" 2>&1) ||
  fail "gpu-check PARTS: exit status $? ($out)"
[ "$(ls "$work/check2")" = "$(printf '%s\n' bench_steps.log gpu_tests.log)" ] || fail "gpu-check PARTS: logs ($(ls "$work/check2"))"
grep -q "ran $work/pack/moeut_gpu_tests" "$work/check2/gpu_tests.log" &&
  grep -q "ran $work/pack/moeut-bench --config $root/configs/244M.cfg --batch 32" "$work/check2/bench_steps.log" ||
  fail "gpu-check PARTS: programs not from the pack"
if out=$(OUT="$work/check3" BIN="$work/pack" PARTS="tests table" "$root/launch/dev/gpu-check.sh" 2>&1); then
  fail "gpu-check: an unknown part ran ($out)"
fi
grep -q "unknown part 'table'" <<< "$out" || fail "gpu-check: no message for an unknown part ($out)"
echo "gpu-check.sh: every step from BIN, the four training steps in one log, 6 logs, PARTS on a pack: ok"
