"""GPTQ's quantization settings per module: the config's ``bits``, ``group_size``,
``sym`` and ``desc_act`` after GPTQModel's ``dynamic`` overrides and HF's
``modules_to_not_convert``, and a v1 / v2 disagreement between two config files.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..errors import ConfigError
from .hf import config_field, not_convert_match
from .patterns import ConfigPattern

#: Bit widths whose codes convert to Marlin 4-bit losslessly: a b-bit code is a valid
#: 4-bit code and ``delta`` absorbs the offset (issue 4, "Bit widths").
CONVERTIBLE_BITS = (2, 3, 4)
PASSTHROUGH_BITS = (8,)
#: ``checkpoint_format`` values that mean "already Marlin-packed" (spec 5.1).
MARLIN_FORMATS = ("marlin",)
#: Keys a ``dynamic`` override may set that change how we read a layer.
DYNAMIC_KEYS = ("bits", "group_size", "sym", "desc_act")
LM_HEAD = "lm_head"


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """The quantization settings that apply to one module after ``dynamic`` overrides.

    ``skip`` is the reason a config excludes the module from quantization ("" if not).
    """

    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    skip: str = ""
    rule: str = ""


class GptqLayerConfigs:
    """The per-module settings of :class:`~converter.formats.gptq.GptqSource`, a mixin of
    it (it reads the source's ``ckpt``, ``cfg_path`` and the fields its ``__init__`` sets)."""

    def _format_conflict(self, fmt: str) -> tuple[str, str] | None:
        inner = self.ckpt.config.get("quantization_config")
        if self.ckpt.quant_config_file in (None, "config.json") or not isinstance(inner, dict):
            return None
        if str(inner.get("quant_method", "gptq")).lower() != "gptq":
            return None
        other = inner.get("checkpoint_format") or inner.get("format") or "gptq"
        other = other.lower() if isinstance(other, str) else other
        if other in ("gptq", "gptq_v2") and other != fmt:
            return fmt, other
        return None

    def _parse_dynamic(self, dyn: Any) -> list[tuple[str, ConfigPattern, dict[str, Any]]]:
        if dyn is None:
            return []
        if not isinstance(dyn, dict):
            raise ConfigError(
                f"expected an object of regex -> overrides, found {type(dyn).__name__}",
                path=self.cfg_path,
                tensor="dynamic",
            )
        rules = []
        for key, overrides in dyn.items():
            pattern = key[2:] if key.startswith(("-:", "+:")) else key
            rx = ConfigPattern(pattern, entry=f"key {key!r}", field="dynamic", path=self.cfg_path)
            if not isinstance(overrides, dict):
                raise ConfigError(
                    f"value of {key!r} must be an object of overrides, found {json.dumps(overrides)[:200]}",
                    path=self.cfg_path,
                    tensor="dynamic",
                )
            for k in DYNAMIC_KEYS:
                if k in overrides:
                    want = bool if k in ("sym", "desc_act") else int
                    config_field(overrides, k, want, None, path=self.cfg_path, field=f"dynamic[{key!r}].{k}")
            rules.append((key, rx, overrides))
        return rules

    def layer_config(self, module: str) -> LayerConfig:
        """The settings for ``module`` after ``dynamic`` and ``modules_to_not_convert``.

        ``dynamic`` follows GPTQModel's ``dynamic_get``: keys are tried in order with
        ``re.match``; the first match wins; ``-:`` means "not quantized".
        """
        base = LayerConfig(self.bits, self.group_size, self.sym, self.desc_act)
        entry = not_convert_match(module, self.not_convert)
        if entry is not None:
            return dataclasses.replace(base, skip=f"module matches modules_to_not_convert entry {entry!r}", rule=entry)
        for key, rx, overrides in self.dynamic:
            if not rx.match(module):
                continue
            if key.startswith("-:"):
                return dataclasses.replace(base, skip=f"excluded from quantization by dynamic rule {key!r}", rule=key)
            return LayerConfig(
                bits=overrides.get("bits", base.bits),
                group_size=overrides.get("group_size", base.group_size),
                sym=overrides.get("sym", base.sym),
                desc_act=overrides.get("desc_act", base.desc_act),
                rule=key,
            )
        return base
