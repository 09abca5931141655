"""The module's packed eager launch (torch_op.FastGemm, MARLIN_FAST_LAUNCH=1): bitwise
the op's path at every route, on torch's current stream, captured in a CUDA graph and
replayed, and picked by the switch."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from tests.helpers.serving_layers import LAYERS, assert_replays_match_eager  # noqa: E402
from tests.helpers.serving_layers import make_layer as _layer  # noqa: E402

MS = (1, 8, 64, 3, 130)


@pytest.fixture(scope="module")
def mods(cp):
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from converter.gpu.api import MarlinLinearModule

    return [MarlinLinearModule(_layer(*spec, seed=i)) for i, spec in enumerate(LAYERS)]


def _bits(t) -> np.ndarray:
    return t.detach().cpu().numpy().view(np.uint16)


def _both(mod, x, monkeypatch):
    from converter.gpu import torch_op

    monkeypatch.setenv(torch_op.FAST_LAUNCH_ENV, "0")
    slow = mod(x)
    monkeypatch.setenv(torch_op.FAST_LAUNCH_ENV, "1")
    return slow, mod(x)


def test_fast_is_bitwise_the_op_path(cp, mods, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    for mod in mods:
        for m in MS:
            x = torch.randn(m, mod.in_features, generator=gen, device="cuda", dtype=torch.float16)
            for _ in range(2):  # the first call packs, the second reuses
                slow, fast = _both(mod, x, monkeypatch)
                assert np.array_equal(_bits(fast), _bits(slow)), (mod.in_features, mod.out_features, m)
            assert (m, torch.float16) in mod._fast
    # 3-D input and a view that is not contiguous (the latter falls back to the op's path)
    mod = mods[1]
    x = torch.randn(2, 5, mod.in_features, generator=gen, device="cuda", dtype=torch.float16)
    slow, fast = _both(mod, x, monkeypatch)
    assert fast.shape == (2, 5, mod.out_features) and np.array_equal(_bits(fast), _bits(slow))
    xt = torch.randn(mod.in_features, 4, generator=gen, device="cuda", dtype=torch.float16).t()
    slow, fast = _both(mod, xt, monkeypatch)
    assert np.array_equal(_bits(fast), _bits(slow))


def test_the_switch_picks_the_path(cp, mods, monkeypatch: pytest.MonkeyPatch) -> None:
    from converter.gpu import kernels, torch_op

    mod = mods[0]
    calls = []
    real = kernels.emit_gemm

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(kernels, "emit_gemm", spy)
    x = torch.randn(2, mod.in_features, dtype=torch.float16, device="cuda")
    monkeypatch.setenv(torch_op.FAST_LAUNCH_ENV, "0")
    mod(x)
    assert calls == [1] and not torch_op.fast_launch_on()
    monkeypatch.setenv(torch_op.FAST_LAUNCH_ENV, "1")
    mod(x)
    assert calls == [1] and torch_op.fast_launch_on() and (2, torch.float16) in mod._fast


def test_fast_follows_torchs_current_stream(cp, mods, monkeypatch: pytest.MonkeyPatch) -> None:
    from converter.gpu import torch_op

    monkeypatch.setenv(torch_op.FAST_LAUNCH_ENV, "1")
    mod = mods[1]  # act-order: the gather launches too
    seen = []
    real = torch_op._Packed.launch
    monkeypatch.setattr(torch_op._Packed, "launch", lambda self, stream: (seen.append(stream), real(self, stream)))
    x = torch.randn(3, mod.in_features, dtype=torch.float16, device="cuda")
    want = _bits(mod(x))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    seen.clear()
    with torch.cuda.stream(side):
        y = mod(x)
    torch.cuda.current_stream().wait_stream(side)
    assert seen and set(seen) == {side.cuda_stream}
    assert np.array_equal(_bits(y), want)


def test_fast_graph_capture_and_replay(cp, mods, monkeypatch: pytest.MonkeyPatch) -> None:
    from converter.gpu import torch_op

    monkeypatch.setenv(torch_op.FAST_LAUNCH_ENV, "1")

    @contextlib.contextmanager
    def unpacked():  # the eager reference runs through run_gemm
        monkeypatch.setenv(torch_op.FAST_LAUNCH_ENV, "0")
        try:
            yield
        finally:
            monkeypatch.setenv(torch_op.FAST_LAUNCH_ENV, "1")

    assert_replays_match_eager(mods, unpacked)


def test_moving_the_module_drops_the_packed_launches(cp, mods, monkeypatch: pytest.MonkeyPatch) -> None:
    from converter.gpu import torch_op

    monkeypatch.setenv(torch_op.FAST_LAUNCH_ENV, "1")
    mod = mods[0]
    x = torch.randn(1, mod.in_features, dtype=torch.float16, device="cuda")
    mod(x)
    assert mod._fast
    mod.to("cuda")
    assert not mod._fast
    mod(x)
    mod.locks = mod.locks.clone()
    assert not mod._fast
