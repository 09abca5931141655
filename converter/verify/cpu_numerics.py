"""The CPU check's tolerance and rows, and the source side of its product: a chunk's
reference ``x @ W`` from the source's own codes and formula."""

from __future__ import annotations

import numpy as np

from ..formats.packing import first_code_diff, unpack_words
from ..numerics import ROWS, accumulate
from ..quant_weight import QuantWeight
from .against import _Diff

#: Both sides of the CPU check are fp32; they differ only by fp32 rounding.
CPU_REL_TOL = 1e-5
#: Rows of random activations in the CPU check.
CPU_M = ROWS


def _codes_and_reference(
    diff: _Diff,
    words: np.ndarray,
    q: np.ndarray,
    qw: QuantWeight,
    k0: int,
    y_ref: np.ndarray | None,
    x: np.ndarray | None,
) -> None:
    """A chunk's codes against the source's 4-bit words (:meth:`Source.load_words`), then
    its reference product ``y_ref += x @ W_source`` when ``y_ref`` is given.

    ``q`` are the artifact's codes ``(rows, size_n)`` (an unpadded layer, natural row
    order), ``qw`` the chunk's scales and zeros (empty ``q``).  Where every code agrees
    the source's codes ARE ``q``, so the source formula is evaluated on ``q`` (the same
    numbers, bit for bit); otherwise the words are unpacked, the differences counted as
    :meth:`_Diff.compare` does, and the product uses the source's own codes."""
    src_q = q
    if first_code_diff(words, q, qw.bits) >= 0:
        src_q = unpack_words(words, qw.bits, axis=0)
        diff.compare(q, src_q, (k0, 0))
    if y_ref is not None:
        assert x is not None
        a, c, b = qw.source_formula()
        accumulate(y_ref, x, src_q, qw.group_size, a, c, b, factored=False)


def _widened(qw: QuantWeight, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | float, np.ndarray | None]:
    """The source chunk's codes and formula (:meth:`QuantWeight.source_formula`) with
    zero columns up to ``width`` (a padded layer's): scale 0 makes their weight 0."""
    a, c, b = qw.source_formula()
    extra = width - qw.size_n
    if not extra:
        return qw.q, a, c, b

    def wide(m: np.ndarray) -> np.ndarray:
        return np.pad(m, ((0, 0), (0, extra)))

    return wide(qw.q), wide(a), wide(c) if isinstance(c, np.ndarray) else c, None if b is None else wide(b)
