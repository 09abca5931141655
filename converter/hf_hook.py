"""Registers the transformers quantizer of converted folders (``quant_method:
"marlin-convert"``, :mod:`converter.model.hf_quantizer`) once transformers is imported.

``import converter`` never imports transformers or torch (the CLIs need neither, and must
start fast), so :func:`install` registers at once only when transformers' quantizer
registry (``transformers.quantizers.auto``) is already imported; otherwise it puts a
finder first on ``sys.meta_path`` that wraps transformers' loader of that module and
registers right after it has run, then takes itself off. The registry, not the
``transformers`` package, is the trigger: ``from_pretrained`` imports it before it reads
a quantization config, and ``import transformers`` alone (a tokenizer) stays lazy instead
of importing torch and every quantizer (about 4 s). Registering twice does nothing, and a
failure is at most a warning: it never breaks ``import converter`` nor ``import transformers``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

#: The module that holds AUTO_QUANTIZER_MAPPING (the same in transformers 5.17 and 5.25).
_TARGET = "transformers.quantizers.auto"
_lock = threading.Lock()
_registered = False


def register_now() -> bool:
    """Register the quantizer (imports transformers and torch); whether it is registered.

    Without torch nothing is registered, silently: transformers cannot build a model then.
    Any other failure is a RuntimeWarning saying ``from_pretrained`` cannot load converted folders.
    """
    global _registered
    with _lock:
        if _registered:
            return True
        try:
            if importlib.util.find_spec("torch") is None:
                return False
            from .model.hf_quantizer import register

            register()
        except Exception as exc:
            warnings.warn(
                f"marlin-convert: the transformers quantizer for quant_method 'marlin-convert' is not registered "
                f"({type(exc).__name__}: {exc}); from_pretrained cannot load converted model folders",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        _registered = True
        return True


class _RegisteringLoader(importlib.abc.Loader):
    """transformers' own loader of the registry, and the registration once the registry has run."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps transformers' loader: importlib.resources and friends ask it.
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        module.__loader__ = self._inner
        self._inner.exec_module(module)
        uninstall()
        register_now()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the registry with the other finders, and wraps the loader they give."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def uninstall() -> None:
    """Take the finder off ``sys.meta_path`` (if it is there)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def install() -> None:
    """Register now if the registry is imported, else when it is; never raises."""
    try:
        if _TARGET in sys.modules:
            register_now()
        elif not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
    except Exception:
        pass  # registration is an extra: import converter must work without it
