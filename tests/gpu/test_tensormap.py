"""The persistent Hopper kernel's tensor map of A (``converter.gpu.tensormap``), on the CPU.

The bulk tensor copy is emulated from the map's geometry alone (an element at box
coordinate (i, r, c) is read at byte ``2 i + strides[0] (t0 + r) + strides[1] (c0 + c)``
of A, zero where the token is past M), and must give the slot layout that
``reference.hopper_activations`` defines, exactly.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest

from converter.errors import GpuUnavailableError, KernelError
from converter.gpu import reference as ref
from converter.gpu import tensormap
from converter.gpu.tensormap import activation_box


def _tensor_copy(a: np.ndarray, geo, t0: int, c0: int) -> np.ndarray:
    """One box of ``geo`` at token t0, chunk c0: (2 U, T, 8) in box order (chunk, token, value)."""
    flat = a.reshape(-1).view(np.uint8)
    m = geo.dims[1]
    box = np.zeros(geo.box[::-1], dtype=np.float16)
    for c in range(geo.box[2]):
        for r in range(geo.box[1]):
            if t0 + r >= m:
                continue  # out of range: the copy delivers zeros
            at = geo.strides[0] * (t0 + r) + geo.strides[1] * (c0 + c)
            box[c, r] = flat[at : at + 2 * geo.box[0]].view(np.float16)
    return box


@pytest.mark.parametrize(
    ("m", "k", "tok", "u"), [(1, 256, 8, 8), (13, 512, 16, 8), (40, 256, 32, 4), (130, 128, 128, 4)]
)
def test_activation_box_is_the_wgmma_slot_layout(m: int, k: int, tok: int, u: int) -> None:
    rng = np.random.default_rng(m)
    a = rng.normal(0, 1, (m, k)).astype(np.float16)
    geo = activation_box(m, k, tok, u)
    assert geo.dims == (8, m, k // 8) and geo.strides == (2 * k, 16) and geo.box == (8, tok, 2 * u)
    assert geo.box_bytes == 2 * np.prod(geo.box)
    m_pad = -(-m // tok) * tok
    want = ref.hopper_activations(a, None, m_pad, tok)  # (chunks of tokens, K / 8, T, 8)
    for mc in range(m_pad // tok):
        for kt in range(0, k // 16, u):
            got = _tensor_copy(a, geo, mc * tok, 2 * kt)
            assert np.array_equal(got, want[mc, 2 * kt : 2 * kt + 2 * u])


@pytest.mark.parametrize(
    ("m", "k", "tok", "u", "rule"),
    [
        (0, 256, 8, 8, "M >= 1"),
        (4, 200, 8, 8, "K a multiple of 16 U = 128"),
        (4, 256, 12, 8, "T a multiple of 8 up to 256"),
        (4, 256, 264, 8, "T a multiple of 8 up to 256"),
        (4, 8192, 8, 256, "2 U at most 256"),
    ],
)
def test_activation_box_rejects_what_the_copy_cannot_do(m: int, k: int, tok: int, u: int, rule: str) -> None:
    with pytest.raises(KernelError, match=f"no activation box for M={m}, K={k}, T={tok}, U={u}: needs .*{rule}"):
        activation_box(m, k, tok, u)


def test_without_cuda_bindings_the_kernel_takes_the_relayout_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No cuda-bindings: available() says so once (a warning naming the install), and
    activation_map's driver lookup raises GpuUnavailableError with the same advice."""
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes the import fail
    tensormap.available.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"tensor maps need NVIDIA's cuda-bindings: pip install"):
            assert tensormap.available() is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # cached: no second warning
            assert tensormap.available() is False
        with pytest.raises(GpuUnavailableError, match=r"tensor maps need NVIDIA's cuda-bindings: pip install"):
            tensormap._driver()
    finally:
        tensormap.available.cache_clear()
