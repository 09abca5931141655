"""Writer for ``.tinyloop`` v1 containers and a min-max quantizer that feeds it.

Used by ``scripts/make_sample.py`` and the tests; the layout rules are those of
``docs/spec/tinyloop-v1.md``, "Byte layout": little-endian preamble, UTF-8 JSON
header, zero padding to 64, tensors at 64-aligned offsets relative to ``data_start``,
and the file padded with zeros to a multiple of 64.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, Union

import numpy as np

from ..atomic import write_atomically
from ..constants import (
    TINYLOOP_ALIGNMENT,
    TINYLOOP_DTYPES,
    TINYLOOP_EXTRA_CHANNELS,
    TINYLOOP_MAGIC,
    TINYLOOP_PREAMBLE_FORMAT,
    TINYLOOP_PREAMBLE_SIZE,
    TINYLOOP_SUPPORTED_BITS,
    TINYLOOP_SUPPORTED_VERSIONS,
)

__all__ = ["TensorArg", "pack_codes", "quantize_linear_tinyloop", "write_tinyloop"]

#: A tensor to write: an array whose dtype implies the code, or ``(code, array)``;
#: bf16 must be given as ``("bf16", uint16 array of raw bits)``.
TensorArg = Union[np.ndarray, "tuple[str, np.ndarray]"]

# numpy dtype -> .tinyloop code, for arrays given without an explicit code.
_IMPLIED_CODES = {np.dtype(storage): code for code, (storage, _) in TINYLOOP_DTYPES.items() if code != "bf16"}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _normalise(name: str, value: TensorArg) -> tuple[str, np.ndarray]:
    if isinstance(value, tuple):
        code, arr = value
        if code not in TINYLOOP_DTYPES:
            raise ValueError(f"tensor {name!r}: unknown dtype code {code!r}, expected one of {sorted(TINYLOOP_DTYPES)}")
        arr = np.asarray(arr)
        storage = np.dtype(TINYLOOP_DTYPES[code][0])
        if (arr.dtype.kind, arr.dtype.itemsize) != (storage.kind, storage.itemsize):
            raise ValueError(f"tensor {name!r}: dtype code {code!r} needs a {storage} array, got {arr.dtype}")
    else:
        arr = np.asarray(value)
        key = arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype
        if key not in _IMPLIED_CODES:
            raise ValueError(
                f"tensor {name!r}: numpy dtype {arr.dtype} has no .tinyloop code; "
                "pass (code, array), e.g. ('bf16', uint16 bits)"
            )
        code, storage = _IMPLIED_CODES[key], key
    # Little-endian, C order: exactly the bytes the spec lays out.
    return code, np.ascontiguousarray(arr, dtype=storage.newbyteorder("<") if storage.itemsize > 1 else storage)


def write_tinyloop(
    path: str | Path,
    model: Mapping[str, Any],
    tensors: Mapping[str, TensorArg],
    linears: Mapping[str, Mapping[str, Any]],
    *,
    check: bool = True,
) -> Path:
    """Write a ``.tinyloop`` v1 file atomically.

    Tensors are laid out in the order given, each at the next multiple of 64 after
    the previous one (spec, "Byte layout"), with zero bytes in every gap and after
    the last tensor up to a multiple of 64.  The header is compact JSON, keys in the
    order given, so the same arguments always give the same bytes.

    Args:
        path: destination; written as a temporary file in the same folder, fsynced,
            then renamed over ``path`` (:func:`converter.atomic.write_atomically`).
        model: free-form hyper-parameters (the header's ``model`` object).
        tensors: ``{name: array}`` or ``{name: (code, array)}``; codes as in
            ``TINYLOOP_DTYPES`` (``u8 i8 i32 f16 bf16 f32``); bf16 only as
            ``("bf16", uint16 raw bits)``.
        linears: the header's ``linears`` object, written as given.
        check: re-open the temporary file with
            :class:`~converter.formats.tinyloop.TinyloopSource` and plan it before the
            rename, so a file that breaks the spec never appears at ``path``.  The
            tests pass False to build malformed files on purpose.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: a tensor's dtype has no ``.tinyloop`` code or disagrees with its
            code; ``model``/``linears`` are not JSON-serialisable (or hold NaN).
        SourceFormatError, UnsupportedQuantError: with ``check``, the result breaks the
            spec (e.g. a linear naming a missing tensor).
        OSError: the file cannot be written.
    """
    path = Path(path)
    arrays = {name: _normalise(name, value) for name, value in tensors.items()}
    table: dict[str, dict[str, Any]] = {}
    cursor = 0
    for name, (code, arr) in arrays.items():
        table[name] = {"dtype": code, "shape": [int(d) for d in arr.shape], "offset": cursor, "nbytes": arr.nbytes}
        cursor = _round_up(cursor + arr.nbytes, TINYLOOP_ALIGNMENT)
    header = {"model": dict(model), "tensors": table, "linears": {k: dict(v) for k, v in linears.items()}}
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    preamble = struct.pack(
        TINYLOOP_PREAMBLE_FORMAT, TINYLOOP_MAGIC, TINYLOOP_SUPPORTED_VERSIONS[-1], 0, len(header_bytes)
    )
    data_start = _round_up(TINYLOOP_PREAMBLE_SIZE + len(header_bytes), TINYLOOP_ALIGNMENT)

    def write(fh: BinaryIO) -> None:
        fh.write(preamble)
        fh.write(header_bytes)
        fh.write(b"\0" * (data_start - TINYLOOP_PREAMBLE_SIZE - len(header_bytes)))
        pos = 0
        for name, (_, arr) in arrays.items():
            fh.write(b"\0" * (table[name]["offset"] - pos))
            fh.write(arr.reshape(-1).view(np.uint8).data)
            pos = table[name]["offset"] + arr.nbytes
        fh.write(b"\0" * (_round_up(pos, TINYLOOP_ALIGNMENT) - pos))

    def plan_it(tmp: Path) -> None:
        from .tinyloop import TinyloopSource

        with TinyloopSource(tmp) as src:
            src.plan()

    return write_atomically(path, write, check=plan_it if check else None)


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes into a ``.tinyloop`` ``qweight`` (spec, "Codes and weights").

    Args:
        q: integer ``(K, N)`` codes in ``[0, 2**bits - 1]``, ``K * bits % 8 == 0``.
        bits: 2 or 4.

    Returns:
        uint8 ``(N, K * bits // 8)``: row ``k`` of column ``n`` sits in byte
        ``[n, k // (8 // bits)]`` at bit ``bits * (k % (8 // bits))``.

    Raises:
        ValueError: bad ``bits``, shape, or a code out of range.
    """
    if bits not in TINYLOOP_SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {TINYLOOP_SUPPORTED_BITS}, got {bits}")
    q = np.asarray(q)
    if q.ndim != 2 or (q.shape[0] * bits) % 8:
        raise ValueError(f"codes must be (K, N) with K * bits % 8 == 0, got {q.shape} at {bits} bits")
    if q.size and (int(q.min()) < 0 or int(q.max()) >= 1 << bits):
        raise ValueError(f"codes must be in [0, {(1 << bits) - 1}], found [{int(q.min())}, {int(q.max())}]")
    per_byte = 8 // bits
    size_k, size_n = q.shape
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    lanes = q.T.astype(np.uint8).reshape(size_n, size_k // per_byte, per_byte) << shifts
    return np.ascontiguousarray(np.bitwise_or.reduce(lanes, axis=-1).astype(np.uint8))


def quantize_linear_tinyloop(
    name: str,
    w: np.ndarray,
    bits: int,
    group_size: int,
    rng: np.random.Generator,
    *,
    bias: np.ndarray | None = None,
    symmetric: bool = False,
    exact_int4: bool = False,
    channels: tuple[str, ...] = (),
) -> tuple[dict[str, TensorArg], dict[str, Any]]:
    """Min-max quantize one weight into ``.tinyloop`` tensors and a LINEAR entry.

    Per group ``g`` and column ``n`` (rows ``[g*G, (g+1)*G)``): asymmetric gives
    ``scale = (max - min) / (2**bits - 1)``, ``zero = min``; symmetric gives
    ``scale = max|w| / (2**(bits-1) - 1)`` and ``zero = -2**(bits-1) * scale`` (so a
    4-bit layer has ``delta = zero + 8 * scale == 0`` exactly).  Scale and zero are
    rounded to float16 first, and the codes ``q = clip(round((w - zero) / scale))`` are
    computed from those float16 values in float32, so ``W ~= q * scale + zero`` holds
    for what is actually stored (spec, "Codes and weights").

    Args:
        name: the linear's name; tensors are ``{name}.qweight``, ``.scale``, ``.zero``,
            ``.bias`` and ``.{channel}``.
        w: float32 ``(K, N)`` weight in the ``y = x @ W`` orientation.
        bits: 2 or 4.
        group_size: ``G``, divides ``K``; ``G == K`` is per-row quantization.
        rng: fills the extra channels (their content is opaque to this tool).
        bias: optional ``(N,)``, stored as float16.
        symmetric: use the symmetric scheme above.
        exact_int4: set the LINEAR's ``exact_int4`` flag.
        channels: extra ``u8`` channels to add, from ``("frac4", "sign_bit")``:
            ``frac4`` is ``(N, K // 2)`` (a nibble per weight), ``sign_bit`` is
            ``(N, ceil(K / 8))`` (a bit per weight).

    Returns:
        ``(tensors, linear)``: arguments for :func:`write_tinyloop`.

    Raises:
        ValueError: bad shapes, bits, group size or channel name, or a scale/zero that
            does not fit float16.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"w must be (K, N), got shape {w.shape}")
    size_k, size_n = w.shape
    if bits not in TINYLOOP_SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {TINYLOOP_SUPPORTED_BITS}, got {bits}")
    if group_size <= 0 or size_k % group_size:
        raise ValueError(f"group_size {group_size} must divide K = {size_k}")
    unknown = set(channels) - set(TINYLOOP_EXTRA_CHANNELS)
    if unknown:
        raise ValueError(f"unknown channels {sorted(unknown)}; expected some of {TINYLOOP_EXTRA_CHANNELS}")
    qmax = (1 << bits) - 1
    wg = w.reshape(size_k // group_size, group_size, size_n)
    with np.errstate(over="ignore"):
        if symmetric:
            half = 1 << (bits - 1)
            scale = (np.abs(wg).max(axis=1) / np.float32(half - 1)).astype(np.float16)
            zero = (np.float16(-half) * scale).astype(np.float16)
        else:
            lo, hi = wg.min(axis=1), wg.max(axis=1)
            scale = ((hi - lo) / np.float32(qmax)).astype(np.float16)
            zero = lo.astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(zero).all()):
        raise ValueError(f"linear {name!r}: scale or zero overflows float16")
    s32, z32 = scale.astype(np.float32)[:, None, :], zero.astype(np.float32)[:, None, :]
    # A constant group has scale 0: any code reproduces it, so divide by 1 instead.
    q = np.rint((wg - z32) / np.where(s32 == 0, np.float32(1), s32))
    q = np.clip(q, 0, qmax).astype(np.uint8).reshape(size_k, size_n)

    tensors: dict[str, TensorArg] = {
        f"{name}.qweight": pack_codes(q, bits),
        f"{name}.scale": scale,
        f"{name}.zero": zero,
    }
    linear: dict[str, Any] = {
        "bits": bits,
        "in_features": size_k,
        "out_features": size_n,
        "group_size": group_size,
        "qweight": f"{name}.qweight",
        "scale": f"{name}.scale",
        "zero": f"{name}.zero",
    }
    if bias is not None:
        tensors[f"{name}.bias"] = np.asarray(bias, dtype=np.float16).reshape(size_n)
        linear["bias"] = f"{name}.bias"
    if exact_int4:
        linear["exact_int4"] = True
    for ch in channels:
        width = size_k // 2 if ch == "frac4" else -(-size_k // 8)
        tensors[f"{name}.{ch}"] = rng.integers(0, 256, size=(size_n, width), dtype=np.uint8)
        linear[ch] = f"{name}.{ch}"
    return tensors, linear
