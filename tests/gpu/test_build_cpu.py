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
    assert build.compiled == [(STREAMK, (a,), "float16"), (STREAMK, (b,), "float16")]


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
    msg = r"NVRTC could not build marlin_decode.cu \(float16\) for sm_90: .*identifier undefined"
    with pytest.raises(KernelError, match=msg):
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


def test_a_bf16_kernel_is_its_own_build_with_the_same_name_and_the_bf16_define(fake) -> None:
    cp = fake()
    name = build.NAMES["marlin_decode.cu"][0]
    fp16 = build.function("marlin_decode.cu", name)
    bf16 = build.function("marlin_decode.cu", name, "bfloat16")
    assert bf16 is not fp16 and bf16.name == fp16.name == name
    assert build.function("marlin_decode.cu", name, "bfloat16") is bf16
    assert ["-DMARLIN_BF16" in c[1] for c in cp.calls] == [False, True]
    assert build.compiled == [("marlin_decode.cu", (name,), "float16"), ("marlin_decode.cu", (name,), "bfloat16")]


def test_copy_kernels_serve_bf16_from_their_fp16_build(fake) -> None:
    cp = fake()
    fn = build.function("marlin_wgmma.cu", "hopper_activations")
    assert build.function("marlin_wgmma.cu", "hopper_activations", "bfloat16") is fn
    assert build.function("marlin_gemm.cu", "gather_columns", "bfloat16").name == "gather_columns"
    assert all("-DMARLIN_BF16" not in c[1] for c in cp.calls) and len(cp.calls) == 2


def test_a_file_without_a_bf16_form_is_refused_by_name_without_compiling(fake) -> None:
    cp = fake()
    name = next(n for n in build.NAMES["marlin_wgmma.cu"] if n != "hopper_activations")
    with pytest.raises(KernelError, match=r"marlin_wgmma.cu has no bfloat16 form \(it has float16\)"):
        build.function("marlin_wgmma.cu", name, "bfloat16")
    assert cp.calls == []


def test_prebuild_of_both_types_builds_every_bf16_form_once_and_the_copy_kernels_once(fake) -> None:
    cp = fake()
    build.prebuild(acts=build.ACTS)
    bf16 = sorted((c[2] for c in cp.calls if "-DMARLIN_BF16" in c[1]), key=lambda n: n[0])
    with_bf16 = [s for s in build.NAMES if "bfloat16" in build.ACT_SOURCES[s]]
    want = sorted((tuple(n for n in build.NAMES[s] if n not in build.ACT_FREE) for s in with_bf16), key=lambda n: n[0])
    assert bf16 == want
    assert sum("-DMARLIN_BF16" not in c[1] for c in cp.calls) == len(build.NAMES)
    before = len(cp.calls)
    build.prebuild(acts=build.ACTS)
    assert len(cp.calls) == before


def test_every_constexpr_function_of_the_kernels_is_a_device_function() -> None:
    """NVRTC 13.5 (pip's nvidia-cuda-nvrtc) refuses a kernel that calls a constexpr
    function without __device__ ("host functions are not allowed in JIT mode"), which
    13.0 let through: marlin_decode.cu's ring size once failed every decode route there."""
    import re

    # a constexpr function's declaration, its signature over several lines or not ("if
    # constexpr" is a statement, not a function)
    fn = re.compile(r"(?<!if )\bconstexpr\b[^;{}=]*?\b\w+\s*\([^)]*\)[^;{}=]*\{", re.S)
    bare = []
    for path in sorted(build.kernel_dir().glob("*.cu*")):
        text = path.read_text()
        for m in fn.finditer(text):
            start = max(text.rfind(c, 0, m.start()) for c in ";{}") + 1  # the declaration's start
            if "__device__" not in text[start : m.end()]:
                bare.append(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}")
    assert bare == []
