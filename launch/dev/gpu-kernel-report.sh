#!/usr/bin/env bash
# On a GPU host: Nsight Compute's own report (speed of light, compute and memory workload, warp
# stalls by reason, occupancy) for the first COUNT launches of the kernels matching REGEX in a
# program, for kernels that launch/dev/gpu-kernel-metrics.sh's fixed metrics do not explain (the
# pipes and shared memory of the flash kernels, say). SKIP (environment) launches that match are
# passed over first.
#   launch/dev/gpu-kernel-report.sh NAME REGEX COUNT -- PROGRAM ARGS...
# e.g. launch/dev/gpu-kernel-report.sh flash_bwd flash_backward 1 -- build-gpu/launch/moeut-bench \
#        --config configs/1B.cfg --batch 16 --steps 1 --warmup 1
# Writes $OUT/NAME.txt (the report) and $OUT/NAME.log (the program's output).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/tmp/moeut-kernel-report}
mkdir -p "$out"
. "$root/launch/dev/gpu-step.sh"
name=$1 regex=$2 count=$3
[ "${4:-}" = -- ] || { echo "usage: $0 NAME REGEX COUNT -- PROGRAM ARGS..." >&2; exit 2; }
shift 4
show_source "$(dirname "$1")"  # the program's own build
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1)
# The warp-state section prints no breakdown of the stalls in text: each reason's cycles per issued
# instruction come as metrics of their own.
stalls=''
for reason in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle membar \
  dispatch_stall no_instruction not_selected selected sleeping branch_resolving drain imc_miss misc tex_throttle; do
  stalls+=${stalls:+,}smsp__average_warps_issue_stalled_${reason}_per_issue_active.ratio
done
"$ncu" -k "regex:$regex" --launch-skip "${SKIP:-0}" --launch-count "$count" --clock-control none \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section Occupancy --section LaunchStats --metrics "$stalls" \
  --log-file "$out/$name.txt" "$@" > "$out/$name.log"
cat "$out/$name.txt"
