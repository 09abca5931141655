"""Fixtures for the GPU kernel tests: the CuPy module, or a skip with the reason."""

from __future__ import annotations

import pytest

from converter.errors import GpuUnavailableError


@pytest.fixture(scope="session")
def cp():
    """The ``cupy`` module on an sm_80+ GPU; skips the test when there is none.

    The suite touches nearly every variant, of both activation types, so it builds whole
    files up front and in parallel (a served model compiles each kernel on first use
    instead: tests/gpu/test_build.py)."""
    from converter.gpu import build, runtime

    try:
        cp = runtime.cupy_module()
    except GpuUnavailableError as exc:
        pytest.skip(str(exc).split(";")[0])  # the reason, not the CLI's advice after it
    build.prebuild(acts=build.ACTS)
    return cp
