"""The packed launch's argument layout (converter.gpu.kernels.pack_args), on the CPU:
every argument's bytes are where its kernelParams entry points, slots patch in place."""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from converter.errors import KernelError
from converter.gpu import kernels, tensormap


def _at(addr: int, size: int) -> bytes:
    return ctypes.string_at(int(addr), size)


def _map(seed: int) -> tensormap.TensorMapArg:
    raw = np.random.default_rng(seed).integers(0, 256, tensormap.TENSOR_MAP_BYTES, dtype=np.uint8)
    return tensormap.TensorMapArg(raw=raw, arg=object())


def test_values_are_where_their_params_point() -> None:
    tm = _map(1)
    args = (np.int32(7), tm.arg, np.uint64(0xDEAD_BEEF_0000), np.int32(-3), np.uint64(5), np.int32(9))
    packed = kernels.pack_args(args, maps=(tm,))
    assert packed.params.dtype == np.uint64 and packed.params.size == len(args)
    assert packed.buf.ctypes.data % 64 == 0 and packed.buf.size % 8 == 0
    assert packed.params_ptr == packed.params.ctypes.data
    for a, p in zip(args, packed.params, strict=True):
        want = tm.raw.tobytes() if a is tm.arg else a.tobytes()
        assert _at(p, len(want)) == want
        assert (int(p) - packed.buf.ctypes.data) % (64 if a is tm.arg else a.itemsize) == 0


def test_slots_patch_in_place() -> None:
    args = (kernels.Slot("xmap", by_ref=True), np.int32(1), kernels.Slot("out"), np.uint64(3), kernels.Slot("ws"))
    packed = kernels.pack_args(args)
    assert set(packed.slots) == {"xmap", "out", "ws"}
    for name, value in (("out", 0x7F00_0000_1000), ("ws", 0x7F00_0000_2000)):
        i, off = packed.slots[name]
        assert off % 8 == 0
        packed.words[off // 8] = value
        assert _at(packed.params[i], 8) == np.uint64(value).tobytes()
    tm = _map(2)
    packed.params[packed.slots["xmap"][0]] = tm.raw.ctypes.data
    assert _at(packed.params[0], 128) == tm.raw.tobytes()
    assert _at(packed.params[1], 4) == np.int32(1).tobytes()
    assert _at(packed.params[3], 8) == np.uint64(3).tobytes()


@pytest.mark.parametrize("bad", [None, 5, np.zeros(2, dtype=np.int32), object()])
def test_refuses_what_it_cannot_lay_out(bad) -> None:
    with pytest.raises(KernelError, match="cannot be packed"):
        kernels.pack_args((np.int32(1), bad))


def _run(lead: str, ws: bool) -> kernels.GemmLaunch:
    plan = types.SimpleNamespace(blocks=132, threads=128, smem=1000, rows=16, u=8)
    scalars = tuple(np.int32(v) for v in (1, 4096, 4096, 4096, 8, 0, 3, 1))
    return kernels.GemmLaunch(plan, "fn", lead, False, True, 100 if ws else 0, 132, 0, 16, 1, 4096, scalars)


@pytest.mark.parametrize("lead", ["xmap", "a", "wgmma", "at"])
def test_gemm_call_packs_the_launchs_arguments(lead: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed GEMM call holds, argument by argument, the values emit_gemm passes."""
    unused = _map(0)
    monkeypatch.setattr(tensormap, "unused", lambda: unused)
    run = _run(lead, ws=True)
    ptrs = {name: np.uint64(0x7F00_0000_0000 + 0x100 * i) for i, name in enumerate(("a", "at", "out", "ws"))}
    b, s, lk = np.uint64(0x10), np.uint64(0x20), np.uint64(0x30)
    tm = _map(3)
    plain = kernels.gemm_call(run, ptrs["a"], tm.arg, b, s, None, None, ptrs["out"], ptrs["ws"], lk, ptrs["at"])
    slot = kernels.Slot
    call = kernels.gemm_call(
        run, slot("a"), slot("xmap", by_ref=True), b, s, None, None, slot("out"), slot("ws"), lk, slot("at")
    )
    assert (call.grid, call.block, call.shared_mem) == ((132,), (128,), 1000)
    packed = kernels.pack_args(call.args, maps=(unused,))
    for name, (_, off) in packed.slots.items():
        if name != "xmap":
            packed.words[off // 8] = ptrs[name]
    if "xmap" in packed.slots:
        packed.params[packed.slots["xmap"][0]] = tm.raw.ctypes.data
    assert len(packed.params) == len(plain.args)
    maps = {id(tm.arg): tm.raw, id(unused.arg): unused.raw}
    for a, p in zip(plain.args, packed.params, strict=True):
        want = maps[id(a)].tobytes() if id(a) in maps else a.tobytes()
        assert _at(p, len(want)) == want
