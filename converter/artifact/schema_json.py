"""Manifest dataclasses to JSON and back: the stored form of a dataclass, and the reader
that checks every field's type against the dataclass as it builds it.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from functools import cache
from typing import Any, TypeVar, Union

from .. import jsonio
from ..constants import META_MANIFEST
from ..errors import ArtifactError

T = TypeVar("T")


def to_json(obj: Any) -> Any:
    """The JSON value of a manifest dataclass (fields in declaration order; a field with
    a default only when it differs from it), enum, tuple or plain value."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.default is not dataclasses.MISSING and value == f.default:
                continue
            out[f.name] = to_json(value)
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [to_json(v) for v in obj]
    return obj


class _Mismatch(Exception):
    """A JSON value that does not fit the dataclass field it is read into."""


def from_json(cls: type[T], value: Any, where: str = "") -> T:
    """Read a JSON object into dataclass ``cls``, checking every field's type.

    Integers written as integral floats (``128.0``) read as ints, as JSON Schema allows.

    Raises:
        ArtifactError: a field is missing, unknown or of the wrong type (naming its path).
    """
    try:
        return _read(cls, value, where)
    except _Mismatch as exc:
        raise ArtifactError(f"manifest does not fit its schema: {exc}", tensor=META_MANIFEST) from None


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _read(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch(f"{where or '(root)'}: expected an object, found {jsonio.json_type(value)}")
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise _Mismatch(f"{where or '(root)'}: unknown field {unknown[0]!r}")
        hints = _hints(tp)
        kwargs = {}
        for name, f in fields.items():
            at = f"{where}.{name}" if where else name
            if name in value:
                kwargs[name] = _read(hints[name], value[name], at)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Mismatch(f"{at}: required field is missing")
        return tp(**kwargs)
    if origin in (Union, types.UnionType):  # X | None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _read(args[0], value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise _Mismatch(f"{where}: expected an array, found {jsonio.json_type(value)}")
        (item, _) = typing.get_args(tp)
        return tuple(_read(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _, item = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _Mismatch(f"{where}: expected an object, found {jsonio.json_type(value)}")
        if item is not Any:
            for key, v in value.items():
                _read(item, v, f"{where}.{key}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise _Mismatch(f"{where}: {value!r} is not one of {[m.value for m in tp]}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise _Mismatch(f"{where}: expected a boolean, found {jsonio.json_type(value)}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise _Mismatch(f"{where}: expected an integer, found {jsonio.json_type(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _Mismatch(f"{where}: expected a string, found {jsonio.json_type(value)}")
        return value
    raise TypeError(f"no JSON reading for {tp!r}")  # a dataclass field of a type the schema has no form for
