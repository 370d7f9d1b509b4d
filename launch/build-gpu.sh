#!/usr/bin/env bash
# Builds, on this machine, the binaries the GPU hosts run (portable CPU code, static Boost,
# sm_90a) into build-gpu/, which the device tool carries (launch/gpu-check.sh runs them there).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/launch/install-deps.sh"
[ -x /usr/local/cuda/bin/nvcc ] && export CUDACXX=${CUDACXX:-/usr/local/cuda/bin/nvcc}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$root" -B "$root/build-gpu" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DMOEUT_PORTABLE=ON \
  -DMOEUT_CUDA=ON >/dev/null
cmake --build "$root/build-gpu" --parallel "$(nproc)" --target moeut_gpu_tests moeut-bench-cvmm moeut-bench
