#!/usr/bin/env bash
# The folders' layers: each includes only the folders below it, so the include graph has no
# cycle. Order, bottom up: kernels, core, parallel, checkpoints, launch (tests may include any).
# Prints each folder's includes of other folders and fails on one that points up or sideways.
# Usage: include_layers.sh [REPOSITORY_ROOT]
set -euo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
layers=(kernels core parallel checkpoints launch)
status=0
for i in "${!layers[@]}"; do
  folder=${layers[$i]}
  below=" ${layers[*]:0:$i} "
  used=$(grep -rhoE '#include "(kernels|core|parallel|checkpoints|launch)/' "$root/$folder" \
           --include='*.h' --include='*.cpp' --include='*.cu' --include='*.cuh' |
         sed 's/#include "//; s#/##' | sort -u | grep -vx "$folder" || true)
  echo "$folder -> $(echo $used)"
  for other in $used; do
    if [[ "$below" != *" $other "* ]]; then
      echo "FAIL: $folder includes $other, which is not below it:"
      grep -rnE "#include \"$other/" "$root/$folder" --include='*.h' --include='*.cpp' --include='*.cu' --include='*.cuh'
      status=1
    fi
  done
done
[ $status = 0 ] && echo "include layers: ok"
exit $status
