"""GPU path: our own Marlin-layout kernels (``kernels/*.cu``) loaded through CuPy.

This is the only package that imports CuPy, and it does so lazily: importing
``converter.gpu`` (or :mod:`converter.gpu.reference`, the NumPy twins) never needs a GPU.
Anything that does need one raises :class:`converter.errors.GpuUnavailableError` with a
one-line message when CuPy or a suitable GPU (compute capability 8.0+) is missing.

Modules:
    runtime:   CuPy import on demand, device checks.
    plan:      pure GEMM planning: kernel kinds, variants, routing, the K split, ``Tuning``.
    build:     NVRTC builds, each kernel compiled on first use (``prebuild`` for whole files).
    kernels:   the checked launchers (their pieces: checks, operands, launches, packed_args).
    reference: NumPy twins of every launcher, same signatures (gathered from reference_*).
    verify:    :func:`verify_layer_gpu` for ``marlin-verify --gpu``.
    api:       :func:`load_artifact_gpu`, :class:`MarlinLinear`, ``MarlinLinearModule``.
"""

from __future__ import annotations

__all__ = ["api", "build", "kernels", "plan", "reference", "runtime", "verify"]
