"""Import CuPy on demand and check the GPU.

Nothing here runs at import time: :func:`cupy_module` is called by the first launcher
that needs the GPU. Every failure becomes a :class:`GpuUnavailableError` whose message
is one line, so the CLI prints it without a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType

from ..errors import GpuUnavailableError

#: mma.sync.m16n8k16 with f16 inputs and f32 accumulation needs sm_80 (PTX ISA).
MIN_COMPUTE_CAPABILITY = 80


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """The current CUDA device as the kernels see it.

    Attributes:
        index: CUDA device ordinal.
        name: marketing name (``"NVIDIA H200"``).
        compute_capability: e.g. 90 for sm_90.
        sm_count: number of multiprocessors (132 on an H200).
        smem_per_block_optin: bytes of shared memory one block may opt in to
            (227 KB on sm_90, 163 KB on sm_80, 99 KB on sm_86/sm_89).
        smem_per_sm: bytes of shared memory per multiprocessor.
    """

    index: int
    name: str
    compute_capability: int
    sm_count: int
    smem_per_block_optin: int = 48 * 1024
    smem_per_sm: int = 100 * 1024

    @property
    def arch(self) -> str:
        """NVRTC target name for this device, e.g. ``"sm_90"``."""
        return f"sm_{self.compute_capability}"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def cupy_module() -> ModuleType:
    """Return the ``cupy`` module after checking that a usable GPU is present.

    Returns:
        The imported ``cupy`` module.

    Raises:
        GpuUnavailableError: CuPy is not installed or fails to import, no CUDA device
            is visible, or the current device is older than sm_80. The message is one
            line and says what to do.
    """
    cp = _import_cupy()
    device_info()  # raises when no suitable device
    return cp


@functools.lru_cache(maxsize=1)
def _import_cupy() -> ModuleType:
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising anything
        raise GpuUnavailableError(
            "CuPy is not available (" + _one_line(exc) + "); on a machine without an NVIDIA GPU, run on the CPU "
            'instead: from_pretrained(..., device_map="cpu"), load_model(path, device="cpu") or marlin-verify '
            "--cpu; with one, install the GPU extra: pip install -e '.[cuda12]' (or '.[cuda13]') from the checkout"
        ) from None
    return cupy


@functools.cache
def _device_info(index: int) -> DeviceInfo:
    cp = _import_cupy()
    props = cp.cuda.runtime.getDeviceProperties(index)
    cc = int(props["major"]) * 10 + int(props["minor"])
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])

    def attribute(code: int, key: str) -> int:
        # cudaDevAttrMaxSharedMemoryPerBlockOptin = 97, ...PerMultiprocessor = 81
        try:
            return int(cp.cuda.runtime.deviceGetAttribute(code, index))
        except Exception:
            return int(props[key])

    info = DeviceInfo(
        index,
        name,
        cc,
        int(props["multiProcessorCount"]),
        attribute(97, "sharedMemPerBlockOptin"),
        attribute(81, "sharedMemPerMultiprocessor"),
    )
    if cc < MIN_COMPUTE_CAPABILITY:
        raise GpuUnavailableError(
            f"GPU {index} ({name}) has compute capability {cc // 10}.{cc % 10}; "
            "the Marlin kernels need 8.0 or newer (mma.sync.m16n8k16)"
        )
    return info


def device_info() -> DeviceInfo:
    """Describe the current CUDA device.

    Raises:
        GpuUnavailableError: no CuPy, no visible CUDA device, or compute capability
            below 8.0 (one-line message).
    """
    cp = _import_cupy()
    try:
        count = cp.cuda.runtime.getDeviceCount()
        index = cp.cuda.runtime.getDevice() if count else -1
    except Exception as exc:
        raise GpuUnavailableError("no usable CUDA device (" + _one_line(exc) + ")") from None
    if count == 0:
        raise GpuUnavailableError("no CUDA device is visible (CuPy found 0 devices)")
    return _device_info(index)


def require_gpu() -> DeviceInfo:
    """Check that the GPU path can run here and describe the device.

    Used by the test suite's skip hook and by ``marlin-verify`` to decide GPU mode.

    Returns:
        :class:`DeviceInfo` of the current device.

    Raises:
        GpuUnavailableError: no CuPy, no visible CUDA device, or compute capability
            below 8.0 (one-line message).
    """
    _import_cupy()
    return device_info()
