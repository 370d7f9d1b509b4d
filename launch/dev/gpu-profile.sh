#!/usr/bin/env bash
# On a GPU host: device time per kernel of moeut-bench steps, through Nsight Compute (one metric,
# gpu__time_duration, so each kernel runs once under the profiler), summed by kernel name.
# Usage: launch/dev/gpu-profile.sh CONFIG BATCH [LAYERS]
#   LAYERS (optional) replaces n_layers, so a 1B-wide model profiles in a few hundred launches.
# BIN (environment): the folder holding moeut-bench and its source.txt (default build-gpu's; a
# folder that launch/dev/gpu-pack.sh filled, such as gpu-compare.sh's build-b, works too).
# Writes $OUT/profile_<name>.csv (raw) and prints the table, largest first.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/tmp/moeut-gpu-profile}
mkdir -p "$out"
. "$root/launch/dev/gpu-step.sh"
bin=${BIN:-$root/build-gpu}
bench=$(program_in "$bin" moeut-bench)
show_source "$bin"
config=$1 batch=$2 layers=${3:-}
name=$(basename "$config" .cfg)_b$batch${layers:+_l$layers}
cfg=$out/$name.cfg
cp "$config" "$cfg"
[ -n "$layers" ] && sed -i "s/^n_layers *=.*/n_layers = $layers/" "$cfg"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1)
# One warm-up step, then one step whose training work (not its forward-only pass) is profiled.
"$ncu" --profile-from-start off --metrics gpu__time_duration.sum --csv --clock-control none --log-file "$out/profile_$name.csv" \
  "$bench" --config "$cfg" --batch "$batch" --steps 1 --warmup 1 > "$out/profile_$name.log"
python3 - "$out/profile_$name.csv" <<'EOF'
import csv, sys, collections, re
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
ni, vi, ui = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3, "second": 1e3}
second = [(r[ni], float(r[vi].replace(",", "")) * scale[r[ui]]) for r in rows]
total = collections.defaultdict(float); count = collections.Counter()
for name, ms in second:
    short = re.sub(r"\(.*\)$", "", name.replace("(anonymous namespace)::", "").replace("void ", ""))
    short = short.replace("moeut::cuda::", "")[:90]
    total[short] += ms; count[short] += 1
all_ms = sum(total.values())
print(f"{len(second)} launches, {all_ms:.2f} ms of kernel time in one step")
for name, ms in sorted(total.items(), key=lambda x: -x[1]):
    print(f"{ms:9.3f} ms {100 * ms / all_ms:5.1f}% {count[name]:5d}x  {name}")
EOF
