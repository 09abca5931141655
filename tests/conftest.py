"""Shared fixtures: the real third-party checkpoints and the GPU skip hook."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.paths import REALINPUT


def _gpu_skip_reason() -> str | None:
    try:
        from converter.gpu.runtime import require_gpu
    except ImportError as exc:
        return f"GPU support not importable: {exc}"
    try:
        require_gpu()
    except Exception as exc:  # GpuUnavailableError, with its one-line reason
        return str(exc)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The marker, not the keyword: tests/gpu/ also holds CPU tests of the GPU package.
    gpu_items = [i for i in items if i.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _gpu_skip_reason()
    if reason:
        marker = pytest.mark.skip(reason=f"needs a GPU: {reason}")
        for item in gpu_items:
            item.add_marker(marker)


@pytest.fixture(scope="session")
def realinput() -> Path:
    """The folder of real third-party checkpoints; skips when ../shared is absent."""
    if not REALINPUT.is_dir():
        pytest.skip(f"real checkpoints not found at {REALINPUT} (set MARLIN_SHARED)")
    return REALINPUT
