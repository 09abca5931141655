"""scripts/probe_streamk.py patches the shipped persistent kernel (tests/helpers/streamk_probe.py); its anchors
must still be there."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.paths import REPO
from tests.helpers.streamk_probe import instrumented_source


def test_every_hook_lands_in_the_shipped_kernel() -> None:
    src = instrumented_source(REPO / "kernels")
    # every stamp slot the timeline reads is written exactly where it was meant to be
    assert sorted(int(i) for i in re.findall(r"STAMP\((\d)\);", src)) == [0, 1, 2, 2, 3, 4, 5, 6]
    # both consumer forms lose their wgmma and dequantization under the probe macros
    assert src.count("#ifdef PROBE_NOMMA") == 2
    assert src.count("#ifdef PROBE_NODQ") == 2
    # two defines (0 and 1), then the producer's expected bytes, its bulk copies, the threads' copies
    assert src.count("PROBE_NOLOAD_V") == 5


def test_a_moved_anchor_fails_loudly(tmp_path: Path) -> None:
    folder = tmp_path / "kernels"
    shutil.copytree(REPO / "kernels", folder)
    path = folder / "marlin_streamk.cu"
    text = path.read_text(encoding="utf-8")
    path.write_text(
        text.replace(
            "                if (!b_units) {  // Marlin's order", "                if (!b_units)  {  // Marlin's order"
        ),
        encoding="utf-8",
    )
    moved = r"anchor not found once in marlin_streamk.cu: .                if \(!b_units\) \{  // Marlin's order"
    with pytest.raises(AssertionError, match=moved):
        instrumented_source(folder)
