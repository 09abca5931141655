"""What the converted model is checked on while it runs: each swapped layer's output on
the model's own activations (forward hooks), and every pass-through tensor it loaded
against the source's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..artifact.problems import ProblemCode
from .loader import dequantized_weight
from .report import ModelReport

P = ProblemCode


class _LayerProbe:
    """Forward hooks on the converted model's swapped layers: each layer's output on the
    model's own activations against the source layer (fp32) and a 16-bit linear of it
    (bf16 for bf16 activations, else fp16). Each hook also records the dtype the layer's
    kernel took and gave (``dtypes``): a bf16 model's layers run bf16, never cast."""

    def __init__(self, source: Any, plans: dict[str, Any]) -> None:
        self.source, self.plans = source, plans
        self.stats: dict[str, list[float]] = {}
        self.dtypes: dict[str, tuple[str, str]] = {}
        self.handles: list[Any] = []
        self.modules: dict[str, Any] = {}

    def attach(self, modules: dict[str, Any]) -> None:
        self.modules = modules
        for mod in modules.values():
            mod.keep_raw = True
            self.handles.append(mod.register_forward_hook(self._hook))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for mod in self.modules.values():
            mod.keep_raw, mod.raw_output = False, None
        self.modules = {}  # no reference may keep the converted model alive past its stage

    def _hook(self, mod: Any, args: tuple[Any, ...], out: Any) -> None:
        import torch
        import torch.nn.functional as F

        from .modules import sixteen_bit

        lp = self.plans.get(mod.layer_name)
        if lp is None:
            return
        x = args[0].detach()
        w = torch.from_numpy(dequantized_weight(self.source, lp)).to(x.device)
        bias = None
        if lp.bias is not None:
            from .modules import to_torch

            t = self.source.load_tensor(lp.bias.name)
            bias = to_torch(t.data, t.dtype).float().to(x.device)
        # the 16-bit linear runs in the activations' type where it is bf16 (as the kernel
        # does), else in fp16
        half = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float16
        x16 = x.to(half)
        ref = x16.float() @ w
        if bias is not None:
            ref = ref + bias
        w16 = sixteen_bit(w.T, half)  # fp32 where it leaves fp16's range, as the loader keeps it
        y16 = F.linear(x16.to(w16.dtype), w16, None if bias is None else bias.to(w16.dtype)).float()
        scale = float(ref.abs().mean()) or 1.0
        # The layer's own 16-bit output, before any cast to the activations' dtype.
        raw = mod.raw_output if mod.raw_output is not None else out
        self.dtypes[mod.layer_name] = (str(x.dtype).removeprefix("torch."), str(raw.dtype).removeprefix("torch."))
        ours = raw.detach().float()
        mod.raw_output = None
        e = float((ours - ref).abs().mean()) / scale if bool(torch.isfinite(ours).all()) else math.inf
        e16 = float((y16 - ref).abs().mean()) / scale
        s = self.stats.setdefault(mod.layer_name, [0.0, 0.0])
        s[0], s[1] = max(s[0], e), max(s[1], e16)
        from ..safetensors_io import release_mapped_pages

        release_mapped_pages()


def _tensor_checks(
    model: Any, load: Any, source: Any, report: ModelReport, cast: Any = None, stored: Any = None
) -> None:
    """Every pass-through tensor the converted model loaded against the source's: dtype, then
    bytes. ``cast``: the torch dtype the model was asked to run in: a floating-point tensor
    is then compared with the source's rounded to it, and the dtype the artifact stores it
    in (``stored``: tensor name to dtype code) with the source's, since the load's cast
    hides it."""
    import torch

    from ..safetensors_io import release_mapped_pages
    from .modules import dtype_code, to_torch

    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    infos = source.ckpt.infos
    for tname, names in load.tensors.items():
        t = named.get(names[0])
        if t is None:
            continue
        if tname not in infos:
            report.add(
                P.TENSOR_NOT_IN_SOURCE, f"{tname}: loaded into {names[0]}, but the source has no such tensor", tname
            )
            continue
        src = source.load_tensor(tname)
        mine = dtype_code(t)
        if cast is not None and t.is_floating_point():
            kept = (stored or {}).get(tname, src.dtype)
            if kept != src.dtype:
                report.add(
                    P.TENSOR_DTYPE,
                    f"{tname}: the artifact stores it as {kept}, but the source stores {src.dtype}",
                    tname,
                )
            elif t.dtype != cast:
                report.add(P.TENSOR_DTYPE, f"{tname}: loaded as {mine} into {names[0]}, not the dtype asked", tname)
            elif src.dtype in ("F16", "BF16", "F32", "F64"):
                want = to_torch(src.data, src.dtype).to(cast)
                if want.shape != t.shape or not torch.equal(want, t.detach().cpu()):
                    report.add(P.TENSOR_BYTES, f"{tname}: differs from the source's rounded to {mine}", tname)
            continue
        if mine != src.dtype:
            report.add(
                P.TENSOR_DTYPE,
                f"{tname}: loaded as {mine} (the artifact's dtype) into {names[0]}, but the source stores {src.dtype}",
                tname,
            )
            continue
        ours = t.detach().cpu().contiguous()
        ours_np = (ours.view(torch.int16) if ours.dtype == torch.bfloat16 else ours).numpy().reshape(-1)
        src_np = np.asarray(src.data).reshape(-1)
        n = _count_differing(ours_np, src_np)
        if n:
            report.add(P.TENSOR_BYTES, f"{tname}: {n} of {src_np.size} values differ from the source's", tname)
        del ours, ours_np, src_np
        release_mapped_pages()


def _count_differing(a: np.ndarray, b: np.ndarray, chunk: int = 1 << 20) -> int:
    """How many elements differ bitwise between two flat arrays of one item size (all, if the sizes differ)."""
    if a.size != b.size or a.dtype.itemsize != b.dtype.itemsize:
        return max(a.size, b.size)
    view = f"u{a.dtype.itemsize}"
    a, b = a.view(view), b.view(view)
    return sum(int(np.count_nonzero(a[i : i + chunk] != b[i : i + chunk])) for i in range(0, a.size, chunk))
