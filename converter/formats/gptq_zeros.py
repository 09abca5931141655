"""GPTQ's zero conventions (v1: stored = z - 1; v2: stored = z) per layer: the config's,
unless the layer's stored zeros are all the symmetric value of the other convention
(spec 1.6), and the zeros decoded by it.
"""

from __future__ import annotations

import numpy as np

from ..constants import ZeroConvention
from ..errors import ConfigError
from .gptq_config import CONVERTIBLE_BITS, PASSTHROUGH_BITS
from .packing import decode_gptq_zeros, field_ones, symmetric_zero, unpack_words


class GptqZeroConventions:
    """The zero convention of each layer of :class:`~converter.formats.gptq.GptqSource`, a
    mixin of it (it reads the source's ``ckpt``, ``convention``, ``format_conflict`` and
    ``layer_config``)."""

    def _settle_format(self, prefixes: list[str]) -> ZeroConvention:
        """The zero convention when the two configs disagree: what the data shows.

        A layer whose stored zeros are all the symmetric value of one convention shows
        it (spec 1.6); every such layer must show the same one, and there must be one.

        Raises:
            ConfigError: no layer's zeros tell v1 from v2, or two layers disagree.
        """
        assert self.format_conflict is not None
        mine, theirs = self.format_conflict
        said = f"{self.ckpt.quant_config_file} says checkpoint_format {mine!r} but config.json says {theirs!r}"
        shown: dict[ZeroConvention, str] = {}
        for prefix in prefixes:
            bits = self.layer_config(prefix).bits
            if bits not in (*CONVERTIBLE_BITS, *PASSTHROUGH_BITS) or f"{prefix}.qzeros" not in self.ckpt:
                continue
            data = _zeros_show(self._stored_zeros(prefix, bits), bits)
            if data is not None:
                shown.setdefault(data, prefix)
        if len(shown) == 1:
            ((convention, layer),) = shown.items()
            self._conflict_note = (
                f"{said}; the zeros of {layer} (all the symmetric value of {convention.value}) decide: "
                f"decoded as {convention.value} (data wins)"
            )
            return convention
        why = (
            "and layers' zeros show both (" + ", ".join(f"{c.value}: {n}" for c, n in shown.items()) + ")"
            if shown
            else "and no layer's zeros tell v1 from v2 (none is all the symmetric value)"
        )
        raise ConfigError(
            f"{said}, {why}; correct the config that is wrong", path=self.cfg_path, tensor="checkpoint_format"
        )

    def _stored_zeros(self, prefix: str, bits: int) -> np.ndarray:
        """A layer's ``qzeros`` fields as stored (uint8 ``(G, N)``, no convention applied)."""
        return unpack_words(np.asarray(self.ckpt.array(f"{prefix}.qzeros")), bits, axis=1)

    def _layer_convention(self, prefix: str, bits: int) -> tuple[ZeroConvention, list[str]]:
        """The zero convention of one layer: the config's, unless the stored zeros are
        all the symmetric value of the other convention (spec 1.6 table and trap)."""
        warnings: list[str] = []
        stored = self._stored_zeros(prefix, bits)
        data = _zeros_show(stored, bits)
        if data is not None and data is not self.convention:
            label = {
                ZeroConvention.GPTQ_V1: "gptq (v1: stored = z - 1)",
                ZeroConvention.GPTQ_V2: "gptq_v2 (stored = z)",
            }
            value = symmetric_zero(bits) - (data is ZeroConvention.GPTQ_V1)
            warnings.append(
                f"config says checkpoint_format {label[self.convention]} but every stored zero is {value}, "
                f"the symmetric value of {label[data]}; decoded as {data.value} (data wins)"
            )
            return data, warnings
        convention = self.convention
        if convention is ZeroConvention.GPTQ_V1:
            wrapped = int(np.count_nonzero(stored == (1 << bits) - 1))
            if wrapped:
                how = (
                    "decoded per field as (stored + 1) mod 8 (GPTQModel's 3-bit rule)"
                    if bits == 3
                    else f"decoded by the whole-word add of 0x{int(field_ones(bits)):08X}, "
                    "which undoes GPTQModel's borrow"
                )
                warnings.append(
                    f"{wrapped} v1 zero field(s) store {(1 << bits) - 1}, i.e. z - 1 = -1: a true zero of 0 that "
                    f"decodes out of range per field; {how}; a producer that clamped or wrapped it otherwise "
                    "would need a different reading"
                )
        return convention, warnings

    def _decode_zeros(
        self, prefix: str, bits: int, convention: ZeroConvention, g0: int = 0, g1: int | None = None
    ) -> np.ndarray:
        words = np.asarray(self.ckpt.array(f"{prefix}.qzeros")[g0:g1])
        return decode_gptq_zeros(words, bits, v1=convention is ZeroConvention.GPTQ_V1)


def _zeros_show(stored: np.ndarray, bits: int) -> ZeroConvention | None:
    """The convention a layer's stored zeros show by being all one symmetric value, or None."""
    if not stored.size or not np.all(stored == stored.flat[0]):
        return None
    sym = symmetric_zero(bits)
    return {sym - 1: ZeroConvention.GPTQ_V1, sym: ZeroConvention.GPTQ_V2}.get(int(stored.flat[0]))
