"""Streaming and memory (issue 5, item 5).

Conversion goes tensor by tensor from memory-mapped input; the input pages each chunk
touched are dropped (``MADV_DONTNEED``) so they do not pile up in RSS.  Peak RSS of
the ``marlin-convert`` process must stay at or below 3 x the largest single tensor +
300 MiB.  The default run uses a ~420 MB checkpoint whose bound (~350 MB) is below
the input size, so a converter that held the model (or its touched pages) would fail.
The ~2 GB measurement is ``@pytest.mark.slow`` and needs ``MARLIN_BIG=1``; the
benchmark script reports the same number (docs/performance-cpu.md).

Speed is not asserted here (no timed assertions in tests): scripts/bench_convert.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from converter.artifact.validate import validate_artifact
from converter.safetensors_io import SafetensorsFile
from tests.helpers.paths import REPO
from tests.helpers.synthetic_gptq import small_gptq

MIB = 2**20

# Runs the real CLI in a child and prints that child's peak RSS (bytes) as JSON.
_MEASURE = r"""
import json, resource, subprocess, sys
r = subprocess.run([sys.executable, "-c",
    "import sys; sys.argv[0] = 'marlin-convert'; from converter.cli import main_convert; main_convert()",
    *sys.argv[1:]], capture_output=True, text=True)
print(json.dumps({"rc": r.returncode, "stderr": r.stderr[-2000:],
                  "maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def peak_rss_of_convert(src: Path, out: Path) -> int:
    """Peak RSS in bytes of one ``marlin-convert SRC OUT`` process (its own ru_maxrss)."""
    r = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(src), str(out), "--quiet"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=1800,
    )
    res = json.loads(r.stdout)
    assert res["rc"] == 0, res["stderr"]
    return int(res["maxrss"])


def largest_tensor_bytes(src: Path) -> int:
    best = 0
    for f in src.glob("*.safetensors"):
        with SafetensorsFile(f) as sf:
            for name in sf.infos:
                b, e = sf.byte_range(name)
                best = max(best, e - b)
    return best


def _check_memory(src: Path, out: Path) -> tuple[int, int, int]:
    in_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    bound = 3 * largest_tensor_bytes(src) + 300 * MIB
    rss = peak_rss_of_convert(src, out)
    assert rss <= bound, f"peak RSS {rss / MIB:.0f} MiB exceeds 3 x largest tensor + 300 MiB = {bound / MIB:.0f} MiB"
    report, art = validate_artifact(out)
    art.close()
    assert report.ok, [p.message for p in report.problems]
    return in_bytes, bound, rss


def test_peak_rss_bounded_on_a_checkpoint_larger_than_the_bound(tmp_path: Path) -> None:
    src = small_gptq(
        tmp_path / "src", hidden=2048, intermediate=8192, kv=512, blocks=13, vocab=4096, shards=3, group_size=128
    )
    in_bytes, bound, rss = _check_memory(src, tmp_path / "out.safetensors")
    assert in_bytes > bound  # holding the input (or its touched pages) would break the bound


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("MARLIN_BIG"), reason="~2 GB synthetic checkpoint; set MARLIN_BIG=1 (and -m slow) to run"
)
def test_peak_rss_bounded_2gb(tmp_path: Path) -> None:
    src = small_gptq(
        tmp_path / "src", hidden=4096, intermediate=14336, kv=1024, blocks=14, vocab=32000, shards=4, group_size=128
    )
    in_bytes, bound, rss = _check_memory(src, tmp_path / "out.safetensors")
    assert in_bytes > 2e9
