"""benchmarks/ab_streamk_variants.py on the CPU: a variant's spec (source, defines, run
length, block size) and the stored variants that are meant to be timed still apply to the
shipped kernel (a patch that no longer matches is refused by name, not half applied)."""

from __future__ import annotations

import pytest

from benchmarks.ab_streamk_variants import KERNEL, apply_patch, parse
from tests.helpers.paths import REPO

VARIANTS = REPO / "docs" / "notes" / "streamk_variants"


def test_a_variant_spec_names_source_defines_run_length_and_block_size() -> None:
    name, code, defines, iters, threads, pipe = parse(
        f"wg4={VARIANTS / 'four_consumer_warpgroups.patch'}:SK_WG4=1,X=2@55%640"
    )
    assert (name, defines, iters, threads, pipe) == ("wg4", ("-DSK_WG4=1", "-DX=2"), 55, 640, None)
    assert "struct ConsumerShape" in code and "struct ConsumerShape" not in KERNEL.read_text()
    assert parse("main=-")[1:] == (KERNEL.read_text(), (), None, None, None)
    # ^KIND.R.U.NS forces a pipe on every row, also one the catalog does not build
    assert parse("skg64=-@7^hopper_skg.8.8.6")[3:] == (7, None, ("hopper_skg", 8, 8, 6))
    with pytest.raises(SystemExit, match="a forced pipe is KIND.R.U.NS"):
        parse("x=-^hopper_skg.8")


def test_a_forced_pipe_outside_the_catalog_is_planned() -> None:
    from benchmarks.ab_streamk_variants import allow_pipes
    from converter.gpu.plan import catalog

    before = catalog.GEMM_PIPES
    try:
        allow_pipes([("hopper_skg", 8, 8, 6)])
        v = catalog.kernel_variant(8192, 57344, 128, ("hopper_skg", 8, 8, 6), smem_limit=227 * 1024)
        assert v.name(True) == "marlin_streamk<64, 8, 1, 6, true, true>"
    finally:
        catalog.GEMM_PIPES = before


@pytest.mark.parametrize(
    "patch", ["four_consumer_warpgroups.patch", "deep_wgmma_queue.patch", "bf16_weight_bf16x2.patch"]
)
def test_the_variants_to_time_apply_to_the_shipped_kernel(patch: str) -> None:
    patched = apply_patch(KERNEL.read_text(), (VARIANTS / patch).read_text())
    assert patched != KERNEL.read_text()


def test_a_patch_that_no_longer_matches_is_refused() -> None:
    stale = "@@ -1,1 +1,1 @@\n-no such line in the kernel\n+anything\n"
    with pytest.raises(SystemExit, match="does not match the kernel exactly once"):
        apply_patch(KERNEL.read_text(), stale)
