"""Which sibling layers fuse (converter.model.fuse), and the fused modules under torch.compile."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from converter.model.fuse import enabled, plan_fusion  # noqa: E402
from converter.model.modules import FusedKernel, FusedSlice  # noqa: E402

A = "model.layers.3.self_attn"
M = "model.layers.3.mlp"


def rec(k: int = 256, n: int = 128, *, group: int = 128, bias: bool = False, act_order: bool = False, padded=None):
    return SimpleNamespace(
        size_k=k, size_n=n, group_size=group, has_bias=bias, act_order=act_order, layout_n=padded or n
    )


def swaps_of(names: list[str]) -> dict[str, str]:
    return {n: f"L:{n}" for n in names}


def test_llama_block_fuses_qkv_and_gate_up_in_column_order() -> None:
    mods = [f"{A}.{c}_proj" for c in "qkvo"] + [f"{M}.{c}_proj" for c in ("gate", "up", "down")]
    swaps = swaps_of(mods)
    records = {layer: rec() for layer in swaps.values()}
    groups = plan_fusion(swaps, records)
    assert sorted(groups) == sorted(mods[:3] + mods[4:6])
    qkv, gu = groups[f"{A}.q_proj"], groups[f"{M}.up_proj"]
    assert qkv.name == f"{A}.q_proj+k_proj+v_proj" and qkv.modules == tuple(mods[:3])
    assert qkv.layers == tuple(f"L:{m}" for m in mods[:3])
    assert groups[f"{A}.v_proj"] is qkv and gu.name == f"{M}.gate_proj+up_proj"


@pytest.mark.parametrize(
    "change",
    [
        {"act_order": True},  # each layer has its own perm
        {"padded": 192},  # padded columns would sit between the siblings' columns
        {"bias": True},  # a bias on some members only
        {"k": 512},  # not one input width
        {"group": 64},  # not one group size
        {"k": 200},  # outside the kernel's limits (K % 64)
    ],
)
def test_a_group_with_any_member_that_differs_does_not_fuse(change: dict) -> None:
    swaps = swaps_of([f"{A}.q_proj", f"{A}.k_proj", f"{A}.v_proj"])
    records = {layer: rec() for layer in swaps.values()}
    records[f"L:{A}.v_proj"] = rec(**change)
    assert plan_fusion(swaps, records) == {}


def test_missing_or_unconverted_sibling_does_not_fuse() -> None:
    swaps = swaps_of([f"{A}.q_proj", f"{A}.k_proj", f"{M}.gate_proj", f"{M}.up_proj"])
    records = {layer: rec() for layer in swaps.values()}
    del records[f"L:{M}.up_proj"]  # passed through unconverted
    assert plan_fusion(swaps, records) == {}


def test_all_biased_members_fuse() -> None:
    swaps = swaps_of([f"{M}.gate_proj", f"{M}.up_proj"])
    assert len(plan_fusion(swaps, {layer: rec(bias=True) for layer in swaps.values()})) == 2


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MARLIN_FUSE", raising=False)
    assert enabled(None) and not enabled(False)
    monkeypatch.setenv("MARLIN_FUSE", "0")
    assert not enabled(None) and enabled(True)


class _Kernel(torch.nn.Module):
    """Stands in for the GPU kernel module: fp16 in, fp16 out."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(k, n, generator=torch.Generator().manual_seed(0)), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float16
        return (x.float() @ self.w).half()


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        fused = FusedKernel("qkv", _Kernel(8, 12), 3)
        self.q_proj, self.k_proj, self.v_proj = (FusedSlice(c, fused, 4 * i, 4 * i + 4, 8) for i, c in enumerate("qkv"))

    def forward(self, h: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        y = self.q_proj(h) * self.k_proj(h) + self.v_proj(h)
        # v on another tensor: the group must run the kernel again, not reuse h's result
        return y if other is None else y - self.v_proj(other)


def _want(w: torch.Tensor, h: torch.Tensor, o: torch.Tensor | None = None) -> torch.Tensor:
    y = (h.float() @ w).half()
    y = y[..., 0:4] * y[..., 4:8] + y[..., 8:12]
    return y if o is None else y - (o.float() @ w).half()[..., 8:12]


def test_siblings_on_other_tensors_each_get_their_own_result() -> None:
    m = _Attention()
    gen = torch.Generator().manual_seed(2)
    h, o = (torch.randn(4, 8, generator=gen).half() for _ in range(2))
    assert torch.equal(m(h, o), _want(m.q_proj.fused.kernel.w, h, o))
    assert m.q_proj.fused._held[0] is o  # v took o's result; q and k may still ask for it


def test_fused_slices_compile_fullgraph_without_recompiling() -> None:
    from torch._dynamo.testing import CompileCounter

    m = _Attention()
    counter = CompileCounter()
    compiled = torch.compile(m, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        h = torch.randn(2, 3, 8, generator=gen).half()
        assert torch.equal(compiled(h), _want(m.q_proj.fused.kernel.w, h))
        assert m.q_proj.fused._held is None
    assert counter.frame_count == 1  # the group holds nothing between calls: one graph
