#!/usr/bin/env bash
# On a GPU host: the GPU tests and the benchmarks, from binaries built by launch/dev/build-gpu.sh
# (BIN, environment: their build folder, default build-gpu; a folder that launch/dev/gpu-pack.sh
# filled serves for the tests and the training steps). PARTS (environment): which of "tests
# kernels steps" run (default all three, about 8 minutes; "tests steps", the PERFORMANCE table
# alone, about 4), or "seeds", the seed sweep (launch/gpu-seed-sweep.sh: 8 seeds of the 126M
# recipe with a warm-up of 200 steps, on which this code trained 8 of 8 seeds (the
# sweep's default warm-up of 50 collapses some seeds in the official code too: docs/DESIGN.md,
# "Training stability"); about 2 minutes on 4 GPUs, 5 on one; it fails when a seed diverges or
# ends above 4.70).
# Logs go under $OUT (the device tool brings them back, 8 files at most: this writes 6, the
# sweep 2 more). Exit status: failed steps.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${BIN:-$root/build-gpu}
out=${OUT:-/tmp/moeut-gpu-check}
parts=" ${PARTS:-tests kernels steps} "
for part in $parts; do
  [[ " tests kernels steps seeds " == *" $part "* ]] ||
    { echo "PARTS: unknown part '$part' (tests kernels steps seeds)" >&2; exit 2; }
done
runs() { [[ "$parts" == *" $1 "* ]]; }
mkdir -p "$out"
. "$root/launch/dev/gpu-step.sh"
# The GPU and the binaries' commit go to the output only: at most 8 files come back from the
# device, and the steps below fill them.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
show_source "$bin"
# program NAME: NAME's path in BIN, or the step that runs it fails saying it is missing.
program() { program_in "$bin" "$1" || echo "missing-$1"; }
if runs tests; then
  step gpu_tests "$(program moeut_gpu_tests)"
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # expert dispatch between two GPU ranks over NCCL
    step gpu_mpi_tests env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 \
      mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE "$(program moeut_gpu_mpi_tests)"
  fi
fi
if runs kernels; then
  cvmm=$(program moeut-bench-cvmm)
  step bench_cvmm_16k "$cvmm" 16384
  step bench_cvmm_64k "$cvmm" 65536
  step scatter_floor_16k "$(program moeut-bench-scatter-floor)" 16384
  step scatter_phases_16k timeout 300 "$cvmm" 16384 3 --phases  # where a scatter item's time goes
fi
# The training step at the four points of docs/PERFORMANCE.md's table (table_points), into one log.
training_steps() {
  local status=0 profile batch point bench
  bench=$(program moeut-bench)
  for point in "${table_points[@]}"; do
    read -r profile batch <<< "$point"
    echo "== $profile batch $batch"
    "$bench" --config "$root/configs/$profile.cfg" --batch "$batch" || status=$?
  done
  return $status
}
if runs steps; then step bench_steps training_steps; fi
if runs seeds; then step seed_sweep env BIN="$bin" OUT="$out" WARMUP="${WARMUP:-200}" "$root/launch/gpu-seed-sweep.sh" seeds; fi
exit $failed
