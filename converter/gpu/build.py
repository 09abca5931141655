"""NVRTC builds of ``kernels/*.cu``: each kernel compiled on first use, once per process
and device.

A model touches a handful of the ~190 template instantiations (one per route it takes),
so each is compiled by itself when a launch first asks for it (:func:`function`), not
every variant of a file up front: a fresh machine then pays for what it runs. Tools
that want everything at once (the GPU test session, benchmarks) call :func:`prebuild`,
which compiles whole files in parallel. CuPy also caches each cubin on disk.

A compile error shows up as one :class:`KernelError` carrying NVRTC's log
(``err.nvrtc_log``); the same error object is raised again on later calls instead of
recompiling.

The activation type is a build option, not a template parameter: a file built for bf16
gets ``-DMARLIN_BF16`` (``kernels/marlin_common.cuh`` picks the codes, the weight
arithmetic, the conversions and the mma type from it), so every kernel keeps its name and
the planner's catalog serves both types. :data:`ACT_SOURCES` says which files have a
bf16 form; ``hopper_activations`` and ``gather_columns`` only move 16-bit values and are
built once, for fp16, whatever the activations are.

Kernel sources are found by :func:`kernel_dir`: ``converter/_kernels`` inside an
installed wheel, else the repository's top-level ``kernels/``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
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
#: ``.cu`` file -> the kernels (template instantiations included) it can build.
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
#: Activation types the kernels take ("act": A and C), as the launchers name them.
ACTS = ("float16", "bfloat16")
#: ``.cu`` file -> the activation types it can be built for.
ACT_SOURCES: dict[str, tuple[str, ...]] = {
    "marlin_gemm.cu": ACTS,
    "marlin_decode.cu": ACTS,
    "dequant.cu": ACTS,
    "asym_correction.cu": ("float16",),  # the two-kernel path (a check, not a route): fp16 only
    "marlin_wgmma.cu": ("float16",),
    "marlin_streamk.cu": ACTS,
}
#: Kernels that only move 16-bit values: one build serves every activation type.
ACT_FREE = frozenset({"gather_columns", "hopper_activations"})


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


# One lock for the caches only: compiles run outside it, so prebuild's threads overlap
# (NVRTC releases the GIL) and a launch never waits on an unrelated file's compile.
_lock = threading.Lock()
_functions: dict[tuple[str, str, int, str], Any] = {}
_failures: dict[tuple[str, str, int, str], KernelError] = {}
#: NVRTC invocations so far, as (source, names, act): what a fresh process really compiled.
compiled: list[tuple[str, tuple[str, ...], str]] = []


def _act_of(name: str, act: str) -> str:
    return "float16" if name in ACT_FREE else act


def function(source: str, name: str, act: str = "float16") -> Any:
    """One kernel of ``source`` (a CuPy ``RawKernel``) for activations of type ``act``
    (:data:`ACTS`), compiled on first use.

    Raises:
        GpuUnavailableError: no CuPy / GPU / sm_80+.
        KernelError: ``name`` is not a kernel of ``source``, the file needs sm_90 or
            has no form for ``act``, or NVRTC failed (``err.nvrtc_log`` holds the full
            log). Raised once per process, kernel, device and type, then re-raised
            without recompiling.
    """
    act = _act_of(name, act)
    key = (source, name, runtime.device_info().index, act)
    with _lock:
        fn = _functions.get(key)
        if fn is not None:
            return fn
        if key in _failures:
            raise _failures[key]
    _compile(source, (name,), act)
    with _lock:
        if key in _failures:
            raise _failures[key]
        return _functions[key]


def prebuild(sources: tuple[str, ...] | None = None, workers: int = 8, acts: tuple[str, ...] = ("float16",)) -> None:
    """Compile every kernel of ``sources`` (default: every file this device runs) for
    each type of ``acts`` it has a form for, one NVRTC call per file and type, in
    parallel. Failures are kept for :func:`function` to raise; this raises nothing but
    :class:`GpuUnavailableError`."""
    info = runtime.device_info()
    todo = [
        (s, act, names)
        for s in (sources or tuple(NAMES))
        if s not in ARCH_SPECIFIC or info.compute_capability == 90
        for act in acts
        if act in ACT_SOURCES[s]
        for names in [tuple(n for n in NAMES[s] if act == "float16" or n not in ACT_FREE)]
        if any((s, n, info.index, act) not in _functions for n in names)
    ]
    with ThreadPoolExecutor(max(1, min(workers, len(todo)))) as pool:
        list(pool.map(lambda t: _compile(t[0], t[2], t[1]), todo))


def _compile(source: str, names: tuple[str, ...], act: str = "float16") -> None:
    """Build ``names`` of ``source`` for activations ``act`` in one NVRTC call and file
    each kernel, or its error, under (source, name, device, act)."""
    cp = runtime.cupy_module()
    info = runtime.device_info()
    folder = kernel_dir()
    err: KernelError | None = None
    fns: dict[str, Any] = {}
    ran = False
    unknown = [n for n in names if n not in NAMES.get(source, ())]
    arch = info.arch + "a" if source in ARCH_SPECIFIC else info.arch
    if unknown:
        err = KernelError(f"{source} has no kernel {unknown[0]}", path=folder / source)
    elif act not in ACT_SOURCES.get(source, ()):
        err = KernelError(f"{source} has no {act} form (it has {', '.join(ACT_SOURCES[source])})", path=folder / source)
    elif source in ARCH_SPECIFIC and info.compute_capability != 90:
        err = KernelError(f"{source} needs sm_90 (wgmma); this device is {info.arch}", path=folder / source)
    else:
        ran = True
        code = (folder / source).read_text(encoding="utf-8")
        options = ("-std=c++17", f"--gpu-architecture={arch}", f"-I{folder}")
        if act == "bfloat16":
            options += ("-DMARLIN_BF16",)
        try:
            mod = cp.RawModule(code=code, options=options, name_expressions=list(names))
            fns = {n: mod.get_function(n) for n in names}  # forces the compile now, not at first launch
        except Exception as exc:  # cupy.cuda.compiler.CompileException and driver errors
            log = str(exc)
            first = next((ln.strip() for ln in log.splitlines() if "error" in ln), log.strip()[:200])
            err = KernelError(f"NVRTC could not build {source} ({act}) for {arch}: {first}", path=folder / source)
            err.nvrtc_log = log  # type: ignore[attr-defined]
    with _lock:
        if ran:
            compiled.append((source, names, act))
        for n in names:
            key = (source, n, info.index, act)
            if err is not None:
                _failures.setdefault(key, err)
            else:
                _functions.setdefault(key, fns[n])
