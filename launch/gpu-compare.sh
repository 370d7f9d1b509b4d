#!/usr/bin/env bash
# On a GPU host: an A/B measurement of a change in one call. Two variants run side by side,
# alternating, so both see the same machine: the expert kernels at 16k tokens (moeut-bench-cvmm)
# and the 1B step (moeut-bench), each `rounds` times. The tests of variant B run first.
#   launch/gpu-compare.sh DIR_A DIR_B [FILTER]    two builds' binaries
#   launch/gpu-compare.sh --env VAR DIR [FILTER]  one build, A with VAR=1 set, B without it
# A DIR is a build folder (launch/build-gpu.sh) or one that launch/gpu-pack.sh filled with the
# three binaries used here (two whole builds exceed what the device tool carries). FILTER: gtest
# filter for the tests (default '*Cvmm*:*Plan*:*Model*'). ROUNDS (environment): alternations
# (default 2). BENCHES (environment): which benchmarks, of "cvmm 1B" (the default; "1B" alone
# saves about two minutes of device time when the expert kernels did not change). STEP_LIMIT
# (environment): seconds each program may run (default 300). No benchmarks when B's tests fail.
# Logs under $OUT. Exit status: failed steps.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/moeut-gpu-compare}
mkdir -p "$out"
. "$root/launch/gpu-step.sh"
step_tail=${step_tail:-12}
if [ "${1:-}" = --env ]; then
  var=$2 dir_a=$3 dir_b=$3 filter=${4:-}
else
  var='' dir_a=$1 dir_b=$2 filter=${3:-}
fi
filter=${filter:-'*Cvmm*:*Plan*:*Model*'}
rounds=${ROUNDS:-2}
limit=${STEP_LIMIT:-300}  # seconds per program run: a hung kernel ends there, not at the call's limit
benches=" ${BENCHES:-cvmm 1B} "
for b in $benches; do
  case $b in cvmm | 1B) ;; *) echo "BENCHES: unknown benchmark '$b' (cvmm, 1B)" >&2; exit 2 ;; esac
done
# variant V PROGRAM ARGS...: PROGRAM from variant V's folder (a or b), with VAR=1 set for A in
# the --env form and unset otherwise.
variant() {
  local v=$1 program=$2 dir=$dir_b path; shift 2
  [ "$v" = a ] && dir=$dir_a
  path=$(program_in "$dir" "$program") || return 127
  if [ -z "$var" ]; then timeout "$limit" "$path" "$@"
  elif [ "$v" = a ]; then env "$var=1" timeout "$limit" "$path" "$@"
  else env -u "$var" timeout "$limit" "$path" "$@"; fi
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "A: ${var:+$var=1 }$dir_a | B: $dir_b | rounds $rounds"
show_source "$dir_a"
[ "$dir_b" = "$dir_a" ] || show_source "$dir_b"
step tests_b variant b moeut_gpu_tests --gtest_filter="$filter"
# A variant that fails its tests (or hangs in them: a kernel that deadlocks) is not timed.
[ "$failed" -eq 0 ] || { echo "tests of B failed: no benchmarks"; exit "$failed"; }
if [[ $benches == *" cvmm "* ]]; then
  for r in $(seq "$rounds"); do
    for v in a b; do
      step "cvmm_${v}_$r" variant "$v" moeut-bench-cvmm 16384
    done
  done
fi
if [[ $benches == *" 1B "* ]]; then
  for r in $(seq "$rounds"); do
    for v in a b; do
      step "bench_1B_${v}_$r" variant "$v" moeut-bench --config "$root/configs/1B.cfg" --batch 16
    done
  done
fi
exit $failed
