"""marlin-convert: asymmetric 4-bit checkpoints to Marlin artifacts, offline.

Public API: :func:`open_source`, :func:`convert`, :func:`verify`,
:func:`validate_artifact`, :func:`open_artifact`, :func:`load_model` (a converted model
folder as a transformers model; imports torch and transformers on call), and
:class:`QuantWeight`.  GPU code lives in ``converter.gpu`` and imports CuPy lazily.

Importing the package also registers ``quant_method: "marlin-convert"`` with transformers
(now if transformers is imported, else when it is: :mod:`converter.hf_hook`), so that
``AutoModelForCausalLM.from_pretrained(OUTDIR, device_map="cuda")`` loads a converted folder.
"""

__version__ = "0.1.0"

# First: in the two commands' processes, a Ctrl-C during the imports below (and converter.cli's)
# exits 130 with one line instead of a traceback (see converter/faults.py).
from . import faults as _faults  # noqa: F401
from . import hf_hook as _hf_hook

# Imported eagerly: the submodules `convert` and `verify` share their function's
# name, and a lazy import would leave the package attribute bound to the module.
from .artifact.reader import open_artifact
from .artifact.validate import validate_artifact
from .convert import convert
from .formats import open_source
from .model import load_model  # torch and transformers only when it is called
from .quant_weight import QuantWeight, Tensor
from .verify import verify

# Last, and never raising: registers with transformers without importing it (or torch).
_hf_hook.install()

__all__ = [
    "QuantWeight",
    "Tensor",
    "__version__",
    "convert",
    "load_model",
    "open_artifact",
    "open_source",
    "validate_artifact",
    "verify",
]
