#!/usr/bin/env bash
# sha256 of the artifacts (single file, model folder, 200 KB shards) made from every
# checkpoint in $MARLIN_SHARED/realinput (default ../shared) and the bundled sample, so
# that a refactor can show its output is byte-identical:
#   bash scripts/artifact_hashes.sh /tmp/before > before.txt   (on the old commit)
#   bash scripts/artifact_hashes.sh /tmp/after > after.txt && diff before.txt after.txt
set -euo pipefail
out=$1
cd "$(dirname "$0")/.."
shared=${MARLIN_SHARED:-../shared}
bin=${MARLIN_BIN:-.venv/bin}
mkdir -p "$out"
for d in "$shared"/realinput/llama-tiny/*/ "$shared"/realinput/minilm/*/ tests/data/sample.tinyloop; do
  n=$(basename "$d")
  "$bin/marlin-convert" "$d" "$out/$n.safetensors" --force -q
  "$bin/marlin-convert" "$d" "$out/$n-dir/" --force -q
  "$bin/marlin-convert" "$d" "$out/$n-sh.safetensors" --max-shard-size 200KB --force -q
done
cd "$out" && find . -type f | LC_ALL=C sort | xargs sha256sum
