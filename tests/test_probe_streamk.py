"""scripts/probe_streamk.py patches the shipped persistent kernel (tests/helpers/streamk_probe.py). The probe is
research tooling: an edit to the product kernel that moves one of its anchors skips these checks (with the
anchor named) rather than failing CI; the probe itself still fails loudly when run on such a kernel, and
its anchors are then updated by whoever runs it next."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.paths import REPO
from tests.helpers.streamk_probe import instrumented_source


def _shipped_source() -> str:
    """The shipped kernel with the probe's hooks, or a skip naming the anchor it lost."""
    try:
        return instrumented_source(REPO / "kernels")
    except AssertionError as exc:
        pytest.skip(f"kernels/marlin_streamk.cu moved on from the probe's anchors ({exc}); research tooling, not CI")


def test_every_hook_lands_in_the_shipped_kernel() -> None:
    src = _shipped_source()
    # every stamp slot the timeline reads is written exactly where it was meant to be
    assert sorted(int(i) for i in re.findall(r"STAMP\((\d)\);", src)) == [0, 1, 2, 2, 3, 4, 5, 6]
    # both consumer forms lose their wgmma and dequantization under the probe macros
    assert src.count("#ifdef PROBE_NOMMA") == 2
    assert src.count("#ifdef PROBE_NODQ") == 2
    # two defines (0 and 1), then thread 0's arrive with no bytes and its copies, the threads' copies
    assert src.count("PROBE_NOLOAD_V") == 5


def test_a_moved_anchor_fails_loudly(tmp_path: Path) -> None:
    _shipped_source()
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


def test_weight_copies_rotate_past_the_l2() -> None:
    from tests.helpers.streamk_probe import L2_ROTATION_BYTES, weight_copies

    assert weight_copies(8192, 57344) == 2  # 235 MB of codes: two copies already
    assert weight_copies(4096, 4096) == 23  # 8 MiB each: 23 x 8 MiB >= 180 MiB
    for k, n in ((4096, 4096), (8192, 1024), (28672, 8192)):
        c = weight_copies(k, n)
        assert c * k * n // 2 >= L2_ROTATION_BYTES  # enough copies
        assert c == 2 or (c - 1) * k * n // 2 < L2_ROTATION_BYTES  # and no more


def test_persistent_cases_name_the_row_another_kernel_serves() -> None:
    from tests.helpers.streamk_probe import persistent_cases

    pipes = persistent_cases("8192:57344:1,28672:8192:64")
    assert [p[0].value for p in pipes.values()] == ["hopper_skg", "hopper_sk"]
    assert list(pipes) == [(8192, 57344, 1), (28672, 8192, 64)]
    with pytest.raises(ValueError, match=r"^4096x4096 at M=1 is served by decode, not the persistent kernel$"):
        persistent_cases("4096:4096:1")
