# Sourced by the GPU host scripts. step NAME COMMAND...: runs COMMAND with its output in
# $out/NAME.log, shows the log's last $step_tail lines (25 unless set) and counts failures in
# $failed, which the script exits with.
failed=0
# The training steps of docs/PERFORMANCE.md's table, "profile batch", in the order they are timed
# (gpu-check.sh times them all, gpu-compare.sh those named in BENCHES).
table_points=("1B 16" "1B 32" "244M 16" "244M 32")
# point_name PROFILE BATCH: a table point's name in BENCHES and the logs: the profile alone at
# batch 16, PROFILE_bBATCH otherwise.
point_name() { if [ "$2" = 16 ]; then echo "$1"; else echo "$1_b$2"; fi; }
# show_source DIR: the commit DIR's binaries were built from (launch/dev/build-gpu.sh writes it into a
# build folder, gpu-pack.sh copies it): DIR is a build or packed folder, or a folder inside one.
show_source() {
  echo "binaries in $1: $(cat "$1/source.txt" 2>/dev/null || cat "$1/../source.txt" 2>/dev/null || echo "no source.txt")"
}
# program_in DIR NAME: the path of program NAME in DIR, a build folder (launch/dev/build-gpu.sh) or one
# that launch/dev/gpu-pack.sh filled.
program_in() {
  local sub
  for sub in '' launch/ tests/; do [ -x "$1/$sub$2" ] && { echo "$1/$sub$2"; return 0; }; done
  echo "no $2 in $1" >&2
  return 127
}
step() {
  local name=$1; shift
  echo "== $name: $*"
  if "$@" > "$out/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED ($?)"; failed=$((failed + 1)); fi
  tail -n "${step_tail:-25}" "$out/$name.log"
}
