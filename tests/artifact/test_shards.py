"""Sharded output, folder mode, and verifying sharded artifacts (issue 4, items 7-8)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from converter.artifact.schema import Manifest, Shard, read_document
from converter.artifact.shards import parse_size, plan_shards
from converter.cli import convert_app, verify_app
from converter.constants import HF_WEIGHTS_GUARD
from converter.convert import convert
from converter.errors import ConverterError, OutputExistsError
from converter.safetensors_io import SafetensorsFile
from converter.verify import verify
from tests.helpers.paths import SAMPLE
from tests.helpers.producers import assert_truth, gptq_config, gptq_tensors, make_layer, plain_tensors, write_checkpoint

NAMES = [f"model.layers.{i}.mlp.{p}" for i in range(3) for p in ("up_proj", "down_proj")]


@pytest.fixture()
def src(tmp_path: Path) -> tuple[Path, dict]:
    rng = np.random.default_rng(0)
    layers = {n: make_layer(rng, 256, 128, act_order=n.endswith("down_proj"), bias=True) for n in NAMES}
    tensors = {k: v for n, lay in layers.items() for k, v in gptq_tensors(n, lay, v1=False).items()}
    tensors.update(plain_tensors(rng))
    folder = write_checkpoint(tmp_path / "src", tensors, gptq_config(4, 128, fmt="gptq_v2", desc_act=True))
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return folder, layers


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5kb") == 1500
    assert parse_size("123B") == parse_size(123) == 123  # a string needs its unit; an int is bytes
    with pytest.raises(ConverterError, match=r"^--max-shard-size: '123' has no unit; add one of .*e\.g\. 123GB"):
        parse_size("123")
    with pytest.raises(ConverterError, match=r"--max-shard-size: '5 parsecs' is not a size"):
        parse_size("5 parsecs")
    with pytest.raises(ConverterError, match=r"--max-shard-size: must be positive, found '0GB'"):
        parse_size("0GB")


def test_plan_shards_keeps_layer_tensors_together() -> None:
    layout = [
        ("a.marlin_B", "I32", (4, 128)),
        ("a.marlin_scales", "F16", (1, 64)),
        ("a.marlin_delta", "F32", (1, 64)),
        ("a.bias", "F16", (64,)),
        ("b.marlin_B", "I32", (4, 128)),
        ("b.marlin_scales", "F16", (1, 64)),
        ("b.marlin_delta", "F32", (1, 64)),
        ("norm", "F16", (64,)),
    ]
    shards = plan_shards(layout, ["a", "b"], 3000)  # a: 2560 bytes, b: 2432, norm: 128
    assert [[n for n, _, _ in s] for s in shards] == [
        ["a.marlin_B", "a.marlin_scales", "a.marlin_delta", "a.bias"],
        ["b.marlin_B", "b.marlin_scales", "b.marlin_delta", "norm"],
    ]
    assert plan_shards(layout, ["a", "b"], None) == [layout]
    assert len(plan_shards(layout, ["a", "b"], 1)) == 3  # oversize units get a shard each


def test_sharded_output(tmp_path: Path, src: tuple[Path, dict]) -> None:
    folder, layers = src
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    report = convert(folder, out, max_shard_size="40KB")
    index = tmp_path / "out" / "model.safetensors.index.json"
    assert report.output == str(index) and not out.exists()
    data = json.loads(index.read_text())
    files = sorted(set(data["weight_map"].values()))
    count = len(files)
    assert count >= 3 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    total = 0
    manifests = []
    for i, f in enumerate(files, 1):
        with SafetensorsFile(tmp_path / "out" / f) as sf:
            total += sum(sf.byte_range(n)[1] - sf.byte_range(n)[0] for n in sf.infos)
            doc = read_document(sf.metadata, path=sf.path)
            m = Manifest.parse(sf.metadata, path=sf.path)
            assert doc.notes == () and m.shard == Shard(index=i, count=count)
            assert set(m.checksums.tensors) == set(data["weight_map"])  # whole model in every shard
            manifests.append(dataclasses.replace(m, shard=None))
    assert all(m == manifests[0] for m in manifests) and data["metadata"]["total_size"] == total
    for name in NAMES:  # a converted layer never straddles shards
        assert len({f for t, f in data["weight_map"].items() if t.startswith(name + ".")}) == 1
    for path in (index, index.parent):
        rep = verify(path, against=folder, gpu=False)
        assert rep.ok, [p.message for p in rep.problems]
    for name, lay in layers.items():
        assert_truth(index, name, lay)
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("which", [0, -1])
def test_verify_reads_the_shards_it_opened_even_when_one_is_replaced_meanwhile(
    tmp_path: Path, src: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch, which: int
) -> None:
    """An atomic replace of a shard during marlin-verify is either before its open or after:
    every shard is opened once and read by handle (as the single file is), so verify checks
    the shards it opened and never reports one rewritten."""
    import sys

    folder, _ = src
    rng = np.random.default_rng(1)
    other_layers = {n: make_layer(rng, 256, 128, act_order=n.endswith("down_proj"), bias=True) for n in NAMES}
    tensors = {k: v for n, lay in other_layers.items() for k, v in gptq_tensors(n, lay, v1=False).items()}
    tensors.update(plain_tensors(rng))
    other_src = write_checkpoint(tmp_path / "src2", tensors, gptq_config(4, 128, fmt="gptq_v2", desc_act=True))
    for name, source in (("out", folder), ("other", other_src)):
        (tmp_path / name).mkdir()
        convert(source, tmp_path / name / "model.safetensors", max_shard_size="40KB")
    index = tmp_path / "out" / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert shards == sorted(
        set(json.loads((index.parent.parent / "other" / index.name).read_text())["weight_map"].values())
    )
    shard = shards[which]
    before = (tmp_path / "out" / shard).read_bytes()
    assert before != (tmp_path / "other" / shard).read_bytes()

    verify_mod = sys.modules["converter.verify.run"]
    real = verify_mod.check_artifact

    def replace_then_check(a: object, **kw: object) -> object:
        os.replace(tmp_path / "other" / shard, tmp_path / "out" / shard)  # a concurrent convert --force
        return real(a, **kw)

    monkeypatch.setattr(verify_mod, "check_artifact", replace_then_check)
    report = verify(index, against=folder, gpu=False)
    assert report.ok, [p.message for p in report.problems]
    assert report.checked["layers"] == len(NAMES)
    assert (tmp_path / "out" / shard).read_bytes() != before  # the replace did happen mid-verify


def test_force_rewrite_removes_stale_shards(tmp_path: Path, src: tuple[Path, dict]) -> None:
    folder, _ = src
    out = tmp_path / "a.safetensors"
    convert(folder, out, max_shard_size="40KB")
    old = sorted(p.name for p in tmp_path.glob("a-*.safetensors"))
    assert len(old) >= 3
    with pytest.raises(OutputExistsError, match=r"a.safetensors.index.json: output exists; pass --force"):
        convert(folder, out, max_shard_size="80KB")
    convert(folder, out, max_shard_size="80KB", force=True)
    new = sorted(p.name for p in tmp_path.glob("a-*.safetensors"))
    assert len(new) < len(old) and all(n.endswith(f"-of-{len(new):05d}.safetensors") for n in new)
    convert(folder, out, force=True)  # one file now: the old index and shards go
    assert (
        out.is_file()
        and not list(tmp_path.glob("a-*.safetensors"))
        and not (tmp_path / "a.safetensors.index.json").exists()
    )
    assert verify(out, against=folder, gpu=False).ok


def test_failure_mid_write_leaves_the_folder_untouched(
    tmp_path: Path, src: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, _ = src
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("x")
    from converter.formats.gptq import GptqSource

    real = GptqSource.load_layer
    calls = {"n": 0}

    def flaky(self, layer, k_start=0, k_stop=None, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise ConverterError("disk on fire", path="x")
        return real(self, layer, k_start, k_stop, **kw)

    monkeypatch.setattr(GptqSource, "load_layer", flaky)
    with pytest.raises(ConverterError, match="disk on fire"):
        convert(folder, str(out_dir) + "/", max_shard_size="40KB")
    assert sorted(p.name for p in out_dir.iterdir()) == ["keep.txt"]


def test_verify_reports_missing_shard_and_bad_index(tmp_path: Path, src: tuple[Path, dict]) -> None:
    folder, _ = src
    out = tmp_path / "m.safetensors"
    convert(folder, out, max_shard_size="40KB")
    index = tmp_path / "m.safetensors.index.json"
    data = json.loads(index.read_text())
    victim = sorted(set(data["weight_map"].values()))[1]
    moved = sorted(t for t, f in data["weight_map"].items() if f == victim)[0]
    data["weight_map"][moved] = sorted(set(data["weight_map"].values()))[0]
    index.write_text(json.dumps(data))
    rep = verify(index, shapes_only=True)
    codes = {(p.code, p.tensor) for p in rep.problems}
    assert ("index_mismatch", moved) in codes and not rep.ok
    (tmp_path / victim).unlink()
    rep = verify(index, shapes_only=True)
    msgs = [p.message for p in rep.problems]
    assert any(m == f"{victim}: shard listed in m.safetensors.index.json is missing" for m in msgs)
    assert any(p.code == "missing_tensor" for p in rep.problems)
    os.mkfifo(tmp_path / victim)  # there, but nothing to read: said so, and no read waits for a writer
    msgs = [p.message for p in verify(index, shapes_only=True).problems]
    assert f"{victim}: shard listed in m.safetensors.index.json is not a regular file (a FIFO)" in msgs


def test_verify_flags_a_single_file_that_would_shadow_the_shards(tmp_path: Path, src: tuple[Path, dict]) -> None:
    """m.safetensors beside m.safetensors.index.json is what transformers would load:
    the sharded artifact is otherwise intact, and verify says what to move."""
    folder, _ = src
    convert(folder, tmp_path / "m.safetensors", max_shard_size="40KB")
    index = tmp_path / "m.safetensors.index.json"
    assert verify(index, shapes_only=True).ok
    shutil.copy(sorted(tmp_path.glob("m-0*.safetensors"))[0], tmp_path / "m.safetensors")
    rep = verify(index, shapes_only=True)
    assert not rep.ok
    assert [(p.code, p.tensor, p.message) for p in rep.problems] == [
        (
            "index_mismatch",
            "m.safetensors",
            "m.safetensors lies beside m.safetensors.index.json: a loader that looks for the single file first "
            "(transformers does) would load it instead of the shards; move it away",
        )
    ]


def test_verify_reports_an_unreadable_shard_and_still_checks_the_others(tmp_path: Path, src: tuple[Path, dict]) -> None:
    """A truncated shard was fatal (exit 2, nothing else reported): it is a problem like
    a missing shard, and corruption in another shard is still found."""
    folder, _ = src
    out = tmp_path / "m.safetensors"
    convert(folder, out, max_shard_size="40KB")
    index = tmp_path / "m.safetensors.index.json"
    shards = sorted(tmp_path.glob("m-*.safetensors"))
    with open(shards[0], "r+b") as fh:
        fh.truncate(os.path.getsize(shards[0]) - 100)
    data = bytearray(shards[-1].read_bytes())
    data[-50] ^= 1
    shards[-1].write_bytes(bytes(data))
    rep = verify(index, shapes_only=True)
    assert not rep.ok
    first = next(p for p in rep.problems if p.code == "missing_shard")
    assert first.message.startswith(f"{shards[0].name}: shard listed in m.safetensors.index.json cannot be read: ")
    assert "past the end of the data buffer" in first.message
    assert any(p.code == "missing_tensor" for p in rep.problems)
    assert any(p.code == "checksum_mismatch" for p in rep.problems)
    assert not any(p.code == "index_mismatch" for p in rep.problems)
    shards[-1].write_bytes(b"garbage")  # every other shard still readable: a problem, not fatal
    assert any(p.code == "missing_shard" and shards[-1].name in p.message for p in verify(index).problems)


def test_verify_an_index_that_names_no_shards(tmp_path: Path, src: tuple[Path, dict]) -> None:
    folder, _ = src
    convert(folder, tmp_path / "m.safetensors", max_shard_size="40KB")
    index = tmp_path / "m.safetensors.index.json"
    index.write_text('{"metadata": {}, "weight_map": {}}')
    from converter.errors import ArtifactError

    with pytest.raises(ArtifactError, match=r"the index names no shards \(its weight_map is empty\)"):
        verify(index, shapes_only=True)


def test_folder_mode_writes_a_complete_model_folder(tmp_path: Path, src: tuple[Path, dict]) -> None:
    folder, layers = src
    out = tmp_path / "model"
    report = convert(folder, str(out) + "/")
    assert report.output == str(out / "model.safetensors")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    cfg = json.loads((out / "config.json").read_text())
    src_cfg = json.loads((folder / "config.json").read_text())
    # transformers_weights stops a from_pretrained without `import converter` (docs/serving.md).
    assert {k: v for k, v in cfg.items() if k not in ("quantization_config", "transformers_weights")} == {
        k: v for k, v in src_cfg.items() if k != "quantization_config"
    }
    assert cfg["transformers_weights"] == HF_WEIGHTS_GUARD
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["schema_version"], qc["bits"], qc["zero_correction"]) == (
        "marlin-convert",
        2,
        4,
        "delta",
    )
    assert qc["weight_file"] == "model.safetensors" and qc["act_order"] is True and qc["group_sizes"] == [128]
    assert qc["source_quantization_config"] == src_cfg["quantization_config"]
    assert oct(os.stat(out / "config.json").st_mode & 0o777) != "0o600"
    assert verify(out, against=folder, gpu=False).ok
    # An existing folder is folder mode too; rewriting needs --force.
    with pytest.raises(OutputExistsError, match=r"model.safetensors: output exists"):
        convert(folder, out)
    convert(folder, out, force=True, max_shard_size="60KB")
    assert (
        json.loads((out / "config.json").read_text())["quantization_config"]["weight_file"]
        == "model.safetensors.index.json"
    )
    assert not (out / "model.safetensors").exists()
    assert verify(out, against=folder, gpu=False).ok


@pytest.mark.skipif(not SAMPLE.is_file(), reason="bundled sample missing")
def test_folder_mode_from_tinyloop_builds_a_minimal_config(tmp_path: Path) -> None:
    out = tmp_path / "tl"
    out.mkdir()
    convert(SAMPLE, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "tinyloop" and cfg["vocab_size"] == 1000 and cfg["d_model"] == 128
    assert cfg["quantization_config"]["source_format"] == "tinyloop"
    assert sorted({2, 4} & set(cfg["quantization_config"]["source_bits"])) == [2, 4]
    assert verify(out, against=SAMPLE, gpu=False).ok


def test_cli_sharded_convert_and_verify(tmp_path: Path, src: tuple[Path, dict]) -> None:
    folder, _ = src
    runner = CliRunner()
    res = runner.invoke(convert_app, [str(folder), str(tmp_path / "o") + "/", "--max-shard-size", "40KB", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["output"] == str(tmp_path / "o" / "model.safetensors.index.json")
    for target in (tmp_path / "o", tmp_path / "o" / "model.safetensors.index.json"):
        res = runner.invoke(verify_app, [str(target), "--shapes", "--against", str(folder), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["ok"] is True
    res = runner.invoke(convert_app, [str(folder), str(tmp_path / "p.safetensors"), "--max-shard-size", "lots"])
    assert res.exit_code == 2 and "'lots' is not a size" in res.output


def test_failed_folder_mode_removes_the_folder_it_created(
    tmp_path: Path, src: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, _ = src
    from converter.formats.gptq import GptqSource

    def broken(self, name):
        raise ConverterError("read error", path=name)

    monkeypatch.setattr(GptqSource, "load_tensor", broken)
    out = tmp_path / "new"
    with pytest.raises(ConverterError, match="read error"):
        convert(folder, str(out) + "/")
    assert not out.exists()


def test_source_files_of_sharded_input_include_the_index(tmp_path: Path, src: tuple[Path, dict]) -> None:
    rng = np.random.default_rng(1)
    lay = make_layer(rng, 128, 64)
    folder = write_checkpoint(
        tmp_path / "sh", {**gptq_tensors("m.lin", lay, v1=True), **plain_tensors(rng)}, gptq_config(), shards=2
    )
    report = convert(folder, tmp_path / "a.safetensors")
    from converter.artifact.reader import open_artifact

    with open_artifact(report.output) as art:
        names = [f.name for f in art.manifest.source.files]
    assert names == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "config.json",
    ]


def test_folder_mode_refuses_the_source_folder(tmp_path: Path, src: tuple[Path, dict]) -> None:
    folder, _ = src
    for path in (folder, folder / "model.safetensors"):
        with pytest.raises(ConverterError, match=r"src: output folder is the input's folder; choose another folder"):
            convert(path, str(folder) + "/", force=True)


def test_verifying_one_shard_alone_points_to_the_index(tmp_path: Path, src: tuple[Path, dict]) -> None:
    folder, _ = src
    convert(folder, tmp_path / "m.safetensors", max_shard_size="40KB")
    shard = sorted(tmp_path.glob("m-*.safetensors"))[0]
    from converter.errors import ArtifactError

    with pytest.raises(
        ArtifactError,
        match=rf"{shard.name}: shard: this file is shard 1 of \d+ of a sharded artifact; "
        r"verify its index \(m.safetensors.index.json\) or its folder",
    ):
        verify(shard, shapes_only=True)


def test_a_sharded_single_file_artifact_verifies_by_its_folder_and_names_its_index(
    tmp_path: Path, src: tuple[Path, dict]
) -> None:
    """`--max-shard-size` turns OUT into shards plus OUT.index.json: the folder that holds
    them is the artifact, and OUT itself (which does not exist) points to the index."""
    folder, _ = src
    out = tmp_path / "art" / "m.safetensors"
    out.parent.mkdir()
    convert(folder, out, max_shard_size="40KB")
    rep = verify(out.parent, shapes_only=True)
    assert rep.ok and rep.checked["layers"] == len(NAMES) and rep.checked["checksums"] is True
    with pytest.raises(
        ConverterError,
        match=r"m.safetensors: no such file; it was written as shards: verify their index, "
        r"m.safetensors.index.json, or the folder",
    ):
        verify(out, shapes_only=True)
    convert(folder, out.with_name("n.safetensors"), max_shard_size="40KB")
    from converter.errors import ArtifactError

    with pytest.raises(
        ArtifactError,
        match=r"art: folder holds no single artifact \(m.safetensors.index.json, n.safetensors.index.json; "
        r"no model.safetensors.index.json or model.safetensors\); give the artifact file or its index",
    ):
        verify(out.parent, shapes_only=True)


@pytest.mark.parametrize(
    ("index_text", "match"),
    [
        (
            '{"weight_map": {"a": "../m-00001-of-00002.safetensors"}}',
            r"weight_map: shard '../m-00001-of-00002.safetensors' must be a plain file name in the same folder",
        ),
        (
            '{"weight_map": ["m-00001-of-00002.safetensors"]}',
            r"weight_map: weight_map must be a map of tensor name to shard file",
        ),
        ('{"weight_map": {"a": 1', r"m.safetensors.index.json: JSON file is not valid JSON: "),
    ],
)
def test_verifying_a_bad_index(tmp_path: Path, src: tuple[Path, dict], index_text: str, match: str) -> None:
    """Documented change: the artifact's index is read by the one HF index reader
    (converter/hf_index.py), with its messages."""
    folder, _ = src
    convert(folder, tmp_path / "m.safetensors", max_shard_size="40KB")
    (tmp_path / "m.safetensors.index.json").write_text(index_text)
    from converter.errors import ArtifactError

    with pytest.raises(ArtifactError, match=match):
        verify(tmp_path / "m.safetensors.index.json", shapes_only=True)
