#!/usr/bin/env bash
# Installs the dependencies and builds the given targets (all when none) into build/.
# Usage: launch/build.sh [target ...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/launch/install-deps.sh"
[ -x /usr/local/cuda/bin/nvcc ] && export CUDACXX=${CUDACXX:-/usr/local/cuda/bin/nvcc}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$root/build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$root/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$root/build" --parallel "$(nproc)" "${targets[@]}"
