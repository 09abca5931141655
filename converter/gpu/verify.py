"""GPU check of one converted layer: kernel output against an fp32 reference.

Used by ``marlin-verify --gpu``. The check runs the fused path (GEMM with the delta
folded into the dequantized weight) and the two-kernel path (symmetric GEMM, then
``C += xsum @ delta``) on random fp16 activations and compares both with
``A.astype(float32) @ w_ref_f32`` over all the layer's columns (``n_out`` of a padded
layer: the kernels store exactly those). With bf16 activations (``act="bfloat16"``) the
fused path runs in its bf16 form; the two-kernel path has no bf16 form and is left out.
On sm_90, where ``MarlinLinear`` keeps ``B`` unit-major
(:func:`converter.gpu.kernels.keeps_b_units`), or with the scales and deltas inline
(:func:`converter.gpu.kernels.keeps_b_stages`), the fused call on that copy must also
give the bits of the call on ``B``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..constants import GPU_MEAN_REL_TOLS
from ..dtypes import f32_to_bf16
from ..errors import KernelError
from . import kernels, runtime


def _as_f32(cp: Any, c: Any) -> Any:
    """fp16 as is; bf16, which CuPy lacks and the kernels hand back as uint16 bits, widened."""
    if c.dtype == cp.uint16:
        return (c.astype(cp.uint32) << 16).view(cp.float32)
    return c.astype(cp.float32)


def _errors(c: Any, ref: Any) -> tuple[float, float]:
    """(mean |c - ref| / mean |ref|, max |c - ref| / mean |ref|); NaN/inf give inf."""
    cp = runtime.cupy_module()
    c32 = _as_f32(cp, c)
    if not bool(cp.isfinite(c32).all()):
        return float("inf"), float("inf")
    diff = cp.abs(c32 - ref)
    scale = float(cp.abs(ref).mean())
    scale = scale if scale > 0 else 1.0
    return float(diff.mean()) / scale, float(diff.max()) / scale


def verify_layer_gpu(
    B: Any,
    scales: Any,
    delta: Any,
    perm: Any,
    size_k: int,
    size_n: int,
    group_size: int,
    w_ref_f32: Any,
    *,
    n_out: int | None = None,
    ms: tuple[int, ...] = (1, 16, 17, 64, 128),
    repeats: int = 10,
    seed: int = 0,
    act: str = "float16",
) -> dict[Any, Any]:
    """Run one layer's kernels on the GPU and measure their error.

    Args:
        B: int32 ``(size_k // 16, 2 * size_n)`` artifact ``marlin_B`` (NumPy or CuPy).
        scales: float16 ``(G, size_n)`` artifact ``marlin_scales``.
        delta: float32 ``(G, size_n)`` artifact ``marlin_delta``, or None (symmetric).
        perm: int32 ``(size_k,)`` artifact ``marlin_perm``, or None.
        size_k, size_n, group_size: the layer's sizes (``group_size == size_k`` or -1
            means per-channel); ``size_n`` the width of ``B`` (``padded_n`` when padded).
        w_ref_f32: float32 ``(size_k, n_out)`` reference weight in SOURCE input-channel
            order (the source checkpoint's dequantized weight, or
            :func:`converter.gpu.reference.reference_weight` when there is none).
        n_out: the layer's true N (``size_n`` in the manifest), at most ``size_n``;
            default ``size_n``. The kernels store exactly ``n_out`` columns.
        ms: batch sizes M to test.
        repeats: calls per path and M; all must be bitwise identical (a race shows as
            a moving result).
        seed: seed of the random activations, ``A ~ N(0, 1)`` rounded to ``act``.
        act: the activation type, ``"float16"`` or ``"bfloat16"`` (the fused path only).

    Returns:
        ``{M: {"mean_rel_err", "max_rel_err", "deterministic",
        "two_kernel_mean_rel_err", "two_kernel_max_rel_err",
        "two_kernel_deterministic", "unit_major_same"}, ..., "ok": bool}``. Relative errors are
        ``mean|C - ref| / mean|ref|`` and ``max|C - ref| / mean|ref|`` over all M x N
        outputs (``M x n_out``; inf when any output is NaN/inf). ``ok`` holds when, for every M and
        both paths, the mean relative error is at most ``GPU_MEAN_REL_TOLS[act]`` (1e-3 in
        fp16, 8e-3 in bf16) and all repeats agree, and the unit-major call gives the same bits.
        With ``delta`` None only the symmetric GEMM runs and the two-kernel keys are
        absent; ``unit_major_same`` is there only where ``MarlinLinear`` would keep ``B``
        unit-major or with the scales inline (sm_90, a layer the persistent kernel serves
        at every M), and compares the call on that copy.

    Raises:
        GpuUnavailableError: no CuPy / GPU / sm_80+.
        KernelError: shapes or dtypes do not match the layer's sizes.
    """
    if act not in GPU_MEAN_REL_TOLS:
        raise KernelError(f"act={act!r}: the kernels take {' or '.join(GPU_MEAN_REL_TOLS)} activations")
    tol = GPU_MEAN_REL_TOLS[act]
    cp = runtime.cupy_module()
    rng = np.random.default_rng(seed)
    dev = {
        "B": cp.asarray(B),
        "scales": cp.asarray(scales),
        "delta": None if delta is None else cp.asarray(delta),
        "perm": None if perm is None else cp.asarray(perm),
    }
    w_ref = cp.asarray(
        np.asarray(w_ref_f32, dtype=np.float32) if isinstance(w_ref_f32, np.ndarray) else w_ref_f32.astype(cp.float32)
    )
    n_out = size_n if n_out is None else n_out
    if tuple(w_ref.shape) != (size_k, n_out):
        raise KernelError(f"w_ref_f32 must be ({size_k}, {n_out}), got {tuple(w_ref.shape)}")
    kw = dict(size_k=size_k, size_n=size_n, group_size=group_size, perm=dev["perm"], n_out=n_out)
    units = None
    if kernels.keeps_b_stages(size_k, size_n, group_size, dev["delta"] is not None and bool(dev["delta"].any())):
        # What MarlinLinear serves this layer from (api.py): proven against B's own call.
        units = kernels.prepare_b_stages(dev["B"], dev["scales"], kernels.prepare_delta(dev["delta"]), size_k, size_n)
    elif kernels.keeps_b_units(size_k, size_n, group_size):
        units = kernels.prepare_b_units(dev["B"], size_k, size_n)
    result: dict[Any, Any] = {}
    ok = True
    for m in ms:
        a_f32 = rng.standard_normal((m, size_k), dtype=np.float32)
        a = cp.asarray(f32_to_bf16(a_f32) if act == "bfloat16" else a_f32.astype(np.float16))
        ref = _as_f32(cp, a) @ w_ref
        paths = {
            "": functools.partial(kernels.marlin_gemm, a, dev["B"], dev["scales"], delta=dev["delta"], act=act, **kw)
        }
        if dev["delta"] is not None and act == "float16":
            paths["two_kernel_"] = functools.partial(
                kernels.marlin_gemm_two_kernel, a, dev["B"], dev["scales"], delta=dev["delta"], **kw
            )
        entry: dict[str, Any] = {}
        for prefix, run in paths.items():
            first = run()
            same = True
            for _ in range(repeats - 1):
                again = run()
                same &= bool((again.view(cp.uint16) == first.view(cp.uint16)).all())
            kernels.synchronize()
            mean_err, max_err = _errors(first, ref)
            entry[prefix + "mean_rel_err"] = mean_err
            entry[prefix + "max_rel_err"] = max_err
            entry[prefix + "deterministic"] = same
            ok &= same and mean_err <= tol
            if prefix == "" and units is not None:
                again = kernels.marlin_gemm(a, None, dev["scales"], delta=dev["delta"], b_units=units, act=act, **kw)
                entry["unit_major_same"] = bool((again.view(cp.uint16) == first.view(cp.uint16)).all())
                ok &= entry["unit_major_same"]
        result[m] = entry
    result["ok"] = bool(ok)
    return result
