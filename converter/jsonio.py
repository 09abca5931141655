"""The one JSON policy for every file we parse from strangers.

Safetensors headers, the artifact manifest, HF configs and indexes, and ``.tinyloop``
headers all go through :func:`loads`, which accepts a document only when:

* it fits the size bound (``max_bytes``; callers that read a length field check it
  before allocating anything);
* its bytes are UTF-8 and every string is Unicode text: an escaped lone UTF-16
  surrogate (``"\\ud800"``) is refused, as serde_json, which the reference safetensors
  reader uses, refuses it;
* it is JSON, nested at most :data:`MAX_DEPTH` levels deep: deeper nesting is refused
  before any code that walks the value (``repr``, ``json.dumps``, the schema check) can
  exhaust the stack on it;
* no object repeats a key (Python's ``json`` would keep the last value silently);
* the top level is an object, where the caller needs one.

``NaN`` and ``Infinity`` are accepted by default, as Python's ``json`` (and therefore
transformers, which writes HF configs) accepts them; ``finite_numbers=True`` refuses
them and floats that overflow, for formats whose spec says numbers are finite.  What we
*write* is standard JSON: :func:`non_finite_path` finds a value that standard JSON
cannot hold before a source config is copied into an output.

:func:`read_object` reads regular files only: a FIFO would block the reader forever,
a device would never end.

Failures are :class:`JsonError`, a ``ValueError`` carrying the rule broken and where;
:meth:`JsonError.message` phrases it for a named document, and :func:`parse_object` /
:func:`read_object` turn it into the caller's :class:`~converter.errors.ConverterError`.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, NoReturn

from .errors import ConverterError, SourceFormatError

#: Bound for JSON files read whole (configs, indexes): far above any real config.
MAX_JSON_BYTES = 64 * 1024 * 1024
#: Bytes of a parser message kept in ours (a number token can be megabytes long).
_DETAIL_CHARS = 200
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
#: Bound on the walk that locates a duplicate key (only run once one was found).
_MAX_WALK = 1_000_000
#: Deepest nesting of arrays and objects accepted.  Real configs, indexes, headers and
#: manifests nest fewer than 10 levels; Python's parser itself gives up near 1000, and
#: code that walks a value that deep from inside a call stack can hit the recursion limit.
MAX_DEPTH = 64


class JsonRule(enum.Enum):
    """The rule of the policy a document broke."""

    TOO_LARGE = "too large"
    NOT_UTF8 = "not UTF-8"
    NOT_JSON = "not JSON"
    LONE_SURROGATE = "lone surrogate"
    NOT_OBJECT = "not an object"
    DUPLICATE_KEY = "duplicate key"


class JsonError(ValueError):
    """A document broke :mod:`converter.jsonio`'s policy.

    Attributes:
        rule: which rule.
        detail: the parser's own words (``NOT_JSON``), the decoder's reason
            (``NOT_UTF8``), the escaped surrogate (``LONE_SURROGATE``), the JSON type
            found (``NOT_OBJECT``), or the size (``TOO_LARGE``).
        offset: byte offset of the first bad byte (``NOT_UTF8``), else None.
        key: the repeated key (``DUPLICATE_KEY``), else None.
        where: JSON path (keys and indices) of the object that repeats ``key``.
        found: the Python type of a non-object top level (``NOT_OBJECT``).
        limit: the size bound (``TOO_LARGE``).
    """

    def __init__(
        self,
        rule: JsonRule,
        detail: str,
        *,
        offset: int | None = None,
        key: str | None = None,
        where: tuple[str | int, ...] = (),
        found: type | None = None,
        limit: int | None = None,
    ) -> None:
        super().__init__(f"{rule.value}: {detail}")
        self.rule, self.detail, self.offset, self.key = rule, detail, offset, key
        self.where, self.found, self.limit = where, found, limit

    def message(self, what: str) -> str:
        """One line naming the document (``what``, e.g. "safetensors header") and the rule."""
        if self.rule is JsonRule.TOO_LARGE:
            return f"{self.detail} bytes is too large for a {what} (limit {self.limit})"
        if self.rule is JsonRule.NOT_UTF8:
            return f"{what} is not valid UTF-8 ({self.detail} at byte {self.offset})"
        if self.rule is JsonRule.LONE_SURROGATE:
            return f"{what} JSON escapes a lone UTF-16 surrogate: {self.detail}"
        if self.rule is JsonRule.NOT_OBJECT:
            return f"{what} must be a JSON object, found {self.found.__name__ if self.found else self.detail}"
        if self.rule is JsonRule.DUPLICATE_KEY:
            return f"{what} is not valid JSON: duplicate key {self.key!r}"
        return f"{what} is not valid JSON: {self.detail}"


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type ("object", "array", "integer", ...)."""
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _reject_constant(token: str) -> NoReturn:
    raise ValueError(f"non-standard JSON constant {token}")


def _finite_float(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"number {token[:40]} overflows a float")
    return value


def loads(
    data: bytes | str, *, object_required: bool = False, finite_numbers: bool = False, max_bytes: int = MAX_JSON_BYTES
) -> Any:
    """Parse one JSON document under the policy in the module docstring.

    Args:
        data: the document's bytes (UTF-8), or text already decoded from a checked
            container (the manifest string inside a safetensors header).
        object_required: the top level must be an object.
        finite_numbers: refuse ``NaN``, ``Infinity`` and floats that overflow.
        max_bytes: refuse longer documents.

    Returns:
        The parsed value (a dict when ``object_required``).

    Raises:
        JsonError: the rule broken, checked in this order: size, UTF-8 (for text: no
            raw lone surrogate), JSON syntax (and finite numbers), escaped lone
            surrogates, top-level object, duplicate keys.
    """
    if len(data) > max_bytes:
        raise JsonError(JsonRule.TOO_LARGE, str(len(data)), limit=max_bytes)
    if isinstance(data, str):
        text = data
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a raw lone surrogate: not Unicode text
            raise JsonError(JsonRule.LONE_SURROGATE, ascii(text[exc.start : exc.end])) from None
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonError(JsonRule.NOT_UTF8, exc.reason, offset=exc.start) from None
    duplicates: list[tuple[int, str]] = []

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in pairs:
            if key in obj and not duplicates:
                duplicates.append((id(obj), key))
            obj[key] = value
        return obj

    strict = {"parse_constant": _reject_constant, "parse_float": _finite_float} if finite_numbers else {}
    try:
        value = json.loads(text, object_pairs_hook=pairs_hook, **strict)
    except RecursionError:
        raise JsonError(JsonRule.NOT_JSON, "nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, the hooks, int digit limits
        raise JsonError(JsonRule.NOT_JSON, str(exc)[:_DETAIL_CHARS]) from None
    # Fewer brackets than the bound cannot nest past it: the walk runs only when needed.
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(value) > MAX_DEPTH:
        raise JsonError(JsonRule.NOT_JSON, f"nested more than {MAX_DEPTH} levels deep")
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise JsonError(JsonRule.LONE_SURROGATE, ascii(exc.object[exc.start : exc.end])) from None
    if object_required and not isinstance(value, dict):
        raise JsonError(JsonRule.NOT_OBJECT, json_type(value), found=type(value))
    if duplicates:
        obj_id, key = duplicates[0]
        raise JsonError(JsonRule.DUPLICATE_KEY, key, key=key, where=_path_to(value, obj_id))
    return value


def _depth(root: Any) -> int:
    """Nesting depth of arrays and objects (1 for a flat object), walked without recursion;
    stops as soon as it passes :data:`MAX_DEPTH`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            break
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def non_finite_path(value: Any) -> str | None:
    """The JSON path (``a.b[3]``) of the first NaN or infinite number in a parsed
    value, or None when standard JSON can hold all of it (``json.dumps(allow_nan=False)``)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return where or "(root)"
        if isinstance(node, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(node))))
    return None


def _path_to(root: Any, target: int) -> tuple[str | int, ...]:
    """JSON path of the container whose ``id`` is ``target`` (``()`` for the root)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(root, ())]
    seen = 0
    while stack and seen < _MAX_WALK:
        node, path = stack.pop()
        seen += 1
        if id(node) == target:
            return path
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend((child, (*path, key)) for key, child in items if isinstance(child, (dict, list)))
    return ()


def parse_object(
    raw: bytes | str,
    *,
    path: str | Path,
    what: str,
    error: type[ConverterError] = SourceFormatError,
    max_bytes: int = MAX_JSON_BYTES,
) -> dict[str, Any]:
    """:func:`loads` a document that must be an object, raising the caller's error.

    Raises:
        error (default SourceFormatError): any rule of the policy, as
            :meth:`JsonError.message` phrases it for ``what``, naming ``path``.
    """
    try:
        return loads(raw, object_required=True, max_bytes=max_bytes)
    except JsonError as exc:
        raise error(exc.message(what), path=path) from None


def read_object(
    path: Path, *, what: str, error: type[ConverterError], max_bytes: int = MAX_JSON_BYTES
) -> dict[str, Any]:
    """Read a whole JSON file that must hold an object (configs, indexes).

    The file must be a regular file (opened without blocking, so a FIFO is refused
    instead of waited on), and its size is checked from ``fstat`` before anything is read.

    Raises:
        error: unreadable, not a regular file, too large, or any rule of the policy
            (naming ``path``).
    """
    return parse_object(
        read_regular_file(path, what=what, error=error, max_bytes=max_bytes),
        path=path,
        what=what,
        error=error,
        max_bytes=max_bytes,
    )


def read_regular_file(path: Path, *, what: str, error: type[ConverterError], max_bytes: int) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``.

    Raises:
        error: the file cannot be opened, is not a regular file (a FIFO, device, socket
            or folder), or is larger than ``max_bytes``.
    """
    try:
        # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"cannot read: {exc.strerror}", path=path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{not_regular(st.st_mode)}; refusing to read it as a {what}", path=path)
        if st.st_size > max_bytes:
            raise error(JsonError(JsonRule.TOO_LARGE, str(st.st_size), limit=max_bytes).message(what), path=path)
        chunks, total = [], 0
        while block := os.read(fd, 1 << 20):
            chunks.append(block)
            total += len(block)
            if total > max_bytes:  # it grew while being read
                raise error(JsonError(JsonRule.TOO_LARGE, str(total), limit=max_bytes).message(what), path=path)
        return b"".join(chunks)
    except OSError as exc:
        raise error(f"cannot read: {exc.strerror}", path=path) from None
    finally:
        os.close(fd)


def not_regular(mode: int) -> str:
    """What a non-regular file is, for a message: "a directory", "a FIFO", ..."""
    if stat.S_ISDIR(mode):
        return "a directory, not a file"
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"not a regular file ({kind})"


def inside_folder(real: Path, root: Path) -> bool:
    """Whether the resolved path ``real`` lies in the resolved folder ``root``, or, for a
    hub cache snapshot (``models--org--name/snapshots/<rev>/file -> ../../blobs/<hash>``),
    in its ``blobs``: where a folder's symbolic links may lead."""
    if real.is_relative_to(root):
        return True
    return root.parent.name == "snapshots" and real.is_relative_to(root.parent.parent / "blobs")


def link_out_of(path: Path, folder: Path) -> Path | None:
    """Where ``path`` leads when it is a symbolic link that leaves ``folder``
    (:func:`inside_folder`), else None."""
    if not os.path.islink(path):
        return None
    real = Path(os.path.realpath(path))
    return None if inside_folder(real, Path(os.path.realpath(folder))) else real
