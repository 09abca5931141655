#!/usr/bin/env bash
# Whole-model parity on the GPU (issue 13). Run from the repo root on the GPU machine
# (nothing to install: torch, transformers, cupy as found; the checkpoints as an argument):
#
#   PYTHONPATH=$PWD bash scripts/gpu_model_parity.sh REALINPUT [OUTDIR]
#
# OUTDIR (default $OUT/model-parity, or /tmp/model-parity) gets the reports (<name>.json,
# <name>.json.stderr, runs.tsv); the converted model folders go to $WORK (default
# /tmp/model-parity-models), so that only the small reports come back from a device run.
# REALINPUT holds llama-tiny/ and minilm/ (a copy of shared/realinput, e.g. .realinput/).
# 1. the GPU tests of the model path (tests/gpu/test_model_gpu.py, synthetic model);
# 2. every llama-tiny producer and the full MiniLM: marlin-convert SRC WORK/<name>/, then
#    marlin-verify WORK/<name> --model --against SRC --gpu --json (OUTDIR/<name>.json);
# 3. one --text run (perplexities) on the act-order Llama;
# then a table. Exit 1 if a test, a conversion or a verification failed.
# DEVICE=--cpu runs the same on the CPU (a smoke test of this script without a GPU).
# SKIP_TESTS=1 leaves out step 1. VERIFY_ARGS adds options to every marlin-verify call (e.g. VERIFY_ARGS="--dtype bfloat16").
set -uo pipefail
real=${1:?usage: scripts/gpu_model_parity.sh REALINPUT [OUTDIR]}
out=${2:-${OUT:-/tmp}/model-parity}
work=${WORK:-/tmp/model-parity-models}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
py=${PYTHON:-python3}
device=${DEVICE:---gpu}
mkdir -p "$out" "$work"
conv() { "$py" -c "import sys; sys.argv[0]='marlin-convert'; from converter.cli import main_convert; main_convert()" "$@"; }
now() { date +%s.%N; }
fail=0

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
"$py" -c "import torch, transformers, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| cupy', cupy.__version__, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'torch has no CUDA')" 2>&1 || echo "(version probe failed: is this the GPU machine?)"

echo "== 1. GPU tests of the model path"
if [ "${SKIP_TESTS:-0}" = 1 ]; then echo "   skipped (SKIP_TESTS)"; else
  timeout 300 "$py" -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_model_gpu.py 2>&1 | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "GPU model tests FAILED"; fail=1; }
fi

echo "== 2. every real model"
: > "$out/runs.tsv"
srcs=()
for d in "$real"/llama-tiny/*/ "$real"/minilm/minilm-autoround-gptq-w4g128-asym-full/; do [ -d "$d" ] && srcs+=("${d%/}"); done
[ "${#srcs[@]}" -gt 0 ] || { echo "no checkpoints under $real (expected llama-tiny/* and minilm/minilm-autoround-gptq-w4g128-asym-full)"; exit 2; }
verify_cmd=("$py" -c "import sys; sys.argv[0]='marlin-verify'; from converter.cli import main_verify; main_verify()")
run() {  # run NAME SRC JSON [extra marlin-verify args]
  local name=$1 src=$2 json=$3 t0 rc
  shift 3
  t0=$(now)
  # shellcheck disable=SC2086  # VERIFY_ARGS is a list of words on purpose
  timeout 600 "${verify_cmd[@]}" "$work/$name" --model --against "$src" "$device" --json ${VERIFY_ARGS:-} "$@" > "$json" 2> "$json.stderr"
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$(basename "$json" .json)" "$rc" "$(awk -v a="$t0" -v b="$(now)" 'BEGIN { print b - a }')" "$json" >> "$out/runs.tsv"
  [ "$rc" -eq 0 ] || fail=1
  echo "   $(basename "$json" .json): exit $rc"
}
for src in "${srcs[@]}"; do
  name=$(basename "$src")
  if ! conv "$src" "$work/$name/" --force --quiet; then echo "CONVERT FAILED $name"; fail=1; continue; fi
  run "$name" "$src" "$out/$name.json"
done

echo "== 3. --text (perplexity) on the act-order Llama"
descact="$real/llama-tiny/gptqmodel-gptq-w4g128-asym-descact"
[ -d "$work/gptqmodel-gptq-w4g128-asym-descact" ] && run gptqmodel-gptq-w4g128-asym-descact "$descact" "$out/descact+text.json" --text README.md

"$py" - "$out/runs.tsv" <<'PY' || fail=1
import json, sys

def f(v, spec=".2e"):
    return "-" if v is None else format(v, spec)

rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
head = ["model", "exit", "output", "mean rel err ours / 16-bit", "max rel err ours / 16-bit", "top-1 ours / 16-bit", "top-5 ours / 16-bit",
        "cosine ours / 16-bit", "ppl ours / 16-bit / fp32", "worst layer (kernel) / 16-bit", "layers", "GPU MB", "verify s", "wall s"]
table, bad = [], 0
for name, rc, wall, path in rows:
    try:
        d = json.load(open(path))
    except (OSError, ValueError) as exc:
        table.append([name, rc, f"no JSON ({exc}); stderr: {open(path + '.stderr').read().strip()[:200]}"])
        bad += 1
        continue
    if "error" in d:
        table.append([name, rc, f"error: {d['error']['message'][:200]}"])
        bad += 1
        continue
    c, h, r = d["metrics"].get("converted", {}), d["metrics"].get("fp16_dequant", {}), d["metrics"].get("fp32", {})
    paths = {}
    for p in d["load"].get("layers", {}).values():
        paths[p] = paths.get(p, 0) + 1
    kernel = [x for x in d["layers"] if x["path"] == "marlin-kernel" and x["rel_err"] is not None]
    worst = max(kernel, key=lambda x: x["rel_err"], default=None)
    table.append([
        name, rc, d["output"],
        f"{f(c.get('mean_rel_err'))} / {f(h.get('mean_rel_err'))}", f"{f(c.get('max_rel_err'))} / {f(h.get('max_rel_err'))}",
        f"{f(c.get('top1'), '.4f')} / {f(h.get('top1'), '.4f')}", f"{f(c.get('top5'), '.4f')} / {f(h.get('top5'), '.4f')}",
        f"{f(c.get('cosine'), '.6f')} / {f(h.get('cosine'), '.6f')}" if "cosine" in c else "-",
        f"{f(c.get('ppl'), '.4g')} / {f(h.get('ppl'), '.4g')} / {f(r.get('ppl'), '.4g')}" if "ppl" in c else "-",
        f"{f(worst['rel_err'])} / {f(worst['fp16_rel_err'])}" if worst else "-",
        " ".join(f"{n} {k}" for k, n in sorted(paths.items())),
        f"{(d.get('gpu_peak_bytes') or 0) / 2**20:.0f}", f"{d['wall_s']:.1f}", f"{float(wall):.1f}",
    ])
    errors = [p["message"] for p in d["problems"] if p["severity"] == "error"]
    if not d["ok"] or rc != "0":
        bad += 1
        table.append(["", "", "PROBLEMS: " + " | ".join(errors[:3])])
widths = [max(len(str(row[i])) for row in [head] + table if i < len(row)) for i in range(len(head))]
for row in [head] + table:
    print("  ".join(str(v).ljust(widths[i]) if i < len(row) - 1 else str(v) for i, v in enumerate(row)))
print(f"== {len(rows) - bad} of {len(rows)} passed")
sys.exit(1 if bad else 0)
PY
exit $fail
