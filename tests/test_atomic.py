"""Atomic output (issue 5, item 3).

The converter writes to ``.<name>.<random>.incomplete`` in the target folder, fsyncs,
then renames.  Killed with SIGKILL in the middle of a large write, it leaves no file
at the target and a pre-existing output byte-identical; the leftover temporary is
removed by the next run to the same target (it is unlocked: its writer is dead).
It never writes into its input.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from converter.atomic import interrupts_deferred, remove_stale_temporaries
from converter.convert import convert
from converter.errors import ConverterError, OutputExistsError
from converter.formats.gptq import GptqSource
from converter.safetensors_io import StreamingWriter
from tests.helpers.clirun import run_cli
from tests.helpers.paths import REPO, SAMPLE
from tests.helpers.synthetic_gptq import small_gptq

OLD = b"previous artifact, must survive\n" * 1000


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(folder: Path) -> dict[str, str]:
    return {p.name: _sha(p) for p in sorted(folder.iterdir()) if p.is_file()}


def _temporaries(out: Path) -> list[Path]:
    """Hidden temporaries of ``out``: ``.<name>.*.staged`` and ``..<name>.*.staged.*.incomplete``."""
    return sorted(p for p in out.parent.iterdir() if p.name.startswith((f".{out.name}.", f"..{out.name}.")))


def _writing(out: Path) -> list[Path]:
    return [p for p in _temporaries(out) if p.name.endswith(".incomplete")]


def _bytes_written(pid: int) -> int:
    """Bytes the process has passed to write/pwrite so far (Linux /proc/<pid>/io)."""
    try:
        with open(f"/proc/{pid}/io") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("wchar:"))
    except (OSError, StopIteration):
        return 0


def _kill_mid_write(src: Path, out: Path, *, min_written: float = 0.05, timeout: float = 120) -> Path:
    """Start marlin-convert, wait until its temporary holds real data, SIGKILL it.

    Returns:
        The temporary file it left behind.
    """
    code = "import sys; from converter.cli import main_convert; sys.argv[0] = 'marlin-convert'; main_convert()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(src), str(out), "--force", "--quiet"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + timeout
    try:
        while True:
            assert proc.poll() is None, f"converter finished before it could be killed: {proc.stderr.read()!r}"
            assert time.monotonic() < deadline, "no temporary file appeared"
            tmps = _writing(out)
            if tmps:
                # The file is allocated up front (fallocate), so its size and blocks say
                # nothing; the process's own write counter does.
                size = tmps[0].stat().st_size
                if size and _bytes_written(proc.pid) >= min_written * size:
                    break
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (tmp,) = _writing(out)
    return tmp


def _check_kill(tmp_path: Path, src: Path) -> None:
    out = tmp_path / "out" / "model.marlin.safetensors"
    out.parent.mkdir()
    out.write_bytes(OLD)
    before_src = _tree(src)
    tmp = _kill_mid_write(src, out)
    # No partial artifact at the target: the old file is intact, byte for byte.
    assert out.read_bytes() == OLD
    lock = out.parent / ".model.marlin.marlin-lock"  # the output's lock file; its lock died with the process
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(
        [out.name, lock.name, *(t.name for t in _temporaries(out))]
    )
    assert tmp in _temporaries(out)
    assert tmp.stat().st_size > len(OLD)  # it really was in the middle of a big write
    assert out.stat().st_size == len(OLD)
    assert _tree(src) == before_src
    # The next run (a new process) removes the dead writer's temporaries and completes.
    r = run_cli("marlin-convert", src, out, "--force", "--quiet")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]
    assert out.read_bytes()[:8] != OLD[:8]
    assert _tree(src) == before_src


def test_sigkill_mid_write_leaves_old_output_untouched(tmp_path: Path) -> None:
    """Small real version (~40 MB input) for the default run."""
    src = small_gptq(
        tmp_path / "src", hidden=1024, intermediate=4096, kv=256, blocks=2, vocab=4096, shards=2, group_size=128
    )
    _check_kill(tmp_path, src)


@pytest.mark.slow
def test_sigkill_mid_write_300mb(tmp_path: Path) -> None:
    src = small_gptq(
        tmp_path / "src", hidden=4096, intermediate=14336, kv=1024, blocks=2, vocab=8192, shards=3, group_size=128
    )
    assert sum(p.stat().st_size for p in src.glob("*.safetensors")) > 300e6
    _check_kill(tmp_path, src)


def test_failure_mid_write_removes_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception after some layers were written: temp deleted, old output intact."""
    src = small_gptq(tmp_path / "src")
    out = tmp_path / "model.marlin.safetensors"
    out.write_bytes(OLD)
    calls = []
    real = GptqSource.load_packed

    def flaky(self, layer, k0=0, k1=None):
        calls.append(layer.name)
        if len(calls) == 3:
            assert _temporaries(out), "the temporary should exist while writing"
            raise ConverterError("injected failure", path=self.path, tensor=layer.name)
        return real(self, layer, k0, k1)

    monkeypatch.setattr(GptqSource, "load_packed", flaky)
    with pytest.raises(ConverterError, match="injected failure"):
        convert(src, out, force=True)
    assert out.read_bytes() == OLD
    assert _temporaries(out) == []


def test_existing_output_needs_force(tmp_path: Path) -> None:
    src = small_gptq(tmp_path / "src")
    out = tmp_path / "model.marlin.safetensors"
    out.write_bytes(OLD)
    with pytest.raises(
        OutputExistsError, match=r"model.marlin.safetensors: output exists; pass --force to overwrite it"
    ):
        convert(src, out)
    assert out.read_bytes() == OLD


@pytest.mark.parametrize("how", ["same_path", "symlink", "hardlink"])
def test_never_writes_into_the_input(tmp_path: Path, how: str) -> None:
    src = small_gptq(tmp_path / "src")
    shard = next(src.glob("*.safetensors"))
    before = _tree(src)
    if how == "same_path":
        out = shard
    elif how == "symlink":
        out = tmp_path / "link.safetensors"
        out.symlink_to(shard)
    else:
        out = tmp_path / "hard.safetensors"
        os.link(shard, out)
    with pytest.raises(ConverterError, match=r"output would overwrite the input; choose another path"):
        convert(src, out, force=True)
    assert _tree(src) == before
    assert _temporaries(out) == [] and not list(src.glob("*.incomplete"))


def test_never_writes_into_a_tinyloop_input(tmp_path: Path) -> None:
    src = tmp_path / "m.tinyloop"
    src.write_bytes(SAMPLE.read_bytes())
    before = _sha(src)
    with pytest.raises(ConverterError, match=r"output would overwrite the input"):
        convert(src, src, force=True)
    assert _sha(src) == before


def test_stale_temporary_removed_but_live_one_kept(tmp_path: Path) -> None:
    out = tmp_path / "a.safetensors"
    stale = tmp_path / ".a.safetensors.dead1234.incomplete"
    stale.write_bytes(b"x" * 100)
    other = tmp_path / ".b.safetensors.dead1234.incomplete"  # another target's: not ours to touch
    other.write_bytes(b"y")
    with StreamingWriter(out, [("t", "U8", (4,))], header_reserve=256) as live:
        # A second writer to the same target starts while the first is alive.
        assert remove_stale_temporaries(out) == []  # the live one is locked
        assert live.tmp_path.exists() and not stale.exists()
        assert other.exists()
        live.write("t", __import__("numpy").arange(4, dtype="u1"))
        live.finish({"format": "pt"})
    assert out.exists() and not live.tmp_path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, other.name])


def test_output_folder_missing(tmp_path: Path) -> None:
    src = small_gptq(tmp_path / "src")
    with pytest.raises(ConverterError, match=r"nodir: output folder does not exist"):
        convert(src, tmp_path / "nodir" / "out.safetensors")


def test_write_back_starts_each_range_and_waits_beyond_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    import converter.atomic as atomic

    calls: list[tuple] = []
    monkeypatch.setattr(
        atomic.writeback, "_SYNC_FILE_RANGE", lambda fd, off, n, flags: calls.append(("sync", off, n, flags))
    )
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append(("drop", off, n, advice)))
    wait = atomic._SYNC_WAIT_BEFORE | atomic._SYNC_WRITE | atomic._SYNC_WAIT_AFTER
    wb = atomic.WriteBack(7, window=100)
    for off in (0, 60, 120):
        wb.wrote(off, 60)
    wb.wrote(500, 0)  # nothing written, nothing to do
    # Each range is started at once; once more than 100 bytes are in flight the oldest
    # are waited for (0 at 120 bytes, 60 at 120 again), and kept in the page cache.
    write = atomic._SYNC_WRITE
    assert calls == [
        ("sync", 0, 60, write),
        ("sync", 60, 60, write),
        ("sync", 0, 60, wait),
        ("sync", 120, 60, write),
        ("sync", 60, 60, wait),
    ]
    calls.clear()
    dropping = atomic.WriteBack(7, window=50, drop=True)
    dropping.wrote(0, 60)
    assert calls == [("sync", 0, 60, write), ("sync", 0, 60, wait), ("drop", 0, 60, os.POSIX_FADV_DONTNEED)]


def test_streaming_writer_starts_write_back_of_what_it_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import converter.atomic as atomic

    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(atomic.writeback, "_SYNC_FILE_RANGE", lambda fd, off, n, flags: calls.append((off, n, flags)))
    with StreamingWriter(tmp_path / "o.safetensors", [("t", "I32", (4, 8))], header_reserve=120) as w:
        w.write("t", np.arange(16, dtype=np.int32).reshape(2, 8), 2)
        assert calls == [(w.data_start + 64, 64, atomic._SYNC_WRITE)]
        w.finish({})


@pytest.mark.parametrize("dropped", [False, True])
def test_streaming_writer_waits_only_for_an_output_it_drops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dropped: bool
) -> None:
    """An output that stays cached only has its ranges started (the kernel's dirty limits
    and the final fsync do the rest); one larger than the cache budget is waited for
    beyond the window and dropped behind it."""
    import converter.atomic as atomic
    import converter.safetensors_io as sio

    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(atomic.writeback, "_SYNC_FILE_RANGE", lambda fd, off, n, flags: calls.append((off, n, flags)))
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, -1)))
    monkeypatch.setattr(sio.writer, "WRITEBACK_WINDOW", 100)
    monkeypatch.setattr(sio.writer, "_cache_budget", lambda: 0 if dropped else 1 << 40)
    with StreamingWriter(tmp_path / "o.safetensors", [("t", "I32", (4, 16))], header_reserve=120) as w:
        for row in range(4):
            w.write("t", np.full((1, 16), row, dtype=np.int32), row)
        start = w.data_start
        w.finish({})
    write = atomic._SYNC_WRITE
    wait = atomic._SYNC_WAIT_BEFORE | atomic._SYNC_WRITE | atomic._SYNC_WAIT_AFTER
    started = [(start + 64 * r, 64, write) for r in range(4)]
    if not dropped:
        assert calls == started
    else:  # 128 bytes in flight after the second row: the oldest row is waited for and dropped
        assert calls == [
            started[0],
            started[1],
            (start, 64, wait),
            (start, 64, -1),
            started[2],
            (start + 64, 64, wait),
            (start + 64, 64, -1),
            started[3],
            (start + 128, 64, wait),
            (start + 128, 64, -1),
        ]
    assert (tmp_path / "o.safetensors").exists()


def test_interrupts_deferred_holds_a_signal_until_the_block_ends() -> None:
    """SIGINT inside the block changes nothing there; the previous handler (here
    Python's, KeyboardInterrupt) acts once it ends, and the handlers are restored."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # a handler would have run by now
            reached.append(True)
    assert reached == [True]
    assert {s: signal.getsignal(s) for s in before} == before
    with interrupts_deferred():  # no signal: nothing happens on the way out
        pass


def test_interrupts_deferred_lets_a_failure_stand_and_skips_ignored_signals() -> None:
    """An error from the block is what propagates (the held signal is dropped: the
    command ends anyway); a held signal whose handler was SIG_IGN is skipped and the next
    one acted on."""
    with pytest.raises(ValueError, match="commit failed"):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            raise ValueError("commit failed")
    seen = []
    old_hup, old_term = signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old_hup)
        signal.signal(signal.SIGTERM, old_term)


# --------------------------------------------------------------------------- long output names (issue 42)


@pytest.mark.parametrize("length", [210, 231, 243, 255])
@pytest.mark.parametrize("sharded", [False, True])
def test_every_legal_output_name_gets_a_legal_temporary(tmp_path: Path, length: int, sharded: bool) -> None:
    """Temporaries are named by a hash of a long name: a 210-255-byte output works (before,
    the 46 bytes a staged temporary adds failed it, naming a hidden ``.staged`` file)."""
    from converter.atomic import STAGED_SUFFIX, TEMP_SUFFIX, temporary_name

    out = tmp_path / ("m" * (length - len(".safetensors")) + ".safetensors")
    staged = temporary_name(out, STAGED_SUFFIX)
    assert len(staged.name) <= 255 and len(temporary_name(staged, TEMP_SUFFIX).name) <= 255
    args = ["--max-shard-size", "300kB"] if sharded else []
    r = run_cli("marlin-convert", SAMPLE, out, "-q", *args)
    if not sharded or length <= 240:  # a shard is named 15 bytes longer
        assert r.returncode == 0, r.stderr
        art = out if not sharded else out.with_name(out.name + ".index.json")
        assert run_cli("marlin-verify", art, "--shapes").returncode == 0
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
        return
    # a shard's own name would be longer than 255 bytes: refused up front, by the user's path
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith(f"error: {out}: output name too long"), line
    assert ".staged" not in line and ".incomplete" not in line
    assert list(tmp_path.iterdir()) == []


def test_a_255_byte_single_file_error_never_names_an_index(tmp_path: Path) -> None:
    out = tmp_path / ("n" * 243 + ".safetensors")
    out.write_bytes(b"x")
    r = run_cli("marlin-convert", SAMPLE, out)
    assert r.returncode == 2 and "index.json" not in r.stderr and "--force" in r.stderr, r.stderr
    assert run_cli("marlin-convert", SAMPLE, out, "--force", "-q").returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_a_dead_writers_hashed_temporary_is_cleaned(tmp_path: Path) -> None:
    from converter.atomic import STAGED_SUFFIX, TEMP_SUFFIX, temporary_name

    out = tmp_path / ("k" * 243 + ".safetensors")
    staged = temporary_name(out, STAGED_SUFFIX)
    inner = temporary_name(staged, TEMP_SUFFIX)
    dead = temporary_name(out, TEMP_SUFFIX)
    for p in (staged, inner, dead):
        p.write_bytes(b"")
    os.utime(staged, (0, 0))
    assert sorted(remove_stale_temporaries(out)) == sorted([staged, inner, dead])
