#!/usr/bin/env bash
# On a GPU host: an A/B measurement of a change in one call. The variants run side by side,
# alternating, so all see the same machine: the expert kernels at 16k tokens (moeut-bench-cvmm)
# and the 1B step (moeut-bench), each `rounds` times. The tests of every variant but A run first.
#   launch/dev/gpu-compare.sh DIR_A DIR_B [DIR_C ...] [FILTER]  builds' binaries (variants a, b, c, ...)
#   launch/dev/gpu-compare.sh --env VAR DIR [FILTER]            one build, A with VAR=1 set, B without it
# A DIR is a build folder (launch/dev/build-gpu.sh) or one that launch/dev/gpu-pack.sh filled with the
# three binaries used here (two whole builds exceed what the device tool carries); arguments that
# are folders are variants, a last one that is not is FILTER: the gtest filter for the tests
# (default '*Cvmm*:*Plan*:*Model*'). Several variants in one call (a series of commits, say) share
# the machine's start and its warm-up. ROUNDS (environment): alternations (default 2). BENCHES
# (environment): which benchmarks, of "cvmm 1B 1B_b32 244M 244M_b32" (default "cvmm 1B": the
# kernels and the 1B step at batch 16; "1B" alone saves about two minutes of device time when the
# expert kernels did not change; 244M the 244M step at batch 16; the _b32 ones the steps at batch
# 32: the four points of docs/PERFORMANCE.md's table). CVMM_TOKENS (environment):
# the kernel benchmark's tokens (default 16384). CVMM_ARGS (environment): more arguments for
# moeut-bench-cvmm (--stride-routing, say). STEP_LIMIT (environment): seconds each
# program may run (default 300). A variant whose tests fail is not benchmarked. Logs under $OUT:
# summary.txt (tests passed or failed, and each run's timings on one line) and one log a kind.
# Exit status: failed steps.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/tmp/moeut-gpu-compare}
mkdir -p "$out"
. "$root/launch/dev/gpu-step.sh"
step_tail=${step_tail:-12}
declare -A dir_of
names=(a b c d e f g h)
if [ "${1:-}" = --env ]; then
  var=$2 filter=${4:-} variants=(a b)
  dir_of[a]=$3 dir_of[b]=$3
else
  var='' filter='' variants=()
  for arg in "$@"; do
    if [ -d "$arg" ] && [ -z "$filter" ]; then
      [ ${#variants[@]} -lt ${#names[@]} ] || { echo "gpu-compare.sh: at most ${#names[@]} variants" >&2; exit 2; }
      v=${names[${#variants[@]}]}
      variants+=("$v")
      dir_of[$v]=$arg
    else
      [ -z "$filter" ] || { echo "gpu-compare.sh: '$arg' after the filter '$filter'" >&2; exit 2; }
      filter=$arg
    fi
  done
  [ ${#variants[@]} -ge 2 ] || { echo "gpu-compare.sh: needs two variant folders at least" >&2; exit 2; }
fi
filter=${filter:-'*Cvmm*:*Plan*:*Model*'}
rounds=${ROUNDS:-2}
limit=${STEP_LIMIT:-300}  # seconds per program run: a hung kernel ends there, not at the call's limit
benches=" ${BENCHES:-cvmm 1B} "
known=cvmm
for point in "${table_points[@]}"; do known+=" $(point_name $point)"; done
for b in $benches; do
  [[ " $known " == *" $b "* ]] || { echo "BENCHES: unknown benchmark '$b' ($known)" >&2; exit 2; }
done
# variant V PROGRAM ARGS...: PROGRAM from variant V's folder, with VAR=1 set for A in the --env
# form and unset otherwise.
variant() {
  local v=$1 program=$2 path; shift 2
  path=$(program_in "${dir_of[$v]}" "$program") || return 127
  if [ -z "$var" ]; then timeout "$limit" "$path" "$@"
  elif [ "$v" = a ]; then env "$var=1" timeout "$limit" "$path" "$@"
  else env -u "$var" timeout "$limit" "$path" "$@"; fi
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for v in "${variants[@]}"; do
  echo "${v^^}: $([ "$v" = a ] && echo "${var:+$var=1 }")${dir_of[$v]}"
done
echo "rounds $rounds"
show_source "${dir_of[a]}"
for v in "${variants[@]:1}"; do [ "${dir_of[$v]}" = "${dir_of[a]}" ] || show_source "${dir_of[$v]}"; done
# Each step's figures go on one line of $out/summary.txt as soon as it ends, and its log is folded
# into one file a kind (tests, cvmm, bench_1B, ...) under its "== NAME" line: at most 8 files come back
# from the device, and a call that runs past its limit is killed with no chance to tidy up.
figures() {  # figures LOG: a benchmark's timings on one line
  sed -nE -e 's/^  ([A-Za-z]([A-Za-z0-9 ,]*[A-Za-z0-9])?)[ :[].* ([0-9.]+) ms.*/\1 \3/p' \
    -e 's/.*step ([0-9.]+) ms.*/step \1 ms/p' -e 's|^([0-9]+) tokens/s.*|\1 tokens/s|p' "$1" | paste -sd '|' | sed 's/|/ | /g'
}
# compare_step NAME COMMAND...: step, then its summary line and its log folded into its kind's file.
# Status: the step's (0: passed).
compare_step() {
  local name=$1 before=$failed log="$out/$1.log" kind passed
  step "$@"
  [ "$failed" -eq "$before" ] && passed=0 || passed=1
  kind=$(sed -E 's/_[a-h](_[0-9]+)?$//' <<< "$name")
  if [ "$kind" = tests ]; then
    echo "tests ${name#tests_}: $([ "$passed" -eq 0 ] && echo passed || echo failed)" >> "$out/summary.txt"
  else
    echo "$(sed -E 's/_([a-h])_([0-9]+)$/ \1 \2/' <<< "$name"): $(figures "$log")" >> "$out/summary.txt"
  fi
  { echo "== $name"; cat "$log"; } >> "$out/$kind.log"
  rm "$log"
  return "$passed"
}
rm -f "$out"/{summary.txt,tests.log,cvmm.log} "$out"/bench_*.log  # a previous run's, where $OUT is kept
trap 'echo; cat "$out/summary.txt" 2>/dev/null' EXIT
# A variant that fails its tests (or hangs in them: a kernel that deadlocks) is not timed.
timed=(a)
for v in "${variants[@]:1}"; do
  if compare_step "tests_$v" variant "$v" moeut_gpu_tests --gtest_filter="$filter"; then
    timed+=("$v")
  else
    echo "tests of ${v^^} failed: no benchmarks of ${v^^}"
  fi
done
[ ${#timed[@]} -ge 2 ] || { echo "no variant but A passed its tests: no benchmarks"; exit "$failed"; }
# alternate NAME PROGRAM ARGS...: PROGRAM of every timed variant in turn, `rounds` times, as steps
# NAME_<variant>_<round>.
alternate() {
  local name=$1 r v; shift
  for r in $(seq "$rounds"); do
    for v in "${timed[@]}"; do compare_step "${name}_${v}_$r" variant "$v" "$@"; done
  done
}
read -r -a cvmm_args <<< "${CVMM_ARGS:-}"
[[ $benches == *" cvmm "* ]] && alternate cvmm moeut-bench-cvmm "${CVMM_TOKENS:-16384}" "${cvmm_args[@]}"
for point in "${table_points[@]}"; do
  read -r profile batch <<< "$point"
  name=$(point_name "$profile" "$batch")
  [[ $benches == *" $name "* ]] && alternate "bench_$name" moeut-bench --config "$root/configs/$profile.cfg" --batch "$batch"
done
exit $failed
