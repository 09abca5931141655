"""The mutation fuzzer's parts: seed files, mutators, targets, one checked run.

Each example takes a valid seed file and applies 1-4 random mutations: byte and bit
flips, truncation, appended or inserted bytes, an "interesting" integer over the
length field, and structural JSON mutations of the header (and, for artifacts, of the
manifest inside it, re-sealing its checksum so the mutation reaches the deeper
checks): replace a value with an interesting one, delete or duplicate a key, deep
nesting.  The only exceptions allowed to escape a target are ``ConverterError`` and
its subclasses; anything else, or a run past the time limit (a hang), is a failure.

The mutators take a ``random.Random``: ``tests/test_fuzz.py`` drives them from
Hypothesis with a small CI budget, ``scripts/fuzz.py`` for 10^5+ examples.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import struct
import tempfile
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from converter.errors import ConverterError

from .paths import SAMPLE
from .synthetic_gptq import write_gptq

TARGETS = ("safetensors", "artifact", "tinyloop", "gptq_config")
INTERESTING_INTS = (
    0,
    1,
    -1,
    2,
    7,
    8,
    15,
    16,
    63,
    64,
    127,
    128,
    255,
    256,
    1023,
    4096,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63),
    10**30,
)
INTERESTING_VALUES: tuple[object, ...] = (
    *INTERESTING_INTS,
    0.5,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    "",
    "F7",
    "F16",
    "I32",
    "U8",
    "BF16",
    "gptq",
    "gptq_v2",
    "marlin",
    "1",
    "2",
    "-1",
    "\x00",
    "é",
    None,
    True,
    False,
    [],
    {},
    [0],
    [-1, 4],
    [2**62, 2**62],
    [0, 0],
    [0, 2**70],
    [0] * 70,
    [1] * 70,
    [2**31, 0],
    {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
)
MAX_JSON_NODES = 100_000  # size cap for the JSON walkers: never loop unbounded


class Hang(Exception):
    """An example ran past the per-example time limit."""


# -- seeds ------------------------------------------------------------------------------
def build_seeds(folder: Path) -> dict[str, Path]:
    """Deterministic valid inputs: a GPTQ folder, its converted artifact, the sample."""
    from converter.convert import convert

    gptq = folder / "gptq"
    write_gptq(gptq, hidden=128, intermediate=256, kv=64, blocks=1, vocab=64, shards=1, group_size=64, bias=True)
    art = folder / "seed.marlin.safetensors"
    convert(gptq, art, force=True)
    tl = folder / "seed.tinyloop"
    shutil.copyfile(SAMPLE, tl)
    cfg = folder / "seed.quantize_config.json"  # pristine: the target overwrites the folder's copy
    shutil.copyfile(gptq / "quantize_config.json", cfg)
    return {
        "safetensors": next(gptq.glob("*.safetensors")),
        "artifact": art,
        "tinyloop": tl,
        "gptq_config": cfg,
        "gptq_folder": gptq,
    }


# -- mutators ---------------------------------------------------------------------------
def _walk(node: object, depth: int = 0) -> Iterator[tuple[object, object]]:
    """(container, key) for every value in a JSON tree, capped in count and depth."""
    stack = [(node, 0)]
    seen = 0
    while stack and seen < MAX_JSON_NODES:
        cur, d = stack.pop()
        if d > 64:
            continue
        items = cur.items() if isinstance(cur, dict) else enumerate(cur) if isinstance(cur, list) else ()
        for k, v in items:
            seen += 1
            yield cur, k
            if isinstance(v, (dict, list)):
                stack.append((v, d + 1))


def mutate_json(obj: object, rnd: random.Random) -> object:
    """One structural mutation of a JSON value (in place where possible)."""
    slots = list(_walk(obj))
    if not slots:
        return rnd.choice(INTERESTING_VALUES)
    cont, key = rnd.choice(slots)
    op = rnd.randrange(6)
    if op == 0:
        cont[key] = rnd.choice(INTERESTING_VALUES)
    elif op == 1 and isinstance(cont, dict):
        del cont[key]
    elif op == 1 and isinstance(cont, list):
        cont.pop(key)
    elif op == 2 and isinstance(cont[key], int) and not isinstance(cont[key], bool):
        cont[key] = cont[key] + rnd.choice((-1, 1, -8, 8, 64, -64, 2**32, -(2**40)))
    elif op == 3 and isinstance(cont, dict):
        other = rnd.choice(list(cont))
        cont[key], cont[other] = cont[other], cont[key]
    elif op == 4:
        deep: object = 0
        for _ in range(rnd.choice((10, 500, 5000))):
            deep = [deep]
        cont[key] = deep
    else:
        v = cont[key]
        if isinstance(v, list) and v:
            cont[key] = v + v[: rnd.randrange(1, len(v) + 1)]
        elif isinstance(v, str):
            cont[key] = v[: rnd.randrange(len(v) + 1)] + rnd.choice(("", "x", "\ud800", "\n", '"'))
        else:
            cont[key] = rnd.choice(INTERESTING_VALUES)
    return obj


def _dumps(obj: object, rnd: random.Random) -> bytes:
    try:
        text = json.dumps(obj, separators=(",", ":"), allow_nan=True, ensure_ascii=rnd.random() < 0.5)
    except (RecursionError, ValueError):
        text = "[" * 10000
    return text.encode("utf-8", "surrogatepass")


def _dup_key(raw: bytes, rnd: random.Random) -> bytes:
    """Duplicate the first key of the top-level object (JSON allows it; we must not)."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return raw
    if not isinstance(obj, dict) or not obj:
        return raw
    k = rnd.choice(list(obj))
    first = json.dumps({k: obj[k]}, separators=(",", ":"))[1:-1]
    return raw.rstrip()[:-1] + b"," + first.encode() + b"}"


def _header_span(data: bytes, kind: str) -> tuple[int, int] | None:
    """(start, length) of the JSON header of a safetensors or .tinyloop file."""
    if kind == "tinyloop":
        if len(data) < 24:
            return None
        (n,) = struct.unpack_from("<Q", data, 16)
        return (24, n) if 24 + n <= len(data) else None
    if len(data) < 8:
        return None
    (n,) = struct.unpack_from("<Q", data, 0)
    return (8, n) if 8 + n <= len(data) else None


def _replace_header(data: bytes, kind: str, start: int, old_len: int, new: bytes, keep_len: bool) -> bytes:
    if keep_len and len(new) <= old_len:
        new = new + b" " * (old_len - len(new))
        return data[:start] + new + data[start + old_len :]
    len_at = 16 if kind == "tinyloop" else 0
    out = bytearray(data[:start] + new + data[start + old_len :])
    struct.pack_into("<Q", out, len_at, len(new))
    return bytes(out)


def mutate_header(data: bytes, kind: str, rnd: random.Random) -> bytes:
    span = _header_span(data, kind)
    if span is None:
        return mutate_bytes(data, rnd)
    start, n = span
    raw = data[start : start + n]
    if rnd.random() < 0.15:
        new = _dup_key(raw, rnd)
    else:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            return mutate_bytes(data, rnd)
        if kind == "artifact" and isinstance(obj, dict) and rnd.random() < 0.6:
            obj = _mutate_manifest(obj, rnd)
        else:
            obj = mutate_json(obj, rnd)
        new = _dumps(obj, rnd)
    return _replace_header(data, kind, start, n, new, keep_len=rnd.random() < 0.8)


def _mutate_manifest(header: dict, rnd: random.Random) -> dict:
    """Mutate the manifest inside ``__metadata__`` and re-seal its checksum."""
    from converter.artifact.manifest import checksum
    from converter.constants import META_MANIFEST, META_MANIFEST_CHECKSUM

    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not isinstance(meta.get(META_MANIFEST), str):
        return mutate_json(header, rnd)
    try:
        manifest = json.loads(meta[META_MANIFEST])
    except (ValueError, RecursionError):
        return header
    manifest = mutate_json(manifest, rnd)
    text = _dumps(manifest, rnd).decode("utf-8", "surrogatepass")
    meta[META_MANIFEST] = text
    if rnd.random() < 0.9:
        meta[META_MANIFEST_CHECKSUM] = checksum(text.encode("utf-8", "surrogatepass"))
    return header


def mutate_bytes(data: bytes, rnd: random.Random) -> bytes:
    b = bytearray(data)
    op = rnd.randrange(7)
    if not b:
        return bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(1, 32)))
    # bias positions towards the header, where the structure lives
    hot = min(len(b), 4096)
    pos = rnd.randrange(hot) if rnd.random() < 0.7 else rnd.randrange(len(b))
    if op == 0:
        b[pos] ^= rnd.randrange(1, 256)
    elif op == 1:
        b[pos] ^= 1 << rnd.randrange(8)
    elif op == 2:
        del b[rnd.randrange(len(b)) :]
    elif op == 3:
        b += bytes(rnd.getrandbits(8) for _ in range(rnd.choice((1, 3, 8, 64))))
    elif op == 4 and len(b) >= 8:
        at = rnd.choice((0, 16)) if len(b) >= 24 else 0
        struct.pack_into("<Q", b, at, rnd.choice(INTERESTING_INTS) % 2**64)
    elif op == 5:
        ins = bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(1, 16)))
        b[pos:pos] = ins
    else:  # also op 4 on a file shorter than a length field
        n = rnd.randrange(1, 9)
        b[pos : pos + n] = bytes(rnd.getrandbits(8) for _ in range(n))
    return bytes(b)


def mutate(data: bytes, kind: str, rnd: random.Random) -> bytes:
    """1-4 mutations, mixing structural JSON edits and raw byte edits."""
    for _ in range(rnd.randint(1, 4)):
        if kind == "gptq_config":
            if rnd.random() < 0.7:
                try:
                    data = _dumps(mutate_json(json.loads(data), rnd), rnd)
                    continue
                except (ValueError, RecursionError):
                    pass
            data = mutate_bytes(data, rnd)
        elif rnd.random() < 0.5:
            data = mutate_header(data, "artifact" if kind == "artifact" else kind, rnd)
        else:
            data = mutate_bytes(data, rnd)
    return data


# -- targets ----------------------------------------------------------------------------
def run_target(kind: str, path: Path, gptq_folder: Path | None = None) -> None:
    """Exercise one parser on ``path``; only ConverterError may escape."""
    if kind == "safetensors":
        from converter.safetensors_io import SafetensorsFile

        with SafetensorsFile(path) as f:
            for name in f.infos:
                a = f.array(name)
                bytes(f.raw(name)[:64])
                a.reshape(-1)[:4].tolist()
            f.release_pages()
    elif kind == "artifact":
        from converter.verify import verify

        verify(path, shapes_only=True)
    elif kind == "tinyloop":
        from converter.formats.tinyloop import TinyloopSource

        with TinyloopSource(path) as src:
            plan = src.plan()
            src.describe()
            for layer in [la for la in plan.layers if la.convertible][:3]:
                src.load_layer(layer)
            for info in plan.tensors[:3]:
                src.load_tensor(info.name)
    elif kind == "gptq_config":
        from converter.formats import open_source

        assert gptq_folder is not None
        with open_source(gptq_folder) as src:
            plan = src.plan()
            for layer in [la for la in plan.layers if la.convertible][:2]:
                src.load_layer(layer)
    else:
        raise ValueError(kind)


@contextlib.contextmanager
def time_limit(seconds: float):
    def on_alarm(signum, frame):
        raise Hang(f"example ran longer than {seconds:g} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def check_one(
    kind: str, data: bytes, workdir: Path, seeds: dict[str, Path], timeout: float = 20.0, stats: Counter | None = None
) -> str | None:
    """Write ``data`` as the target's input and run it.

    Returns:
        None (fine: accepted, or refused with our own error), else a failure description.
        ``stats`` (if given) counts ``accepted`` and ``refused``.
    """
    if kind == "gptq_config":
        folder = seeds["gptq_folder"]
        cfg = folder / "quantize_config.json"
        cfg.write_bytes(data)
        path, gptq_folder = cfg, folder
    else:
        suffix = {"tinyloop": ".tinyloop"}.get(kind, ".safetensors")
        fd, tmp = tempfile.mkstemp(suffix=suffix, dir=workdir)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        path, gptq_folder = Path(tmp), None
    try:
        with time_limit(timeout):
            run_target(kind, path, gptq_folder)
    except ConverterError:
        if stats is not None:
            stats["refused"] += 1
        return None
    except Hang as exc:
        return f"HANG: {exc}"
    except RecursionError:
        return "RecursionError:\n" + traceback.format_exc(limit=-6)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}\n" + traceback.format_exc(limit=-6)
    finally:
        if kind != "gptq_config":
            path.unlink(missing_ok=True)
    if stats is not None:
        stats["accepted"] += 1
    return None


def manifest_text(data: bytes) -> str:
    """The manifest string inside an artifact's header."""
    start, n = _header_span(data, "artifact")
    return json.loads(data[start : start + n])["__metadata__"]["marlin.manifest"]


def with_manifest(data: bytes, text: str, *, reseal: bool = True) -> bytes:
    """The artifact ``data`` with its manifest string replaced by ``text`` (and, with
    ``reseal``, its checksum updated, so that the manifest itself is what is tested)."""
    from converter.artifact.manifest import checksum

    start, n = _header_span(data, "artifact")
    header = json.loads(data[start : start + n])
    header["__metadata__"]["marlin.manifest"] = text
    if reseal:
        header["__metadata__"]["marlin.manifest_checksum"] = checksum(text.encode())
    # ensure_ascii: a lone surrogate in ``text`` is written as an escape
    return _replace_header(data, "artifact", start, n, json.dumps(header).encode(), keep_len=False)
