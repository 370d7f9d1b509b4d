#!/usr/bin/env bash
# Installs the dependencies and builds the given targets (all when none).
# Usage: [MOEUT_BUILD_DIR=dir] [MOEUT_CMAKE_ARGS="-D..."] launch/build.sh [target ...]
# (default build/, configured once with the default options).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$root/${MOEUT_BUILD_DIR:-build}
"$root/launch/install-deps.sh"
[ -x /usr/local/cuda/bin/nvcc ] && export CUDACXX=${CUDACXX:-/usr/local/cuda/bin/nvcc}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$dir/CMakeCache.txt" ] || [ -n "${MOEUT_CMAKE_ARGS:-}" ]; then
  # shellcheck disable=SC2086  # the options are words to split
  cmake -S "$root" -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release ${MOEUT_CMAKE_ARGS:-} >/dev/null
fi
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$dir" --parallel "$(nproc)" "${targets[@]}"
