"""NumPy twins of the GPU kernels, with the launchers' signatures (no GPU needed).

Each twin computes what its kernel computes, from the same artifact tensors:

* :func:`dequant` reproduces ``kernels/dequant.cu`` bit for bit. The kernel forms
  ``q - 8`` exactly (fp16 exponent trick) and then does one fp16 ``mul.rn`` (or
  ``fma.rn`` with ``fp16(delta)``); in float64 that product-plus-addend is exact
  (at most 4 + 11 significant bits over an exponent span under 53 bits), so one
  round-to-nearest-even to float16 gives the same bits.
* :func:`marlin_gemm` follows the launcher's kernels: with the "weight" arithmetic
  (tile kernel, per-weight decode variant) it uses that same fp16 weight; with
  "group" (decode kernel, small M: scale and delta applied per group in fp32) the
  unrounded ``(q - 8) * s + fp16(delta)``; ``plan.gemm_arith`` says which for
  (M, N). It multiplies in float64 and rounds once to float16; the kernels accumulate exact products in fp32 in
  another order, so the two differ by at most the bound in :func:`gemm_error_bound`.
* :func:`group_sums`, :func:`add_correction`, :func:`gather_columns` mirror
  ``kernels/asym_correction.cu`` and the gather in ``kernels/marlin_gemm.cu``.

Conventions (checkpoint-formats.md section 4): ``B`` int32 ``(K/16, 2N)`` Marlin tile
order; ``scales`` float16 ``(G, N)`` Marlin-permuted (8x8 transpose per 64 columns, or
the 32-entry list when ``G == 1``); ``delta`` float32 ``(G, N)`` natural order; ``perm``
int32 ``(K,)`` with Marlin row k = source channel ``perm[k]``; A rows are ``(M, K)``
float16 in SOURCE channel order for :func:`marlin_gemm` (it gathers), Marlin order for

The twins live by kernel family: :mod:`~converter.gpu.reference_dequant` (the weight),
:mod:`~converter.gpu.reference_layouts` (operand layouts), :mod:`~converter.gpu.reference_gemm`
(the fused GEMM and its error bound), :mod:`~converter.gpu.reference_correction` (the
two-kernel path); this module gathers them.
"""

from __future__ import annotations

from .reference_correction import add_correction, group_sums, marlin_gemm_two_kernel
from .reference_dequant import dequant, reference_weight
from .reference_gemm import _arith, _decode_parts, _decode_weight, _delta16, _weight, gemm_error_bound, marlin_gemm
from .reference_layouts import b_stages, b_units, gather_columns, hopper_activations, streamk_x_slot

# Everything this module defined before the split (issue 39) stays importable from here.
__all__ = [
    "_arith",
    "_decode_parts",
    "_decode_weight",
    "_delta16",
    "_weight",
    "add_correction",
    "b_stages",
    "b_units",
    "dequant",
    "gather_columns",
    "gemm_error_bound",
    "group_sums",
    "hopper_activations",
    "marlin_gemm",
    "marlin_gemm_two_kernel",
    "reference_weight",
    "streamk_x_slot",
]
