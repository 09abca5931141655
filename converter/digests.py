"""sha256 of the input files, on a thread of its own.

The manifest records every source file's sha256 (``source.files``), and ``marlin-verify
--against`` compares them.  Hashing a multi-GB checkpoint takes about a second per 1.5 GB
on one core, so :func:`converter.convert.convert` and :func:`converter.verify.verify`
(both as soon as the source is open; a failing check stops it) start a
:class:`FileDigests`, work meanwhile (the artifact header is sized with placeholder
digests of the final length), and read the real ones last.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path

from .errors import ConverterError
from .safetensors_io import drop_pages

#: Bytes hashed at a time (hashlib releases the GIL while it hashes them).
READ_CHUNK = 64 << 20
#: What stands in for a digest until it is known: the length of a sha256 hex digest.
PLACEHOLDER = "0" * 64


class FileDigests:
    """Hashes ``paths`` in order on one background thread.

    Args:
        paths: the files; a path named twice is hashed once.

    The thread reads each file through a map of its own and drops the pages of every
    block once hashed (``MADV_DONTNEED``), so at most one block (64 MiB) adds to the
    process's RSS.  :meth:`close` stops it early.
    """

    def __init__(self, paths: Iterable[Path]) -> None:
        self.paths = list(dict.fromkeys(Path(p) for p in paths))
        self._futures: dict[Path, Future[str]] = {p: Future() for p in self.paths}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="marlin-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for path in self.paths:
            fut = self._futures[path]
            try:
                digest = self._hash(path)
            except (OSError, ValueError) as exc:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                fut.set_exception(ConverterError(f"cannot read for sha256: {why}", path=path))
                continue
            if digest is None:
                fut.cancel()
            else:
                fut.set_result(digest)

    def _hash(self, path: Path) -> str | None:
        """sha256 of one file through a read-only map of its own, dropped block by block
        (no copy into a buffer, and no more than a block in RSS); None once stopped."""
        h = hashlib.sha256()
        with open(path, "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            if not size:
                return h.hexdigest()
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    for start in range(0, size, READ_CHUNK):
                        if self._stop.is_set():
                            return None
                        h.update(view[start : start + READ_CHUNK])
                        drop_pages(mm)
                finally:
                    view.release()
        return h.hexdigest()

    def placeholders(self) -> dict[Path, str]:
        """``{path: PLACEHOLDER}``: digests of the right length, for sizing."""
        return dict.fromkeys(self.paths, PLACEHOLDER)

    def result(self) -> dict[Path, str]:
        """``{path: sha256 hex}``, waiting for the thread as needed.

        Raises:
            ConverterError: a file could not be read.
        """
        return {p: f.result() for p, f in self._futures.items()}

    def close(self) -> None:
        """Stop hashing (what is left is not needed) and wait for the thread."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> FileDigests:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
