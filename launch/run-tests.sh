#!/usr/bin/env bash
# The test suite: install, build everything, run every test. GPU tests (label gpu) run last and
# verbosely, so that on a machine without a GPU each one shows "skipped: no GPU".
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/launch/build.sh"
cd "$root/build"
ctest --output-on-failure --parallel "$(nproc)" --timeout 900 --label-exclude gpu
# grep -c reads all of ctest's output (grep -q would stop early, and pipefail would count the
# broken pipe as "no GPU tests").
if [ "$(ctest --show-only --label-regex gpu | grep -c "Test *#")" -gt 0 ]; then
  ctest --verbose --timeout 900 --label-regex gpu 2>&1 |
    grep -E "skipped: no GPU|\[ +(OK|FAILED|SKIPPED) +\] [A-Za-z]|tests passed|tests failed|Failure|Expected|actual"
fi
