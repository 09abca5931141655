"""``marlin-verify OUTDIR --model --against SRC``: does the converted model give the
same answers as its source?

Three models run on the same tokens, one after another (each freed before the next):

1. the converted model (:func:`~converter.model.loader.build_converted`: our kernel on
   the GPU, the exact path on the CPU). While it runs, a hook on every swapped layer
   compares its output, on the model's own activations, with the *source* layer in fp32
   and with an fp16 linear of the same dequantized weight; and every pass-through
   tensor it loaded is compared with the source's (dtype and bytes);
2. the fp32 reference dequantized from the source (:mod:`~converter.model.reference`);
3. the fp16-dequantized reference (what fp16 weights themselves cost).

Pass rule: the converted model's mean relative error against fp32 is at most 1.5x the
fp16 reference's, its top-1 agreement (logits only) *at decided positions* at least the
fp16 reference's there minus 0.5 % (:func:`top1_verdict`), no layer is far off (below),
and nothing structural is wrong (a parameter the artifact does not feed, a tensor in
another dtype or with other bytes than the source's).

Why top-1 is judged at decided positions only: top-1 agreement over every position is
decided by near-ties. On a real 135M model (512 tokens of text) a perfect conversion,
exactly as close to fp32 as fp16 is (mean relative error 2.42e-3 against fp16's
2.43e-3), disagreed with fp32 at 4 positions and fp16 at 1: both are rounding noise at
positions whose two best tokens are closer than that noise, and the old bar (fp16's
agreement minus 0.5 %) failed it. A position is *decided* when fp32's top-1 minus top-2
logit exceeds ``DECIDED_FACTOR`` x the fp16 reference's largest logit error at that
position: no perturbation as large as the one fp16 rounding itself causes there, not
even ``ERROR_FACTOR`` times it, can flip its top-1 (a flip needs the two logits to
move by the margin between them together). The bound comes from the fp16 reference,
never from the model judged, so a broken model cannot widen its own excuse; a wrong
delta, perm or bias moves logits by far more than fp16 rounding and flips decided
positions (and fails the mean-error and per-layer rules too). A deterministic bound
was preferred to a statistical one (a binomial test on flips) because it needs no
assumption about how flips are distributed and means the same at 64 positions as at
512.

The whole run is offline and code-free (:mod:`converter.model.guard`): offline mode is
forced, the socket layer refuses every connection, the tokenizer is loaded with
``trust_remote_code=False`` after its ``tokenizer_config.json`` is checked for remote
code, and ``--text`` is read only as far as the token budget needs.

A layer is far off when its error is above ``LAYER_FACTOR`` x the fp16 linear's and
above ``LAYER_FLOOR``: a wrong ``delta``, ``perm`` or bias is off by tens of percent,
the kernel's own fp16 rounding by about 1.5x fp16's.

Peak memory: one copy of the model in fp32 (the fp32 reference, built in place) plus
the artifact's and the source's memory maps; the converted model (4-bit codes, the
pass-through tensors) is freed before it, and the per-layer checks dequantize one
layer at a time.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import inspect
import math
import resource
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..artifact.problems import ProblemCode
from ..errors import ConverterError, GpuUnavailableError
from . import ModelError
from .build import CAUSAL_LM, import_stack, quiet_transformers
from .guard import check_config, offline
from .loader import KernelFactory, build_converted, dequantized_weight, read_converted_config, resolve_device
from .report import ModelReport

P = ProblemCode

#: The converted model may cost this many times the fp16-dequantized model's error.
ERROR_FACTOR = 1.5
#: ... and lose at most this share of top-1 agreement against fp16's, at decided positions.
TOP1_MARGIN = 0.005
#: A position is decided when fp32's top-1 minus top-2 logit exceeds this many times the
#: fp16 reference's largest logit error there: ``2 * ERROR_FACTOR`` (a flip needs the two
#: logits to close the margin between them, each moving by up to ERROR_FACTOR x fp16's).
DECIDED_FACTOR = 2 * ERROR_FACTOR
#: A layer is flagged above this many times the fp16 linear's error and above LAYER_FLOOR.
LAYER_FACTOR = 4.0
LAYER_FLOOR = 5e-3
#: The fixed input when no --text is given: this many sequences of this many tokens
#: (fewer when max_position_embeddings is smaller), ids uniform over the vocabulary, seed 0.
FIXED_SEQUENCES, FIXED_TOKENS = 4, 128
#: --text is cut to this many tokens (or max_position_embeddings).
MAX_TEXT_TOKENS = 512
STAGES = 5


class _Stages:
    def __init__(self, report: ModelReport, progress: Callable[[str], None] | None) -> None:
        self.report, self.progress, self.i = report, progress, 0

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.i += 1
        if self.progress:
            self.progress(f"[{self.i}/{STAGES}] {name}")
        t = time.perf_counter()
        try:
            yield
        finally:
            self.report.stages.append({"stage": name, "seconds": round(time.perf_counter() - t, 3)})


@contextlib.contextmanager
def _true_fp32(torch: Any, device: Any) -> Iterator[None]:
    """No TF32 while the references run on CUDA: the fp32 reference must be fp32."""
    if device.type != "cuda":
        yield
        return
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[0], saved[1]
        torch.set_float32_matmul_precision(saved[2])


def _pick_device(gpu: bool | None) -> Any:
    if gpu is False:
        return resolve_device("cpu")
    try:
        return resolve_device("cuda")
    except (GpuUnavailableError, ImportError):
        if gpu:
            raise
        return resolve_device("cpu")


def input_ids(folder: Path, cfg: dict[str, Any], text: str | Path | None) -> tuple[np.ndarray, dict[str, Any]]:
    """The tokens all three models run on: int64 ``(sequences, tokens)`` and a description.

    With ``text``: the file tokenized by the folder's own tokenizer (offline), one
    sequence of at most ``MAX_TEXT_TOKENS`` (or ``max_position_embeddings``) tokens.
    Without: ``FIXED_SEQUENCES`` x ``FIXED_TOKENS`` ids drawn uniformly from the
    vocabulary with seed 0.

    Raises:
        ModelError: no ``vocab_size``; no tokenizer in the folder; fewer than 2 tokens.
        ConverterError: the text file cannot be read.
    """
    max_pos = cfg.get("max_position_embeddings")
    limit = lambda n: min(n, max_pos) if isinstance(max_pos, int) and max_pos > 0 else n  # noqa: E731
    if text is None:
        vocab = cfg.get("vocab_size")
        if not isinstance(vocab, int) or vocab <= 0:
            raise ModelError(
                "config.json has no vocab_size: cannot make the fixed input",
                path=folder / "config.json",
                tensor="vocab_size",
            )
        ids = np.random.default_rng(0).integers(0, vocab, (FIXED_SEQUENCES, limit(FIXED_TOKENS)), dtype=np.int64)
        return ids, {"from": "fixed", "text": None, "sequences": int(ids.shape[0]), "tokens": int(ids.shape[1])}
    text = Path(text)
    try:
        with text.open("r", encoding="utf-8") as f:
            f.read(1)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConverterError(f"cannot read --text: {getattr(exc, 'strerror', None) or exc}", path=text) from None
    if not any(
        (folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt")
    ):
        raise ModelError(
            "--text needs a tokenizer, and the folder has none (tokenizer.json / tokenizer_config.json)", path=folder
        )
    tok = _tokenizer(folder)
    budget = limit(MAX_TEXT_TOKENS)
    ids = _tokenize_prefix(tok, text, budget)[:budget]
    if len(ids) < 2:
        raise ModelError(f"--text gives {len(ids)} token(s); at least 2 are needed", path=text)
    arr = np.asarray([ids], dtype=np.int64)
    return arr, {"from": "text", "text": str(text), "sequences": 1, "tokens": int(arr.shape[1])}


def _first_line(exc: BaseException) -> str:
    from .guard import short

    text = str(exc).strip()
    return f"{type(exc).__name__}: {short(text.splitlines()[0], 300) if text else ''}"


def _tokenizer(folder: Path) -> Any:
    """The folder's tokenizer: offline, ``trust_remote_code=False``, its ``tokenizer_config.json``
    refused first if it names remote code.

    Raises:
        ModelError: remote code named; anything the tokenizer's loading raises, a panic of
            the Rust tokenizer (a ``BaseException``) included.
    """
    from ..formats.hf_checkpoint import read_json_file

    tc_path = folder / "tokenizer_config.json"
    if tc_path.is_file():
        tc = read_json_file(tc_path)
        if isinstance(tc, dict):
            check_config(tc, path=tc_path)
    from transformers import AutoTokenizer

    try:
        with quiet_transformers(), offline(folder / "config.json"):
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except ModelError:
        raise
    except BaseException as exc:  # the Rust tokenizer's PanicException is a BaseException
        raise ModelError(f"cannot load the folder's tokenizer: {_first_line(exc)}", path=folder) from None


#: --text is read this many characters at a time (doubling) until it gives enough tokens.
TEXT_CHUNK_CHARS = 16 << 10
#: ... and never more than this many characters in all.
MAX_TEXT_CHARS = 4 << 20
#: Tokens beyond the budget that a prefix must give before its first ``budget`` are trusted:
#: the tokens at the cut may differ from the whole text's.
TEXT_SLACK_TOKENS = 16


def _tokenize_prefix(tok: Any, text: Path, budget: int) -> list[int]:
    """The token ids of ``text``'s beginning: read and tokenized in growing prefixes until
    one gives ``budget + TEXT_SLACK_TOKENS`` tokens (or the file ends, or
    ``MAX_TEXT_CHARS`` were read), so memory and time follow the budget, not the file.

    Raises:
        ConverterError: the file cannot be read or is not UTF-8 (in the part read).
        ModelError: the tokenizer fails on it (a Rust panic included).
    """
    want = budget + TEXT_SLACK_TOKENS
    n = TEXT_CHUNK_CHARS
    content = ""
    try:
        with text.open("r", encoding="utf-8") as f:
            while True:
                more = f.read(n - len(content))
                content += more
                ids = _encode(tok, content, text)
                if len(ids) >= want or not more or len(content) >= MAX_TEXT_CHARS:
                    return ids
                n = min(2 * n, MAX_TEXT_CHARS)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConverterError(f"cannot read --text: {getattr(exc, 'strerror', None) or exc}", path=text) from None


def _encode(tok: Any, content: str, text: Path) -> list[int]:
    try:
        return list(tok(content)["input_ids"])
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # a Rust panic is a BaseException
        raise ModelError(f"the folder's tokenizer fails on --text: {_first_line(exc)}", path=text) from None


def _run(model: Any, ids: np.ndarray, device: Any) -> tuple[np.ndarray, str]:
    """float32 ``(sequences, tokens, V or hidden)`` on the host, and its name.

    Raises:
        ModelError: the forward pass fails (mixed dtypes an architecture cannot take ...).
    """
    import torch

    x = torch.from_numpy(ids).to(device)
    kwargs: dict[str, Any] = {"input_ids": x, "attention_mask": torch.ones_like(x)}
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False
    try:
        with torch.no_grad():  # (not inference_mode: the kernel's tensors cross DLPack)
            out = model(**kwargs)
    except (RuntimeError, TypeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"{type(model).__name__} failed in its forward pass: {first}") from None
    logits = getattr(out, "logits", None)
    y, what = (logits, "logits") if logits is not None else (out.last_hidden_state, "last_hidden_state")
    return y.float().cpu().numpy(), what


def _free(device: Any) -> None:
    """Return a freed model's memory: Python's, glibc's heap (``malloc_trim``), the GPU pools."""
    import torch

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    if device.type == "cuda":
        torch.cuda.empty_cache()
        from ..gpu.runtime import cupy_module

        cupy_module().get_default_memory_pool().free_all_blocks()


#: Rows (positions) per chunk of the comparison, so that float64 temporaries stay small
#: whatever the vocabulary.
_CHUNK_ELEMENTS = 1 << 20


def output_metrics(y: np.ndarray, ref: np.ndarray, *, encoder: bool, ids: np.ndarray | None) -> dict[str, Any]:
    """Compare one model's output with the fp32 reference's, a few positions at a time.

    Args:
        y, ref: float32 ``(sequences, tokens, features)``.
        encoder: hidden states, not logits: also the cosine of mean-pooled embeddings; no
            top-1 / top-5 (an argmax over hidden features means nothing), and the max
            error per position relative to that position's norm.
        ids: the tokens, for the perplexity of ``y`` (causal LMs on ``--text``), or None.

    Returns:
        ``mean_rel_err`` (mean |y - ref| / mean |ref|), ``max_rel_err`` (logits: max
        |y - ref| / mean |ref|; hidden states: max over positions of ||y - ref|| / ||ref||,
        which near-zero features cannot inflate), ``top1``, ``top5`` (see
        :class:`ModelReport`; None for hidden states), and when asked ``cosine`` (lowest
        over sequences) and ``ppl``; errors are ``inf`` and the cosine -1 when ``y`` is
        not finite. Temporaries: about ``_CHUNK_ELEMENTS`` float64 values.
    """
    b, t, v = y.shape
    k = min(5, v)
    rows = max(1, _CHUNK_ELEMENTS // max(v, 1))
    sum_diff = sum_ref = 0.0
    max_diff = max_pos = 0.0
    top1 = top5 = 0.0
    finite = True
    pooled_y = np.zeros((b, v)) if encoder else None
    pooled_r = np.zeros((b, v)) if encoder else None
    nll, n_nll = 0.0, 0
    for i in range(b):
        for t0 in range(0, t, rows):
            yc = y[i, t0 : t0 + rows].astype(np.float64)
            rc = ref[i, t0 : t0 + rows].astype(np.float64)
            finite &= bool(np.isfinite(yc).all())
            d = np.abs(yc - rc)
            sum_diff += float(d.sum())
            max_diff = max(max_diff, float(d.max()))
            sum_ref += float(np.abs(rc).sum())
            if not encoder:
                top1 += float(np.sum(np.argmax(yc, axis=1) == np.argmax(rc, axis=1)))
                ty = np.argpartition(-yc, k - 1, axis=1)[:, :k]
                tr = np.argpartition(-rc, k - 1, axis=1)[:, :k]
                top5 += sum(len(set(a) & set(c)) / k for a, c in zip(ty.tolist(), tr.tolist(), strict=True))
            else:
                rel = np.linalg.norm(yc - rc, axis=1) / np.maximum(np.linalg.norm(rc, axis=1), 1e-30)
                max_pos = max(max_pos, float(rel.max()))
                pooled_y[i] += yc.sum(axis=0)
                pooled_r[i] += rc.sum(axis=0)
            if ids is not None:
                nxt = ids[i, t0 + 1 : t0 + 1 + len(yc)]  # position p predicts token p + 1
                lg = yc[: len(nxt)]
                if len(nxt):
                    m = lg.max(axis=1, keepdims=True)
                    logz = m[:, 0] + np.log(np.exp(lg - m).sum(axis=1))
                    nll += float(np.sum(logz - lg[np.arange(len(nxt)), nxt]))
                    n_nll += len(nxt)
    n = b * t
    scale = (sum_ref / (n * v)) or 1.0
    out: dict[str, Any] = {
        "mean_rel_err": sum_diff / (n * v) / scale if finite else math.inf,
        "max_rel_err": (max_pos if encoder else max_diff / scale) if finite else math.inf,
        "top1": None if encoder else top1 / n,
        "top5": None if encoder else top5 / n,
    }
    if encoder:
        cos = (pooled_y * pooled_r).sum(axis=1) / (
            np.linalg.norm(pooled_y, axis=1) * np.linalg.norm(pooled_r, axis=1) + 1e-30
        )
        out["cosine"] = float(cos.min()) if finite else -1.0
    if ids is not None:
        mean_nll = nll / max(n_nll, 1)
        out["ppl"] = math.exp(mean_nll) if finite and math.isfinite(mean_nll) and mean_nll < 700 else math.inf
    return out


def reference_decisions(ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32's top-1 token and its margin over the second (float64) at every position,
    ``(sequences, tokens)`` each; computed a few positions at a time."""
    b, t, v = ref.shape
    top = np.zeros((b, t), dtype=np.int64)
    margin = np.full((b, t), np.inf)
    rows = max(1, _CHUNK_ELEMENTS // max(v, 1))
    for i in range(b):
        for t0 in range(0, t, rows):
            rc = ref[i, t0 : t0 + rows].astype(np.float64)
            top[i, t0 : t0 + len(rc)] = np.argmax(rc, axis=1)
            if v > 1:
                two = -np.partition(-rc, 1, axis=1)[:, :2]
                margin[i, t0 : t0 + len(rc)] = two[:, 0] - two[:, 1]
    return top, margin


def position_errors(y: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A model's top-1 token and its largest absolute logit error against ``ref`` at every
    position, ``(sequences, tokens)`` each (inf where ``y`` is not finite)."""
    b, t, v = y.shape
    top = np.zeros((b, t), dtype=np.int64)
    err = np.zeros((b, t))
    rows = max(1, _CHUNK_ELEMENTS // max(v, 1))
    for i in range(b):
        for t0 in range(0, t, rows):
            yc = y[i, t0 : t0 + rows].astype(np.float64)
            rc = ref[i, t0 : t0 + rows].astype(np.float64)
            top[i, t0 : t0 + len(yc)] = np.argmax(yc, axis=1)
            e = np.abs(yc - rc).max(axis=1)
            err[i, t0 : t0 + len(yc)] = np.where(np.isfinite(yc).all(axis=1), e, np.inf)
    return top, err


def top1_verdict(
    ref_top: np.ndarray, ref_margin: np.ndarray, f16_top: np.ndarray, f16_err: np.ndarray, conv_top: np.ndarray
) -> dict[str, Any]:
    """Top-1 agreement at the positions where the fp32 reference is decided (see the
    module docstring): fp32's top-1 minus top-2 logit above ``DECIDED_FACTOR`` x the
    fp16 reference's largest logit error at that position.

    Returns:
        ``positions``, ``decided`` (how many), ``converted`` and ``fp16`` (agreement with
        fp32 at the decided positions; None when none is decided), ``min`` (fp16's
        minus ``TOP1_MARGIN``) and ``ok``.
    """
    decided = ref_margin > DECIDED_FACTOR * f16_err
    n = int(decided.sum())
    conv = float(np.mean(conv_top[decided] == ref_top[decided])) if n else None
    f16 = float(np.mean(f16_top[decided] == ref_top[decided])) if n else None
    floor = None if f16 is None else f16 - TOP1_MARGIN
    return {
        "positions": int(ref_top.size),
        "decided": n,
        "converted": conv,
        "fp16": f16,
        "min": floor,
        "ok": conv is None or floor is None or conv >= floor,
    }


class _LayerProbe:
    """Forward hooks on the converted model's swapped layers: each layer's output on the
    model's own activations against the source layer (fp32) and an fp16 linear of it."""

    def __init__(self, source: Any, plans: dict[str, Any]) -> None:
        self.source, self.plans = source, plans
        self.stats: dict[str, list[float]] = {}
        self.handles: list[Any] = []
        self.modules: dict[str, Any] = {}

    def attach(self, modules: dict[str, Any]) -> None:
        self.modules = modules
        for mod in modules.values():
            mod.keep_raw = True
            self.handles.append(mod.register_forward_hook(self._hook))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for mod in self.modules.values():
            mod.keep_raw, mod.raw_output = False, None
        self.modules = {}  # no reference may keep the converted model alive past its stage

    def _hook(self, mod: Any, args: tuple[Any, ...], out: Any) -> None:
        import torch
        import torch.nn.functional as F

        lp = self.plans.get(mod.layer_name)
        if lp is None:
            return
        x = args[0].detach()
        w = torch.from_numpy(dequantized_weight(self.source, lp)).to(x.device)
        bias = None
        if lp.bias is not None:
            from .modules import to_torch

            t = self.source.load_tensor(lp.bias.name)
            bias = to_torch(t.data, t.dtype).float().to(x.device)
        x16 = x.to(torch.float16)
        ref = x16.float() @ w
        if bias is not None:
            ref = ref + bias
        y16 = F.linear(x16, w.T.to(torch.float16), None if bias is None else bias.to(torch.float16)).float()
        scale = float(ref.abs().mean()) or 1.0
        # The layer's own fp16 output, before the cast to the activations' dtype.
        ours = (mod.raw_output if mod.raw_output is not None else out).detach().float()
        mod.raw_output = None
        e = float((ours - ref).abs().mean()) / scale if bool(torch.isfinite(ours).all()) else math.inf
        e16 = float((y16 - ref).abs().mean()) / scale
        s = self.stats.setdefault(mod.layer_name, [0.0, 0.0])
        s[0], s[1] = max(s[0], e), max(s[1], e16)
        from ..safetensors_io import release_mapped_pages

        release_mapped_pages()


def _tensor_checks(model: Any, load: Any, source: Any, report: ModelReport) -> None:
    """Every pass-through tensor the converted model loaded against the source's: dtype, then bytes."""
    import torch

    from ..safetensors_io import release_mapped_pages
    from .modules import dtype_code

    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    infos = source.ckpt.infos
    for tname, names in load.tensors.items():
        t = named.get(names[0])
        if t is None:
            continue
        if tname not in infos:
            report.add(
                P.TENSOR_NOT_IN_SOURCE, f"{tname}: loaded into {names[0]}, but the source has no such tensor", tname
            )
            continue
        src = source.load_tensor(tname)
        mine = dtype_code(t)
        if mine != src.dtype:
            report.add(
                P.TENSOR_DTYPE,
                f"{tname}: loaded as {mine} (the artifact's dtype) into {names[0]}, but the source stores {src.dtype}",
                tname,
            )
            continue
        ours = t.detach().cpu().contiguous()
        ours_np = (ours.view(torch.int16) if ours.dtype == torch.bfloat16 else ours).numpy().reshape(-1)
        src_np = np.asarray(src.data).reshape(-1)
        n = _count_differing(ours_np, src_np)
        if n:
            report.add(P.TENSOR_BYTES, f"{tname}: {n} of {src_np.size} values differ from the source's", tname)
        del ours, ours_np, src_np
        release_mapped_pages()


def _count_differing(a: np.ndarray, b: np.ndarray, chunk: int = 1 << 20) -> int:
    """How many elements differ bitwise between two flat arrays of one item size (all, if the sizes differ)."""
    if a.size != b.size or a.dtype.itemsize != b.dtype.itemsize:
        return max(a.size, b.size)
    view = f"u{a.dtype.itemsize}"
    a, b = a.view(view), b.view(view)
    return sum(int(np.count_nonzero(a[i : i + chunk] != b[i : i + chunk])) for i in range(0, a.size, chunk))


def verify_model(
    path: str | Path,
    against: str | Path,
    *,
    text: str | Path | None = None,
    gpu: bool | None = None,
    progress: Callable[[str], None] | None = None,
    attn_implementation: str = "eager",
    kernel_factory: KernelFactory | None = None,
    allow_source_mismatch: bool = False,
) -> ModelReport:
    """Whole-model parity of a converted folder with its source checkpoint.

    Args:
        path: the converted model folder (``marlin-convert SRC OUTDIR``).
        against: the source checkpoint (folder, ``.safetensors`` or index).
        text: a UTF-8 text file to tokenize as input (else the fixed input; see
            :func:`input_ids`); with a causal LM also gives perplexities.
        gpu: True: CUDA required; False: CPU; None: CUDA when usable.
        progress: called with one line per stage.
        attn_implementation: the attention all three models use (``eager``: the same
            arithmetic on every device).
        kernel_factory: see :func:`~converter.model.loader.build_converted` (tests).
        allow_source_mismatch: run the models even when the source's sha256 differs from
            the one recorded at conversion (``source_differs`` is then a warning); by
            default that is an error and the check stops after stage 1, before any
            model is built.

    Returns:
        The :class:`ModelReport`; ``ok`` says whether it passed. Content problems
        (numbers off, a dropped bias, a tensor in another dtype, an artifact failing
        ``--shapes``) are findings, not exceptions.

    Raises:
        ModelError, ArtifactError, ConverterError: input that cannot be checked (not a
            converted folder, a .tinyloop model, an unknown architecture, layers without
            modules or modules without layers, no source config ...): exit 2 in the CLI.
        GpuUnavailableError: ``gpu=True`` without a usable GPU.
    """
    with offline(Path(path) / "config.json"):
        return _verify_model(
            path,
            against,
            text=text,
            gpu=gpu,
            progress=progress,
            attn_implementation=attn_implementation,
            kernel_factory=kernel_factory,
            allow_source_mismatch=allow_source_mismatch,
        )


def _verify_model(
    path: str | Path,
    against: str | Path,
    *,
    text: str | Path | None,
    gpu: bool | None,
    progress: Callable[[str], None] | None,
    attn_implementation: str,
    kernel_factory: KernelFactory | None,
    allow_source_mismatch: bool,
) -> ModelReport:
    t_start = time.perf_counter()
    torch, _ = import_stack()
    from ..artifact.validate import validate_artifact
    from ..formats import open_source
    from .modules import swapped_modules
    from .reference import FP16, FP32, build_reference, source_config

    folder, cfg = read_converted_config(path)
    report = ModelReport(model=str(folder), source=str(against))
    stage = _Stages(report, progress)
    device = _pick_device(gpu)
    report.device = str(device)
    with contextlib.ExitStack() as stack:
        with stage("checking the artifact and the source"):
            vrep, art = validate_artifact(folder)
            recorded = {f.name: f.sha256 for f in art.manifest.source.files} if art.manifest else {}
            art.close()
            if not vrep.ok:
                for p in vrep.problems:
                    if p.severity == "error":
                        report.add(P.ARTIFACT, f"artifact: {p.message}", p.tensor)
                return _finish(report, t_start)
            source = open_source(against)
            stack.callback(source.close)
            source_config(source)
            actual = {f["name"]: f["sha256"] for f in source.describe()["files"]}
            changed = sorted(n for n in recorded.keys() & actual.keys() if recorded[n] != actual[n])
            if changed or (recorded and not recorded.keys() & actual.keys()):
                what = f"sha256 differs: {', '.join(changed)}" if changed else "no file names in common"
                message = f"the source is not the checkpoint this folder was converted from ({what})"
                if not allow_source_mismatch:
                    # Stage 1 knows: stop before three model builds (the slow part) prove it.
                    report.add(
                        P.SOURCE_DIFFERS,
                        f"{message}; stopped before building any model (--allow-source-mismatch compares anyway)",
                    )
                    return _finish(report, t_start)
                report.add(P.SOURCE_DIFFERS, message, severity="warning")
            ids, report.input = input_ids(folder, cfg, text)
            plans = {lp.name: lp for lp in source.plan().layers}
        stack.enter_context(_true_fp32(torch, device))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        cupy_peak = 0
        encoder = None
        ppl_ids = None
        with stage("fp32 reference dequantized from the source"):
            ref, _ = build_reference(source, FP32, device, attn_implementation=attn_implementation)
            y32, report.output = _run(ref, ids, device)
            del ref
            _free(device)
            encoder = report.output == "last_hidden_state"
            decisions = None if encoder else reference_decisions(y32)
        with stage(f"converted model on {device}"):
            model, load = build_converted(
                folder,
                device,
                strict=False,
                attn_implementation=attn_implementation,
                validate=False,
                kernel_factory=kernel_factory,
            )
            report.architecture, report.kind, report.load = load.architecture, load.kind, load.to_json()
            ppl_ids = ids if text is not None and load.kind == CAUSAL_LM else None
            probe = _LayerProbe(source, plans)
            probe.attach(swapped_modules(model))
            y, _ = _run(model, ids, device)
            probe.detach()
            _tensor_checks(model, load, source, report)
            if device.type == "cuda":
                from ..gpu.runtime import cupy_module

                cupy_peak = int(cupy_module().get_default_memory_pool().total_bytes())
            del model
            conv = output_metrics(y, y32, encoder=encoder, ids=ppl_ids)
            conv_top = None if encoder else position_errors(y, y32)[0]
            del y
            _free(device)
        with stage("fp16-dequantized reference from the source"):
            ref, _ = build_reference(source, FP16, device, attn_implementation=attn_implementation)
            y, _ = _run(ref, ids, device)
            del ref
            f16 = output_metrics(y, y32, encoder=encoder, ids=ppl_ids)
            verdict = None
            if decisions is not None and conv_top is not None:
                f16_top, f16_err = position_errors(y, y32)
                verdict = top1_verdict(decisions[0], decisions[1], f16_top, f16_err, conv_top)
            del y
            _free(device)
        with stage("comparing"):
            ref32 = {"ppl": output_metrics(y32, y32, encoder=False, ids=ppl_ids)["ppl"]} if ppl_ids is not None else {}
            del y32
            _judge(report, load, probe, plans, conv, f16, ref32, verdict)
        if device.type == "cuda":
            report.gpu_peak_bytes = int(torch.cuda.max_memory_allocated(device)) + cupy_peak
    return _finish(report, t_start)


def _finish(report: ModelReport, t_start: float) -> ModelReport:
    report.wall_s = round(time.perf_counter() - t_start, 3)
    report.peak_rss_bytes = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return report


def _judge(
    report: ModelReport,
    load: Any,
    probe: _LayerProbe,
    plans: dict[str, Any],
    conv: dict[str, Any],
    f16: dict[str, Any],
    ref32: dict[str, Any],
    verdict: dict[str, Any] | None = None,
) -> None:
    if "ppl" in ref32:
        for m in (conv, f16):
            m["ppl_rel_diff"] = abs(m["ppl"] - ref32["ppl"]) / ref32["ppl"] if math.isfinite(m["ppl"]) else math.inf
    report.metrics = {"converted": conv, "fp16_dequant": f16, "fp32": ref32}
    limit = ERROR_FACTOR * max(f16["mean_rel_err"], 1e-7)
    if verdict is not None:
        conv["top1_decided"], f16["top1_decided"] = verdict["converted"], verdict["fp16"]
        conv["decided_positions"] = f16["decided_positions"] = verdict["decided"]
    report.bar = {
        "mean_rel_err_limit": limit,
        "top1_min": None if verdict is None else verdict["min"],
        "top1_rule": None if verdict is None else "decided positions",
        "decided_factor": DECIDED_FACTOR,
        "error_factor": ERROR_FACTOR,
        "top1_margin": TOP1_MARGIN,
        "layer_factor": LAYER_FACTOR,
        "layer_floor": LAYER_FLOOR,
    }
    what = report.output
    if not conv["mean_rel_err"] <= limit:
        report.add(
            P.MODEL_ERROR,
            f"{what}: mean relative error {conv['mean_rel_err']:.3g} "
            "against the fp32 model dequantized from the source "
            f"is above {ERROR_FACTOR:g}x the fp16-dequantized model's {f16['mean_rel_err']:.3g} (limit {limit:.3g})",
        )
    if verdict is not None and not verdict["ok"]:
        report.add(
            P.MODEL_TOP1,
            f"{what}: top-1 agreement with the fp32 model at its {verdict['decided']} decided positions "
            f"(of {verdict['positions']}: top-1 minus top-2 logit above {DECIDED_FACTOR:g}x the fp16-dequantized "
            f"model's largest logit error there) {verdict['converted']:.4f} is below the fp16-dequantized "
            f"model's {verdict['fp16']:.4f} minus {TOP1_MARGIN:g}",
        )
    modules = load.modules
    for layer, path in load.layers.items():
        e, e16 = probe.stats.get(layer, [None, None])
        bad = e is not None and e > LAYER_FACTOR * e16 and e > LAYER_FLOOR
        report.layers.append(
            {
                "name": layer,
                "module": modules.get(layer),
                "path": path,
                "rel_err": e,
                "fp16_rel_err": e16,
                "ok": not bad,
            }
        )
        if layer not in plans:
            report.add(
                P.LAYER_NOT_IN_SOURCE,
                f"layer {layer}: in the artifact, but the source has no such quantized layer",
                layer,
            )
        elif e is None:
            report.add(
                P.LAYER_NOT_RUN,
                f"layer {layer} (module {modules.get(layer)}) never ran in the forward pass",
                layer,
                severity="warning",
            )
        elif bad:
            report.add(
                P.LAYER_ERROR,
                f"layer {layer} (module {modules.get(layer)}): output mean relative error {e:.3g} against the source "
                f"layer on the model's own activations, {e / max(e16, 1e-30):.1f}x "
                f"the fp16-dequantized layer's {e16:.3g} "
                f"(limit: above {LAYER_FACTOR:g}x and {LAYER_FLOOR:g})",
                layer,
            )
    for name in load.missing:
        module, _, attr = name.rpartition(".")
        if attr == "bias" and module in load.layers:
            report.add(
                P.MISSING_BIAS,
                f"{name}: module {load.modules.get(module, module)} has a bias, the converted layer {module} has none "
                "(it runs without)",
                name,
            )
        else:
            report.add(
                P.MISSING_TENSOR,
                f"{name}: the model has this tensor, the artifact nothing to load into it (left as initialised)",
                name,
            )
    for layer, why in load.not_converted.items():
        report.add(
            P.NOT_CONVERTED,
            f"layer {layer} passed through unconverted ({why}); it runs through its exact dequantization "
            "as an fp16 linear, not the Marlin kernel",
            layer,
            severity="warning",
        )
    for layer, why in load.kernel_fallback.items():
        report.add(
            P.KERNEL_FALLBACK, f"layer {layer}: {why}; it runs the exact path on the GPU", layer, severity="warning"
        )
    for w in load.warnings:
        report.add(P.TIED_DIFFERS, w, severity="warning")
    if load.unused:
        shown = ", ".join(load.unused[:8]) + (f", ... ({len(load.unused)} tensors)" if len(load.unused) > 8 else "")
        report.add(
            P.UNUSED_TENSORS,
            f"{len(load.unused)} artifact tensor(s) feed no module of {load.architecture}: {shown}",
            severity="warning",
        )
