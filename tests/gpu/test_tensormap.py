"""The persistent Hopper kernel's tensor map of A (``converter.gpu.tensormap``), on the CPU.

The bulk tensor copy is emulated from the map's geometry and the 128-byte swizzle
rule alone, and must give the slot that ``reference.streamk_x_slot`` defines, exactly;
read back the way the kernel's swizzled wgmma descriptors address it, that slot must
give A. (The GPU test that both activation paths give the same bits is in
test_kernels.py.)
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


def _tensor_copy(a: np.ndarray, geo, c0: int, t0: int) -> np.ndarray:
    """One box of ``geo`` at (K offset c0, token t0), emulated from the geometry alone:
    box element (i, r) is read at byte ``2 (c0 + i) + strides[0] (t0 + r)`` of A (zero
    where the token is past M) and written at byte ``128 r + 2 i`` of the box, with the
    128-byte swizzle applied to that address (bits 4-6 XOR bits 7-9). Returns (T, 64)."""
    flat = a.reshape(-1).view(np.uint8)
    width, rows = geo.box
    out = np.zeros(rows * 2 * width, dtype=np.uint8)
    for r in range(rows):
        if t0 + r >= geo.dims[1]:
            continue  # out of range: the copy delivers zeros
        src = geo.strides[0] * (t0 + r) + 2 * c0
        for i in range(0, width, 8):  # 16-byte pieces
            dst = 128 * r + 2 * i
            dst ^= ((dst >> 7) & 7) << 4
            out[dst : dst + 16] = flat[src + 2 * i : src + 2 * i + 16]
    return out.view(np.float16).reshape(rows, width)


def _wgmma_reads(slot: np.ndarray, tok: int, u: int, r: int, k: int) -> np.float16:
    """The value wgmma's 128-byte-swizzled K-major operand sees at (token r, value k of
    the stage), the start address stepped as the kernel's x_step does (box u / 4 at
    u / 4 T 128, then 32 bytes per k-tile in the row), 8-row atoms 1024 bytes apart
    (the descriptor's stride byte offset), the swizzle applied to the address."""
    kt, kk = divmod(k, 16)
    start = (kt // 4) * tok * 128 + (kt % 4) * 32
    addr = start + (r // 8) * 1024 + (r % 8) * 128 + 2 * kk
    addr ^= ((addr >> 7) & 7) << 4
    return slot.reshape(-1)[addr // 2]


@pytest.mark.parametrize(
    ("m", "k", "tok", "u"), [(1, 256, 8, 8), (13, 512, 16, 8), (40, 256, 32, 4), (130, 128, 128, 4), (70, 256, 64, 8)]
)
def test_activation_box_is_the_swizzled_slot_wgmma_reads(m: int, k: int, tok: int, u: int) -> None:
    """Each stage's boxes, copied as the map's geometry says, are reference.streamk_x_slot
    exactly; and read back as the kernel's swizzled descriptors address them, they give A
    (zeros past M)."""
    rng = np.random.default_rng(m)
    a = rng.normal(0, 1, (m, k)).astype(np.float16)
    geo = activation_box(m, k, tok, u)
    assert geo.dims == (k, m) and geo.strides == (2 * k,) and geo.box == (64, tok) and geo.boxes == u // 4
    assert geo.swizzle == 128  # the 128-byte pattern _tensor_copy applies
    assert geo.stage_bytes == geo.boxes * 2 * np.prod(geo.box) == 32 * tok * u
    for mc in range(-(-m // tok)):
        for kt in range(0, k // 16, u):
            got = np.stack([_tensor_copy(a, geo, 16 * kt + 64 * b, mc * tok) for b in range(geo.boxes)])
            want = ref.streamk_x_slot(a, tok, u, mc, kt)
            assert np.array_equal(got, want)
            for r in range(tok):
                tok_row = mc * tok + r
                seen = np.array([_wgmma_reads(want, tok, u, r, kk) for kk in range(16 * u)])
                expect = a[tok_row, 16 * kt : 16 * (kt + u)] if tok_row < m else np.zeros(16 * u, np.float16)
                assert np.array_equal(seen, expect), (mc, kt, r)


@pytest.mark.parametrize(
    ("m", "k", "tok", "u", "rule"),
    [
        (0, 256, 8, 8, "M >= 1"),
        (4, 200, 8, 8, "K a multiple of 16 U = 128"),
        (4, 256, 8, 2, "U a multiple of 4"),
        (4, 256, 12, 8, "T a multiple of 8 up to 256"),
        (4, 256, 264, 8, "T a multiple of 8 up to 256"),
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


@pytest.mark.parametrize(("m", "k", "tok"), [(5, 256, 8), (40, 512, 32), (130, 256, 128), (3, 192, 24)])
def test_relaid_out_swizzled_activations_follow_the_kernels_index(m: int, k: int, tok: int) -> None:
    """reference.hopper_activations(swizzle=True), the twin of the path without a tensor
    map, against the destination index hopper_activations (kernels/marlin_wgmma.cu)
    computes for the 16-byte piece of row r, chunk c: ``((r / tok) K / 64 + c / 8) tok +
    r % tok`` rows of 8 pieces, piece ``c % 8 ^ r % 8``; rows past M zero."""
    rng = np.random.default_rng(k)
    a = rng.normal(0, 1, (m, k)).astype(np.float16)
    m_pad = -(-m // tok) * tok
    flat = ref.hopper_activations(a, None, m_pad, tok, swizzle=True).reshape(-1, 8)
    want = np.zeros_like(flat)
    for r in range(m):
        for c in range(k // 8):
            to = (((r // tok) * (k // 64) + c // 8) * tok + r % tok) * 8 + ((c % 8) ^ (r % 8))
            want[to] = a[r, 8 * c : 8 * c + 8]
    assert np.array_equal(flat, want)


def test_activation_map_asks_the_driver_for_the_swizzled_2d_box(monkeypatch: pytest.MonkeyPatch) -> None:
    """activation_map's call of cuTensorMapEncodeTiled, seen through a stand-in driver
    (no GPU): fp16, rank 2, A's address, dims (K, M), stride 2 K, box (64, T), unit
    element strides, the 128-byte swizzle, zero fill; a refusal names the map."""
    import enum
    import types

    calls = []

    def encode(*args):
        calls.append(args)
        return drv.CUresult.CUDA_SUCCESS if len(calls) == 1 else "CUDA_ERROR_INVALID_VALUE", types.SimpleNamespace(
            opaque=list(range(16))
        )

    names = ["CU_TENSOR_MAP_SWIZZLE_NONE", "CU_TENSOR_MAP_SWIZZLE_64B", "CU_TENSOR_MAP_SWIZZLE_128B"]
    drv = types.SimpleNamespace(
        cuuint64_t=int,
        cuuint32_t=int,
        cuTensorMapEncodeTiled=encode,
        CUresult=enum.Enum("CUresult", ["CUDA_SUCCESS"]),
        CUtensorMapDataType=enum.Enum("DT", ["CU_TENSOR_MAP_DATA_TYPE_FLOAT16"]),
        CUtensorMapInterleave=enum.Enum("IL", ["CU_TENSOR_MAP_INTERLEAVE_NONE"]),
        CUtensorMapSwizzle=enum.Enum("SW", names),
        CUtensorMapL2promotion=enum.Enum("L2", ["CU_TENSOR_MAP_L2_PROMOTION_L2_128B"]),
        CUtensorMapFloatOOBfill=enum.Enum("OOB", ["CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE"]),
    )
    monkeypatch.setattr(tensormap, "_driver", lambda: drv)
    monkeypatch.setattr(tensormap, "_as_arg", lambda raw: raw)
    a = types.SimpleNamespace(shape=(40, 512), data=types.SimpleNamespace(ptr=0x7000))
    tensormap.activation_map_at.cache_clear()
    raw = tensormap.activation_map(a, 32, 8)
    # The same address and sizes again: the cached map, no second driver call.
    assert tensormap.activation_map(a, 32, 8) is raw and len(calls) == 1
    assert raw.dtype == np.uint8 and raw.size == tensormap.TENSOR_MAP_BYTES
    dtype, rank, ptr, dims, strides, box, elem, interleave, swizzle, _, fill = calls[0]
    assert (dtype.name, rank, ptr) == ("CU_TENSOR_MAP_DATA_TYPE_FLOAT16", 2, 0x7000)
    assert (dims, strides, box, elem) == ([512, 40], [1024], [64, 32], [1, 1])
    assert (interleave.name, swizzle.name, fill.name) == (
        "CU_TENSOR_MAP_INTERLEAVE_NONE",
        "CU_TENSOR_MAP_SWIZZLE_128B",
        "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE",
    )
    tensormap.activation_map_at.cache_clear()
    with pytest.raises(KernelError, match="cuTensorMapEncodeTiled refused A's map"):
        tensormap.activation_map(a, 32, 8)
