#!/usr/bin/env bash
# Installs the Debian packages the project builds and runs with. Idempotent: skips what is there.
set -euo pipefail
packages=(cmake g++ make pkg-config libopenmpi-dev openmpi-bin libhdf5-dev hdf5-tools zlib1g-dev
          libboost-program-options-dev libgtest-dev sentencepiece libsentencepiece-dev ninja-build
          ca-certificates curl python3 python3-matplotlib python3-numpy python3-h5py)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}"
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)
"${as_root[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
