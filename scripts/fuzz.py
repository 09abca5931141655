#!/usr/bin/env python3
"""Mutation fuzzer for every parser that reads files from strangers.

Usage::

    python scripts/fuzz.py                       # 100_000 examples over 4 targets, 2 workers
    python scripts/fuzz.py -n 20000 --targets safetensors,artifact --workers 1 --seed 3

Targets (each a parser plus the code that consumes its result):

* ``safetensors``: :class:`~converter.safetensors_io.SafetensorsFile` on a GPTQ shard,
  then every tensor's array and bytes.
* ``artifact``: ``marlin-verify --shapes``'s path (:func:`converter.verify.verify`
  with ``shapes_only``): container, ``__metadata__``, manifest JSON, JSON Schema,
  checksums, shapes.
* ``tinyloop``: :class:`~converter.formats.tinyloop.TinyloopSource`, ``plan()``, and
  a few ``load_layer``/``load_tensor`` calls, on ``tests/data/sample.tinyloop``.
* ``gptq_config``: ``quantize_config.json`` of a small GPTQ folder, through
  ``open_source`` and ``plan()``.

Each example takes a valid seed file and applies 1-4 random mutations: byte and bit
flips, truncation, appended or inserted bytes, an "interesting" integer over the
length field, and structural JSON mutations of the header (and, for artifacts, of the
manifest inside it, re-sealing its checksum so the mutation reaches the deeper
checks): replace a value with an interesting one, delete or duplicate a key, deep
nesting.  The only exceptions allowed to escape are ``ConverterError`` and its
subclasses; anything else, and any example that runs longer than ``--timeout``
seconds (a hang), is a failure, saved under ``--out`` as a reproducer.

The seeds, mutators and targets are ``tests/helpers/fuzzing.py``;
``tests/test_fuzz.py`` drives the same from Hypothesis (``st.randoms()``), with a small
CI budget.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a plain script from a fresh checkout
    sys.path.insert(0, str(REPO))

from tests.helpers.fuzzing import TARGETS, build_seeds, check_one, mutate  # noqa: E402


# -- driver -----------------------------------------------------------------------------
def _worker(args: tuple[str, int, int, float, str]) -> tuple[str, int, Counter, list[tuple[int, str]], list[bytes]]:
    kind, seed, count, timeout, out = args
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="marlin-fuzz-", dir=base) as tmp:
        workdir = Path(tmp)
        seeds = build_seeds(workdir / "seeds")
        seed_bytes = seeds[kind].read_bytes()
        rnd = random.Random(seed)
        failures: list[tuple[int, str]] = []
        kinds: Counter = Counter()
        saved: list[bytes] = []
        for i in range(count):
            data = mutate(seed_bytes, kind, rnd)
            problem = check_one(kind, data, workdir, seeds, timeout, kinds)
            if problem is not None:
                sig = problem.splitlines()[0][:200]
                kinds["fail"] += 1
                if sig not in {f[1].splitlines()[0][:200] for f in failures}:
                    failures.append((i, problem))
                    name = Path(out) / f"{kind}-{seed}-{i}.bin"
                    name.write_bytes(data)
                    saved.append(str(name).encode())
        # restore the config seed for the next job of this worker
        return kind, count, kinds, failures, saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--examples", type=int, default=100_000, help="total examples, split evenly over targets")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per example before it counts as a hang")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "marlin-fuzz-failures")
    a = ap.parse_args(argv)
    targets = [t for t in a.targets.split(",") if t]
    for t in targets:
        if t not in TARGETS:
            ap.error(f"unknown target {t!r} (known: {', '.join(TARGETS)})")
    a.out.mkdir(parents=True, exist_ok=True)
    per_target = a.examples // len(targets)
    jobs_per_target = max(1, a.workers) * 2
    jobs = []
    for ti, t in enumerate(targets):
        for j in range(jobs_per_target):
            n = per_target // jobs_per_target + (1 if j < per_target % jobs_per_target else 0)
            jobs.append((t, a.seed * 1000 + ti * 100 + j, n, a.timeout, str(a.out)))
    t0 = time.monotonic()
    ran: Counter = Counter()
    failed: Counter = Counter()
    outcome: dict[str, Counter] = {t: Counter() for t in targets}
    reports: list[str] = []
    with ProcessPoolExecutor(max_workers=max(1, a.workers)) as pool:
        for kind, count, kinds, failures, saved in pool.map(_worker, jobs):
            ran[kind] += count
            failed[kind] += kinds["fail"]
            outcome[kind].update(kinds)
            for (i, problem), path in zip(failures, saved, strict=True):
                reports.append(f"[{kind}] example {i} ({path.decode()}):\n{problem}")
    dt = time.monotonic() - t0
    total = sum(ran.values())
    for t in targets:
        o = outcome[t]
        print(
            f"{t:12s} {ran[t]:8d} examples, {failed[t]:5d} failures "
            f"(accepted {o['accepted']}, refused with our own error {o['refused']})"
        )
    print(f"total        {total:8d} examples in {dt:.0f} s ({total / dt:.0f}/s), {sum(failed.values())} failures")
    for r in reports[:20]:
        print(r)
    return 1 if sum(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
