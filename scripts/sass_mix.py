#!/usr/bin/env python3
"""Instruction mix of a kernel's main loop, from a cubin, without a disassembler here.

The GPU machine has ``cuobjdump``; this one has only ``nvcc``/``ptxas``. A
``cuobjdump -sass`` listing of any cubin of the same architecture maps each
instruction's low 12 bits (its opcode field) to a mnemonic; with that table this
script reads the ``.text`` sections of a cubin built here and prints, per kernel, the
opcode histogram of the stretch from the first ``SYNCS`` (mbarrier wait) before the
first ``HGMMA`` to the branch after the last ``HGMMA`` of that run: the consumer's
stage loop in ``kernels/marlin_streamk.cu``. Opcodes the listing never showed print
as ``?xyz``. Used for docs/notes/perf_notes.md ("The instruction diet").

Usage (GPU machine, once):  cuobjdump -sass some.cubin > listing.sass
        (here)  nvcc -std=c++17 -arch=sm_90a -cubin -Ikernels inst.cu -o k.cubin
                python3 scripts/sass_mix.py listing.sass k.cubin [name-filter]
where inst.cu #includes the kernel and instantiates the wanted templates.
"""

from __future__ import annotations

import collections
import re
import struct
import subprocess
import sys


def opcode_table(listing: str) -> dict[int, str]:
    """Low 12 bits of the first instruction word -> mnemonic, from a cuobjdump listing."""
    table: dict[int, str] = {}
    pat = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;\s*/\* 0x([0-9a-f]{16}) \*/")
    with open(listing, encoding="utf-8") as f:
        for line in f:
            m = pat.search(line)
            if m:
                table.setdefault(int(m.group(2), 16) & 0xFFF, m.group(1))
    return table


def kernels(cubin: str):
    """(name, [first 64-bit word of each instruction]) per ``.text.<name>`` section."""
    sections = subprocess.run(["readelf", "-S", "-W", cubin], capture_output=True, text=True, check=True).stdout
    with open(cubin, "rb") as f:
        data = f.read()
    for line in sections.splitlines():
        m = re.search(r"\]\s+\.text\.(\S+)\s+\S+\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)", line)
        if m:
            off, size = int(m.group(2), 16), int(m.group(3), 16)
            yield m.group(1), [struct.unpack_from("<Q", data, off + 16 * i)[0] for i in range(size // 16)]


def main(listing: str, cubin: str, name_filter: str = "") -> None:
    table = opcode_table(listing)
    for name, words in kernels(cubin):
        if name_filter not in name:
            continue
        ops = [table.get(w & 0xFFF, f"?{w & 0xFFF:03x}") for w in words]
        mma = [i for i, o in enumerate(ops) if o == "HGMMA"]
        if not mma:
            print(f"{name}: {len(ops)} instructions, no HGMMA")
            continue
        end = mma[0]
        while end + 1 < len(ops) and ops[end + 1] != "BRA":
            end += 1
        start = mma[0]
        while start > 0 and ops[start] != "SYNCS":
            start -= 1
        loop = ops[start : end + 2]
        mix = collections.Counter(loop).most_common()
        print(f"{name}: {len(ops)} instructions; loop {len(loop)}: " + ", ".join(f"{k} {v}" for k, v in mix))


if __name__ == "__main__":
    main(*sys.argv[1:])
