#!/usr/bin/env bash
# Copies the binaries that launch/dev/gpu-compare.sh runs out of a build folder (launch/dev/build-gpu.sh)
# into DEST (7 MB instead of the build's 55, so two variants fit in what the device tool
# carries). DEST should match .gitignore's build-*/ (build-a, build-b), so the tool may carry it.
#   launch/dev/gpu-pack.sh BUILD DEST
set -euo pipefail
build=$1 dest=$2
mkdir -p "$dest"
cp "$build/tests/moeut_gpu_tests" "$build/launch/moeut-bench-cvmm" "$build/launch/moeut-bench" "$build/source.txt" "$dest/"
