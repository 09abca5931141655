#!/usr/bin/env python3
"""Measure every target of the CPU performance issue (11) in paired runs, and the packers.

Usage::

    python scripts/make_big_gptq.py /tmp/big-gptq          # once: ~2.1 GB, 4 shards, 98 layers
    python benchmarks/bench_convert.py /tmp/big-gptq --runs 5 --json /tmp/bench.json
    python benchmarks/bench_convert.py /tmp/big-gptq --runs 5 --base-hashes /tmp/base_hashes.txt
    python benchmarks/bench_convert.py --packer-only          # just the 8192x8192 packer race

Each run is one pair, in this order: ``cp`` of the input's weight files plus ``sync -f``
on the copy (the converter fsyncs too), ``marlin-convert``, then ``marlin-verify OUT
--against IN --cpu`` (CPU numerics); the copy and the artifact are deleted after their
run, so that neither tool ever replaces an old output.  The ratios are taken within a run (convert / cp,
verify / convert), and the medians over runs are compared with the targets, so a noisy
neighbour slows both sides of a pair alike.  ``cp`` goes first so that it pays for any
cold page cache (dropping caches needs root privileges we do not assume).  Both tools
run on a pseudo-terminal, as a user would run them, so each run also measures the time
from start to the first progress output (the first printable text; rich's cursor codes
do not count).  Peak RSS is each child's own ``ru_maxrss`` (``wait4``); file-backed
pages the child has mapped count too.  After the pairs, ``marlin-verify OUT --cpu``
(default checks, no source) runs once for its RSS, and the input is converted once more
with ``MARLIN_NATIVE=0`` (the NumPy packer, the reference): the two artifacts must be
byte-identical.  With ``--base-hashes FILE`` (``scripts/artifact_hashes.sh`` output of
the main branch) the real checkpoints and the sample are converted and compared too.

Targets (issue 11): convert <= 1.5x cp+sync; verify --against <= 1.5x convert; peak RSS
of convert, verify and verify --against <= 3 x largest tensor + 300 MiB; first progress
output <= 1 s; artifacts byte-identical.  Exit 0 when all hold, else 1, after printing
which missed.

Packer race: ``converter.marlin.layout.pack_b`` (compiled when built, and its NumPy twin)
and the GPTQ-words fast path against an upstream-style reference that dequantizes to
float, re-quantizes with ``round(w / s) + 8`` and permutes with index arrays, as
IST-DASLab ``marlin.Layer.pack`` does: bit-identical, and ``pack_b`` >= 10x faster.
"""

from __future__ import annotations

import argparse
import fcntl
import filecmp
import json
import os
import pty
import re
import select
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from converter import native  # noqa: E402
from converter.formats.packing import pack_words, unpack_words  # noqa: E402
from converter.marlin.layout import (  # noqa: E402
    pack_b,
    pack_b_from_gptq4,
    pack_b_from_gptq4_numpy,
    pack_b_numpy,
)
from tests.helpers.synthetic_gptq import largest_tensor  # noqa: E402

MB = 1e6
MIB = 2**20
CONVERT_VS_CP = 1.5
VERIFY_VS_CONVERT = 1.5
FIRST_OUTPUT_S = 1.0
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\x1b[=>]")


# -- running the tools ----------------------------------------------------------------
def tool(name: str) -> str:
    return shutil.which(name, path=str(Path(sys.executable).parent)) or name


def run_on_tty(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Run ``cmd`` on a fresh pseudo-terminal (120 x 40).

    Returns ``{"rc", "wall_s", "cpu_s", "first_output_s", "maxrss_bytes", "tail"}``
    (``cpu_s``: user + system time of the child); the first output is the first read
    holding a printable character once ANSI codes are removed.
    """
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    first = None
    out = bytearray()
    while True:
        ready, _, _ = select.select([master], [], [], 0.05)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        if first is None and any(chr(c).isalnum() for c in ANSI.sub(b"", data)):
            first = time.perf_counter() - t0
        out += data
        del out[:-4096]
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    os.close(master)
    text = ANSI.sub(b"", bytes(out)).decode("utf-8", "replace")
    return {
        "rc": proc.returncode,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "first_output_s": first,
        "maxrss_bytes": usage.ru_maxrss * 1024,  # Linux: KiB
        "tail": text.strip().splitlines()[-1:] if text.strip() else [],
    }


def checked(res: dict, what: str) -> dict:
    if res["rc"]:
        raise SystemExit(f"{what} failed ({res['rc']}): {' '.join(res['tail'])}")
    return res


def weight_files(src: Path) -> list[Path]:
    return sorted(src.glob("*.safetensors")) if src.is_dir() else [src]


def time_cp(files: list[Path], dest: Path) -> float:
    dest.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    subprocess.run(["cp", *map(str, files), str(dest)], check=True)
    subprocess.run(["sync", "-f", str(dest)], check=False)  # same durability as our fsync
    dt = time.perf_counter() - t
    shutil.rmtree(dest)
    return dt


# -- the paired runs ------------------------------------------------------------------
def bench(src: Path, out_dir: Path, runs: int, base_hashes: Path | None) -> dict:
    files = weight_files(src)
    in_bytes = sum(f.stat().st_size for f in files)
    name, big = largest_tensor(files)
    bound = 3 * big + 300 * MIB
    out_dir.mkdir(parents=True, exist_ok=True)
    art = out_dir / "bench.marlin.safetensors"
    pairs = []
    for r in range(runs):
        cp_s = time_cp(files, out_dir / "cp")
        conv = checked(run_on_tty([tool("marlin-convert"), str(src), str(art), "--force"]), "marlin-convert")
        ver = checked(
            run_on_tty([tool("marlin-verify"), str(art), "--against", str(src), "--cpu"]), "marlin-verify --against"
        )
        pairs.append({"cp_s": cp_s, "convert": conv, "verify_against": ver})
        if r + 1 < runs:
            # As cp's copy is: every run writes a new output, none replaces an old one.
            art.unlink()
        print(
            f"run {r + 1}: cp+sync {cp_s:.2f} s, marlin-convert {conv['wall_s']:.2f} s "
            f"({conv['wall_s'] / cp_s:.2f}x), marlin-verify --against {ver['wall_s']:.2f} s "
            f"({ver['wall_s'] / conv['wall_s']:.2f}x convert); first output {conv['first_output_s']:.2f} / "
            f"{ver['first_output_s']:.2f} s; peak RSS {conv['maxrss_bytes'] / MB:.0f} / "
            f"{ver['maxrss_bytes'] / MB:.0f} MB",
            flush=True,
        )
    plain = checked(run_on_tty([tool("marlin-verify"), str(art), "--cpu"]), "marlin-verify")
    print(
        f"marlin-verify (default, CPU numerics): {plain['wall_s']:.2f} s, peak RSS {plain['maxrss_bytes'] / MB:.0f} MB"
    )
    ref = out_dir / "numpy.marlin.safetensors"
    env = {**os.environ, "MARLIN_NATIVE": "0"}
    numpy_run = checked(run_on_tty([tool("marlin-convert"), str(src), str(ref), "--force"], env), "NumPy convert")
    same = filecmp.cmp(art, ref, shallow=False)
    print(f"NumPy-packer conversion: {numpy_run['wall_s']:.2f} s; artifacts byte-identical: {same}")
    art.unlink()
    ref.unlink()
    real = None
    if base_hashes is not None:
        with tempfile.TemporaryDirectory(prefix="marlin-hashes-") as tmp:
            got = subprocess.run(
                ["bash", str(REPO / "scripts" / "artifact_hashes.sh"), str(Path(tmp) / "out")],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "MARLIN_BIN": str(Path(sys.executable).parent)},
            ).stdout
        real = got == base_hashes.read_text()
        print(f"real checkpoints and sample vs {base_hashes}: byte-identical: {real}")

    def med(values: list[float]) -> float:
        return float(statistics.median(values))

    conv_ratio = med([p["convert"]["wall_s"] / p["cp_s"] for p in pairs])
    ver_ratio = med([p["verify_against"]["wall_s"] / p["convert"]["wall_s"] for p in pairs])
    first = max(
        med([p["convert"]["first_output_s"] for p in pairs]),
        med([p["verify_against"]["first_output_s"] for p in pairs]),
    )
    rss = {
        "convert": max(p["convert"]["maxrss_bytes"] for p in pairs),
        "verify": plain["maxrss_bytes"],
        "verify_against": max(p["verify_against"]["maxrss_bytes"] for p in pairs),
    }
    targets = {
        f"marlin-convert wall time <= {CONVERT_VS_CP}x cp + sync (median ratio)": (
            conv_ratio,
            conv_ratio <= CONVERT_VS_CP,
        ),
        f"marlin-verify --against wall time <= {VERIFY_VS_CONVERT}x marlin-convert (median ratio)": (
            ver_ratio,
            ver_ratio <= VERIFY_VS_CONVERT,
        ),
        **{
            f"{tool_name} peak RSS <= 3 x largest tensor + 300 MiB ({bound / MB:.0f} MB)": (v / MB, v <= bound)
            for tool_name, v in (
                ("marlin-convert", rss["convert"]),
                ("marlin-verify", rss["verify"]),
                ("marlin-verify --against", rss["verify_against"]),
            )
        },
        f"time to the first progress output (TTY) <= {FIRST_OUTPUT_S:g} s (median, worse tool)": (
            first,
            first <= FIRST_OUTPUT_S,
        ),
        "artifact byte-identical to the NumPy packer's": (same, same),
    }
    if real is not None:
        targets["real checkpoints and sample byte-identical to the base hashes"] = (real, real)
    return {
        "input": str(src),
        "input_bytes": in_bytes,
        "files": len(files),
        "runs": runs,
        "native": native.status(),
        "largest_tensor": name,
        "largest_tensor_bytes": big,
        "rss_bound_bytes": bound,
        "pairs": pairs,
        "median": {
            "cp_s": med([p["cp_s"] for p in pairs]),
            "convert_s": med([p["convert"]["wall_s"] for p in pairs]),
            "verify_against_s": med([p["verify_against"]["wall_s"] for p in pairs]),
            "convert_cpu_s": med([p["convert"]["cpu_s"] for p in pairs]),
            "verify_against_cpu_s": med([p["verify_against"]["cpu_s"] for p in pairs]),
            "convert_vs_cp": conv_ratio,
            "verify_vs_convert": ver_ratio,
            "first_output_convert_s": med([p["convert"]["first_output_s"] for p in pairs]),
            "first_output_verify_s": med([p["verify_against"]["first_output_s"] for p in pairs]),
        },
        "verify_default": plain,
        "numpy_convert_s": numpy_run["wall_s"],
        "peak_rss_bytes": rss,
        "targets": {k: {"value": v, "met": bool(ok)} for k, (v, ok) in targets.items()},
    }


# -- packer race ----------------------------------------------------------------------
def _upstream_perm() -> np.ndarray:
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
    return np.array(perm).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].ravel()


def reference_pack(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group_size: int) -> np.ndarray:
    """Upstream-style: dequantize to float, re-quantize against Marlin's symmetric
    offset (delta absorbs the zero point), tile, gather with ``_perm``, pack nibbles."""
    k, n = q.shape
    g = np.arange(k) // group_size
    s = scales.astype(np.float32)[g]
    w = (q.astype(np.float32) - zeros.astype(np.float32)[g]) * s  # the source weight
    delta = (8.0 - zeros.astype(np.float32)[g]) * s
    codes = np.clip(np.round((w - delta) / s) + 8, 0, 15).astype(np.int64)
    perm = _upstream_perm()
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
    out = np.empty((size // 16, 2 * size), dtype=np.int32)
    t_ref, ref = _best(lambda: reference_pack(q, scales, zeros, group_size), 1)
    t_ours, ours = _best(lambda: pack_b(q), repeat)
    t_numpy, ours_np = _best(lambda: pack_b_numpy(q), repeat)
    t_fast, fast = _best(lambda: pack_b_from_gptq4(words, out=out), repeat)
    t_fast_np, fast_np = _best(lambda: pack_b_from_gptq4_numpy(words), repeat)
    t_unpack, _ = _best(lambda: pack_b(unpack_words(words, 4, axis=0)), repeat)
    same = all(np.array_equal(ref, b) for b in (ours, ours_np, fast, fast_np))
    res = {
        "size": size,
        "native": native.status(),
        "reference_s": t_ref,
        "pack_b_s": t_ours,
        "pack_b_numpy_s": t_numpy,
        "speedup": t_ref / t_ours,
        "gptq_words_fast_s": t_fast,
        "gptq_words_fast_GBps": words.nbytes / t_fast / 1e9,
        "gptq_words_numpy_s": t_fast_np,
        "gptq_words_numpy_GBps": words.nbytes / t_fast_np / 1e9,
        "gptq_unpack_then_pack_s": t_unpack,
        "bit_identical": same,
    }
    print(
        f"packer {size}x{size}, group {group_size} ({native.status()}): reference (float round trip) {t_ref:.2f} s; "
        f"pack_b {t_ours:.3f} s ({res['speedup']:.0f}x, target >= 10x: {'met' if res['speedup'] >= 10 else 'MISSED'}), "
        f"NumPy pack_b {t_numpy:.3f} s; bit-identical: {same}"
    )
    print(
        f"  from GPTQ qweight words: {t_fast:.3f} s ({res['gptq_words_fast_GBps']:.1f} GB/s of words), NumPy "
        f"{t_fast_np:.3f} s ({res['gptq_words_numpy_GBps']:.2f} GB/s); unpack_words + pack_b {t_unpack:.3f} s"
    )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", type=Path, nargs="?", help="GPTQ checkpoint folder (make one with make_big_gptq.py)")
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/marlin-bench"))
    ap.add_argument("--runs", type=int, default=5, help="paired runs (medians are taken over them)")
    ap.add_argument(
        "--base-hashes", type=Path, help="scripts/artifact_hashes.sh output to compare the real inputs with"
    )
    ap.add_argument("--packer-only", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    results = {}
    if not a.packer_only:
        if a.input is None:
            ap.error("give the input folder, or --packer-only")
        results["convert"] = bench(a.input, a.out_dir, a.runs, a.base_hashes)
    results["packer"] = bench_packer()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    missed = []
    if not (results["packer"]["bit_identical"] and results["packer"]["speedup"] >= 10):
        missed.append("packer: bit-identical and >= 10x the reference")
    if "convert" in results:
        c = results["convert"]
        print(
            f"\ninput {c['input_bytes'] / MB:.0f} MB in {c['files']} files, {c['runs']} paired runs, medians: "
            f"cp+sync {c['median']['cp_s']:.2f} s, marlin-convert {c['median']['convert_s']:.2f} s, "
            f"marlin-verify --against {c['median']['verify_against_s']:.2f} s "
            f"(CPU time: {c['median']['convert_cpu_s']:.2f} s and {c['median']['verify_against_cpu_s']:.2f} s)"
        )
        for what, t in c["targets"].items():
            value = t["value"]
            shown = f"{value:.2f}" if isinstance(value, float) else str(value)
            print(f"  {'met   ' if t['met'] else 'MISSED'} {what}: {shown}")
            if not t["met"]:
                missed.append(what)
    if missed:
        print("missed: " + "; ".join(missed))
        return 1
    print("all targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
