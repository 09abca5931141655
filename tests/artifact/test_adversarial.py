"""Artifacts that are internally consistent (checksums re-sealed) but lie, and other
inputs an adversarial review found: marlin-verify must report each one, never crash
and never say OK."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from converter.convert import convert
from converter.errors import SourceFormatError
from converter.verify import verify
from tests.helpers.artifact_edit import rewrite_artifact_arrays
from tests.helpers.clirun import run_cli
from tests.helpers.paths import REPO, SAMPLE

L = "pre.0.attn_qkv"

Tensors = dict[str, tuple[str, np.ndarray]]  # as rewrite_artifact_arrays hands them to an edit


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("adv") / "base.safetensors"
    convert(SAMPLE, out)
    return out


def layer(manifest: dict, name: str = L) -> dict:
    return next(e for e in manifest["layers"] if e["name"] == name)


def codes(report) -> set[str]:
    return {p.code for p in report.problems if p.severity == "error"}


def test_resealed_copy_is_still_ok(base: Path, tmp_path: Path) -> None:
    assert verify(
        rewrite_artifact_arrays(base, tmp_path / "a.safetensors", lambda m, t: None), against=SAMPLE, gpu=False
    ).ok


def test_lying_symmetric_flag(base: Path, tmp_path: Path) -> None:
    art = rewrite_artifact_arrays(base, tmp_path / "a.safetensors", lambda m, t: layer(m).update(symmetric=True))
    rep = verify(art, shapes_only=True)
    assert [p.message for p in rep.problems if p.code == "manifest_inconsistent"] == [
        f"layer {L}: symmetric is True but marlin_delta is not zero"
    ]


def test_detached_bias_is_caught_against_source(base: Path, tmp_path: Path) -> None:
    def edit(m: dict, t: Tensors) -> None:
        layer(m)["has_bias"] = False
        m["passthrough"].append({"name": f"{L}.bias", "reason": "x"})

    art = rewrite_artifact_arrays(base, tmp_path / "a.safetensors", edit)
    shapes = verify(art, shapes_only=True)
    assert "layer_tensor_as_passthrough" in codes(shapes)
    assert [p.message for p in shapes.problems if p.severity == "error"] == [
        f"{L}.bias: belongs to converted layer {L} but is listed as pass-through"
    ]
    rep = verify(art, against=SAMPLE, gpu=False)
    assert not rep.ok and "layer_tensor_as_passthrough" in codes(rep)


def test_has_bias_lie_is_caught_against_source(base: Path, tmp_path: Path) -> None:
    # has_bias false while the bias tensor simply stays: --shapes sees an unknown
    # tensor, --against also names the fact that differs from the source.
    art = rewrite_artifact_arrays(base, tmp_path / "a.safetensors", lambda m, t: layer(m).update(has_bias=False))
    assert "unknown_tensor" in codes(verify(art, shapes_only=True))


def test_dropped_tensor_is_caught_against_source(base: Path, tmp_path: Path) -> None:
    def edit(m: dict, t: Tensors) -> None:
        del t["embed"]
        m["passthrough"] = [p for p in m["passthrough"] if p["name"] != "embed"]

    art = rewrite_artifact_arrays(base, tmp_path / "a.safetensors", edit)
    assert verify(art, shapes_only=True).ok  # self-consistent ...
    rep = verify(art, against=SAMPLE, gpu=False)  # ... but not what the source converts to
    assert "embed: a conversion of the source has this tensor; the artifact lacks it" in [
        p.message for p in rep.problems
    ]


@pytest.mark.parametrize(
    "case", ["perm_out_of_range", "perm_not_a_permutation", "group_lies", "bias_removed", "k_shrunk", "perm_missing"]
)
def test_broken_layers_are_reported_not_crashed(base: Path, tmp_path: Path, case: str) -> None:
    def edit(m: dict, t: Tensors) -> None:
        e = layer(m)
        if case.startswith("perm"):
            e["act_order"] = True
            if case != "perm_missing":
                perm = np.arange(e["size_k"], dtype=np.int32)
                perm[5] = 1000 if case == "perm_out_of_range" else 0
                t[f"{L}.marlin_perm"] = ("I32", perm)
        elif case == "group_lies":
            e.update(group_size=128, num_groups=1)
        elif case == "bias_removed":
            del t[f"{L}.bias"]
        elif case == "k_shrunk":
            e.update(size_k=64, num_groups=1, group_size=64)
            for suffix, rows in (("marlin_B", 4), ("marlin_scales", 1), ("marlin_delta", 1)):
                d, a = t[f"{L}.{suffix}"]
                t[f"{L}.{suffix}"] = (d, a[:rows])

    art = rewrite_artifact_arrays(base, tmp_path / "a.safetensors", edit)
    # A consistently shrunk layer is a valid artifact of a smaller layer: only the
    # source can tell.
    modes = (
        [{"against": SAMPLE, "gpu": False}]
        if case == "k_shrunk"
        else [{"shapes_only": True}, {"gpu": False}, {"against": SAMPLE, "gpu": False}]
    )
    for kwargs in modes:
        rep = verify(art, **kwargs)
        assert not rep.ok, (case, kwargs)
        assert any(L in p.tensor for p in rep.problems if p.severity == "error"), (case, kwargs)
    res = run_cli("marlin-verify", art, "--cpu", "--against", SAMPLE, "--json")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert json.loads(res.stdout)["ok"] is False


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("code_offset", 6, "code_offset 6 but 4-bit codes are stored with offset 0"),
        ("zero_convention", "gptq_v1", "zero_convention 'gptq_v1' cannot come from a 'tinyloop' source"),
        ("kernel_compatible", False, "kernel_compatible is False but the sizes say True"),
    ],
)
def test_other_manifest_lies(base: Path, tmp_path: Path, key: str, value: object, match: str) -> None:
    art = rewrite_artifact_arrays(base, tmp_path / "a.safetensors", lambda m, t: layer(m).update({key: value}))
    rep = verify(art, shapes_only=True)
    assert any(match in p.message for p in rep.problems), [p.message for p in rep.problems]


@pytest.mark.parametrize("bits,offset", [(2, 6), (3, 4)])
def test_lying_lower_bits_is_caught_by_the_codes(base: Path, tmp_path: Path, bits: int, offset: int) -> None:
    """bits lowered with the matching code_offset, re-sealed: --shapes and the CPU check
    said OK, though B holds 4-bit codes (and the fp16 range check tried fewer codes)."""
    art = rewrite_artifact_arrays(
        base, tmp_path / "a.safetensors", lambda m, t: layer(m).update(bits=bits, code_offset=offset)
    )
    top = offset + (1 << bits) - 1
    for kwargs in ({"shapes_only": True}, {"gpu": False}):
        rep = verify(art, **kwargs)
        assert not rep.ok
        assert [p.message for p in rep.problems if p.code == "manifest_inconsistent"] == [
            f"layer {L}: {L}.marlin_B holds codes 0..15, but {bits}-bit codes stored with offset {offset} lie in "
            f"{offset}..{top} (bits lies, or B is not this layer's)"
        ]


def test_duplicate_layer_entry(base: Path, tmp_path: Path) -> None:
    art = rewrite_artifact_arrays(base, tmp_path / "a.safetensors", lambda m, t: m["layers"].append(dict(layer(m))))
    assert f"layer {L} is listed 2 times" in [p.message for p in verify(art, shapes_only=True).problems]


def test_reserved_tensor_name_is_refused(tmp_path: Path) -> None:
    from converter.formats.tinyloop_writer import quantize_linear_tinyloop, write_tinyloop

    w = np.ones((64,), np.float16)
    rng = np.random.default_rng(0)
    tensors, linear = quantize_linear_tinyloop("lin", rng.standard_normal((64, 64)).astype(np.float32), 4, 64, rng)
    src = write_tinyloop(tmp_path / "m.tinyloop", {"d_model": 64}, {"__metadata__": w, **tensors}, {"lin": linear})
    with pytest.raises(SourceFormatError, match="__metadata__: a tensor may not be named '__metadata__'"):
        convert(src, tmp_path / "o.safetensors")
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob(".*"))


def test_huge_dimension_beside_zero(tmp_path: Path) -> None:
    raw = SAMPLE.read_bytes()
    (h_len,) = struct.unpack("<Q", raw[16:24])
    header = json.loads(raw[24 : 24 + h_len])
    header["tensors"]["pre.0.norm1"].update(shape=[2**62, 0], nbytes=0)
    text = json.dumps(header).encode()
    old_start, new_end = -(-(24 + h_len) // 64) * 64, 24 + len(text)
    bad = tmp_path / "huge.tinyloop"
    bad.write_bytes(raw[:16] + struct.pack("<Q", len(text)) + text + b"\0" * (-new_end % 64) + raw[old_start:])
    res = run_cli("marlin-convert", bad, tmp_path / "o.safetensors")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "pre.0.norm1: shape [4611686018427387904, 0] is too large for any array" in res.stderr


def test_sigterm_leaves_no_temporary_files(tmp_path: Path) -> None:
    from converter.formats.tinyloop_writer import quantize_linear_tinyloop, write_tinyloop

    rng = np.random.default_rng(0)
    tensors, linears = {}, {}
    for i in range(6):
        t, lin = quantize_linear_tinyloop(
            f"pre.{i}.mlp_up", rng.standard_normal((2048, 2048), dtype=np.float32), 4, 128, rng
        )
        tensors.update(t)
        linears[f"pre.{i}.mlp_up"] = lin
    src = write_tinyloop(tmp_path / "big.tinyloop", {"d_model": 2048}, tensors, linears)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code = "import sys; sys.argv[0]='marlin-convert'; from converter.cli import main_convert; main_convert()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(src), str(out_dir / "o.safetensors"), "-q"],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not any(out_dir.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the conversion finished before the signal landed")
    assert proc.returncode == 130 and "no output was written" in err
    assert list(out_dir.iterdir()) == []
