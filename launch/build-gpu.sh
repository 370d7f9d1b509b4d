#!/usr/bin/env bash
# Builds, on this machine, the binaries the GPU hosts run (portable CPU code, static Boost,
# sm_90a) into build-gpu/, which the device tool carries (launch/gpu-check.sh runs them there).
set -euo pipefail
MOEUT_BUILD_DIR=build-gpu MOEUT_CMAKE_ARGS="-DMOEUT_PORTABLE=ON -DMOEUT_CUDA=ON" \
  exec "$(dirname "$0")/build.sh" moeut_gpu_tests moeut_gpu_mpi_tests moeut-bench-cvmm moeut-bench-scatter-floor moeut-bench moeut-train moeut-eval
