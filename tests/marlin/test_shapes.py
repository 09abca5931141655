"""The one shape rule (converter/marlin/shapes.py) that conversion, the layout, the
kernels' launchers and their NumPy twins all apply."""

from __future__ import annotations

import pytest

from converter.errors import KernelError
from converter.marlin.shapes import (
    LayerFit,
    LayerShape,
    check_convertible,
    fit_layer,
    group_count,
    groups_fit,
    kernel_compatible,
    kernel_layer_sizes,
    marlin_shapes,
    padded_width,
    regroup_rows,
    regrouped_size,
    tiles_fit,
    upstream_compatible,
)


@pytest.mark.parametrize(
    "k,n,g,ok,match",
    [
        (512, 512, 128, True, ""),
        (512, 512, -1, True, ""),
        (512, 512, 512, True, ""),
        (512, 50257, 128, False, "size_n = 50257 is not a multiple of 64"),
        (520, 512, 8, False, "size_k = 520 is not a multiple of 16"),
        (512, 512, 24, False, "group_size = 24 is not a multiple of 16"),
        (512, 512, 48, False, "group_size = 48 is not a multiple of 16 that divides size_k = 512"),
    ],
)
def test_check_convertible(k: int, n: int, g: int, ok: bool, match: str) -> None:
    got, reason = check_convertible(k, n, g)
    assert got is ok
    assert match in reason


def test_upstream_and_kernel_limits() -> None:
    assert upstream_compatible(4096, 4096, 128)
    assert upstream_compatible(4096, 4096, -1)
    assert not upstream_compatible(4096, 4096, 64)
    assert not upstream_compatible(384, 384, 128)  # MiniLM: N % 256 != 0
    assert kernel_compatible(384, 384, 128)
    assert kernel_compatible(512, 256, 32)
    assert kernel_compatible(512, 256, 256)
    assert kernel_compatible(192, 64, 48)
    assert not kernel_compatible(80, 64, 16)  # K % 64
    assert not kernel_compatible(512, 96, 128)


@pytest.mark.parametrize(
    ("k", "n", "g"),
    [
        (512, 512, 128),
        (512, 50257, 128),
        (520, 512, 8),
        (512, 512, 24),
        (512, 512, 48),
        (0, 64, -1),
        (64, 0, -1),
        (128, 64, 128),
        (128, 64, 96),
    ],
)
def test_convertible_is_tiles_and_groups(k: int, n: int, g: int) -> None:
    """check_convertible, the layout and the launchers decide by the same two predicates."""
    assert check_convertible(k, n, g)[0] is (tiles_fit(k, n) and groups_fit(k, g))
    try:
        kernel_layer_sizes(k, n, g, error=KernelError)
        ok = True
    except KernelError:
        ok = False
    assert ok is check_convertible(k, n, g)[0]


def test_rule_messages_name_the_numbers() -> None:
    with pytest.raises(
        KernelError, match=r"Marlin B needs size_k % 16 == 0 and size_n % 64 == 0, got size_k=8, size_n=64"
    ):
        kernel_layer_sizes(8, 64, -1, error=KernelError)
    with pytest.raises(ValueError, match=r"group_size = 40 is not a multiple of 16 that divides size_k = 128"):
        kernel_layer_sizes(128, 64, 40)
    assert kernel_layer_sizes(128, 64, -1) == (128, 1, True)
    assert kernel_layer_sizes(128, 64, 32) == (32, 4, False)


def test_group_count_resolves_per_channel() -> None:
    assert group_count(96, -1) == (96, 1)
    assert group_count(96, 32) == (32, 3)
    with pytest.raises(ValueError, match=r"group_size 40 does not divide size_k 96"):
        group_count(96, 40)


def test_marlin_shapes_from_the_sizes() -> None:
    shapes = marlin_shapes(LayerShape(256, 128, 64), act_order=True, bias_dtype="BF16")
    assert {s.value: v for s, v in shapes.items()} == {
        "marlin_B": ("I32", (16, 256)),
        "marlin_scales": ("F16", (4, 128)),
        "marlin_delta": ("F32", (4, 128)),
        "marlin_perm": ("I32", (256,)),
        "bias": ("BF16", (128,)),
    }


def test_marlin_shapes_of_a_padded_layer() -> None:
    shapes = marlin_shapes(LayerShape(64, 50257, 64, padded_n=50304), act_order=False, bias_dtype="F16")
    assert {s.value: v for s, v in shapes.items()} == {
        "marlin_B": ("I32", (4, 100608)),
        "marlin_scales": ("F16", (1, 50304)),
        "marlin_delta": ("F32", (1, 50304)),
        "bias": ("F16", (50257,)),  # the true N: the output's columns
    }


@pytest.mark.parametrize(
    ("k", "n", "g", "pad", "fit"),
    [
        (512, 512, 128, True, LayerFit(True, group_size=128)),
        (512, 512, -1, True, LayerFit(True, group_size=512)),
        # Short last groups (GPTQModel's hidden sizes): gcd(K, g).
        (576, 576, 128, True, LayerFit(True, group_size=64, source_group_size=128)),
        (960, 192, 256, True, LayerFit(True, group_size=64, source_group_size=256)),
        (2880, 64, 256, True, LayerFit(True, group_size=64, source_group_size=256)),
        (1600, 64, 128, True, LayerFit(True, group_size=64, source_group_size=128)),
        (512, 512, 48, True, LayerFit(True, group_size=16, source_group_size=48)),
        # One group longer than K: one group of K (per-channel), whatever its size.
        (64, 64, 128, True, LayerFit(True, group_size=64, source_group_size=128)),
        (64, 64, 100, True, LayerFit(True, group_size=64, source_group_size=100)),
        # N padded to the next multiple of 64, or refused with --no-pad.
        (64, 50257, 64, True, LayerFit(True, group_size=64, padded_n=50304)),
        (576, 32, 128, True, LayerFit(True, group_size=64, source_group_size=128, padded_n=64)),
        (64, 50257, 64, False, LayerFit(False, "size_n = 50257 is not a multiple of 64 (Marlin tile)")),
        # K is never padded; a group size that is no multiple of 16 below K is refused.
        (520, 512, 8, True, LayerFit(False, "size_k = 520 is not a multiple of 16 (Marlin tile)")),
        (576, 64, 100, True, LayerFit(False, "group_size = 100 is not a multiple of 16 that divides size_k = 576")),
        (512, 512, 24, True, LayerFit(False, "group_size = 24 is not a multiple of 16 that divides size_k = 512")),
        (0, 64, -1, True, LayerFit(False, "empty layer (size_k=0, size_n=64)")),
    ],
)
def test_fit_layer(k: int, n: int, g: int, pad: bool, fit: LayerFit) -> None:
    assert fit_layer(k, n, g, pad=pad) == fit
    if fit.ok:  # what it stores always meets the layout's own rule
        assert check_convertible(k, fit.padded_n or n, fit.group_size) == (True, "")
    if fit.source_group_size is not None:
        assert regrouped_size(k, fit.source_group_size) == fit.group_size


def test_padded_width_and_regroup_rows() -> None:
    assert [padded_width(n) for n in (1, 32, 64, 65, 1000, 50257)] == [64, 64, 64, 128, 1024, 50304]
    # K = 576, g = 128 -> 64: artifact group t holds source group t // 2; the short
    # source group 4 is artifact group 8.
    assert regroup_rows(0, 576, 64, 128) == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    # A chunk from row 256 counts from its first source group (2).
    assert regroup_rows(256, 576, 64, 128) == [0, 0, 1, 1, 2]
    assert regroup_rows(0, 960, 64, 256) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 3
    assert regroup_rows(32, 64, 64, 128) == [0]  # one group of K, any chunk
