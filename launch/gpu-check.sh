#!/usr/bin/env bash
# On a GPU host: the GPU tests and the benchmarks, from binaries built by launch/build-gpu.sh
# (BIN, environment: their build folder, default build-gpu). Logs go under $OUT (the device tool
# brings them back, 8 files at most: this writes 6). Exit status: failed steps.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN:-$root/build-gpu}
out=${OUT:-/tmp/moeut-gpu-check}
mkdir -p "$out"
. "$root/launch/gpu-step.sh"
# The GPU and the binaries' commit go to the output only: at most 8 files come back from the
# device, and the steps below fill them.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
show_source "$bin"
step gpu_tests "$bin/tests/moeut_gpu_tests"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # expert dispatch between two GPU ranks over NCCL
  step gpu_mpi_tests env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 \
    mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE "$bin/tests/moeut_gpu_mpi_tests"
fi
step bench_cvmm_16k "$bin/launch/moeut-bench-cvmm" 16384
step bench_cvmm_64k "$bin/launch/moeut-bench-cvmm" 65536
step scatter_floor_16k "$bin/launch/moeut-bench-scatter-floor" 16384
step scatter_phases_16k timeout 300 "$bin/launch/moeut-bench-cvmm" 16384 3 --phases  # where a scatter item's time goes
# The training step at the four points of docs/PERFORMANCE.md's table (table_points), into one log.
training_steps() {
  local status=0 profile batch point
  for point in "${table_points[@]}"; do
    read -r profile batch <<< "$point"
    echo "== $profile batch $batch"
    "$bin/launch/moeut-bench" --config "$root/configs/$profile.cfg" --batch "$batch" || status=$?
  done
  return $status
}
step bench_steps training_steps
exit $failed
