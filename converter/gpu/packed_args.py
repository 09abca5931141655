"""Kernel arguments laid out once for ``cuLaunchKernel`` (:func:`pack_args`): a serving
call then patches only the addresses that change and launches without building an
argument tuple, which is most of an eager call's host time."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from ..errors import KernelError

#: Alignment of a tensor-map argument (the driver's CUtensorMap is 64-byte aligned).
_MAP_ALIGN = 64


class Slot(NamedTuple):
    """A placeholder in a :class:`KernelCall`'s arguments for a value that changes from
    call to call (:func:`pack_args`): a device address patched into the packed buffer,
    or, with ``by_ref``, an argument whose ``kernelParams`` pointer itself is patched to
    point at bytes held elsewhere (a tensor map)."""

    name: str
    by_ref: bool = False


@dataclasses.dataclass(frozen=True)
class PackedArgs:
    """Kernel arguments laid out for ``cuLaunchKernel``'s ``kernelParams``.

    Attributes:
        buf: every argument's value at its natural alignment (uint8; 64-byte aligned
            start, a whole number of 8-byte words).
        words: ``buf`` as uint64, where an address slot is patched (``words[offset // 8]``).
        params: one uint64 address per argument, into ``buf`` (what ``kernelParams``
            points at); a ``by_ref`` slot's entry is patched instead.
        slots: slot name -> (argument index, byte offset in ``buf``).
    """

    buf: np.ndarray
    words: np.ndarray
    params: np.ndarray
    slots: dict[str, tuple[int, int]]

    @property
    def params_ptr(self) -> int:
        """The host address to pass as ``kernelParams``."""
        return int(self.params.ctypes.data)


def pack_args(args: tuple[Any, ...], maps: tuple[Any, ...] = ()) -> PackedArgs:
    """Lay out a :class:`KernelCall`'s arguments once, for launches that only patch
    their :class:`Slot` values (pure host work; no GPU).

    The driver copies each argument's bytes from where ``kernelParams`` points when the
    launch call is made, so the buffers may be patched again as soon as it returns.

    Args:
        args: NumPy scalars (``np.uint64`` addresses, ``np.int32`` sizes), :class:`Slot`
            placeholders, and tensor-map arguments (the ``arg`` of one of ``maps``).
        maps: the :class:`~converter.gpu.tensormap.TensorMapArg` objects whose ``arg``
            may appear in ``args``; their 128 bytes are copied in.

    Returns:
        The :class:`PackedArgs` (slots zero until patched).

    Raises:
        KernelError: an argument of another kind (a CuPy array, a Python int, None).
    """
    raws = {id(m.arg): m.raw for m in maps}
    pieces: list[tuple[int, np.ndarray]] = []
    slots: dict[str, tuple[int, int]] = {}
    end = 0
    for i, a in enumerate(args):
        if isinstance(a, Slot):
            raw, align = np.zeros(8, dtype=np.uint8), 8
        elif isinstance(a, np.generic):
            raw, align = np.frombuffer(a.tobytes(), dtype=np.uint8), a.itemsize
        elif id(a) in raws:
            raw, align = raws[id(a)].view(np.uint8), _MAP_ALIGN
        else:
            raise KernelError(f"argument {i} ({type(a).__name__}) cannot be packed", tensor="args")
        off = -(-end // align) * align
        pieces.append((off, raw))
        if isinstance(a, Slot):
            slots[a.name] = (i, off)
        end = off + raw.size
    total = -(-max(end, 8) // 8) * 8
    base = np.zeros(total + _MAP_ALIGN, dtype=np.uint8)
    shift = -base.ctypes.data % _MAP_ALIGN
    buf = base[shift : shift + total]  # keeps base alive
    for off, raw in pieces:
        buf[off : off + raw.size] = raw
    params = np.array([buf.ctypes.data + off for off, _ in pieces], dtype=np.uint64)
    return PackedArgs(buf=buf, words=buf.view(np.uint64), params=params, slots=slots)
