"""The Marlin target layout: pure NumPy, no GPU needed."""

from .layout import pack_b, permute_scales, unpack_b, unpermute_scales
from .shapes import (
    LayerShape,
    check_convertible,
    kernel_compatible,
    marlin_shapes,
    upstream_compatible,
)

__all__ = [
    "LayerShape",
    "check_convertible",
    "kernel_compatible",
    "marlin_shapes",
    "pack_b",
    "permute_scales",
    "unpack_b",
    "unpermute_scales",
    "upstream_compatible",
]
