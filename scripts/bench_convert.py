#!/usr/bin/env python3
"""Time ``marlin-convert`` against ``cp`` of the same input, and our packer against a
float-round-trip reference packer.

Usage::

    python scripts/make_big_gptq.py /tmp/big-gptq          # once: ~2.1 GB, 4 shards
    python scripts/bench_convert.py /tmp/big-gptq --out-dir /tmp/bench --runs 2
    python scripts/bench_convert.py --packer-only          # just the 8192x8192 packer race

Conversion: each run copies the input's weight files with ``cp`` and then converts
them (in that order, so ``cp`` pays for any cold page cache first and the converter
gets no head start; dropping caches needs root privileges we do not assume, and both
read the same, by then cached, input).  Every output goes to ``--out-dir`` and is
deleted after its run.  Peak RSS is the converter child's ``ru_maxrss`` (file-backed
mmap pages it has touched count too), compared with the bound ``3 x largest tensor +
300 MB``.  Targets: convert <= 2x cp, peak RSS within the bound.

Packer: ``converter.marlin.layout.pack_b`` (and the GPTQ-words fast path
``pack_b_from_gptq4``) against an upstream-style reference that dequantizes to float,
re-quantizes with ``round(w / s) + 8`` and permutes with index arrays, as IST-DASLab
``marlin.Layer.pack`` does.  Target: >= 10x faster, bit-identical.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from converter.formats.packing import pack_words, unpack_words  # noqa: E402
from converter.marlin.layout import pack_b, pack_b_from_gptq4  # noqa: E402
from converter.safetensors_io import SafetensorsFile  # noqa: E402

MB = 1e6


# -- conversion vs cp -----------------------------------------------------------------
def weight_files(src: Path) -> list[Path]:
    return sorted(src.glob("*.safetensors")) if src.is_dir() else [src]


def largest_tensor(files: list[Path]) -> tuple[str, int]:
    best = ("", 0)
    for f in files:
        with SafetensorsFile(f) as sf:
            for name in sf.infos:
                b, e = sf.byte_range(name)
                if e - b > best[1]:
                    best = (name, e - b)
    return best


def child_maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB


def time_cp(files: list[Path], dest: Path) -> float:
    dest.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    subprocess.run(["cp", *map(str, files), str(dest)], check=True)
    subprocess.run(["sync", "-f", str(dest)], check=False)  # same durability as our fsync
    dt = time.perf_counter() - t
    shutil.rmtree(dest)
    return dt


def time_convert(src: Path, out: Path) -> float:
    exe = shutil.which("marlin-convert", path=str(Path(sys.executable).parent)) or "marlin-convert"
    t = time.perf_counter()
    r = subprocess.run([exe, str(src), str(out), "--force", "--quiet"], capture_output=True, text=True)
    dt = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"marlin-convert failed ({r.returncode}): {r.stderr.strip()}")
    out.unlink()
    return dt


def bench_convert(src: Path, out_dir: Path, runs: int) -> dict:
    files = weight_files(src)
    in_bytes = sum(f.stat().st_size for f in files)
    name, big = largest_tensor(files)
    bound = 3 * big + 300 * 2**20
    out_dir.mkdir(parents=True, exist_ok=True)
    cps, convs = [], []
    for r in range(runs):
        cps.append(time_cp(files, out_dir / "cp"))
        convs.append(time_convert(src, out_dir / "bench.marlin.safetensors"))
        print(f"run {r + 1}: cp {cps[-1]:.2f} s, marlin-convert {convs[-1]:.2f} s", flush=True)
    rss = child_maxrss_bytes()
    cp_t, conv_t = min(cps), min(convs)
    res = {
        "input": str(src),
        "input_bytes": in_bytes,
        "files": len(files),
        "runs": runs,
        "cp_s": cp_t,
        "convert_s": conv_t,
        "ratio": conv_t / cp_t,
        "convert_GBps": in_bytes / conv_t / 1e9,
        "cp_GBps": in_bytes / cp_t / 1e9,
        "peak_rss_bytes": rss,
        "largest_tensor": name,
        "largest_tensor_bytes": big,
        "rss_bound_bytes": bound,
        "rss_ok": rss <= bound,
        "time_ok": conv_t <= 2 * cp_t,
    }
    print(
        f"input {in_bytes / MB:.0f} MB in {len(files)} files; best of {runs}: cp {cp_t:.2f} s "
        f"({res['cp_GBps']:.2f} GB/s), marlin-convert {conv_t:.2f} s ({res['convert_GBps']:.2f} GB/s): "
        f"ratio {res['ratio']:.2f}x (target <= 2x: {'met' if res['time_ok'] else 'MISSED'})"
    )
    print(
        f"peak RSS {rss / MB:.0f} MB; largest tensor {name} {big / MB:.1f} MB; bound 3x + 300 MiB = "
        f"{bound / MB:.0f} MB ({'met' if res['rss_ok'] else 'MISSED'})"
    )
    return res


# -- packer race ----------------------------------------------------------------------
def _upstream_perms() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IST-DASLab marlin ``_get_perms`` (spec 4.3/4.4), in NumPy."""
    perm = []
    for i in range(32):
        perm1 = []
        col = i // 4
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1):
                perm1.append(16 * row + col + 8 * block)
        for j in range(4):
            perm.extend(p + 256 * j for p in perm1)
    perm_a = np.array(perm).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].ravel()
    scale_perm = np.array([i + 8 * j for i in range(8) for j in range(8)])
    scale_single = np.array([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])
    return perm_a, scale_perm, scale_single


def reference_pack(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group_size: int) -> np.ndarray:
    """Upstream-style: dequantize to float, re-quantize against Marlin's symmetric
    offset (delta absorbs the zero point), tile, gather with ``_perm``, pack nibbles."""
    k, n = q.shape
    g = np.arange(k) // group_size
    s = scales.astype(np.float32)[g]
    w = (q.astype(np.float32) - zeros.astype(np.float32)[g]) * s  # the source weight
    delta = (8.0 - zeros.astype(np.float32)[g]) * s
    codes = np.clip(np.round((w - delta) / s) + 8, 0, 15).astype(np.int64)
    perm, _, _ = _upstream_perms()
    t = codes.reshape(k // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(k // 16, n * 16)
    t = t.reshape(-1, perm.size)[:, perm].reshape(t.shape).astype(np.uint32)
    out = np.zeros((t.shape[0], t.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        out |= t[:, i::8] << np.uint32(4 * i)
    return out.view(np.int32)


def _best(fn, repeat: int) -> tuple[float, object]:
    best, res = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        res = fn()
        best = min(best, time.perf_counter() - t)
    return best, res


def bench_packer(size: int = 8192, group_size: int = 128, repeat: int = 3) -> dict:
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (size, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 2e-2, (size // group_size, size)).astype(np.float16)
    zeros = rng.integers(0, 16, (size // group_size, size), dtype=np.uint8)
    words = pack_words(q, 4, axis=0)
    t_ref, ref = _best(lambda: reference_pack(q, scales, zeros, group_size), 1)
    t_ours, ours = _best(lambda: pack_b(q), repeat)
    t_fast, fast = _best(lambda: pack_b_from_gptq4(words), repeat)
    t_unpack, _ = _best(lambda: pack_b(unpack_words(words, 4, axis=0)), repeat)
    same = bool(np.array_equal(ref, ours)) and bool(np.array_equal(ref, fast))
    res = {
        "size": size,
        "reference_s": t_ref,
        "pack_b_s": t_ours,
        "speedup": t_ref / t_ours,
        "gptq_words_fast_s": t_fast,
        "gptq_unpack_then_pack_s": t_unpack,
        "bit_identical": same,
    }
    print(
        f"packer {size}x{size}, group {group_size}: reference (float round trip) {t_ref:.2f} s; "
        f"pack_b {t_ours:.3f} s ({res['speedup']:.0f}x, target >= 10x: {'met' if res['speedup'] >= 10 else 'MISSED'}); "
        f"bit-identical: {same}"
    )
    print(f"  from GPTQ qweight words: pack_b_from_gptq4 {t_fast:.3f} s vs unpack_words + pack_b {t_unpack:.3f} s")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", type=Path, nargs="?", help="GPTQ checkpoint folder (make one with make_big_gptq.py)")
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/marlin-bench"))
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--packer-only", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    results = {}
    if not a.packer_only:
        if a.input is None:
            ap.error("give the input folder, or --packer-only")
        results["convert"] = bench_convert(a.input, a.out_dir, a.runs)
    results["packer"] = bench_packer()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    ok = results["packer"]["bit_identical"] and results["packer"]["speedup"] >= 10
    if "convert" in results:
        ok = ok and results["convert"]["rss_ok"] and results["convert"]["time_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
