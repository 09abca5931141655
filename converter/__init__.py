"""marlin-convert: asymmetric 4-bit checkpoints to Marlin artifacts, offline.

Public API: :func:`open_source`, :func:`convert`, :func:`validate_artifact`,
:func:`open_artifact`, and :class:`QuantWeight`.  GPU code lives in
``converter.gpu`` and imports CuPy lazily.
"""

__version__ = "0.1.0"

from .quant_weight import QuantWeight, Tensor  # noqa: E402

__all__ = ["QuantWeight", "Tensor", "__version__", "convert", "open_artifact", "open_source", "validate_artifact"]


def __getattr__(name: str):
    # Lazy so `import converter` stays cheap and never imports optional pieces.
    if name == "convert":
        from .convert import convert

        return convert
    if name == "open_source":
        from .formats import open_source

        return open_source
    if name == "open_artifact":
        from .artifact.reader import open_artifact

        return open_artifact
    if name == "validate_artifact":
        from .artifact.validate import validate_artifact

        return validate_artifact
    raise AttributeError(name)
