#!/usr/bin/env bash
# Builds, on this machine, the binaries the GPU hosts run (portable CPU code, static Boost,
# sm_90a) into build-gpu/, which the device tool carries (launch/dev/gpu-check.sh runs them there).
# build-gpu/source.txt names the commit they were built from (the GPU scripts print it, as the
# host gets the working tree without its history).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
MOEUT_BUILD_DIR=build-gpu MOEUT_CMAKE_ARGS="-DMOEUT_PORTABLE=ON -DMOEUT_CUDA=ON" \
  "$root/launch/build.sh" moeut_gpu_tests moeut_gpu_mpi_tests moeut-bench-cvmm moeut-bench-scatter-floor moeut-bench moeut-train moeut-eval moeut-grad-compare
echo "$(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown), built $(date -u +%FT%TZ)" > "$root/build-gpu/source.txt"
