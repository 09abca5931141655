"""Reading a planned GPTQ layer: its codes (act-order rows gathered), scales and zeros
for a range of Marlin rows, or Marlin ``B`` and the 4-bit words straight from ``qweight``.
"""

from __future__ import annotations

import numpy as np

from ..constants import MARLIN_TILE
from ..marlin.layout import pack_b_from_gptq4
from ..quant_weight import QuantWeight
from .base import LayerPlan
from .hf import integer_zero_weight
from .packing import codes_per_word, gather_rows, packed_len, unpack_words


class GptqLoading:
    """The loaders of :class:`~converter.formats.gptq.GptqSource`, a mixin of it (it reads
    the source's ``ckpt``, ``act_order`` and ``_decode_zeros``)."""

    def load_layer(
        self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None, *, codes: bool = True
    ) -> QuantWeight:
        """Read Marlin rows ``[k_start, k_stop)`` of a convertible layer.

        ``k_start``/``k_stop`` are multiples of the source's group size (or of 32 for a
        per-channel layer, so 3-bit blocks are never split; ``k_stop`` may be K).
        Returns codes uint8 ``(rows, N)`` in Marlin row order (act-order rows gathered
        by ``perm``: source groups in order, the short one last), fp16 scales, true
        zeros uint8, ``delta = (8 - z) * s`` in float32 from the scales as stored
        (spec 4.6), at the artifact's group size.

        Raises:
            SourceFormatError: a scale overflows fp16 (bf16 sources) or is not finite.
        """
        k_stop = layer.size_k if k_stop is None else k_stop
        g, num_groups = layer.source_groups
        b = layer.bits
        qweight = self.ckpt.array(f"{layer.name}.qweight")
        perm = None
        if layer.act_order:
            perm = self.act_order(f"{layer.name}.g_idx", g, num_groups)
            assert perm is not None
            q = gather_rows(qweight, perm[k_start:k_stop], b) if codes else np.zeros((0, layer.size_n), np.uint8)
        elif not codes:  # load_packed: B is made from the words directly
            q = np.zeros((0, layer.size_n), np.uint8)
        else:
            w0, w1 = packed_len(k_start, b), packed_len(k_stop, b)
            if w0 is None or w1 is None:
                q = gather_rows(qweight, np.arange(k_start, k_stop), b)
            else:
                q = unpack_words(np.asarray(qweight[w0:w1]), b, axis=0)
        g0, g1 = k_start // g, -(-k_stop // g)
        z = self._decode_zeros(layer.name, b, layer.zero_convention, g0, g1)
        return integer_zero_weight(
            self.ckpt, layer, q=q, z=z, scales=f"{layer.name}.scales", g0=g0, g1=g1, perm=perm, rows=(k_start, k_stop)
        )

    def load_packed(
        self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None
    ) -> tuple[np.ndarray, QuantWeight] | None:
        """:meth:`Source.load_packed`: Marlin ``B`` for rows ``[k_start, k_stop)`` made
        straight from the 4-bit ``qweight`` words (:func:`pack_b_from_gptq4`), plus the
        chunk's scales and delta (its ``q`` is empty).  None where it does not apply
        (not 4-bit, act-order, rows not on 16-row tiles, a padded layer: the converter
        pads the codes of :meth:`load_layer`).
        """
        k_stop = layer.size_k if k_stop is None else k_stop
        if layer.bits != 4 or layer.act_order or layer.padded_n or k_start % MARLIN_TILE or k_stop % MARLIN_TILE:
            return None
        per = codes_per_word(4)
        words = np.asarray(self.ckpt.array(f"{layer.name}.qweight")[k_start // per : k_stop // per])
        return pack_b_from_gptq4(words), self.load_layer(layer, k_start, k_stop, codes=False)

    def load_words(
        self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None
    ) -> tuple[np.ndarray, QuantWeight] | None:
        """:meth:`Source.load_words`: the 4-bit ``qweight`` words of rows ``[k_start,
        k_stop)`` as stored (a view of the file), plus the chunk's scales and delta (its
        ``q`` is empty).  None where it does not apply (not 4-bit, act-order, a padded
        layer, rows not on whole words)."""
        k_stop = layer.size_k if k_stop is None else k_stop
        per = codes_per_word(4)
        if layer.bits != 4 or layer.act_order or layer.padded_n or k_start % per or k_stop % per:
            return None
        words = np.asarray(self.ckpt.array(f"{layer.name}.qweight")[k_start // per : k_stop // per])
        return words, self.load_layer(layer, k_start, k_stop, codes=False)
