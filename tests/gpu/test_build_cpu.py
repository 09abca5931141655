"""converter.gpu.build on the CPU: a kernel is compiled on first use, by itself, once;
prebuild compiles whole files; errors are kept and raised again without recompiling.
NVRTC is replaced by a recording stand-in (the real compile runs in the GPU suite)."""

from __future__ import annotations

import pytest

from converter.errors import KernelError
from converter.gpu import build, runtime

STREAMK = "marlin_streamk.cu"


class _Fn:
    def __init__(self, name: str) -> None:
        self.name = name


class _FakeCupy:
    """Records every RawModule (one NVRTC call) and its name expressions."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = []
        self.fail = fail
        fake = self

        class RawModule:
            def __init__(self, code: str, options: tuple[str, ...], name_expressions: list[str]) -> None:
                fake.calls.append((code[:0], tuple(options), tuple(name_expressions)))
                self.names = name_expressions

            def get_function(self, name: str) -> _Fn:
                if fake.fail is not None:
                    raise RuntimeError(f"kernel.cu(12): error: {fake.fail}\n1 error detected")
                assert name in self.names
                return _Fn(name)

        self.RawModule = RawModule


@pytest.fixture
def fake(monkeypatch):
    def install(cc: int = 90, fail: str | None = None) -> _FakeCupy:
        cp = _FakeCupy(fail)
        info = runtime.DeviceInfo(index=0, name="fake", compute_capability=cc, sm_count=132)
        monkeypatch.setattr(runtime, "cupy_module", lambda: cp)
        monkeypatch.setattr(runtime, "device_info", lambda: info)
        monkeypatch.setattr(build, "_functions", {})
        monkeypatch.setattr(build, "_failures", {})
        monkeypatch.setattr(build, "compiled", [])
        return cp

    return install


def test_a_kernel_is_compiled_alone_on_first_use_and_once(fake) -> None:
    cp = fake()
    a, b = build.NAMES[STREAMK][:2]
    fn = build.function(STREAMK, a)
    assert fn.name == a and build.function(STREAMK, a) is fn
    assert [c[2] for c in cp.calls] == [(a,)]
    assert "--gpu-architecture=sm_90a" in cp.calls[0][1]
    build.function(STREAMK, b)
    assert [c[2] for c in cp.calls] == [(a,), (b,)]
    assert build.compiled == [(STREAMK, (a,)), (STREAMK, (b,))]


def test_an_unknown_kernel_is_refused_without_compiling(fake) -> None:
    cp = fake()
    with pytest.raises(KernelError, match=r"marlin_streamk.cu has no kernel marlin_streamk<1, 2, 3>"):
        build.function(STREAMK, "marlin_streamk<1, 2, 3>")
    assert cp.calls == [] and build.compiled == []


def test_sm90_files_are_refused_on_sm80_and_the_error_is_kept(fake) -> None:
    cp = fake(cc=80)
    name = build.NAMES[STREAMK][0]
    with pytest.raises(KernelError, match="needs sm_90") as first:
        build.function(STREAMK, name)
    with pytest.raises(KernelError) as again:
        build.function(STREAMK, name)
    assert again.value is first.value and cp.calls == []
    # sm_80 files still build for sm_80 itself
    build.function("marlin_gemm.cu", "gather_columns")
    assert cp.calls[0][1][1] == "--gpu-architecture=sm_80"


def test_an_nvrtc_failure_is_one_line_with_the_log_and_not_retried(fake) -> None:
    cp = fake(fail="identifier undefined")
    name = build.NAMES["marlin_decode.cu"][0]
    with pytest.raises(KernelError, match=r"NVRTC could not build marlin_decode.cu for sm_90: .*identifier undefined"):
        build.function("marlin_decode.cu", name)
    with pytest.raises(KernelError) as again:
        build.function("marlin_decode.cu", name)
    assert "1 error detected" in again.value.nvrtc_log
    assert len(cp.calls) == 1


def test_prebuild_compiles_each_file_once_whole_and_first_use_then_compiles_nothing(fake) -> None:
    cp = fake()
    build.prebuild()
    assert sorted(c[2] for c in cp.calls) == sorted(tuple(v) for v in build.NAMES.values())
    before = len(cp.calls)
    for source, names in build.NAMES.items():
        assert build.function(source, names[-1]).name == names[-1]
    build.prebuild()
    assert len(cp.calls) == before


def test_prebuild_on_sm80_skips_the_sm90_files(fake) -> None:
    cp = fake(cc=80)
    build.prebuild()
    assert {names[0] for _, _, names in cp.calls} == {
        build.NAMES[s][0] for s in build.NAMES if s not in build.ARCH_SPECIFIC
    }
