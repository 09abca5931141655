#!/usr/bin/env bash
# Convert every real checkpoint and the bundled sample, then prove each artifact on
# the GPU (marlin-verify --gpu --against). Usage: scripts/gpu_verify_all.sh REALINPUT OUTDIR
# REALINPUT is shared/realinput (or a copy); results: OUTDIR/<name>.json per artifact.
set -uo pipefail
real=${1:?realinput folder}; out=${2:?output folder}
mkdir -p "$out"
py=${PYTHON:-python3}
conv() { "$py" -c "import sys; sys.argv[0]='marlin-convert'; from converter.cli import main_convert; main_convert()" "$@"; }
ver() { "$py" -c "import sys; sys.argv[0]='marlin-verify'; from converter.cli import main_verify; main_verify()" "$@"; }
fail=0
inputs=("$PWD/tests/data/sample.tinyloop")
for d in "$real"/*/*/; do [ -d "$d" ] && inputs+=("${d%/}"); done
for src in "${inputs[@]}"; do
  name=$(basename "$src"); art="$out/$name.safetensors"
  if ! conv "$src" "$art" --force --quiet; then echo "SKIP $name (refused by marlin-convert)"; continue; fi
  ver "$art" --gpu --against "$src" --json > "$out/$name.json"; rc=$?
  "$py" - "$out/$name.json" "$name" "$rc" <<'PY'
import json, sys
rep = json.load(open(sys.argv[1])); name, rc = sys.argv[2], sys.argv[3]
for row in rep["layers"]:
    g = row.get("gpu")
    if isinstance(g, dict):
        print(f"{name:45s} {row['name']:42s} mean {g['mean_rel_err']:.2e} max {g['max_rel_err']:.2e} deterministic={g['deterministic']} ok={g['ok']}")
    else:
        print(f"{name:45s} {row['name']:42s} {g}")
print(f"== {name}: exit {rc}, ok={rep['ok']}, problems={[p['message'] for p in rep['problems'] if p['severity']=='error'][:3]}")
PY
  [ "$rc" -eq 0 ] || fail=1
done
exit $fail
