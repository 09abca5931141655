"""NVRTC modules for ``kernels/*.cu``, built once per process and device.

One CuPy ``RawModule`` per ``.cu`` file and device, built on first use and kept for
the life of the process (CuPy also caches the cubin on disk).  Templates are reached
through ``name_expressions`` (:data:`NAMES`); every one is fetched at build time, so a
compile error shows up at once as one :class:`KernelError` carrying NVRTC's log
(``err.nvrtc_log``), and the same error object is raised again on later calls instead
of recompiling.

Kernel sources are found by :func:`kernel_dir`: ``converter/_kernels`` inside an
installed wheel, else the repository's top-level ``kernels/``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ..errors import KernelError
from . import runtime
from .plan import kernel_names

#: Every file the kernels are built from (the headers are #included).
SOURCES = (
    "marlin_gemm.cu",
    "marlin_decode.cu",
    "dequant.cu",
    "asym_correction.cu",
    "marlin_common.cuh",
    "marlin_stream.cuh",
    "marlin_wgmma.cu",
    "wgmma_ops.cuh",
    "hopper_pipe.cuh",
    "marlin_streamk.cu",
)
#: ``.cu`` file -> the kernels (template instantiations included) it is built for.
NAMES: dict[str, list[str]] = {
    "marlin_gemm.cu": [*kernel_names("marlin_gemm.cu"), "gather_columns"],
    "marlin_decode.cu": kernel_names("marlin_decode.cu"),
    "dequant.cu": ["marlin_dequant<false>", "marlin_dequant<true>"],
    "asym_correction.cu": ["group_sums", "add_correction"],
    "marlin_wgmma.cu": [*kernel_names("marlin_wgmma.cu"), "hopper_activations"],
    "marlin_streamk.cu": kernel_names("marlin_streamk.cu"),
}
#: Sources that use sm_90a-only instructions (wgmma): built for the device's "a"
#: target, and only on sm_90 (the planner routes nothing to them elsewhere).
ARCH_SPECIFIC = ("marlin_wgmma.cu", "marlin_streamk.cu")


def kernel_dir() -> Path:
    """Folder holding the ``.cu`` sources.

    Looks first at ``converter/_kernels`` (where the wheel's force-include puts them),
    then at ``<repo>/kernels`` (a source checkout).

    Raises:
        KernelError: neither folder holds every file of :data:`SOURCES`.
    """
    here = Path(__file__).resolve().parent
    candidates = (here.parent / "_kernels", here.parents[1] / "kernels")
    for c in candidates:
        if all((c / s).is_file() for s in SOURCES):
            return c
    raise KernelError("kernel sources not found; looked in " + ", ".join(str(c) for c in candidates))


_lock = threading.Lock()
_modules: dict[tuple[str, int], Any] = {}
_failures: dict[tuple[str, int], KernelError] = {}


def module(source: str) -> Any:
    """The compiled ``RawModule`` for ``source`` (e.g. ``"marlin_gemm.cu"``) on this device.

    Raises:
        GpuUnavailableError: no CuPy / GPU / sm_80+.
        KernelError: NVRTC failed; ``err.nvrtc_log`` holds the full log. Raised once
            per process per file and device, then re-raised without recompiling.
    """
    cp = runtime.cupy_module()
    info = runtime.device_info()
    key = (source, info.index)
    with _lock:
        if key in _modules:
            return _modules[key]
        if key in _failures:
            raise _failures[key]
        folder = kernel_dir()
        code = (folder / source).read_text(encoding="utf-8")
        arch = info.arch + "a" if source in ARCH_SPECIFIC else info.arch
        if source in ARCH_SPECIFIC and info.compute_capability != 90:
            err = KernelError(f"{source} needs sm_90 (wgmma); this device is {info.arch}", path=folder / source)
            _failures[key] = err
            raise err
        options = ("-std=c++17", f"--gpu-architecture={arch}", f"-I{folder}")
        try:
            mod = cp.RawModule(code=code, options=options, name_expressions=NAMES[source])
            for name in NAMES[source]:
                mod.get_function(name)  # forces the compile now, not at first launch
        except Exception as exc:  # cupy.cuda.compiler.CompileException and driver errors
            log = str(exc)
            first = next((ln.strip() for ln in log.splitlines() if "error" in ln), log.strip()[:200])
            err = KernelError(f"NVRTC could not build {source} for {arch}: {first}", path=folder / source)
            err.nvrtc_log = log  # type: ignore[attr-defined]
            _failures[key] = err
            raise err from None
        _modules[key] = mod
        return mod


def function(source: str, name: str) -> Any:
    """One kernel of ``source``'s module (a CuPy ``RawKernel``)."""
    return module(source).get_function(name)
