#!/usr/bin/env bash
# The test suite: install, build everything, run every test (GPU tests report "skipped: no GPU"
# on machines without one).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/launch/build.sh"
cd "$root/build"
ctest --output-on-failure --parallel "$(nproc)" --timeout 900
