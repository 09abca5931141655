"""A checkpoint is untrusted input (issue 14): crafted folders and files against
``marlin-convert``.  Each case asserts the exact outcome: exit 2 with one line naming the
file, the tensor and the rule, no traceback, nothing written or deleted anywhere, and the
input's bytes unchanged; or, where the input is fine, the exact result.

Classes: files from outside the checkpoint (symbolic links out of the folder, FIFOs),
crashes (huge zero-size shapes, lone surrogates, deep nesting, undecodable file names),
hangs (pathological regexes, a thousand shards), and results that are not what the
source says (scales fp16 would round, fp16 overflow, tensors the index names but no
shard holds, Marlin-packed or unquantized checkpoints under a GPTQ label, v1/v2 configs
that disagree, all-zero scales).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from converter.convert import convert
from converter.errors import ConfigError, SourceFormatError
from converter.formats import patterns
from converter.safetensors_io import SafetensorsFile
from converter.verify import verify
from tests.helpers.checkpoints import arr, st_bytes
from tests.helpers.clirun import assert_refused, invoke, run_cli, snapshot
from tests.helpers.paths import REPO, SAMPLE
from tests.helpers.producers import (
    gptq_config,
    gptq_tensors,
    make_layer,
    plain_tensors,
    save_safetensors,
    to_bf16_exact,
    write_checkpoint,
)

NAMES = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot for any output\n"


def _tensors(seed: int = 0, **layer_kw: object) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name in NAMES:
        out.update(gptq_tensors(name, make_layer(rng, 128, 64, group_size=64, **layer_kw), v1=True))
    return out | plain_tensors(rng)


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    """A small GPTQ folder: config.json (with the quant config), model.safetensors, tokenizer.json."""
    return write_checkpoint(tmp_path / "ckpt", _tensors(), gptq_config(4, 64))


@pytest.fixture()
def secret(tmp_path: Path) -> Path:
    p = tmp_path / "home" / ".ssh" / "id_ed25519"
    p.parent.mkdir(parents=True)
    p.write_bytes(SECRET)
    return p


def _refused(tmp_path: Path, *args: object, needles: tuple[str, ...]) -> str:
    """Run marlin-convert; assert the refusal and that nothing below tmp_path changed."""
    before = snapshot(tmp_path)
    line = assert_refused(invoke("marlin-convert", *args), *needles)
    assert snapshot(tmp_path) == before
    return line


# --------------------------------------------------------------------------- leaks


@pytest.mark.parametrize(
    "name",
    ["tokenizer.model", "vocab.txt", "tokenizer.json", "merges.txt", "generation_config.json", "config.json"],
)
@pytest.mark.parametrize("mode", ["folder", "file"])
def test_a_link_out_of_the_folder_is_refused_by_name(
    tmp_path: Path, ckpt: Path, secret: Path, name: str, mode: str
) -> None:
    link = ckpt / name
    if link.exists():
        if name == "config.json":  # keep the quant config: it moves to its own file
            qc = json.loads(link.read_text())["quantization_config"]
            (ckpt / "quantize_config.json").write_text(json.dumps(qc))
        link.unlink()
    link.symlink_to(secret)
    out = f"{tmp_path}/out/" if mode == "folder" else tmp_path / "out.safetensors"
    if mode == "file" and name != "config.json":  # tokenizer files are read in folder mode only
        assert convert(ckpt, out).converted
        assert SECRET not in Path(out).read_bytes()
        return
    _refused(
        tmp_path,
        ckpt,
        out,
        needles=(
            f"{link}: is a symbolic link to {secret}, outside the checkpoint folder; links that leave a checkpoint "
            "are not followed (copy the file into the folder)",
        ),
    )


@pytest.mark.parametrize("name", ["quantize_config.json", "quantization_config.json", "quant_config.json"])
def test_a_quant_config_linked_to_any_json_file_is_refused(tmp_path: Path, ckpt: Path, name: str) -> None:
    """Its content would be embedded verbatim in the manifest."""
    other = tmp_path / "elsewhere" / "settings.json"
    other.parent.mkdir()
    other.write_text(json.dumps({**gptq_config(4, 64), "api_token": "xyz"}))
    (ckpt / name).symlink_to(other)
    _refused(tmp_path, ckpt, tmp_path / "o.safetensors", needles=(f"{ckpt / name}: is a symbolic link to {other},",))


def test_weights_and_shards_linked_out_of_the_folder_are_refused(tmp_path: Path, ckpt: Path) -> None:
    moved = tmp_path / "elsewhere.safetensors"
    (ckpt / "model.safetensors").rename(moved)
    (ckpt / "model.safetensors").symlink_to(moved)
    _refused(tmp_path, ckpt, tmp_path / "o.safetensors", needles=(f"{ckpt / 'model.safetensors'}: is a symbolic link",))
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in _tensors()}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(tmp_path, ckpt, tmp_path / "o.safetensors", needles=("outside the checkpoint folder",))
    # Named directly (IN), the same file is the user's choice, and converts.
    assert convert(ckpt / "model.safetensors", tmp_path / "direct.safetensors").converted


@pytest.mark.parametrize(
    "target",
    ["../secret.txt", "/etc/passwd", "sub/../../secret.txt", "loop"],
    ids=["parent", "absolute", "dotdot", "dangling"],
)
def test_every_way_out_of_the_folder(tmp_path: Path, ckpt: Path, target: str) -> None:
    (tmp_path / "secret.txt").write_bytes(SECRET)
    (ckpt / "sub").mkdir()
    link = ckpt / "vocab.txt"
    if target == "loop":
        link.symlink_to("vocab.txt")  # a link to itself resolves nowhere
        needle = "is a symbolic link to"
    else:
        link.symlink_to(target)
        needle = "outside the checkpoint folder"
    _refused(tmp_path, ckpt, f"{tmp_path}/out/", needles=(f"{link}: ", needle))


def test_a_link_to_a_link_out_is_refused(tmp_path: Path, ckpt: Path, secret: Path) -> None:
    (ckpt / "inner").symlink_to(secret)
    (ckpt / "tokenizer.model").symlink_to("inner")
    _refused(
        tmp_path, ckpt, f"{tmp_path}/out/", needles=(f"{ckpt / 'tokenizer.model'}: is a symbolic link to {secret}",)
    )


def test_links_inside_the_folder_are_followed(tmp_path: Path, ckpt: Path) -> None:
    (ckpt / "assets").mkdir()
    (ckpt / "assets" / "vocab.txt").write_text("a\nb\n")
    (ckpt / "vocab.txt").symlink_to("assets/vocab.txt")
    out = tmp_path / "out"
    convert(ckpt, str(out) + "/")
    assert not (out / "vocab.txt").is_symlink() and (out / "vocab.txt").read_text() == "a\nb\n"
    assert verify(out, against=ckpt, gpu=False).ok


def test_a_hub_cache_snapshot_links_into_its_blobs(tmp_path: Path, ckpt: Path) -> None:
    """huggingface_hub's cache: snapshots/<rev>/<file> -> ../../blobs/<hash>."""
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(ckpt.iterdir())):
        shutil.copyfile(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(f"../../blobs/blob{i}")
    out = tmp_path / "out"
    convert(snap, str(out) + "/")
    assert (out / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    assert verify(out, against=snap, gpu=False).ok


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "quantize_config.json", "model.safetensors"])
def test_a_folder_where_a_file_should_be(tmp_path: Path, ckpt: Path, name: str) -> None:
    p = ckpt / name
    if p.exists():
        p.unlink() if name != "model.safetensors" else p.rename(ckpt / "weights.safetensors")
    p.mkdir()
    _refused(
        tmp_path,
        ckpt,
        f"{tmp_path}/out/",
        needles=(f"{p}: a directory, not a file; a checkpoint's files must be regular files",),
    )


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "model.safetensors.index.json", "model.safetensors"])
def test_a_fifo_is_refused_not_waited_on(tmp_path: Path, ckpt: Path, name: str) -> None:
    """A FIFO blocks whoever opens it for reading until a writer comes: never.  Named
    in the folder, or given as IN itself."""
    p = ckpt / name
    if name == "model.safetensors":
        p.rename(ckpt / "weights.safetensors")
    elif p.exists():
        p.unlink()
    os.mkfifo(p)
    before = snapshot(tmp_path)
    runs = [[ckpt, f"{tmp_path}/out/"]] + ([[p, tmp_path / "o.safetensors"]] if name.endswith(("json", "ors")) else [])
    for args in runs if name != "config.json" and name != "tokenizer.json" else runs[:1]:
        res = subprocess.run(
            [sys.executable, "-m", "converter.cli", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        )
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {p}: not a regular file (a FIFO)"), res.stderr
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------- crashes


def _folder_with(tmp_path: Path, header: dict | bytes, data: bytes = b"", name: str = "model.safetensors") -> Path:
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"quantization_config": gptq_config(4, 64)}))
    save_safetensors(folder / "real.safetensors", _tensors())
    (folder / name).write_bytes(st_bytes(header, data))
    return folder


@pytest.mark.parametrize(
    "shape",
    [[0, 2**40, 2**40], [2**62, 0], [0] + [2**20] * 4, [3, 0, 2**61]],
    ids=["0x2^40x2^40", "2^62x0", "0x(2^20)^4", "3x0x2^61"],
)
@pytest.mark.parametrize("dry", [True, False])
def test_zero_size_tensor_with_huge_dimensions(tmp_path: Path, shape: list[int], dry: bool) -> None:
    folder = _folder_with(tmp_path, {"empty": {"dtype": "F16", "shape": shape, "data_offsets": [0, 0]}})
    args = [folder, tmp_path / "o.safetensors"] + (["--dry-run"] if dry else [])
    _refused(
        tmp_path,
        *args,
        needles=(
            f"{folder / 'model.safetensors'}: empty: shape {shape} is too large for any array: its non-zero "
            "dimensions multiply past 2**62 bytes",
        ),
    )


def test_zero_size_tensors_numpy_can_hold_pass_through(tmp_path: Path) -> None:
    folder = _folder_with(tmp_path, {"empty": {"dtype": "F16", "shape": [0, 2**30], "data_offsets": [0, 0]}})
    out = tmp_path / "o.safetensors"
    report = convert(folder, out)
    assert ("empty", "F16", (0, 2**30)) in report.tensors
    assert verify(out, against=folder, gpu=False).ok


@pytest.mark.parametrize(
    ("where", "raw"),
    [
        ("tensor name", b'{"a\\udc80b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'),
        (
            "metadata",
            b'{"__metadata__": {"k": "\\ud800"}, "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}',
        ),
        ("high only", b'{"x\\udbff": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'),
        ("reversed pair", b'{"\\udc00\\ud800": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'),
    ],
)
def test_lone_surrogate_escapes_in_a_header(tmp_path: Path, where: str, raw: bytes) -> None:
    folder = _folder_with(tmp_path, raw, arr("F32", [1, 2, 3, 4]))
    _refused(
        tmp_path,
        folder,
        tmp_path / "o.safetensors",
        needles=(f"{folder / 'model.safetensors'}: safetensors header JSON escapes a lone UTF-16 surrogate: ",),
    )


@pytest.mark.parametrize("doc", ["config.json", "model.safetensors.index.json", "quantize_config.json"])
def test_lone_surrogates_and_deep_nesting_in_configs_and_indexes(tmp_path: Path, ckpt: Path, doc: str) -> None:
    weights = {n: "model.safetensors" for n in _tensors()}
    base = {
        "config.json": json.loads((ckpt / "config.json").read_text()),
        "model.safetensors.index.json": {"metadata": {}, "weight_map": weights},
        "quantize_config.json": gptq_config(4, 64),
    }[doc]
    for bad, needle in (
        (json.dumps({**base, "note": "\udcff"}), "JSON escapes a lone UTF-16 surrogate: '\\udcff'"),
        (json.dumps(base)[:-1] + ', "deep": ' + "[" * 70 + "]" * 70 + "}", "nested more than 64 levels deep"),
        (json.dumps(base)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ):
        (ckpt / doc).write_text(bad)
        _refused(tmp_path, ckpt, tmp_path / "o.safetensors", needles=(f"{ckpt / doc}: JSON file ", needle))


def test_an_undecodable_file_name_is_refused_by_name(tmp_path: Path, ckpt: Path) -> None:
    """os.fsdecode turns the byte 0xff into a lone surrogate: the manifest (UTF-8 JSON)
    cannot record it; it used to crash on encoding the header."""
    weird = os.fsdecode(bytes(ckpt) + b"/model-\xff.safetensors")
    (ckpt / "model.safetensors").rename(weird)
    line = _refused(tmp_path, ckpt, tmp_path / "o.safetensors", needles=("is not valid UTF-8", "rename the file"))
    assert "'model-\\udcff.safetensors'" in line
    out = os.fsdecode(bytes(tmp_path) + b"/out-\xff.safetensors")
    (ckpt / weird).rename(ckpt / "model.safetensors")
    _refused(tmp_path, ckpt, out, needles=("output path", "is not valid UTF-8; choose another name"))


def test_input_truncated_between_chunks_is_a_clean_error(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sizes are checked before every access to a mapped file: a shrunk input is an
    error naming it, the temporaries go, nothing is written."""
    conv = importlib.import_module("converter.convert.stream")  # the write loop, which calls _write_layer

    weights = ckpt / "model.safetensors"
    size = weights.stat().st_size
    real = conv._write_layer
    calls = []

    def truncating(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.truncate(weights, size - 100)
        return real(*args, **kwargs)

    monkeypatch.setattr(conv, "_write_layer", truncating)
    (tmp_path / "out").mkdir()
    with pytest.raises(
        SourceFormatError,
        match=rf"^{weights}: shrank from {size} to {size - 100} bytes while being read \(truncated by another "
        r"program\?\); nothing was written$",
    ):
        convert(ckpt, tmp_path / "out" / "o.safetensors")
    assert os.listdir(tmp_path / "out") == []


SIGBUS_SCRIPT = """
import os, sys
sys.argv[0] = "marlin-convert"
import converter.formats.gptq_load as gptq_load
weights = sys.argv[1]
pack = gptq_load.pack_b_from_gptq4
def truncate_then_pack(words):
    # After the size check, before the pages are read: the one window left.
    os.truncate(weights, 0)
    return pack(words)
gptq_load.pack_b_from_gptq4 = truncate_then_pack
from converter.cli import main_convert
sys.argv[1:] = sys.argv[2:]
main_convert()
"""


@pytest.mark.parametrize("as_json", [False, True])
def test_sigbus_from_a_truncated_mapping_is_one_line_and_no_temporaries(
    tmp_path: Path, ckpt: Path, as_json: bool
) -> None:
    """The input shrinks after the size check, while its pages are read: SIGBUS, which
    Python cannot catch.  The C-level handler (converter/faults.py) names the file,
    removes the temporaries and exits 2."""
    weights = ckpt / "model.safetensors"
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "o.safetensors"
    res = subprocess.run(
        [sys.executable, "-c", SIGBUS_SCRIPT, weights, ckpt, out, *(["--json"] if as_json else [])],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    message = (
        f"{weights}: shrank while being read (truncated by another program?); reading past its new end raised "
        "SIGBUS; no output was written"
    )
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    if as_json:
        assert res.stderr == ""
        doc = json.loads(res.stdout)
        assert doc == {"ok": False, "error": {"type": "SigbusError", "message": message, "file": None, "tensor": None}}
    else:
        assert res.stdout == "" and res.stderr == f"error: {message}\n"
    assert sorted(os.listdir(tmp_path / "out")) == []


# --------------------------------------------------------------------------- hangs


CATASTROPHIC = "(.*){1,32000}[bc]"  # slow even for the regex package: only the time bound stops it


@pytest.fixture()
def quick_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patterns, "MATCH_BUDGET_S", 0.3)


@pytest.mark.parametrize("key", [f"-:{CATASTROPHIC}", f"+:{CATASTROPHIC}", CATASTROPHIC])
def test_a_catastrophic_dynamic_key_is_refused_by_name(tmp_path: Path, key: str, quick_budget: None) -> None:
    src = write_checkpoint(tmp_path / "src", _tensors(), gptq_config(4, 64, dynamic={key: {}}))
    with pytest.raises(
        ConfigError,
        match=rf"^{src / 'config.json'}: dynamic: key {re.escape(repr(key))} takes more than 0.3 s to match "
        r"module names \(stopped at 'model\.layers\.0\.[a-z_.]+'\): catastrophic backtracking; simplify the "
        r"regular expression$",
    ):
        convert(src, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


def test_patterns_that_backtrack_forever_in_re_match_at_once(tmp_path: Path) -> None:
    """Classic exponential patterns for Python's re: the regex package matches them in
    microseconds, with re's answers, so they need no time bound at all."""
    keys = ("-:(.*)*(.*)*(.*)*(.*)*(.*)*X", "-:((.|.)*)*X", "-:^(.+)+\\d$", "-:model(.*)*\\.q_proj")
    for i, key in enumerate(keys):
        src = write_checkpoint(tmp_path / f"k{i}", _tensors(), gptq_config(4, 64, dynamic={key: {}}))
        report = convert(src, tmp_path / f"k{i}.safetensors")
        excluded = {lay.name for lay in report.converted if any("dynamic rule" in w for w in lay.warnings)}
        assert sorted(lay.name for lay in report.converted) == sorted(NAMES)
        # Only the last key matches (q_proj); a layer with a qweight converts by the data.
        assert excluded == ({NAMES[0]} if i == 3 else set())


@pytest.mark.parametrize("field", ["ignore", "targets"])
def test_a_catastrophic_compressed_tensors_entry_is_refused_by_name(
    tmp_path: Path, field: str, quick_budget: None
) -> None:
    from tests.helpers.producers import ct_tensors

    rng = np.random.default_rng(3)
    tensors = ct_tensors("model.layers.0.mlp.up_proj", make_layer(rng, 128, 64, group_size=64), sym=False)
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64},
        "format": "pack-quantized",
    }
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": group},
          "ignore": [], "quantization_status": "compressed"}  # fmt: skip
    entry = f"re:{CATASTROPHIC}"
    if field == "ignore":
        qc["ignore"] = [entry]
        where = "ignore"
    else:
        group["targets"] = [entry]
        where = "config_groups.group_0.targets"
    src = write_checkpoint(tmp_path / "ct", tensors | plain_tensors(rng), qc)
    with pytest.raises(
        ConfigError, match=rf"^{src / 'config.json'}: {where}: {re.escape(repr(entry))} takes more than 0\.3 s"
    ):
        convert(src, tmp_path / "o.safetensors")


def _many_shards(folder: Path, layers: int) -> Path:
    """``4 * layers`` shards of one tensor each, and an index."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(5)
    wmap = {}
    for i in range(layers):
        for name, t in gptq_tensors(
            f"model.layers.{i}.mlp.up_proj", make_layer(rng, 64, 64, group_size=64), v1=True
        ).items():
            fname = f"model-{len(wmap) + 1:05d}-of-{4 * layers:05d}.safetensors"
            save_safetensors(folder / fname, {name: t})
            wmap[name] = fname
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    (folder / "config.json").write_text(json.dumps({"quantization_config": gptq_config(4, 64)}))
    return folder


LIMITED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))
sys.argv[0] = sys.argv[1]
from converter.cli import main_convert, main_verify
sys.argv[1:] = sys.argv[2:]
(main_convert if sys.argv[0] == "marlin-convert" else main_verify)()
"""


def _limited(soft: int, hard: int, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LIMITED.format(soft=soft, hard=hard), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )


def test_a_thousand_shards_within_an_open_files_limit_of_256(tmp_path: Path) -> None:
    """Shards are opened lazily and at most 64 are mapped at once."""
    src = _many_shards(tmp_path / "src", 250)
    out = tmp_path / "o.safetensors"
    res = _limited(256, 256, "marlin-convert", src, out, "-q")
    assert res.returncode == 0, res.stderr
    res = _limited(256, 256, "marlin-verify", out, "--against", src, "--cpu")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK: 250 layers, 750 tensors" in res.stdout


def test_output_shards_beyond_the_open_files_limit(tmp_path: Path) -> None:
    """Every output shard stays open (and locked) until the commit: the soft limit is
    raised when the hard one allows; else the run is refused before the input is hashed
    and before anything is written."""
    src = write_checkpoint(tmp_path / "src", _tensors(), gptq_config(4, 64))
    out = tmp_path / "sh.safetensors"
    res = _limited(36, 4096, "marlin-convert", src, out, "--max-shard-size", "1KB", "-q")
    assert res.returncode == 0, res.stderr
    count = len(list(tmp_path.glob("sh-*.safetensors")))
    assert count == 4  # two layers, the norm, the embedding
    before = snapshot(tmp_path)
    res = _limited(36, 36, "marlin-convert", src, tmp_path / "x.safetensors", "--max-shard-size", "1KB")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == (
        f"error: {tmp_path / 'x.safetensors.index.json'}: writing 4 shards holds 4 files open at once, and with "
        "the input that needs 39; the open-files limit is 36 (hard limit 36, ulimit -n): raise it, or pass a "
        "larger --max-shard-size"
    )
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------- results that are not the source's


def _with_scales(tmp_path: Path, scales: np.ndarray, dtype: str, *, z: int | None = None) -> Path:
    rng = np.random.default_rng(7)
    layer = make_layer(rng, 128, 64, group_size=64)
    layer.s = scales.astype(np.float32)
    if z is not None:
        layer.z[:] = z
    tensors = gptq_tensors(NAMES[0], layer, v1=False) | plain_tensors(rng)
    return write_checkpoint(tmp_path / f"src-{dtype}", tensors, gptq_config(4, 64, fmt="gptq_v2"), scale_dtype=dtype)


def test_f32_scales_that_fp16_would_round_are_refused_with_numbers(tmp_path: Path) -> None:
    s = np.full((2, 64), 0.01, dtype=np.float32)
    s[1, 5] = np.float32(0.0123456789)
    src = _with_scales(tmp_path, s, "F32")
    _refused(
        tmp_path,
        src,
        tmp_path / "o.safetensors",
        needles=(
            f"{src / 'model.safetensors'}: {NAMES[0]}.scales: 128 of 128 scales are not float16 values and would "
            "change in Marlin's float16 scales (largest relative change ",
            "an artifact with rounded scales would not be exact",
        ),
    )


def test_f32_and_bf16_scales_that_fp16_holds_convert_exactly(tmp_path: Path) -> None:
    s = np.random.default_rng(1).uniform(1e-3, 5e-2, (2, 64)).astype(np.float16).astype(np.float32)
    for dtype, values in (("F32", s), ("BF16", to_bf16_exact(s))):
        src = _with_scales(tmp_path, values, dtype)
        out = tmp_path / f"{dtype}.safetensors"
        convert(src, out)
        report = verify(out, against=src, gpu=False)
        assert report.ok and all(row["scales_exact"] for row in report.layers), report.problems


def test_subnormal_bf16_scales_are_refused_with_numbers(tmp_path: Path) -> None:
    """bf16 below fp16's normal range (6.1e-5) loses bits in fp16, up to all of them."""
    s = to_bf16_exact(np.full((2, 64), 3.5e-8, dtype=np.float32))
    src = _with_scales(tmp_path, s, "BF16")
    line = _refused(tmp_path, src, tmp_path / "o.safetensors", needles=("128 of 128 scales are not float16 values",))
    rel = float(line.split("largest relative change ")[1].split(":")[0])
    assert rel > 0.5  # not rounding noise: most of every weight of the layer


@pytest.mark.parametrize(
    ("scale", "z", "what"),
    [
        (30000.0, 0, "128 delta values overflow float16"),
        (9000.0, 8, "group columns form weights (q - 8) * s + delta that overflow float16"),
    ],
)
def test_delta_or_weight_beyond_fp16_passes_that_layer_through(tmp_path: Path, scale: float, z: int, what: str) -> None:
    """One layer the kernels' float16 cannot hold no longer refuses the checkpoint: it
    passes through unchanged with the reason in the manifest, and the rest converts."""
    rng = np.random.default_rng(7)
    bad = make_layer(rng, 128, 64, group_size=64)
    bad.s = np.full((2, 64), scale, dtype=np.float32)
    bad.z[:] = z
    tensors = gptq_tensors(NAMES[0], bad, v1=False) | gptq_tensors(
        NAMES[1], make_layer(rng, 128, 64, group_size=64), v1=False
    )
    src = write_checkpoint(tmp_path / "src", tensors | plain_tensors(rng), gptq_config(4, 64, fmt="gptq_v2"))
    out = tmp_path / "o.safetensors"
    r = run_cli("marlin-convert", src, out, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert [lay["name"] for lay in doc["converted"]] == [NAMES[1]]
    (nc,) = doc["not_converted"]
    assert nc["name"] == NAMES[0] and what in nc["reason"] and "float16 range" in nc["reason"]
    art = SafetensorsFile(out)
    manifest = json.loads(next(v for k, v in art.metadata.items() if "manifest" in k))
    reasons = {p["name"]: p["reason"] for p in manifest["passthrough"]}
    assert what in reasons[f"{NAMES[0]}.scales"]
    assert verify(out, against=src, gpu=False).ok


def test_all_zero_scales_convert_and_pass_shapes(tmp_path: Path) -> None:
    """The false alarm: the layer's delta is zero, so it is symmetric, whatever its zeros."""
    src = _with_scales(tmp_path, np.zeros((2, 64), dtype=np.float32), "F16", z=3)
    out = tmp_path / "o.safetensors"
    (rec,) = convert(src, out).converted
    assert rec.symmetric is True
    report = verify(out, shapes_only=True, against=src, gpu=False)
    assert report.ok, report.problems
    assert verify(out, against=src, gpu=False).ok


@pytest.mark.parametrize("how", ["absent", "elsewhere"])
def test_a_tensor_the_index_names_but_its_shard_lacks(tmp_path: Path, how: str) -> None:
    tensors = _tensors()
    src = write_checkpoint(tmp_path / "src", tensors, gptq_config(4, 64), shards=2)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    if how == "absent":
        index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors"
        rule = "the index names this tensor in model-00001-of-00002.safetensors, but no shard holds it"
        tensor = "model.extra.weight"
    else:
        tensor = next(n for n, f in index["weight_map"].items() if f == "model-00002-of-00002.safetensors")
        index["weight_map"][tensor] = "model-00001-of-00002.safetensors"
        rule = (
            "the index places this tensor in model-00001-of-00002.safetensors, but it is stored in "
            "model-00002-of-00002.safetensors"
        )
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(
        tmp_path,
        src,
        tmp_path / "o.safetensors",
        needles=(f"{src / 'model.safetensors.index.json'}: {tensor}: {rule}",),
    )


def test_marlin_packed_tensors_under_a_gptq_label(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    tensors = {
        f"{NAMES[0]}.B": rng.integers(0, 2**31, (8, 128), dtype=np.int64).astype(np.int32),
        f"{NAMES[0]}.s": rng.standard_normal((1, 64)).astype(np.float16),
        **plain_tensors(rng),
    }
    src = write_checkpoint(tmp_path / "m", tensors, gptq_config(4, 64))
    _refused(
        tmp_path,
        src,
        tmp_path / "o.safetensors",
        needles=(
            f"{src / 'model.safetensors'}: {NAMES[0]}.B: checkpoint is already Marlin-packed (tensors "
            f"{NAMES[0]}.B and {NAMES[0]}.s are AutoGPTQ's Marlin format, though the config says "
            "checkpoint_format gptq; spec 5.1); marlin-convert never packs twice",
        ),
    )


@pytest.mark.parametrize("fmt", ["gptq", "awq", "tinyloop"])
def test_no_quantized_layer_at_all_is_refused(tmp_path: Path, fmt: str) -> None:
    rng = np.random.default_rng(4)
    weights = {f"{NAMES[0]}.weight": rng.standard_normal((64, 128)).astype(np.float16), **plain_tensors(rng)}
    if fmt == "tinyloop":
        from converter.formats.tinyloop_writer import write_tinyloop

        src = write_tinyloop(tmp_path / "m.tinyloop", {"d_model": 64}, weights, {})
        anchor = "entry in its header's linears"
    else:
        cfg = (
            gptq_config(4, 64)
            if fmt == "gptq"
            else {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm"}
        )
        src = write_checkpoint(tmp_path / fmt, weights, cfg)
        anchor = "tensor named *.qweight"
    _refused(
        tmp_path,
        src,
        tmp_path / "o.safetensors",
        needles=(f"{src}: no quantized layers: the {fmt} checkpoint has no {anchor}, so nothing would be converted",),
    )


def test_layers_that_all_pass_through_give_a_warning(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    tensors = gptq_tensors(NAMES[0], make_layer(rng, 128, 64, bits=8, group_size=64), v1=True) | plain_tensors(rng)
    src = write_checkpoint(tmp_path / "s8", tensors, gptq_config(8, 64))
    res = invoke("marlin-convert", src, tmp_path / "o.safetensors")
    assert res.exit_code == 0, res.stderr
    assert (
        "warning: none of the 1 quantized layers converts (each passes through with its reason, listed above): "
        "the artifact holds the source's tensors unchanged"
    ) in res.stderr


def _disagreeing(tmp_path: Path, zeros: str) -> Path:
    rng = np.random.default_rng(8)
    layers = [make_layer(rng, 128, 64, group_size=64, zeros=zeros) for _ in NAMES]
    tensors = {k: v for n, lay in zip(NAMES, layers, strict=True) for k, v in gptq_tensors(n, lay, v1=False).items()}
    src = write_checkpoint(tmp_path / zeros, tensors | plain_tensors(rng), gptq_config(4, 64, fmt="gptq_v2"))
    # The sidecar (read first) says v1; config.json says v2 (what the data is).
    (src / "quantize_config.json").write_text(json.dumps(gptq_config(4, 64, fmt="gptq")))
    return src


def test_v1_v2_disagreement_the_symmetric_zeros_decide(tmp_path: Path) -> None:
    src = _disagreeing(tmp_path, "sym")
    out = tmp_path / "o.safetensors"
    report = convert(src, out)
    note = re.compile(
        r"quantize_config\.json says checkpoint_format 'gptq' but config\.json says 'gptq_v2'; the zeros of "
        r"model\.layers\.0\.(self_attn\.q_proj|mlp\.down_proj) \(all the symmetric value of gptq_v2\) decide: "
        r"decoded as gptq_v2 \(data wins\)"
    )
    assert [lay.zero_convention.value for lay in report.converted] == ["gptq_v2"] * 2
    assert all(len(lay.warnings) == 1 and note.fullmatch(lay.warnings[0]) for lay in report.converted)
    assert verify(out, against=src, gpu=False).ok


def test_v1_v2_disagreement_the_data_cannot_decide(tmp_path: Path) -> None:
    src = _disagreeing(tmp_path, "random")
    _refused(
        tmp_path,
        src,
        tmp_path / "o.safetensors",
        needles=(
            f"{src / 'quantize_config.json'}: checkpoint_format: quantize_config.json says checkpoint_format "
            "'gptq' but config.json says 'gptq_v2', and no layer's zeros tell v1 from v2 (none is all the "
            "symmetric value); correct the config that is wrong",
        ),
    )


# --------------------------------------------------------------------------- messages


@pytest.mark.parametrize(
    ("overrides", "field", "found"),
    [
        ({"bits": "4"}, "bits", '"4"'),
        ({"group_size": 64.5}, "group_size", "64.5"),
        ({"sym": 1}, "sym", "1"),
        ({"desc_act": [True]}, "desc_act", "[true]"),
    ],
)
def test_a_type_error_inside_dynamic_says_where(tmp_path: Path, overrides: dict, field: str, found: str) -> None:
    key = "+:.*q_proj"
    src = write_checkpoint(tmp_path / "d", _tensors(), gptq_config(4, 64, dynamic={key: overrides}))
    want = "bool" if field in ("sym", "desc_act") else "int"
    _refused(
        tmp_path,
        src,
        tmp_path / "o.safetensors",
        needles=(f"{src / 'config.json'}: dynamic['{key}'].{field}: expected {want}, found {found}",),
    )


@pytest.mark.parametrize(
    ("where", "value", "field"),
    [
        ("quant", float("nan"), "damp_percent"),
        ("quant", float("inf"), "meta.x"),
        ("config", float("-inf"), "rope_theta"),
    ],
)
def test_nan_and_infinity_never_reach_the_outputs(tmp_path: Path, where: str, value: float, field: str) -> None:
    cfg = gptq_config(4, 64)
    src = write_checkpoint(tmp_path / "n", _tensors(), cfg)
    full = json.loads((src / "config.json").read_text())
    if where == "quant":
        if field == "meta.x":
            full["quantization_config"]["meta"] = {"x": value}
        else:
            full["quantization_config"][field] = value
    else:
        full[field] = value
    (src / "config.json").write_text(json.dumps(full))  # Python's json writes NaN / Infinity
    needle = f"field {field} is NaN or infinite, which standard JSON cannot hold"
    _refused(tmp_path, src, f"{tmp_path}/out/", needles=(f"{src / 'config.json'}: ", needle))
    if where == "config":  # config.json is only copied in folder mode
        out = tmp_path / "one.safetensors"
        convert(src, out)
        assert verify(out, against=src, gpu=False).ok
    else:
        _refused(tmp_path, src, tmp_path / "one.safetensors", needles=(needle, "the artifact's manifest"))


def test_a_converted_model_folder_is_already_an_artifact(tmp_path: Path, ckpt: Path) -> None:
    for i, shards in enumerate((None, "2KB")):
        out = tmp_path / f"art{i}"
        convert(ckpt, str(out) + "/", max_shard_size=shards)
        for given in (out, *out.glob("*.safetensors*")):
            _refused(
                tmp_path,
                given,
                tmp_path / "again.safetensors",
                needles=(
                    "this is already a marlin-convert artifact, not a source checkpoint; check it with marlin-verify",
                ),
            )


def test_each_shard_of_a_sharded_input_gets_the_hint(tmp_path: Path) -> None:
    """Shard 1 holds the qweights, shard 2 the rest: each fails differently alone, and
    each says it is one shard of the index."""
    tensors = _tensors()
    src = tmp_path / "src"
    write_checkpoint(src, tensors, gptq_config(4, 64))
    (src / "model.safetensors").unlink()
    first = {n: t for n, t in tensors.items() if n.endswith(".qweight")}
    second = {n: t for n, t in tensors.items() if n not in first}
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for name, group in zip(names, (first, second), strict=True):
        save_safetensors(src / name, group)
    wmap = {n: names[0] for n in first} | {n: names[1] for n in second}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    hint = "is one shard of model.safetensors.index.json: pass the index or the folder"
    _refused(
        tmp_path,
        src / names[0],
        tmp_path / "a.safetensors",
        needles=("has qweight but no scales", f"{names[0]} {hint}"),
    )
    _refused(tmp_path, src / names[1], tmp_path / "b.safetensors", needles=("but no qweight", f"{names[1]} {hint}"))
    assert convert(src, tmp_path / "whole.safetensors").converted


def test_a_lone_shard_that_converts_warns_that_the_other_shards_are_left_out(tmp_path: Path) -> None:
    """Shard 1 holds every layer whole, shard 2 the embedding and norm: shard 1 alone
    converts (and exports), and says that the other shard's tensors are not in the output."""
    tensors = _tensors()
    src = tmp_path / "src"
    write_checkpoint(src, tensors, gptq_config(4, 64))
    (src / "model.safetensors").unlink()
    plain = {n: t for n, t in tensors.items() if not n.startswith(NAMES)}
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    save_safetensors(src / names[0], {n: t for n, t in tensors.items() if n not in plain})
    save_safetensors(src / names[1], plain)
    wmap = {n: names[1] if n in plain else names[0] for n in tensors}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    warning = (
        "the other shards' tensors are left out; "
        f"{names[0]} is one shard of model.safetensors.index.json: pass the index or the folder"
    )
    assert convert(src / names[0], tmp_path / "a.safetensors", dry_run=True).warnings == [warning]
    r = invoke("marlin-convert", src / names[0], tmp_path / "a.safetensors")
    assert r.exit_code == 0 and f"warning: {warning}" in r.stderr.splitlines()
    r = invoke("marlin-convert", src / names[0], tmp_path / "ct", "--to", "compressed-tensors", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["warnings"][0] == warning
    assert convert(src, tmp_path / "whole.safetensors").warnings == []
    r = invoke("marlin-convert", src, tmp_path / "ct2", "--to", "compressed-tensors", "--json")
    assert r.exit_code == 0 and warning not in json.loads(r.stdout)["warnings"]


def test_the_input_is_unchanged_by_every_refusal_above(tmp_path: Path, ckpt: Path) -> None:
    """A refusal of each class, run against one folder, leaves every byte of it as it was."""
    before = snapshot(ckpt)
    (ckpt / "vocab.txt").symlink_to(SAMPLE)
    for args in ([ckpt, f"{tmp_path}/o/"], [ckpt / "model.safetensors", ckpt / "x.safetensors"]):
        assert invoke("marlin-convert", *args, "--force").exit_code == 2
    (ckpt / "vocab.txt").unlink()
    assert snapshot(ckpt) == before


def test_611_output_shards_within_an_open_files_limit_of_256(tmp_path: Path) -> None:
    """Not every shard's writer is open at once: the writer parks all but a few (the
    output's lock keeps cleaners away), so 611 shards fit ``ulimit -n 256``."""
    rng = np.random.default_rng(0)
    tensors = gptq_tensors(NAMES[0], make_layer(rng, 128, 64, group_size=64), v1=True)
    for i in range(610):
        tensors[f"model.extra.{i}.weight"] = rng.standard_normal(300).astype(np.float16)
    src = write_checkpoint(tmp_path / "src", tensors, gptq_config(4, 64))
    out = tmp_path / "o.safetensors"
    res = _limited(256, 256, "marlin-convert", src, out, "--max-shard-size", "700B", "-q")
    assert res.returncode == 0, res.stderr
    shards = sorted(tmp_path.glob("o-*.safetensors"))
    assert len(shards) == 611, len(shards)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    res = _limited(256, 256, "marlin-verify", tmp_path / "o.safetensors.index.json", "--against", src, "--cpu", "-q")
    assert res.returncode == 0, res.stdout + res.stderr
