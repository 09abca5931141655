"""Corruption is caught (issue 5, item 4).

Every byte of an artifact is covered by something ``marlin-verify --shapes`` checks:

* tensor data: the manifest's per-tensor xxh3-128;
* the manifest: its own xxh3-128 (``marlin.manifest_checksum``);
* the rest of the header (names, dtypes, shapes, offsets): the container rules and
  the manifest-derived shapes and names;
* the other ``__metadata__`` keys and values: checked by name and value;
* the header padding: must be spaces (our decision: a flip there that still parses
  as JSON whitespace, e.g. a tab, is reported as ``header_padding``).

So a flipped byte anywhere must give exit 1 (problems) or 2 (unreadable), never 0.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from converter.artifact.validate import validate_artifact
from converter.convert import convert
from converter.errors import ConverterError
from tests.helpers.clirun import run_cli
from tests.helpers.synthetic_gptq import small_gptq


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corrupt")
    src = small_gptq(root / "src", bias=True)
    out = root / "model.marlin.safetensors"
    convert(src, out)
    return out


def regions(data: bytes) -> dict[str, tuple[int, int]]:
    """Absolute byte ranges: length prefix, header JSON, padding, and each tensor."""
    (n,) = struct.unpack("<Q", data[:8])
    raw = data[8 : 8 + n]
    json_len = len(raw.rstrip(b" "))
    out = {"<length>": (0, 8), "<header json>": (8, 8 + json_len), "<padding>": (8 + json_len, 8 + n)}
    header = json.loads(raw)
    header.pop("__metadata__")
    for name, entry in header.items():
        b, e = entry["data_offsets"]
        out[name] = (8 + n + b, 8 + n + e)
    return out


def verdict(path: Path) -> str:
    """'ok', 'problems' (exit 1) or 'unreadable' (exit 2), as marlin-verify --shapes decides."""
    try:
        report, art = validate_artifact(path)
    except ConverterError:
        return "unreadable"
    art.close()
    return "ok" if report.ok else "problems"


def flip_positions(data: bytes, rng: np.random.Generator, per_tensor: int = 4, header: int = 200) -> list[int]:
    reg = regions(data)
    pos: set[int] = set(range(8))
    b, e = reg["<header json>"]
    pos.update(int(p) for p in rng.integers(b, e, header))
    # the manifest string specifically, and the start and end of the JSON
    m = data.find(b'"marlin.manifest"', b, e)
    pos.update(int(p) for p in rng.integers(m, m + (e - m) // 2, 50))
    pos.update((b, b + 1, e - 2, e - 1))
    pos.update(range(*reg["<padding>"]))
    for name, (tb, te) in reg.items():
        if name.startswith("<") or te == tb:
            continue
        pos.update((tb, te - 1))
        pos.update(int(p) for p in rng.integers(tb, te, per_tensor))
    return sorted(pos)


def test_clean_artifact_verifies(artifact: Path) -> None:
    assert verdict(artifact) == "ok"
    assert run_cli("marlin-verify", artifact, "--shapes").returncode == 0


@pytest.mark.parametrize("mode", ["byte", "bit"])
def test_every_single_byte_flip_is_caught(artifact: Path, tmp_path: Path, mode: str) -> None:
    data = artifact.read_bytes()
    reg = regions(data)
    assert reg["<padding>"][1] > reg["<padding>"][0], "fixture should have header padding to test"
    rng = np.random.default_rng(5 if mode == "byte" else 6)
    positions = flip_positions(data, rng)
    assert len(positions) > 300
    missed, kinds = [], {"problems": 0, "unreadable": 0}
    for i, p in enumerate(positions):
        flipped = bytearray(data)
        flipped[p] ^= int(rng.integers(1, 256)) if mode == "byte" else 1 << int(rng.integers(0, 8))
        f = tmp_path / f"f{i}.safetensors"  # a new inode each time: no stale map sees new bytes
        f.write_bytes(bytes(flipped))
        v = verdict(f)
        f.unlink()
        if v == "ok":
            where = next(n for n, (b, e) in reg.items() if b <= p < e)
            missed.append((p, where))
        else:
            kinds[v] += 1
    assert missed == []
    # Both outcomes occur: data flips are problems (1), most header flips unreadable (2).
    assert kinds["problems"] > 0 and kinds["unreadable"] > 0


@pytest.mark.parametrize("ws", [b"\t", b"\n", b"\r"])
def test_whitespace_in_padding_is_corruption(artifact: Path, tmp_path: Path, ws: bytes) -> None:
    """JSON would accept it; we do not (padding is written as spaces only)."""
    data = bytearray(artifact.read_bytes())
    b, e = regions(bytes(data))["<padding>"]
    data[(b + e) // 2] = ws[0]
    f = tmp_path / "pad.safetensors"
    f.write_bytes(bytes(data))
    report, art = validate_artifact(f)
    art.close()
    assert [(p.code, p.message) for p in report.problems] == [
        ("header_padding", "pad.safetensors: 1 header padding byte(s) are not spaces (corrupted header)")
    ]


def test_metadata_value_outside_manifest_is_checked(artifact: Path, tmp_path: Path) -> None:
    data = artifact.read_bytes()
    i = data.find(b'"format":"pt"')
    assert i > 0
    f = tmp_path / "fmt.safetensors"
    f.write_bytes(data[:i] + b'"format":"pu"' + data[i + 13 :])
    report, art = validate_artifact(f)
    art.close()
    assert [p.message for p in report.problems] == ["fmt.safetensors: __metadata__['format'] is 'pu', expected 'pt'"]


def test_data_flip_names_the_tensor(artifact: Path, tmp_path: Path) -> None:
    data = bytearray(artifact.read_bytes())
    name = "model.layers.0.mlp.down_proj.marlin_B"
    b, e = regions(bytes(data))[name]
    data[(b + e) // 2] ^= 0x10
    f = tmp_path / "d.safetensors"
    f.write_bytes(bytes(data))
    report, art = validate_artifact(f)
    art.close()
    (p,) = report.problems
    assert p.code == "checksum_mismatch" and p.tensor == name
    assert p.message.startswith(f"{name}: xxh3-128 ") and p.message.endswith("(corrupted bytes)")


def test_cli_reports_flips(artifact: Path, tmp_path: Path) -> None:
    """A few flips through the real CLI: exit 1 or 2, never 0."""
    data = artifact.read_bytes()
    reg = regions(data)
    spots = {
        "data": (reg["model.layers.0.self_attn.q_proj.marlin_scales"][0] + 3, 1),
        "manifest": (data.find(b'"marlin.manifest"') + 40, 1),
        "length": (2, 2),
    }
    for what, (p, code) in spots.items():
        flipped = bytearray(data)
        flipped[p] ^= 0x04
        f = tmp_path / f"{what}.safetensors"
        f.write_bytes(bytes(flipped))
        r = run_cli("marlin-verify", f, "--shapes")
        assert r.returncode == code, (what, r.returncode, r.stdout, r.stderr)
