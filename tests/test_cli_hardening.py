"""The commands' output and environment (issue 14): ``--json`` keeps stdout one document
and stderr empty whatever happens; names from files never reach the terminal raw; the
dry run checks the output (writable, room, limits) and shows the files it would write;
a full disk is named before the input is hashed, by the user's path; interrupts exit
130 with one line; temporaries of killed runs are cleaned by the next run."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from converter import atomic
from converter.artifact import target as target_mod
from converter.convert import convert
from converter.errors import ConverterError
from converter.verify import verify
from tests.helpers.clirun import assert_refused, invoke, run_cli, snapshot
from tests.helpers.paths import REPO, SAMPLE
from tests.helpers.producers import gptq_config, gptq_tensors, make_layer, write_checkpoint

ESC = "\x1b[2J\x1b]0;owned\x07"


def _ckpt(folder: Path, *, plain_name: str = "model.norm.weight", layer: str = "model.layers.0.mlp.up_proj") -> Path:
    rng = np.random.default_rng(0)
    tensors = gptq_tensors(layer, make_layer(rng, 128, 64, group_size=64), v1=True)
    tensors[plain_name] = rng.standard_normal(64).astype(np.float16)
    return write_checkpoint(folder, tensors, gptq_config(4, 64))


def _run_code(code: str, *args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -c code args...`` from the repository, with a bare environment."""
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        timeout=timeout,
    )


# --------------------------------------------------------------------------- --json


@pytest.mark.parametrize(
    ("tool", "args", "kind", "message"),
    [
        ("marlin-convert", [], "UsageError", "Missing argument 'IN'."),
        ("marlin-convert", ["{sample}", "{out}", "--bogus"], "UsageError", "No such option: --bogus"),
        ("marlin-convert", ["{sample}"], "UsageError", "Missing argument 'OUT'."),
        (
            "marlin-convert",
            ["{sample}", "{out}", "--max-shard-size", "5 parsecs"],
            "OptionValueError",
            "--max-shard-size: '5 parsecs' is not a size",
        ),
        (
            "marlin-convert",
            ["{tmp}/nope.tinyloop", "{out}"],
            "ConverterError",
            "nope.tinyloop: no such file or directory",
        ),
        ("marlin-verify", ["{sample}", "--gpu", "--cpu"], "UsageError", "--gpu and --cpu contradict each other"),
        ("marlin-verify", ["{sample}", "--model"], "UsageError", "--model needs --against SRC"),
        ("marlin-verify", ["{sample}", "--text", "{sample}"], "UsageError", "--text needs --model"),
        ("marlin-verify", ["{sample}"], "ArtifactError", "this is a .tinyloop source, not an artifact"),
    ],
)
def test_json_errors_are_one_document_and_stderr_stays_empty(
    tmp_path: Path, tool: str, args: list[str], kind: str, message: str
) -> None:
    fmt = {"sample": SAMPLE, "out": tmp_path / "o.safetensors", "tmp": tmp_path}
    res = run_cli(tool, *[a.format(**fmt) for a in args], "--json")
    assert (res.returncode, res.stderr) == (2, "")
    doc = json.loads(res.stdout)
    assert res.stdout.count("\n") == 1 and doc["ok"] is False
    assert doc["error"]["type"] == kind and message in doc["error"]["message"], doc
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("tool", ["marlin-convert", "marlin-verify"])
def test_json_given_a_value_is_a_json_usage_error(tmp_path: Path, tool: str) -> None:
    """``--json=1`` asks for JSON too: its usage error is the one document, not click's text."""
    args = [SAMPLE, tmp_path / "o.safetensors"] if tool == "marlin-convert" else [SAMPLE]
    res = run_cli(tool, *args, "--json=1")
    assert (res.returncode, res.stderr) == (2, "")
    doc = json.loads(res.stdout)
    assert doc["error"]["type"] == "UsageError" and "--json" in doc["error"]["message"], doc


def test_json_success_is_one_document_and_stderr_stays_empty(tmp_path: Path) -> None:
    res = run_cli("marlin-convert", SAMPLE, tmp_path / "o.safetensors", "--json", "--max-shard-size", "300KB")
    assert res.returncode == 0 and res.stderr == ""
    doc = json.loads(res.stdout)
    assert doc["ok"] and [f["name"] for f in doc["files"]] == [
        "o-00001-of-00003.safetensors",
        "o-00002-of-00003.safetensors",
        "o-00003-of-00003.safetensors",
        "o.safetensors.index.json",
    ]
    assert [f["bytes"] for f in doc["files"]] == [(tmp_path / f["name"]).stat().st_size for f in doc["files"]]
    res = run_cli("marlin-verify", tmp_path / "o.safetensors.index.json", "--json", "--cpu")
    assert res.returncode == 0 and res.stderr == "" and json.loads(res.stdout)["ok"]


# --------------------------------------------------------------------------- names from files


def _no_raw_controls(text: str) -> None:
    assert not any(c in text for c in ("\x1b", "\x07", "\u202e")), repr(text)


def test_escape_sequences_in_names_never_reach_the_terminal(tmp_path: Path) -> None:
    plain, layer = f"model.norm{ESC}.weight", "model.layers.0.\u202eup_proj"
    src = _ckpt(tmp_path / "src", plain_name=plain, layer=layer)
    out = tmp_path / "o.safetensors"
    for args in ([src, out], [src, tmp_path / "d.safetensors", "--dry-run", "--verbose"]):
        res = invoke("marlin-convert", *args)
        assert res.exit_code == 0, res.stderr
        _no_raw_controls(res.stdout + res.stderr)
        assert "model.layers.0.\\u202eup_proj" in res.stdout
        if "--verbose" in args:  # the long form lists every passed-through tensor by name
            assert "model.norm\\x1b[2J\\x1b]0;owned\\x07.weight" in res.stdout
    res = invoke("marlin-verify", out, "--against", src, "--cpu")
    assert res.exit_code == 0
    _no_raw_controls(res.stdout + res.stderr)
    assert "model.layers.0.\\u202eup_proj" in res.stdout
    # JSON keeps the names exactly (JSON escapes control characters itself).
    res = run_cli("marlin-verify", out, "--json", "--shapes")
    assert json.loads(res.stdout)["layers"][0]["name"] == layer and "\x1b" not in res.stdout


def test_escape_sequences_in_names_in_error_lines_and_problems(tmp_path: Path) -> None:
    layer = f"model.layers.0{ESC}.up_proj"
    src = _ckpt(tmp_path / "src", layer=layer)
    out = tmp_path / "o.safetensors"
    convert(src, out)
    # A problem naming the layer (its delta changed: against the source, not exact).
    from tests.helpers.artifact_edit import rewrite_artifact_arrays

    def edit(manifest: dict, t: dict) -> None:
        dtype, d = t[f"{layer}.marlin_delta"]
        t[f"{layer}.marlin_delta"] = (dtype, d + np.float32(1.0))

    bad = rewrite_artifact_arrays(out, tmp_path / "bad.safetensors", edit)
    res = invoke("marlin-verify", bad, "--against", src, "--shapes")
    assert res.exit_code == 1
    _no_raw_controls(res.stdout + res.stderr)
    assert "layer model.layers.0\\x1b[2J\\x1b]0;owned\\x07.up_proj: delta not bit-identical" in res.stdout
    # An error line naming it (the layer's scales are gone).
    from tests.helpers.artifact_edit import read_st, write_st

    meta, tensors = read_st(src / "model.safetensors")
    del tensors[f"{layer}.scales"]
    write_st(src / "model.safetensors", tensors, meta)
    line = assert_refused(invoke("marlin-convert", src, tmp_path / "x.safetensors"))
    _no_raw_controls(line)
    assert "model.layers.0\\x1b[2J\\x1b]0;owned\\x07.up_proj has qweight but no scales" in line


# --------------------------------------------------------------------------- the output, checked first


def test_dry_run_shows_the_files_it_would_write(tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    res = invoke("marlin-convert", SAMPLE, out, "--dry-run", "--max-shard-size", "300KB")
    assert res.exit_code == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("files: "))
    assert line.startswith("files: would write 4: o-00001-of-00003.safetensors (307.2 kB), ")
    assert line.endswith("o.safetensors.index.json (3.9 kB)")
    assert list(tmp_path.iterdir()) == []
    doc = json.loads(run_cli("marlin-convert", SAMPLE, out, "--dry-run", "--json").stdout)
    assert doc["dry_run"] and doc["files"] == [{"name": "o.safetensors", "bytes": 844600}]
    convert(SAMPLE, out)
    assert out.stat().st_size == 844600  # the planned size is the size written


def test_dry_run_refuses_an_unwritable_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """os.access is what answers for a read-only filesystem too (EROFS)."""
    real = target_mod.writable
    monkeypatch.setattr(target_mod, "writable", lambda p: False if Path(p) == tmp_path else real(p))
    for dry in (True, False):
        with pytest.raises(
            ConverterError,
            match=rf"^{tmp_path}: output folder is not writable \(its permissions, or a read-only filesystem\); "
            r"nothing was written$",
        ):
            convert(SAMPLE, tmp_path / "o.safetensors", dry_run=dry)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_on_a_filesystem_of_no_blocks_is_not_called_full() -> None:
    # /proc has 0 free bytes, as a full disk has; root may "write" there (os.access says
    # yes), so the reason must come from the filesystem having no blocks at all.
    r = run_cli("marlin-convert", SAMPLE, "/proc/marlin-test.safetensors")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.strip() == (
        "error: /proc: output folder is on a filesystem that stores no files (such as /proc or /sys); "
        "nothing was written"
    )


def test_too_little_space_is_named_before_the_input_is_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The input's sha256 runs in the background from the start; the space check never
    waits for it (and a dry run never starts it)."""
    from converter import digests as digests_mod

    src = _ckpt(tmp_path / "src")
    monkeypatch.setattr(target_mod, "free_bytes", lambda folder: 1000)

    def no_wait(self: object) -> dict:
        raise AssertionError("waited for the input's sha256 before checking the space")

    monkeypatch.setattr(digests_mod.FileDigests, "result", no_wait)
    started: list[object] = []
    real_init = digests_mod.FileDigests.__init__
    monkeypatch.setattr(
        digests_mod.FileDigests, "__init__", lambda self, paths: started.append(self) or real_init(self, paths)
    )
    for dry in (True, False):
        out = tmp_path / "o.safetensors"
        with pytest.raises(
            ConverterError,
            match=rf"^{out}: not enough free space: the output needs \d+ bytes, its filesystem has 1000 free; "
            r"nothing was written$",
        ):
            convert(src, out, dry_run=dry)
        assert len(started) == (0 if dry else 1)
    assert not started[0]._thread.is_alive()  # stopped with the error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_full_disk_at_write_time_names_the_output_not_a_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Space can go between the check and the write (another writer): the error still
    names the user's path, with the needed and free bytes."""
    from converter import safetensors_io

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_io.writer.os, "posix_fallocate", full)
    monkeypatch.setattr(atomic.disk_space, "free_bytes", lambda folder: 4096)
    for out, name in ((tmp_path / "o.safetensors", "o.safetensors"), (tmp_path / "dir", "model.safetensors")):
        arg = out if out.suffix else str(out) + "/"
        line = assert_refused(invoke("marlin-convert", SAMPLE, arg))
        assert (
            line.startswith(f"error: {tmp_path}/")
            and f"/{name}: cannot write the output: No space left on device (needs " in line
        )
        assert line.endswith(" bytes, 4096 free); nothing was written")
        assert ".incomplete" not in line and ".staged" not in line
    assert list(tmp_path.iterdir()) == []


def test_no_room_for_a_shard_placeholder_names_the_shard_not_a_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found on a tmpfs out of inodes: creating the second shard's hidden placeholder
    failed and the error named '.o-00002-of-0000n.safetensors.<random>.staged'."""
    from converter.artifact import writer

    calls = []
    stage = writer.stage_placeholder

    def no_inodes(folder: Path, name: str, created: list[Path]) -> Path:
        calls.append(name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(folder / f".{name}.0123456789ab.staged"))
        return stage(folder, name, created)

    monkeypatch.setattr(writer, "stage_placeholder", no_inodes)
    line = assert_refused(invoke("marlin-convert", SAMPLE, tmp_path / "o.safetensors", "--max-shard-size", "300KB"))
    assert line.startswith(f"error: {tmp_path}/o-00002-of-0000")
    assert ".safetensors: cannot write the output: No space left on device (" in line
    assert line.endswith("; nothing was written") and ".staged" not in line
    assert list(tmp_path.iterdir()) == []


@contextlib.contextmanager
def _tmpfs(path: Path, size: str, *, read_only: bool = False, inodes: int | None = None) -> Iterator[Path]:
    path.mkdir()
    opts = f"size={size}" + (",ro" if read_only else "") + (f",nr_inodes={inodes}" if inodes else "")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_real_read_only_and_a_real_small_filesystem(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        for extra in (["--dry-run"], []):
            assert_refused(
                invoke("marlin-convert", SAMPLE, ro / "o.safetensors", *extra), "output folder is not writable"
            )
    with _tmpfs(tmp_path / "small", "256k") as small:
        for extra in (["--dry-run"], []):
            line = assert_refused(invoke("marlin-convert", SAMPLE, small / "o.safetensors", *extra))
            assert line.startswith(
                f"error: {small / 'o.safetensors'}: not enough free space: the output needs 844600 bytes"
            )
        assert os.listdir(small) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_real_filesystem_out_of_inodes(tmp_path: Path) -> None:
    """Room for the bytes but not for the shards' files: the shard is named, and why."""
    with _tmpfs(tmp_path / "few", "20m", inodes=4) as few:
        line = assert_refused(invoke("marlin-convert", SAMPLE, few / "o.safetensors", "--max-shard-size", "300KB"))
        assert line.startswith(f"error: {few}")  # the folder, or the shard whose file could not be created
        assert "No space left on device (" in line
        assert "no free inodes: the filesystem cannot create another file" in line
        assert ".staged" not in line and ".incomplete" not in line
        assert os.listdir(few) == []


def test_the_file_size_limit_is_checked_first(tmp_path: Path) -> None:
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (100000, 100000)); "
        "sys.argv[0] = 'marlin-convert'; from converter.cli import main_convert; main_convert()"
    )
    for extra in (["--dry-run"], []):
        res = _run_code(code, str(SAMPLE), str(tmp_path / "o.safetensors"), *extra)
        assert res.returncode == 2 and res.stderr == (
            f"error: {tmp_path / 'o.safetensors'}: this file would be 844600 bytes, above the file-size limit of "
            "100000 bytes (ulimit -f); raise the limit, or split the output with a smaller --max-shard-size\n"
        )
    assert list(tmp_path.iterdir()) == []
    assert resource.getrlimit(resource.RLIMIT_FSIZE)  # this process is untouched


# --------------------------------------------------------------------------- interrupts and leftovers


EARLY_INTERRUPT = """
import os, signal, sys
sys.argv[0] = "marlin-convert"
import converter.faults  # the package's first import: what the console script runs first
os.kill(os.getpid(), getattr(signal, sys.argv[1]))  # Ctrl-C (or a kill) while the rest is still being imported
import converter.cli
print("not reached")
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_during_the_imports_is_one_line_and_exit_130(as_json: bool, sig: str) -> None:
    res = _run_code(EARLY_INTERRUPT, sig, *(["--json"] if as_json else []), timeout=60)
    assert res.returncode == 130
    if as_json:
        assert res.stderr == "" and json.loads(res.stdout) == {
            "ok": False,
            "error": {
                "type": "KeyboardInterrupt",
                "message": "interrupted; no output was written",
                "file": None,
                "tensor": None,
            },
        }
    else:
        assert (res.stdout, res.stderr) == ("", "interrupted; no output was written\n")


HALF_IMPORTED_JSON = """
import os, signal, sys, types
sys.argv[0] = "marlin-convert"
import converter.faults
sys.modules["json"] = types.ModuleType("json")  # as while json is still being imported
os.kill(os.getpid(), signal.SIGTERM)
print("not reached")
"""


def test_an_interrupted_verify_says_its_check_did_not_finish() -> None:
    """marlin-verify writes nothing, so "no output was written" (convert's line) misled."""
    res = _run_code(EARLY_INTERRUPT.replace('"marlin-convert"', '"marlin-verify"'), "SIGTERM", timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (130, "", "interrupted; the check did not finish\n")


def test_interrupt_while_json_is_half_imported_is_still_one_json_document() -> None:
    """Found by killing runs at random: the early handler called json.dumps, which
    raised AttributeError (a traceback, exit 1) when the signal landed inside json's import."""
    res = _run_code(HALF_IMPORTED_JSON, "--json", timeout=60)
    assert (res.returncode, res.stderr) == (130, "")
    assert json.loads(res.stdout)["error"] == {
        "type": "KeyboardInterrupt",
        "message": "interrupted; no output was written",
        "file": None,
        "tensor": None,
    }


AFTER_COMMIT = """
import sys
from converter.artifact import writer
finish = writer.ArtifactWriter.finish
def finish_then_ctrl_c(self, manifest):
    finish(self, manifest)
    raise KeyboardInterrupt  # Ctrl-C just after the rename, while cleaning up
writer.ArtifactWriter.finish = finish_then_ctrl_c
sys.argv[0] = "marlin-convert"
from converter.cli import main_convert
main_convert()
"""


@pytest.mark.parametrize("as_json", [False, True])
def test_interrupt_after_the_commit_does_not_claim_nothing_was_written(tmp_path: Path, as_json: bool) -> None:
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"old")
    res = _run_code(AFTER_COMMIT, str(SAMPLE), str(out), "--force", *(["--json"] if as_json else []))
    message = f"interrupted after the output was written: {out} is complete"
    assert res.returncode == 130
    if as_json:
        assert res.stderr == ""
        assert json.loads(res.stdout)["error"] == {
            "type": "KeyboardInterrupt",
            "message": message,
            "file": None,
            "tensor": None,
        }
    else:
        assert (res.stdout, res.stderr) == ("", message + "\n")
    assert out.read_bytes() != b"old"  # what the line says: the new artifact is in place


MID_COMMIT = """
import os, signal, sys
from converter import atomic
SIG = getattr(signal, sys.argv.pop(1))
AT = int(sys.argv.pop(1))
real = atomic.commit.os.replace
renames = []
def replace_then_signal(src, dst):
    real(src, dst)
    if not os.path.basename(dst).startswith("."):  # a final name (staged, backups are hidden)
        renames.append(dst)
        if len(renames) == AT:  # after the AT-th new file's rename
            os.kill(os.getpid(), SIG)
atomic.commit.os.replace = replace_then_signal
sys.argv[0] = "marlin-convert"
from converter.cli import main_convert
main_convert()
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupt_between_renames_waits_for_the_commit(tmp_path: Path, sig: str) -> None:
    """A signal that lands between two renames of a sharded --force run is held until
    the commit is recorded: the new output is complete (every shard and the index the
    new run's), the line says so, and no backup of the old files is left."""
    out = tmp_path / "a.safetensors"
    args = [str(SAMPLE), str(out), "--max-shard-size", "300KB", "-q"]
    assert run_cli("marlin-convert", *args).returncode == 0
    new = tmp_path / "new"
    new.mkdir()
    assert run_cli("marlin-convert", str(SAMPLE), str(new / "a.safetensors"), *args[2:]).returncode == 0
    for p in tmp_path.glob("a-*"):
        p.write_bytes(p.read_bytes()[:-1] + b" ")  # the old output differs from the new
    res = _run_code(MID_COMMIT, sig, "2", *args, "--force")
    assert res.returncode == 130, res.stderr
    index = tmp_path / "a.safetensors.index.json"  # a sharded artifact is named by its index
    assert res.stderr == f"interrupted after the output was written: {index} is complete\n"
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert names == sorted(p.name for p in new.iterdir())  # nothing hidden left (no .backup)
    for name in names:
        assert (tmp_path / name).read_bytes() == (new / name).read_bytes(), name


def test_interrupt_during_the_commit_also_waits_for_the_old_artifacts_leftovers(tmp_path: Path) -> None:
    """A single-file model folder replacing a sharded one: a Ctrl-C after the first
    rename is held until the old shards and index are gone too, so the folder is the new
    model alone."""
    out = tmp_path / "out"
    assert run_cli("marlin-convert", SAMPLE, f"{out}/", "--max-shard-size", "300KB", "-q").returncode == 0
    assert any(p.name.endswith(".index.json") for p in out.iterdir())
    res = _run_code(MID_COMMIT, "SIGINT", "1", str(SAMPLE), f"{out}/", "-q", "--force")
    assert res.returncode == 130, res.stderr
    assert res.stderr == f"interrupted after the output was written: {out / 'model.safetensors'} is complete\n"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert run_cli("marlin-verify", out, "--shapes").returncode == 0


WHILE_PRINTING = """
import os, signal, sys, time
from converter.cli import convert_cmd
real = convert_cmd.out_console.print
def print_then_interrupt(*a, **k):
    real(*a, **k)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the summary prints, after the commit
    time.sleep(0.05)
convert_cmd.out_console.print = print_then_interrupt
sys.argv[0] = "marlin-convert"
from converter.cli import main_convert
main_convert()
"""


def test_interrupt_while_the_summary_prints_says_the_output_is_complete(tmp_path: Path) -> None:
    """A Ctrl-C after the export's commit, while its summary prints, lands outside our
    handlers, where typer would end with a bare 130 that reads as "nothing written" (a
    break-it pass saw it): the line says which output is complete."""
    src, out = _ckpt(tmp_path / "src"), tmp_path / "ct"
    res = _run_code(WHILE_PRINTING, src, f"{out}/", "--to", "compressed-tensors")
    assert res.returncode == 130, res.stderr
    assert res.stderr == f"interrupted after the output was written: {out / 'model.safetensors'} is complete\n"
    assert run_cli("marlin-verify", out, "--against", src, "-q").returncode == 0


def test_exit_130_is_documented() -> None:
    for tool in ("marlin-convert", "marlin-verify"):
        res = run_cli(tool, "--help")
        assert "130 interrupted" in res.stdout
    readme = (REPO / "docs" / "verify.md").read_text()  # moved from the README (issue 39)
    assert "`130` interrupted" in readme


def _leftovers(folder: Path, stem: str) -> list[Path]:
    """What a SIGKILLed sharded run to ``<stem>.safetensors`` leaves (atomic.py's names)."""
    made = []
    for i in (1, 2, 3):
        shard = f"{stem}-{i:05d}-of-00003.safetensors"
        staged = folder / f".{shard}.{i:012x}{atomic.STAGED_SUFFIX}"
        incomplete = folder / f".{staged.name}.{i + 7:012x}{atomic.TEMP_SUFFIX}"
        for p in (staged, incomplete):
            p.write_bytes(b"x" * 10)
            made.append(p)
        old = time.time() - 3600
        os.utime(staged, (old, old))
    index = folder / f".{stem}.safetensors.index.json.{9:012x}{atomic.STAGED_SUFFIX}"
    index.write_bytes(b"{}")
    os.utime(index, (time.time() - 3600,) * 2)
    return [*made, index]


@pytest.mark.parametrize("later", ["single", "sharded-2", "folder"])
def test_a_killed_sharded_runs_temporaries_go_with_the_next_run(tmp_path: Path, later: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    stem = "model" if later == "folder" else "m"
    left = _leftovers(out, stem)
    keep = out / ".unrelated.safetensors.000000000001.incomplete"
    keep.write_bytes(b"other")
    arg = {"single": out / "m.safetensors", "sharded-2": out / "m.safetensors", "folder": str(out) + "/"}[later]
    convert(SAMPLE, arg, max_shard_size="500KB" if later == "sharded-2" else None)
    assert [p for p in left if p.exists()] == []
    assert keep.exists()  # not this output's


def test_a_live_writers_temporary_is_kept(tmp_path: Path) -> None:
    """An .incomplete file whose lock is held belongs to a running conversion."""
    live = tmp_path / f".m-00001-of-00002.safetensors.{1:012x}{atomic.TEMP_SUFFIX}"
    fd = os.open(live, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        convert(SAMPLE, tmp_path / "m.safetensors")
        assert live.exists()
    finally:
        os.close(fd)


def test_sigterm_mid_write_leaves_nothing(tmp_path: Path) -> None:
    """The existing signal tests run .tinyloop inputs; this one a sharded HF output."""
    src = _ckpt(tmp_path / "src")
    code = (
        "import sys, time; sys.argv[0] = 'marlin-convert'\n"
        "import converter.artifact.writer as w\n"
        "real = w.ArtifactWriter.finish\n"
        "def slow(self, m):\n    print('ready', flush=True); time.sleep(60); return real(self, m)\n"
        "w.ArtifactWriter.finish = slow\n"
        "from converter.cli import main_convert; main_convert()\n"
    )
    (tmp_path / "out").mkdir()
    before = snapshot(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(src), str(tmp_path / "out" / "m.safetensors"), "--max-shard-size", "1KB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "interrupted; no output was written\n"
    assert snapshot(tmp_path) == before


def test_verify_is_unchanged_for_good_artifacts(tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    convert(SAMPLE, out)
    assert verify(out, against=SAMPLE, gpu=False).ok


def test_an_internal_error_under_json_is_still_one_document() -> None:
    """A bug (here: a reader that raises something we never raise on purpose) keeps
    stdout one JSON document under --json; without --json the traceback is shown."""
    code = (
        "import sys; sys.argv[0] = 'marlin-convert'\n"
        "import converter.formats.tinyloop as t\n"
        "def boom(self, **kw): raise ZeroDivisionError('planted')\n"
        "t.TinyloopSource.plan = boom\n"
        "from converter.cli import main_convert; main_convert()\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    for extra in (["--json"], []):
        res = subprocess.run(
            [sys.executable, "-c", code, str(SAMPLE), "/nonexistent/o.safetensors", *extra],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=60,
        )
        assert res.returncode == 1
        if extra:
            assert res.stderr == ""
            assert json.loads(res.stdout)["error"] == {
                "type": "InternalError",
                "message": "internal error ZeroDivisionError: planted; this is a bug, rerun with --debug for the "
                "traceback",
                "file": None,
                "tensor": None,
            }
        else:
            assert "Traceback" in res.stderr and "ZeroDivisionError: planted" in res.stderr


def test_a_real_sigkill_mid_sharded_write_then_a_single_file_run(tmp_path: Path) -> None:
    """SIGKILL runs no handler: the sharded run's staged files stay; the next run to the
    same output, as one file, removes them (their locks died with the process)."""
    src = _ckpt(tmp_path / "src")
    code = (
        "import sys, time; sys.argv[0] = 'marlin-convert'\n"
        "import converter.artifact.writer as w\n"
        "def stuck(self, m):\n    print('ready', flush=True); time.sleep(60)\n"
        "w.ArtifactWriter.finish = stuck\n"
        "from converter.cli import main_convert; main_convert()\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(src), str(out / "m.safetensors"), "--max-shard-size", "1KB"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.kill()
    proc.wait(timeout=60)
    left = sorted(os.listdir(out))
    assert ".m.marlin-lock" in left  # the output's lock file, its lock gone with the process
    left.remove(".m.marlin-lock")
    assert left and all(n.lstrip(".").startswith("m-0000") for n in left), left
    # A later process (staged files older than it, and no live lock: dead leftovers).
    res = run_cli("marlin-convert", src, out / "m.safetensors", "-q")
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(out)) == ["m.safetensors"]


# --------------------------------------------------------------------------- standard streams (issue 42)


def _spawn(tool: str, *args: object, env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen[bytes]:
    from tests.helpers.clirun import _command, _env

    return subprocess.Popen(_command(tool, args), cwd=REPO, env={**_env(), **(env or {})}, **kw)  # type: ignore[call-overload]


def _close(fd: int) -> None:
    os.close(fd)


def test_a_closed_stdout_or_stderr_does_not_fail_the_import(tmp_path: Path) -> None:
    art = tmp_path / "a.safetensors"
    p = _spawn("marlin-convert", SAMPLE, art, stderr=subprocess.PIPE, preexec_fn=lambda: _close(1))
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert err == b""
    p = _spawn("marlin-verify", art, "--json", stderr=subprocess.PIPE, preexec_fn=lambda: _close(1))
    _, err = p.communicate(timeout=120)
    assert (p.returncode, err) == (0, b"")
    # stderr closed: the artifact is written, and nothing meant for stderr lands in it
    art2 = tmp_path / "b.safetensors"
    p = _spawn("marlin-convert", SAMPLE, art2, stdout=subprocess.PIPE, preexec_fn=lambda: _close(2))
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and b"layers converted" in out
    assert verify(art2, shapes_only=True).ok


def test_a_full_stdout_is_one_line_and_the_artifact_stays_valid(tmp_path: Path) -> None:
    art = tmp_path / "a.safetensors"
    with open("/dev/full", "wb") as full:
        p = _spawn("marlin-convert", SAMPLE, art, "--json", stdout=full, stderr=subprocess.PIPE)
        _, err = p.communicate(timeout=120)
    lines = err.decode().splitlines()
    assert p.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: cannot write to standard output"), err
    assert str(art) in lines[0] and "Traceback" not in err.decode()
    assert verify(art, shapes_only=True).ok
    assert [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]


@pytest.mark.parametrize("as_json", [False, True])
def test_a_broken_pipe_exits_quietly_with_the_documented_code(tmp_path: Path, as_json: bool) -> None:
    from converter.cli import BROKEN_PIPE_EXIT

    art = tmp_path / "a.safetensors"
    assert convert(SAMPLE, art).output
    for tool, args in (("marlin-verify", [art]), ("marlin-convert", [SAMPLE, tmp_path / "b.safetensors", "--force"])):
        p = _spawn(tool, *args, *(["--json"] if as_json else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert p.stdout is not None
        p.stdout.close()  # the reader is gone before anything is printed (| head -c 0)
        err = p.communicate(timeout=120)[1]
        assert (p.returncode, err) == (BROKEN_PIPE_EXIT, b""), (tool, err)
    assert BROKEN_PIPE_EXIT != 1
    assert str(BROKEN_PIPE_EXIT) in (REPO / "docs" / "convert.md").read_text()  # exit codes (issue 39)


def test_an_ascii_terminal_gets_ascii(tmp_path: Path) -> None:
    art = tmp_path / "a.safetensors"
    convert(SAMPLE, art)
    p = _spawn("marlin-verify", art, env={"PYTHONIOENCODING": "ascii"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    text = out.decode("ascii")  # raises on anything else
    assert "OK: 15 layers" in text and " ok " in text


def test_consoles_are_created_lazily() -> None:
    r = _run_code(
        "import sys; sys.stdout = None\n"
        "import converter.cli as c\n"
        "assert c.out_console._console is None and c.err_console._console is None\n"
        "c.err_console.print('made')\n"
        "assert c.err_console._console is not None\n"
    )
    assert (r.returncode, r.stderr.strip()) == (0, "made"), r.stderr


# --------------------------------------------------------------------------- races (issue 42)

SLOW_COMMIT = """
import sys, time
from converter import atomic
from converter.artifact import writer
READY = sys.argv.pop(1)
real = writer.commit_all
def slow_commit(pairs, folder):
    open(READY, "w").close()  # tell the test: staged, about to commit
    time.sleep(4)
    real(pairs, folder)
writer.commit_all = slow_commit
sys.argv[0] = "marlin-convert"
from converter.cli import main_convert
main_convert()
"""


def test_two_concurrent_folder_converts_to_one_output_do_not_mix(tmp_path: Path) -> None:
    """The first run holds the output's lock from staging to commit: the second refuses
    with one line, touches nothing of the first's (its temporaries survive), and OUT/
    holds one model, complete."""
    out = tmp_path / "OUT"
    ready = tmp_path / "ready"
    first = subprocess.Popen(
        [sys.executable, "-c", SLOW_COMMIT, str(ready), str(SAMPLE), f"{out}/", "-q"],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    staged = sorted(p.name for p in out.iterdir())
    gptq = _ckpt(tmp_path / "other")
    second = run_cli("marlin-convert", gptq, f"{out}/", "--force")
    assert second.returncode == 2 and second.stdout == "", second.stderr
    assert second.stderr.count("\n") == 1 and "another conversion is writing this output" in second.stderr
    assert str(out) in second.stderr and "marlin-lock" not in second.stderr
    assert sorted(p.name for p in out.iterdir()) == staged  # the first run's temporaries untouched
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert verify(out / "model.safetensors", against=SAMPLE, gpu=False).ok
    # and once it is done, the second one goes through
    assert run_cli("marlin-convert", gptq, f"{out}/", "--force", "-q").returncode == 0
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_an_output_lock_is_refused_while_held_and_free_after(tmp_path: Path) -> None:
    lock = atomic.OutputLock(tmp_path, "m", tmp_path / "m.safetensors")
    with pytest.raises(ConverterError, match="another conversion is writing this output") as info:
        convert(SAMPLE, tmp_path / "m.safetensors")
    assert info.value.path == str(tmp_path / "m.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.marlin-lock"]
    lock.release()
    convert(SAMPLE, tmp_path / "m.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


@pytest.mark.parametrize("when", ["last read", "hashing"])
def test_an_input_rewritten_in_place_during_conversion_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Same size, same inode, new bytes: re-stat after the last read and after hashing."""

    convert_mod = sys.modules["converter.convert.stream"]  # the write loop: it closes the pool, reads the digests

    src = tmp_path / "in.tinyloop"
    src.write_bytes(SAMPLE.read_bytes())
    os.utime(src, (1_000_000, 1_000_000))
    out = tmp_path / "o.safetensors"

    def rewrite() -> None:
        with open(src, "r+b") as fh:  # in place: same inode, same size
            fh.seek(-1, os.SEEK_END)
            fh.write(b"\x00")

    if when == "last read":
        close = convert_mod._WriteBehind.close

        def close_then_rewrite(self: object) -> None:
            close(self)  # type: ignore[arg-type]
            rewrite()

        monkeypatch.setattr(convert_mod._WriteBehind, "close", close_then_rewrite)
    else:
        result = convert_mod.FileDigests.result

        def hash_then_rewrite(self: object) -> object:
            got = result(self)  # type: ignore[arg-type]
            rewrite()
            return got

        monkeypatch.setattr(convert_mod.FileDigests, "result", hash_then_rewrite)
    with pytest.raises(ConverterError, match="was modified .* while being converted; nothing was written") as info:
        convert(src, out)
    assert info.value.exit_code == 2 and info.value.path == str(src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.tinyloop"]


def test_verify_reads_the_artifact_it_opened_even_when_replaced_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An atomic replace of the artifact during marlin-verify is either before its open or
    after: it checks the file it opened, by handle, and never reports it rewritten."""

    verify_mod = sys.modules["converter.verify.run"]
    art = tmp_path / "a.safetensors"
    other = tmp_path / "b.safetensors"
    convert(SAMPLE, art)
    convert(_ckpt(tmp_path / "ck"), other)
    real = verify_mod.check_artifact

    def replace_then_check(a: object, **kw: object) -> object:
        os.replace(other, art)  # what a concurrent marlin-convert --force does
        return real(a, **kw)

    monkeypatch.setattr(verify_mod, "check_artifact", replace_then_check)
    report = verify(art, against=SAMPLE, gpu=False)
    assert report.ok, [p.message for p in report.problems]
    assert report.checked["layers"] == 15  # the sample's, not the replacement's one layer


@pytest.mark.parametrize("prog", ["marlin-convert", "marlin-verify"])
def test_the_early_handlers_document_is_error_documents(monkeypatch, prog: str) -> None:
    """The early handler writes its JSON document by hand (json may not be imported yet):
    it must be the one error_document writes for the same line."""
    import signal

    from converter import faults

    written: list[tuple[int, str]] = []
    handlers: dict[int, object] = {}
    monkeypatch.setattr(faults, "_command", [prog])
    monkeypatch.setattr(faults, "write_fd", lambda fd, text: written.append((fd, text)))
    monkeypatch.setattr(faults.signal, "signal", lambda sig, h: handlers.__setitem__(sig, h))
    monkeypatch.setattr(faults.os, "_exit", lambda code: None)
    faults.quiet_interrupt_until_ready(True)
    handlers[signal.SIGTERM](signal.SIGTERM, None)
    said = faults.INTERRUPTED_CHECK if prog == "marlin-verify" else faults.INTERRUPTED
    assert written == [(1, faults.error_document("KeyboardInterrupt", said) + "\n")]
