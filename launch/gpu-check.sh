#!/usr/bin/env bash
# On a GPU host: the GPU tests and the benchmarks, from binaries built by launch/build-gpu.sh.
# Logs go under $OUT (the device tool brings them back). Exit status: failed steps.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/build-gpu
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
step bench_244M_b32 "$bin/launch/moeut-bench" --config "$root/configs/244M.cfg" --batch 32
step bench_1B_b16 "$bin/launch/moeut-bench" --config "$root/configs/1B.cfg" --batch 16
exit $failed
