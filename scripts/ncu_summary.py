#!/usr/bin/env python3
"""Summarise the logs of ``scripts/gpu_profile.sh`` as one markdown row per profiled launch.

Usage: python3 scripts/ncu_summary.py OUTDIR [--all]

Reads OUTDIR/ncu.log (the sections) and, when present, OUTDIR/ncu_opcodes.log (the SASS
instruction mix of ``PROF_OPCODES=1``). gpu_profile.sh profiles two launches per case, a
warm-up and the measured one; only the second of each pair is printed unless ``--all``.
Columns: the kernel and its grid, duration (us), DRAM throughput (% of peak), issued
warps per scheduler per cycle (1.0 is the issue limit), active warps per SM, the three
largest stall reasons (cycles per issued instruction), executed warp instructions, and
the five most executed SASS opcodes with their share.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HEADER = re.compile(r"^  (?:void )?(marlin_\w+<[^>]*>)\(.*\) \((\d+), 1, 1\)x\((\d+), 1, 1\)")
METRICS = (
    "Duration",
    "DRAM Throughput",
    "Issued Warp Per Scheduler",
    "Achieved Active Warps Per SM",
    "Executed Instructions",
    "Registers Per Thread",
)


def _launches(text: str) -> list[tuple[str, list[str]]]:
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if HEADER.match(ln)]
    return [(lines[a], lines[a:b]) for a, b in zip(starts, [*starts[1:], len(lines)], strict=True)]


def _value(block: list[str], name: str) -> str:
    pat = re.compile(r"^\s+" + re.escape(name) + r"\s+(?:\S+\s+)?([\d.,]+)\s*$")
    return next((m.group(1) for ln in block if (m := pat.match(ln))), "-")


def _stalls(block: list[str]) -> str:
    pat = re.compile(r"^\s+Stall ([\w ]+?)\s+inst\s+([\d.]+)\s*$")
    found = [(float(m.group(2)), m.group(1)) for ln in block if (m := pat.match(ln))]
    return ", ".join(f"{n} {v:.2f}" for v, n in sorted(found, reverse=True)[:3])


def _opcodes(text: str) -> list[str]:
    """The top opcodes of each launch, in launch order."""
    out = []
    for m in re.finditer(r"sass__inst_executed_per_opcode\s+([\d,]+) \(([^)]*)\)", text, re.S):
        total = int(m.group(1).replace(",", ""))
        pairs = re.findall(r"(\w+):\s*([\d,]+)", m.group(2))
        top = sorted(((int(v.replace(",", "")), k) for k, v in pairs), reverse=True)[:5]
        out.append(", ".join(f"{k} {100 * v / total:.0f}%" for v, k in top))
    return out


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    folder, every = Path(sys.argv[1]), "--all" in sys.argv
    launches = _launches((folder / "ncu.log").read_text(errors="replace"))
    ops_file = folder / "ncu_opcodes.log"
    ops = _opcodes(ops_file.read_text(errors="replace")) if ops_file.exists() else []
    print(
        "| kernel | grid x block | us | DRAM % | issue/sched | warps/SM | regs | top stalls | inst | top SASS opcodes |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---:|---|")
    for i, (head, block) in enumerate(launches):
        if not every and i % 2 == 0:
            continue
        m = HEADER.match(head)
        assert m is not None
        vals = [_value(block, k) for k in METRICS]
        mix = ops[i] if i < len(ops) else "-"
        print(
            f"| `{m.group(1)}` | {m.group(2)} x {m.group(3)} | {vals[0]} | {vals[1]} | {vals[2]} | {vals[3]} "
            f"| {vals[5]} | {_stalls(block)} | {vals[4]} | {mix} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
