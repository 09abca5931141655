"""The compiled loops (``converter._native``) against their NumPy twins, the reference.

Packers and unpackers must give the same bits as the NumPy code on random layers of
many shapes, on every real layer (GPTQ v1/v2, act-order, per-channel, AWQ,
compressed-tensors) and on 2- and 3-bit codes with their offsets; the numerics loop must
agree with a plain fp32 ``x @ W`` to fp32 rounding.  Without the extension (no C compiler
at install) these tests skip with the reason and the rest of the suite runs the NumPy
code; the fallback itself is tested here with the extension switched off.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from converter import native
from converter.convert import convert
from converter.formats import open_source
from converter.formats.gptq import GptqSource
from converter.formats.packing import (
    first_code_diff,
    first_code_diff_numpy,
    pack_words,
    unpack_words,
    unpack_words_numpy,
)
from converter.marlin.layout import (
    pack_b,
    pack_b_from_gptq4,
    pack_b_from_gptq4_numpy,
    pack_b_numpy,
    unpack_b,
    unpack_b_numpy,
)
from converter.numerics import accumulate
from tests.helpers.paths import REALINPUT, REPO, SAMPLE
from tests.helpers.producers import gptq_config, gptq_tensors, make_layer, write_checkpoint

needs_native = pytest.mark.skipif(native.lib() is None, reason=f"converter._native: {native.status()}")
REAL = sorted(p for p in REALINPUT.glob("*/*") if p.is_dir()) if REALINPUT.is_dir() else []


# --------------------------------------------------------------------------- packers


@needs_native
@settings(max_examples=60, deadline=None)
@given(kt=st.integers(1, 9), nb=st.integers(1, 7), seed=st.integers(0, 2**32 - 1), top=st.sampled_from([4, 8, 16]))
def test_pack_and_unpack_match_numpy_on_random_codes(kt: int, nb: int, seed: int, top: int) -> None:
    q = np.random.default_rng(seed).integers(0, top, (16 * kt, 64 * nb), dtype=np.uint8)
    b = pack_b(q)
    np.testing.assert_array_equal(b, pack_b_numpy(q))
    np.testing.assert_array_equal(unpack_b(b), unpack_b_numpy(b))
    np.testing.assert_array_equal(unpack_b(b), q)
    words = pack_words(q & 15, 4, axis=0)
    np.testing.assert_array_equal(pack_b_from_gptq4(words), pack_b_from_gptq4_numpy(words))


@needs_native
def test_large_layer_matches_numpy() -> None:
    """A 70B-class down projection shape, 8192 x 28672 rows cut to 1024 to stay quick."""
    rng = np.random.default_rng(7)
    words = rng.integers(-(2**31), 2**31, (1024 // 8, 28672), dtype=np.int64).astype(np.int32)
    b = pack_b_from_gptq4(words)
    np.testing.assert_array_equal(b, pack_b_from_gptq4_numpy(words))
    q = unpack_words(words, 4, axis=0)
    np.testing.assert_array_equal(q, unpack_words_numpy(words, 4, axis=0))
    np.testing.assert_array_equal(pack_b(q), b)
    np.testing.assert_array_equal(unpack_b(b), q)


@needs_native
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_unpack_words_down_the_rows_matches_numpy(bits: int) -> None:
    rng = np.random.default_rng(bits)
    words = rng.integers(0, 2**32, (12, 192), dtype=np.uint64).astype(np.uint32).view(np.int32)
    np.testing.assert_array_equal(unpack_words(words, bits, axis=0), unpack_words_numpy(words, bits, axis=0))


@needs_native
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_unpack_words_along_the_rows_matches_numpy(bits: int) -> None:
    """qzeros: field i of word j is code j * 32/bits + i (the compiled unpack_cols)."""
    rng = np.random.default_rng(10 + bits)
    words = rng.integers(0, 2**32, (7, 24), dtype=np.uint64).astype(np.uint32).view(np.int32)
    got = unpack_words(words, bits, axis=1)
    np.testing.assert_array_equal(got, unpack_words_numpy(words, bits, axis=1))
    per = 32 // bits
    u = int(words.view(np.uint32)[3, 5])
    assert [int(c) for c in got[3, 5 * per : 6 * per]] == [(u >> (bits * i)) & ((1 << bits) - 1) for i in range(per)]
    with pytest.raises(ValueError, match=f"codes: {per - 1} bytes, expected {per}"):
        native.lib().unpack_cols(np.zeros(1, np.uint32), np.zeros(per - 1, np.uint8), 1, 1, bits)


@pytest.mark.parametrize(
    "bits,fault",
    # An 8-bit field holds every byte: no code is too wide for it.
    [(b, f) for b in (2, 4, 8) for f in ("none", "first", "later", "wide", "last") if (b, f) != (8, "wide")],
)
def test_first_code_diff_matches_numpy(bits: int, fault: str) -> None:
    """The compiled words-vs-codes comparison and its NumPy twin give the same index:
    -1 when equal, else the row-major position of the first differing code (a byte above
    the field's mask differs too), with a second difference further on ignored."""
    rng = np.random.default_rng(bits)
    per = 32 // bits
    codes = rng.integers(0, 1 << bits, (6 * per, 192), dtype=np.uint8)
    words = pack_words(codes, bits, axis=0)
    at = {"none": None, "first": (0, 0), "later": (3 * per + 1, 70), "wide": (per + 2, 5), "last": (6 * per - 1, 191)}
    expected = -1
    if at[fault] is not None:
        r, c = at[fault]
        codes[r, c] = (int(codes[r, c]) + 1) % (1 << bits) if fault != "wide" else int(codes[r, c]) | (1 << bits)
        codes[-1, -1] ^= 1 if fault != "last" else 0  # a later difference does not move the first
        expected = r * 192 + c
    assert first_code_diff_numpy(words, codes, bits) == expected
    assert first_code_diff(words, codes, bits) == expected
    assert first_code_diff(words.view(np.uint32), codes, bits) == expected


def test_first_code_diff_rejects_mismatched_shapes() -> None:
    words = np.zeros((2, 64), np.int32)
    with pytest.raises(ValueError, match=r"codes \(15, 64\) do not unpack from words \(2, 64\) at 4 bits"):
        first_code_diff(words, np.zeros((15, 64), np.uint8), 4)
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8, got 3"):
        first_code_diff(words, np.zeros((16, 64), np.uint8), 3)


@needs_native
def test_diff_rows_checks_its_buffers() -> None:
    with pytest.raises(ValueError, match="codes: 1000 bytes, expected 1024"):
        native.lib().diff_rows(np.zeros(128, np.uint32), np.zeros(1000, np.uint8), 2, 64, 4)


def test_gptq_words_are_the_codes_of_load_layer(tmp_path: Path) -> None:
    """GptqSource.load_words: the chunk's qweight words unpack to load_layer's codes, and
    its QuantWeight has the same scales and delta (and no codes); None for act-order."""
    rng = np.random.default_rng(5)
    tensors = gptq_tensors("m.a", make_layer(rng, 256, 128, group_size=64), v1=True)
    tensors |= gptq_tensors("m.b", make_layer(rng, 256, 128, group_size=64, act_order=True), v1=True)
    src = write_checkpoint(tmp_path / "src", tensors, gptq_config(4, 64), where="quantize_config.json")
    with open_source(src) as s:
        plain, ordered = sorted((lay for lay in s.plan().layers), key=lambda lay: lay.name)
        words, qw = s.load_words(plain, 64, 192)
        ref = s.load_layer(plain, 64, 192)
        assert words.shape == (16, 128) and qw.q.shape == (0, 128)
        np.testing.assert_array_equal(unpack_words(words, 4, axis=0), ref.marlin_codes())
        np.testing.assert_array_equal(qw.scales, ref.scales)
        np.testing.assert_array_equal(qw.marlin_delta(), ref.marlin_delta())
        assert s.load_words(ordered, 0, 256) is None


@needs_native
@pytest.mark.parametrize("bits", [2, 3])
def test_narrow_codes_with_their_offset_match_numpy(tmp_path: Path, bits: int) -> None:
    """2- and 3-bit GPTQ layers: codes stored +6 / +4 (quant_weight.marlin_code_offset)."""
    rng = np.random.default_rng(bits)
    layer = make_layer(rng, 256, 128, bits=bits, group_size=64, act_order=bits == 3)
    src = write_checkpoint(
        tmp_path / "src", gptq_tensors("m.proj", layer, v1=True), gptq_config(bits, 64), where="quantize_config.json"
    )
    with open_source(src) as s:
        (lay,) = s.plan().layers
        codes = s.load_layer(lay).marlin_codes()
    assert int(codes.min()) >= 8 - 2 ** (bits - 1) and int(codes.max()) <= 7 + 2 ** (bits - 1)
    np.testing.assert_array_equal(pack_b(codes), pack_b_numpy(codes))


@needs_native
@pytest.mark.skipif(not REAL, reason=f"no real checkpoints under {REALINPUT}")
@pytest.mark.parametrize("ckpt", REAL, ids=lambda p: p.name)
def test_every_real_layer_matches_numpy(ckpt: Path) -> None:
    """GPTQ v1 and v2, act-order, per-channel, AWQ and compressed-tensors layers, as stored."""
    with open_source(ckpt) as s:
        layers = [lay for lay in s.plan().layers if lay.convertible]
        assert layers
        for lay in layers:
            qw = s.load_layer(lay)
            codes = qw.marlin_codes()
            b = pack_b(codes)
            np.testing.assert_array_equal(b, pack_b_numpy(codes), err_msg=lay.name)
            np.testing.assert_array_equal(unpack_b(b), unpack_b_numpy(b), err_msg=lay.name)
            if isinstance(s, GptqSource) and lay.bits == 4 and not lay.act_order:
                words = np.asarray(s.ckpt.array(f"{lay.name}.qweight"))
                np.testing.assert_array_equal(pack_b_from_gptq4(words), b, err_msg=lay.name)
                np.testing.assert_array_equal(
                    unpack_words(words, 4, axis=0), unpack_words_numpy(words, 4, axis=0), err_msg=lay.name
                )


@needs_native
def test_out_buffer_is_filled_and_returned() -> None:
    q = np.random.default_rng(1).integers(0, 16, (32, 128), dtype=np.uint8)
    out = np.full((2, 256), -1, dtype=np.int32)
    assert pack_b(q, out=out) is out
    np.testing.assert_array_equal(out, pack_b_numpy(q))
    with pytest.raises(ValueError, match=r"out must be a C-contiguous int32 array of shape \(2, 256\)"):
        pack_b(q, out=np.empty((2, 255), dtype=np.int32))


@needs_native
def test_compiled_calls_check_their_buffers() -> None:
    lib = native.lib()
    q = np.zeros((16, 64), dtype=np.uint8)
    with pytest.raises(ValueError, match="B: 508 bytes, expected 512"):
        lib.pack_codes(q, np.empty(127, np.int32), 16, 64)
    with pytest.raises(ValueError, match=r"shape \(16, 32\): need size_k % 16 == 0 and size_n % 64 == 0"):
        lib.unpack_b(np.empty(256, np.int32), np.empty(512, np.uint8), 16, 32)
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8, got 3"):
        lib.unpack_rows(np.empty(64, np.uint32), np.empty(512, np.uint8), 1, 64, 3)
    q[3, 5] = 16
    with pytest.raises(ValueError, match=r"codes must be in \[0, 15\], found 16"):
        pack_b(q)
    assert lib.first_diff(b"abcd", b"abcd") == -1 and lib.first_diff(b"abcd", b"abzd") == 2


# --------------------------------------------------------------------------- numerics


def _numerics_case(seed: int, rows: int, n: int, group: int):
    rng = np.random.default_rng(seed)
    groups = -(-rows // group)
    q = rng.integers(0, 16, (rows, n), dtype=np.uint8)
    a = rng.uniform(1e-3, 2e-2, (groups, n)).astype(np.float32)
    c = rng.integers(0, 16, (groups, n)).astype(np.float32)
    b = rng.standard_normal((groups, n)).astype(np.float32) * 0.01
    x = rng.standard_normal((8, rows), dtype=np.float32)
    g = np.arange(rows) // group
    w = ((q.astype(np.float64) - c[g]) * a[g] + b[g]).astype(np.float64)
    return x, q, a, c, b, x.astype(np.float64) @ w


@pytest.mark.parametrize("factored", [False, True])
# (200, 128, 64): a short last group inside the chunk; (96, 64, 48): a group not a multiple of 32
@pytest.mark.parametrize(
    "rows,n,group", [(128, 64, 128), (256, 192, 64), (96, 128, 32), (200, 64, 1024), (200, 128, 64), (96, 64, 48)]
)
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_accumulate_is_x_at_w(
    monkeypatch: pytest.MonkeyPatch, factored: bool, rows: int, n: int, group: int, compiled: bool
) -> None:
    if compiled and native.lib() is None:
        pytest.skip(f"converter._native: {native.status()}")
    if not compiled:
        monkeypatch.setattr(native, "_LIB", None)
    x, q, a, c, b, ref = _numerics_case(rows * n, rows, n, group)
    y = np.ones((8, n), dtype=np.float32)  # accumulated into, not overwritten
    accumulate(y, x, q, group, a, c, b, factored=factored)
    err = np.abs(y.astype(np.float64) - 1.0 - ref).max() / np.abs(ref).max()
    assert err < 2e-6


def test_accumulate_constant_offset_and_no_b() -> None:
    x, q, a, _, _, _ = _numerics_case(3, 64, 64, 32)
    g = np.arange(64) // 32
    ref = x.astype(np.float64) @ ((q - 8.0) * a[g])
    y = np.zeros((8, 64), dtype=np.float32)
    accumulate(y, x, q, 32, a, 8.0, None, factored=True)
    assert np.abs(y - ref).max() / np.abs(ref).max() < 2e-6


def test_accumulate_rejects_mismatched_shapes() -> None:
    y = np.zeros((8, 64), dtype=np.float32)
    q = np.zeros((32, 64), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"accumulate: parameters must be \(1, 64\)"):
        accumulate(y, np.zeros((8, 32), np.float32), q, 32, np.zeros((2, 64), np.float32), 8.0, None, factored=True)
    with pytest.raises(ValueError, match=r"accumulate: x \(8, 16\), q uint8 \(32, 64\), y \(8, 64\) do not fit"):
        accumulate(y, np.zeros((8, 16), np.float32), q, 32, np.zeros((1, 64), np.float32), 8.0, None, factored=True)


# --------------------------------------------------------------------------- fallback


def test_status_names_the_loops_or_why_not() -> None:
    status = native.status()
    if native.lib() is None:
        assert "not built" in status or "MARLIN_NATIVE=0" in status or "stale" in status
    else:
        assert status == f"compiled, {native.lib().ISA} loops"
        assert native.lib().ISA in ("baseline", "avx2", "avx512")


def test_numpy_fallback_converts_byte_identically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The artifact does not depend on which packer ran (the sample: 2- and 4-bit .tinyloop
    layers; a GPTQ checkpoint: the words fast path)."""
    rng = np.random.default_rng(5)
    gptq = write_checkpoint(
        tmp_path / "gptq",
        gptq_tensors("m.proj", make_layer(rng, 256, 128, group_size=64), v1=True),
        gptq_config(4, 64),
        where="quantize_config.json",
    )
    for src in (SAMPLE, gptq):
        fast = convert(src, tmp_path / f"{src.name}.fast.safetensors")
        with monkeypatch.context() as m:
            m.setattr(native, "_LIB", None)
            slow = convert(src, tmp_path / f"{src.name}.numpy.safetensors")
        assert Path(fast.output).read_bytes() == Path(slow.output).read_bytes()


def test_build_hook_says_why_it_did_not_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hatch_build = pytest.importorskip("hatch_build")
    monkeypatch.setenv("MARLIN_NO_NATIVE", "1")
    assert hatch_build.compile_native(REPO, tmp_path / "x.so") == "MARLIN_NO_NATIVE=1 is set"
    monkeypatch.delenv("MARLIN_NO_NATIVE")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    why = hatch_build.compile_native(REPO, tmp_path / "x.so")
    assert why == f"no C compiler found ({str(tmp_path / 'no-such-cc')!r} is not on PATH)"
    assert not (tmp_path / "x.so").exists()


@pytest.mark.slow
def test_wheel_without_a_compiler_installs_and_converts(tmp_path: Path) -> None:
    """A machine without a C compiler: the wheel is pure Python, imports, says why, and
    converts the sample to the same bytes as the compiled build."""
    pytest.importorskip("hatchling")
    env = {**os.environ, "MARLIN_NO_NATIVE": "1"}
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)]
    build = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if build.returncode:
        pytest.skip("cannot build a wheel offline here: " + build.stderr.strip().splitlines()[-1][:200])
    wheel = next(tmp_path.glob("*.whl"))
    assert wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if n.startswith("converter/_native") and not n.endswith((".c", ".h"))]
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    out = tmp_path / "sample.safetensors"
    script = (
        "import sys; from converter import native; from converter.convert import convert; "
        "print(native.status()); convert(sys.argv[1], sys.argv[2])"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MARLIN_NATIVE")}
    run = subprocess.run(
        [sys.executable, "-c", script, str(SAMPLE), str(out)],
        cwd=tmp_path,
        env=env | {"PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.startswith("not built (")
    ref = convert(SAMPLE, tmp_path / "ref.safetensors")
    assert out.read_bytes() == Path(ref.output).read_bytes()
