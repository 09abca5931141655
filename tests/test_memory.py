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

import numpy as np
import pytest
from test_bad_input import REPO, small_gptq

from converter.artifact.validate import validate_artifact
from converter.formats.gptq import GptqSource
from converter.formats.hf import HFCheckpoint
from converter.formats.packing import unpack_words
from converter.marlin.layout import pack_b, pack_b_from_gptq4
from converter.safetensors_io import SafetensorsFile

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
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(src), str(out), "--quiet"],
                       capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=1800)
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
    src = small_gptq(tmp_path / "src", hidden=2048, intermediate=8192, kv=512, blocks=13, vocab=4096, shards=3, group_size=128)
    in_bytes, bound, rss = _check_memory(src, tmp_path / "out.safetensors")
    assert in_bytes > bound  # holding the input (or its touched pages) would break the bound


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MARLIN_BIG"), reason="~2 GB synthetic checkpoint; set MARLIN_BIG=1 (and -m slow) to run")
def test_peak_rss_bounded_2gb(tmp_path: Path) -> None:
    src = small_gptq(tmp_path / "src", hidden=4096, intermediate=14336, kv=1024, blocks=14, vocab=32000, shards=4, group_size=128)
    in_bytes, bound, rss = _check_memory(src, tmp_path / "out.safetensors")
    assert in_bytes > 2e9


def test_release_pages_drops_touched_mmap_pages(tmp_path: Path) -> None:
    """The mechanism: touched file-backed pages leave RSS after release_pages()."""
    p = tmp_path / "big.safetensors"
    n = 64 * MIB
    header = json.dumps({"x": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(p, "wb") as fh:
        fh.write(len(header).to_bytes(8, "little") + header)
        fh.write(np.ones(n, np.uint8).tobytes())

    def rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    with SafetensorsFile(p) as sf:
        before = rss()
        assert int(sf.array("x")[:: 4096].sum()) == n // 4096  # touch every page
        touched = rss()
        sf.release_pages()
        after = rss()
        assert touched - before > 48 * MIB
        assert touched - after > 48 * MIB
        assert int(sf.array("x")[-1]) == 1  # still readable


def test_gptq_fast_path_is_bit_identical(tmp_path: Path) -> None:
    """convert uses GptqSource.load_packed (B straight from qweight words); it must
    equal the reference path pack_b(load_layer().q) for every chunk."""
    src = small_gptq(tmp_path / "src", hidden=256, intermediate=512, kv=64, blocks=1, vocab=64)
    with GptqSource(HFCheckpoint(src)) as s:
        for layer in s.plan().layers:
            for k0, k1 in ((0, layer.size_k), (0, 128), (128, layer.size_k)):
                b, meta = s.load_packed(layer, k0, k1)
                full = s.load_layer(layer, k0, k1)
                assert np.array_equal(b, pack_b(full.q))
                assert np.array_equal(meta.scales, full.scales) and np.array_equal(meta.delta, full.delta)


@pytest.mark.parametrize("k,n", [(16, 64), (32, 128), (256, 192), (128, 4096)])
def test_pack_b_from_gptq4_matches_pack_b(k: int, n: int) -> None:
    rng = np.random.default_rng(k * n)
    words = rng.integers(-(2**31), 2**31, (k // 8, n), dtype=np.int64).astype(np.int32)
    assert np.array_equal(pack_b_from_gptq4(words), pack_b(unpack_words(words, 4, axis=0)))


def test_pack_b_from_gptq4_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"size_k % 16 == 0 and size_n % 64 == 0"):
        pack_b_from_gptq4(np.zeros((1, 64), np.int32))
    with pytest.raises(ValueError, match=r"qweight must be 2-D int32"):
        pack_b_from_gptq4(np.zeros((2, 64), np.float32))
