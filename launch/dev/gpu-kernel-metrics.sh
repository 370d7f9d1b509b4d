#!/usr/bin/env bash
# On a GPU host: memory and stall metrics of the expert kernels (Nsight Compute), at the 1B
# shapes of moeut-bench-cvmm: where each product's bytes go (DRAM, L2 hits, L2 reductions) and
# what its warps wait on, and how unevenly its SMs are kept busy (the busiest SM's active cycles
# over the average: a persistent kernel whose blocks end apart shows it, docs/PERFORMANCE.md v26).
# Usage: launch/dev/gpu-kernel-metrics.sh [TOKENS [BENCH ARGS...]]  (BENCH ARGS go to moeut-bench-cvmm:
# --stride-routing, say)
# BIN (environment): the folder holding moeut-bench-cvmm and its source.txt (default build-gpu's;
# a folder that launch/dev/gpu-pack.sh filled works too).
# Writes $OUT/kernel_metrics.csv (raw) and prints one line per product.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/tmp/moeut-kernel-metrics}
mkdir -p "$out"
. "$root/launch/dev/gpu-step.sh"
bin=${BIN:-$root/build-gpu}
bench=$(program_in "$bin" moeut-bench-cvmm)
show_source "$bin"
tokens=${1:-16384}
shift $(($# > 0 ? 1 : 0))
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1)
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
metrics+=,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_red.sum
metrics+=,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active
metrics+=,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
metrics+=,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio
metrics+=,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
metrics+=,sm__cycles_active.max,sm__cycles_active.avg
# Each product runs once (no warm-up), with caches flushed before it.
"$ncu" -k regex:cvmm_ --metrics "$metrics" --csv --cache-control all --clock-control none \
  --log-file "$out/kernel_metrics.csv" "$bench" "$tokens" 1 "$@" > "$out/kernel_metrics.log"
python3 - "$out/kernel_metrics.csv" <<'EOF'
import csv, sys, statistics
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
ii, ni, gi = head.index("ID"), head.index("Kernel Name"), head.index("Grid Size")
mi, vi = head.index("Metric Name"), head.index("Metric Value")
launches = {}
for r in rows:
    launches.setdefault(int(r[ii]), (r[ni], r[gi], {}))[2][r[mi]] = float(r[vi].replace(",", ""))
# Products in launch order: a run of launches with the same kernel and grid.
groups = []
for i in sorted(launches):
    name, grid, m = launches[i]
    if not groups or groups[-1][0] != (name, grid):
        groups.append(((name, grid), []))
    groups[-1][1].append(m)
short = {"gpu__time_duration.sum": "us", "dram__bytes_read.sum": "dramRd", "dram__bytes_write.sum": "dramWr",
         "lts__t_sector_hit_rate.pct": "L2hit%", "lts__t_sectors_op_read.sum": "L2rdSec",
         "lts__t_sectors_op_write.sum": "L2wrSec", "lts__t_sectors_op_red.sum": "L2redSec",
         "lts__throughput.avg.pct_of_peak_sustained_elapsed": "L2%", "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM%",
         "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM%", "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%",
         "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": "stallLSB",
         "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio": "stallLG",
         "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "stallBar"}
def busiest_over_average(m):
    avg = m.get("sm__cycles_active.avg", 0.0)
    return m.get("sm__cycles_active.max", float("nan")) / avg if avg > 0 else float("nan")
print("product " + " ".join(f"{v:>9}" for v in short.values()) + f"{'SMmax/avg':>10}")
for n, ((name, grid), ms) in enumerate(groups):
    vals = []
    for k in short:
        med = statistics.median(m.get(k, float("nan")) for m in ms)
        if k == "gpu__time_duration.sum": med /= 1e3  # ns -> us
        vals.append(f"{med:9.3g}")
    vals.append(f"{statistics.median(busiest_over_average(m) for m in ms):10.3f}")
    print(f"{n} {name[:40]} grid {grid} x{len(ms)}")
    print("        " + " ".join(vals))
EOF
