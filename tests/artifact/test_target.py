"""No output ever touches the input (issue 14, data loss): every way an output path can
coincide with, replace, delete or be read back as an input file is refused, with
``--force`` too, and the input's bytes are unchanged afterwards. A multi-file commit is
all or nothing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from converter import atomic
from converter.convert import convert
from converter.errors import ConverterError, OutputExistsError
from tests.helpers.clirun import snapshot
from tests.helpers.paths import SAMPLE
from tests.helpers.producers import (
    gptq_config,
    gptq_tensors,
    make_layer,
    plain_tensors,
    save_safetensors,
    write_checkpoint,
)

NAMES = [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("up_proj", "down_proj")]
READ_BACK = (
    r"output is inside the input checkpoint folder .*, where reading the checkpoint again would pick it up as input"
)


def _checkpoint(folder: Path, shards: int = 1) -> Path:
    """A GPTQ checkpoint; with ``shards`` > 1, every layer's tensors in one shard (so each
    shard also converts on its own), the plain tensors in the last."""
    rng = np.random.default_rng(0)
    per_layer = [gptq_tensors(n, make_layer(rng, 256, 128), v1=True) for n in NAMES]
    plain = plain_tensors(rng)
    write_checkpoint(folder, {k: v for t in per_layer for k, v in t.items()} | plain, gptq_config(4, 128))
    if shards > 1:
        (folder / "model.safetensors").unlink()
        groups = [dict() for _ in range(shards)]
        for i, t in enumerate(per_layer):
            groups[i * shards // len(per_layer)].update(t)
        groups[-1].update(plain)
        wmap = {}
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_safetensors(folder / fname, group)
            wmap.update(dict.fromkeys(group, fname))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return folder


def _tree(folder: Path) -> dict[str, str]:
    """sha256 of every file below ``folder`` (links followed), by relative path."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture()
def sharded(tmp_path: Path) -> Path:
    return _checkpoint(tmp_path / "src", shards=3)


def test_one_shard_as_input_and_model_safetensors_beside_it(sharded: Path) -> None:
    """The reported case: with --force this deleted the input's shards and index."""
    before = _tree(sharded)
    shard = sorted(sharded.glob("model-*.safetensors"))[0]
    for force in (False, True):
        with pytest.raises(ConverterError, match=READ_BACK) as err:
            convert(shard, sharded / "model.safetensors", force=force)
        assert not isinstance(err.value, OutputExistsError)
        assert _tree(sharded) == before


def test_sharded_output_inside_the_input_folder(sharded: Path) -> None:
    before = _tree(sharded)
    for out in (sharded / "model.safetensors", sharded / "other.safetensors"):
        with pytest.raises(ConverterError, match=READ_BACK):
            convert(sharded, out, max_shard_size="20KB", force=True)
    assert _tree(sharded) == before
    assert sorted(p.name for p in sharded.iterdir() if p.name.startswith(".")) == []


def test_single_file_output_inside_an_hf_input_folder(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "src")
    before = _tree(src)
    with pytest.raises(ConverterError, match=READ_BACK):
        convert(src, src / "marlin.safetensors")
    with pytest.raises(ConverterError, match=READ_BACK):
        convert(src / "model.safetensors", src / "marlin.safetensors")
    assert _tree(src) == before
    convert(src, tmp_path / "ok.safetensors")  # the folder still converts
    assert _tree(src) == before


@pytest.mark.parametrize("out", ["sub/x.safetensors", "sub/", "sub/deeper/", "link/x.safetensors"])
def test_output_in_a_folder_inside_an_hf_input_folder(tmp_path: Path, out: str) -> None:
    """Below the checkpoint folder (a subfolder, a new one, or a link out and back in)
    is still inside it: refused before anything is created, --force too."""
    src = _checkpoint(tmp_path / "src")
    (src / "sub").mkdir()
    (tmp_path / "link").symlink_to(src / "sub", target_is_directory=True)
    before = _tree(src)
    listing = sorted(p.relative_to(src) for p in src.rglob("*"))
    with pytest.raises(ConverterError, match="output is in a folder inside the input checkpoint folder"):
        convert(src, f"{tmp_path}/{out}" if out.startswith("link") else f"{src}/{out}", force=True)
    assert _tree(src) == before
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == listing


@pytest.mark.parametrize("out", ["new/", "sub/new/"])
def test_dry_run_refuses_a_new_output_folder_inside_the_input_folder(tmp_path: Path, out: str) -> None:
    """A dry run fails exactly when the real run would: a folder output that does not
    exist yet inside the checkpoint folder is refused before anything is planned as
    written (the dry run creates no folder, but the input guard still runs)."""
    src = _checkpoint(tmp_path / "src")
    (src / "sub").mkdir()
    listing = sorted(p.relative_to(src) for p in src.rglob("*"))
    for dry in (True, False):
        with pytest.raises(ConverterError, match="output is in a folder inside the input checkpoint folder"):
            convert(src, f"{src}/{out}", dry_run=dry)
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == listing


def test_empty_output_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty OUT (an unset $OUT) is not the current folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConverterError, match="output path is empty; give a .safetensors file or a folder"):
        convert(SAMPLE, "")
    assert list(tmp_path.iterdir()) == []


def test_output_folder_that_is_a_link_to_the_input_folder(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "src")
    link = tmp_path / "link"
    link.symlink_to(src, target_is_directory=True)
    before = _tree(src)
    with pytest.raises(ConverterError, match=READ_BACK):
        convert(src, link / "x.safetensors", force=True)
    with pytest.raises(ConverterError, match=r"output folder is the input's folder"):
        convert(src, str(link) + "/", force=True)
    assert _tree(src) == before


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_folder_mode_file_linked_to_an_input_file(tmp_path: Path, how: str) -> None:
    src = _checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    link = out / "tokenizer.json"
    if how == "symlink":
        link.symlink_to(src / "tokenizer.json")
    else:
        os.link(src / "tokenizer.json", link)
    before = _tree(src)
    with pytest.raises(
        ConverterError, match=r"out/tokenizer.json: output would overwrite the input; choose another path"
    ):
        convert(src, str(out) + "/", force=True)
    assert _tree(src) == before


def test_force_never_deletes_an_input_file_listed_by_an_old_index(tmp_path: Path) -> None:
    """An old artifact's index at the output path names shards that are links to input
    shards: replacing that artifact would delete them."""
    src = _checkpoint(tmp_path / "src", shards=2)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    shard = sorted(src.glob("model-*.safetensors"))[0]
    os.link(shard, out_dir / "m-00001-of-00002.safetensors")
    (out_dir / "m.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"a": "m-00001-of-00002.safetensors"}}'
    )
    before = _tree(src)
    with pytest.raises(
        ConverterError,
        match=r"m-00001-of-00002.safetensors: replacing the output would delete this "
        r"file, which is part of the input",
    ):
        convert(src, out_dir / "m.safetensors", force=True)
    assert _tree(src) == before
    assert (out_dir / "m-00001-of-00002.safetensors").exists()


def test_tinyloop_output_beside_its_input_is_allowed(tmp_path: Path) -> None:
    src = tmp_path / "m.tinyloop"
    shutil.copyfile(SAMPLE, src)
    before = _tree(tmp_path)
    convert(src, tmp_path / "m.safetensors")
    assert _tree(tmp_path)["m.tinyloop"] == before["m.tinyloop"]


@pytest.mark.parametrize("name", [".m.safetensors.abc.incomplete", ".m.safetensors.abc.staged"])
def test_stale_temporary_cleanup_never_deletes_an_input_with_a_temporary_name(tmp_path: Path, name: str) -> None:
    """A .tinyloop input (found by its magic) named like a dead writer's leftover beside
    the output is the input, not a leftover: the cleanup keeps it."""
    src = tmp_path / name
    shutil.copyfile(SAMPLE, src)
    os.utime(src, (0, 0))  # older than this process, as a dead run's .staged file would be
    before = src.read_bytes()
    convert(src, tmp_path / "m.safetensors")
    assert src.read_bytes() == before
    convert(src, tmp_path / "m.safetensors", force=True)
    assert src.read_bytes() == before


def test_dry_run_refuses_exactly_like_the_real_run(sharded: Path) -> None:
    with pytest.raises(ConverterError, match=READ_BACK):
        convert(sharded, sharded / "x.safetensors", dry_run=True)


# --------------------------------------------------------------------------- commit


def _folder_output(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    src = _checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    convert(src, str(out) + "/", max_shard_size="20KB")
    return src, out, _tree(out)


def test_a_failed_rename_midway_leaves_every_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, out, old = _folder_output(tmp_path)
    # Change the source so that the new artifact differs from the old one.
    (src / "tokenizer.json").write_text('{"version": "2.0"}')
    real = os.replace
    calls = {"n": 0}

    def flaky(a: object, b: object) -> None:
        if str(b).startswith(str(out)) and not Path(str(b)).name.startswith("."):
            calls["n"] += 1
            if calls["n"] == 3:  # two shards renamed, then the disk says no
                raise OSError(5, "Input/output error")
        real(a, b)

    monkeypatch.setattr(atomic.commit.os, "replace", flaky)
    with pytest.raises(
        ConverterError,
        match=r"out: could not rename the new artifact into place \(Input/output error\); "
        r"every output file is as it was",
    ):
        convert(src, str(out) + "/", max_shard_size="20KB", force=True)
    assert _tree(out) == old
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_a_failed_rollback_names_the_files_it_left_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, out, old = _folder_output(tmp_path)
    (src / "tokenizer.json").write_text('{"version": "2.0"}')
    real = os.replace
    state = {"n": 0, "failing": False}

    def flaky(a: object, b: object) -> None:
        if state["failing"] and Path(str(a)).name.endswith(atomic.BACKUP_SUFFIX):
            raise OSError(13, "Permission denied")  # undoing fails too
        if str(b).startswith(str(out)) and not Path(str(b)).name.startswith("."):
            state["n"] += 1
            if state["n"] == 2:
                state["failing"] = True
                raise OSError(5, "Input/output error")
        real(a, b)

    monkeypatch.setattr(atomic.commit.os, "replace", flaky)
    first = sorted(out.glob("model-*.safetensors"))[0]
    with pytest.raises(
        ConverterError,
        match=rf"undoing the renames failed: {first} now hold the new artifact, every "
        r"other output file is as it was; re-run with --force",
    ):
        convert(src, str(out) + "/", max_shard_size="20KB", force=True)


# --------------------------------------------------------------------------- fuzz


SECRET = b"-----BEGIN PRIVATE KEY----- for no output"


def _layouts(root: Path) -> dict[str, Path]:
    """Input shapes: an HF folder (1 or 2 shards), a .tinyloop, and an HF folder whose
    tokenizer.json is a link out of it (to a secret) and whose vocab.txt is a link
    inside it; plus links of every kind to them, and an output folder that already holds
    hard links to input shards under output names, with an old index naming them."""
    one = _checkpoint(root / "one")
    two = _checkpoint(root / "two", shards=2)
    tl = root / "tl" / "m.tinyloop"
    tl.parent.mkdir()
    shutil.copyfile(SAMPLE, tl)
    leaky = _checkpoint(root / "leaky")
    (root / "secret").write_bytes(SECRET)
    (leaky / "tokenizer.json").unlink()
    (leaky / "tokenizer.json").symlink_to(root / "secret")
    (leaky / "words.txt").write_text("a\nb\n")
    (leaky / "vocab.txt").symlink_to("words.txt")
    (root / "links").mkdir()
    (root / "links" / "one").symlink_to(one, target_is_directory=True)
    (root / "links" / "shard.safetensors").symlink_to(sorted(two.glob("model-*"))[0])
    os.link(tl, root / "links" / "hard.safetensors")
    old = root / "old"
    old.mkdir()
    for i, shard in enumerate(sorted(two.glob("model-*")), 1):
        os.link(shard, old / f"m-{i:05d}-of-00002.safetensors")
    (old / "m.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {}, "weight_map": {"a": "m-00001-of-00002.safetensors", "b": "m-00002-of-00002.safetensors"}}
        )
    )
    return {"one": one, "two": two, "tl": tl, "leaky": leaky}


_OUT_CHOICES = [
    "{one}/model.safetensors",
    "{one}/new.safetensors",
    "{one}/",
    "{two}/model.safetensors",
    "{two}/model-00001-of-00002.safetensors",
    "{two}/",
    "{tl}",
    "{tldir}/m.safetensors",
    "{tldir}/",
    "{leaky}/x.safetensors",
    "{root}/links/one/x.safetensors",
    "{root}/links/one/",
    "{root}/links/shard.safetensors",
    "{root}/links/hard.safetensors",
    "{root}/links/",
    "{root}/old/m.safetensors",
    "{root}/old/",
    "{root}/fresh/",
    "{root}/out.safetensors",
]
#: input path -> the layout it reads
_IN_CHOICES = {
    "{one}": "one",
    "{one}/model.safetensors": "one",
    "{two}": "two",
    "{two}/model.safetensors.index.json": "two",
    "{two}/model-00001-of-00002.safetensors": "two",
    "{tl}": "tl",
    "{root}/links/one": "one",
    "{leaky}": "leaky",
    "{leaky}/model.safetensors": "leaky",
}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    src=st.sampled_from(sorted(_IN_CHOICES)),
    out=st.sampled_from(_OUT_CHOICES),
    force=st.booleans(),
    shards=st.sampled_from([None, "20KB"]),
)
def test_fuzz_paths_never_touch_the_input(
    tmp_path_factory: pytest.TempPathFactory, src: str, out: str, force: bool, shards: str | None
) -> None:
    """Random input and output paths (files, folders, shards, symbolic and hard links):
    whatever is refused or written, no input file changes, appears or vanishes; files
    hard-linked to another checkpoint's shards keep their bytes when an output replaces
    or deletes the links; and the secret behind a link out of a checkpoint reaches no
    output."""
    root = tmp_path_factory.mktemp("fuzz")
    paths = _layouts(root)
    fmt = {**paths, "tldir": paths["tl"].parent, "root": root}
    key = _IN_CHOICES[src]
    folder = paths[key] if paths[key].is_dir() else paths[key].parent
    before = snapshot(folder)
    shard_bytes = {p.name: p.read_bytes() for p in sorted(paths["two"].glob("model-*"))}
    try:
        convert(src.format(**fmt), out.format(**fmt), force=force, max_shard_size=shards)
    except ConverterError:
        pass  # refusals are fine; what matters is that the input is untouched
    case = (src, out, force, shards)
    now = snapshot(folder)
    if key == "tl":  # outputs may appear beside a .tinyloop: its folder is no checkpoint
        assert now["m.tinyloop"] == before["m.tinyloop"], case
    else:  # nothing may change, appear in or vanish from an HF input's folder
        assert now == before, case
    assert (root / "secret").read_bytes() == SECRET
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink() and p != root / "secret":
            assert SECRET not in p.read_bytes(), (case, p)
    if "{two}" not in out:  # replacing or deleting a link in old/ never reaches the inode it shares
        assert {p.name: p.read_bytes() for p in sorted(paths["two"].glob("model-*"))} == shard_bytes, case


@pytest.mark.parametrize("shards", [1, 3])
def test_force_into_a_model_folder_removes_the_old_models_extra_files(tmp_path: Path, shards: int) -> None:
    """--force over a model folder that held another model: the old artifact's tokenizer
    (listed in its manifest, unchanged since) goes with it, so the folder does not mix
    two models; the new model's files verify; a file edited since is left alone."""
    src = _checkpoint(tmp_path / "src")  # writes tokenizer.json, which folder mode copies
    (src / "generation_config.json").write_text('{"max_length": 7}')
    out = tmp_path / "out"
    convert(src, f"{out}/", max_shard_size=None if shards == 1 else 200_000)
    assert {"tokenizer.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    (out / "generation_config.json").write_text('{"max_length": 8}')  # the user's edit
    convert(SAMPLE, f"{out}/", force=True)  # a .tinyloop beside no tokenizer
    names = {p.name for p in out.iterdir()}
    assert "tokenizer.json" not in names
    assert (out / "generation_config.json").read_text() == '{"max_length": 8}'
    assert {"model.safetensors", "config.json"} <= names
    assert not any(n.startswith("model-0") or n.endswith(".index.json") for n in names)


def test_a_tampered_old_manifest_deletes_nothing_and_breaks_nothing(tmp_path: Path) -> None:
    """Entries of the old manifest's checksums.files that are not plain names of files
    we wrote (wrong types, paths, a 300-character name) are skipped: the --force run
    succeeds and only the real leftover (the old tokenizer) goes."""
    import xxhash

    from tests.helpers.artifact_edit import rewrite_artifact

    src = _checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    convert(src, f"{out}/")
    (tmp_path / "victim").write_text("keep")
    digest = xxhash.xxh3_128_hexdigest(b"keep")

    def edit(manifest: dict, tensors: dict) -> None:
        manifest["checksums"]["files"] += [
            {"name": None, "bytes": 4, "xxh3_128": digest},
            {"name": 5, "bytes": 4, "xxh3_128": digest},
            {"name": "../victim", "bytes": 4, "xxh3_128": digest},
            {"name": str(tmp_path / "victim"), "bytes": 4, "xxh3_128": digest},
            {"name": "a" * 300, "bytes": 4, "xxh3_128": digest},
            {"name": "tokenizer.json", "bytes": "4", "xxh3_128": digest},
            "not an entry",
        ]

    rewrite_artifact(out / "model.safetensors", out / "model.safetensors", edit)
    convert(SAMPLE, f"{out}/", force=True)
    assert (tmp_path / "victim").read_text() == "keep"
    assert "tokenizer.json" not in {p.name for p in out.iterdir()}  # its valid entry still counts
