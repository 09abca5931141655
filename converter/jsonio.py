"""The one JSON policy for every file we parse from strangers.

Safetensors headers, the artifact manifest, HF configs and indexes, and ``.tinyloop``
headers all go through :func:`loads`, which accepts a document only when:

* it fits the size bound (``max_bytes``; callers that read a length field check it
  before allocating anything);
* its bytes are UTF-8 and every string is Unicode text: an escaped lone UTF-16
  surrogate (``"\\ud800"``) is refused, as serde_json, which the reference safetensors
  reader uses, refuses it;
* it is JSON: nesting deep enough to exhaust the parser is refused, not a crash;
* no object repeats a key (Python's ``json`` would keep the last value silently);
* the top level is an object, where the caller needs one.

``NaN`` and ``Infinity`` are accepted by default, as Python's ``json`` (and therefore
transformers, which writes HF configs) accepts them; ``finite_numbers=True`` refuses
them and floats that overflow, for formats whose spec says numbers are finite.

Failures are :class:`JsonError`, a ``ValueError`` carrying the rule broken and where;
:meth:`JsonError.message` phrases it for a named document, and :func:`parse_object` /
:func:`read_object` turn it into the caller's :class:`~converter.errors.ConverterError`.
"""

from __future__ import annotations

import enum
import json
import math
import re
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

    The size is checked from ``stat`` before anything is read.

    Raises:
        error: unreadable, too large, or any rule of the policy (naming ``path``).
    """
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(JsonError(JsonRule.TOO_LARGE, str(size), limit=max_bytes).message(what), path=path)
        raw = path.read_bytes()
    except OSError as exc:
        raise error(f"cannot read: {exc.strerror}", path=path) from None
    return parse_object(raw, path=path, what=what, error=error, max_bytes=max_bytes)
