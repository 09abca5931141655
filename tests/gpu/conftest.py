"""Fixtures for the GPU kernel tests: the CuPy module, or a skip with the reason."""

from __future__ import annotations

import pytest

from converter.errors import GpuUnavailableError


@pytest.fixture(scope="session")
def cp():
    """The ``cupy`` module on an sm_80+ GPU; skips the test when there is none."""
    from converter.gpu import runtime

    try:
        return runtime.cupy_module()
    except GpuUnavailableError as exc:
        pytest.skip(str(exc))
