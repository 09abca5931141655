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
import resource
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..artifact.problems import ProblemCode
from ..errors import GpuUnavailableError
from . import ModelError
from .build import CAUSAL_LM, import_stack
from .config import torch_dtype
from .guard import offline
from .inputs import (
    FIXED_SEQUENCES,
    FIXED_TOKENS,
    MAX_TEXT_CHARS,
    MAX_TEXT_TOKENS,
    TEXT_CHUNK_CHARS,
    TEXT_SLACK_TOKENS,
    input_ids,
)
from .judge import DECIDED_FACTOR, ERROR_FACTOR, LAYER_FACTOR, LAYER_FLOOR, TOP1_MARGIN, _judge, top1_verdict
from .loader import KernelFactory, build_converted, build_spread, read_converted_config, resolve_device
from .metrics import output_metrics, position_errors, reference_decisions
from .probe import _LayerProbe, _tensor_checks
from .report import ModelReport

# Re-exported: callers and tests import these from here (defined in inputs, metrics and judge).
__all__ = [
    "DECIDED_FACTOR",
    "ERROR_FACTOR",
    "FIXED_SEQUENCES",
    "FIXED_TOKENS",
    "LAYER_FACTOR",
    "LAYER_FLOOR",
    "MAX_TEXT_CHARS",
    "MAX_TEXT_TOKENS",
    "TEXT_CHUNK_CHARS",
    "TEXT_SLACK_TOKENS",
    "TOP1_MARGIN",
    "input_ids",
    "output_metrics",
    "position_errors",
    "reference_decisions",
    "top1_verdict",
    "verify_model",
]

P = ProblemCode

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
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict[Any, Any] | None = None,
    dtype: Any = None,
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
        device_map, max_memory: spread the converted model as ``from_pretrained`` does
            (:func:`~converter.model.loader.build_spread`: ``"auto"`` ... or a dict), for
            a model larger than one GPU; the fp32 and fp16 references then run on the CPU,
            one after the other, each quantized layer dequantized at its call (host memory:
            the unquantized tensors plus one layer).
        dtype: ``"float16"`` or ``"bfloat16"`` (or the torch dtype, ``"fp16"``, ``"bf16"``):
            run the converted model in that type (its embeddings and norms loaded in it;
            the converted layers keep their operands and take the activations in it).
            None or ``"auto"``: each tensor's own, as loaded. As ``load_model(dtype=)`` or, with
            ``device_map``, ``from_pretrained(dtype=)`` told that it was asked
            (:func:`~converter.model.hf_quantizer.dtype_asked`): the same model either
            way. The 16-bit reference is built in it too; the fp32 one is unchanged.

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
            device_map=device_map,
            max_memory=max_memory,
            dtype=dtype,
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
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict[Any, Any] | None = None,
    dtype: Any = None,
) -> ModelReport:
    t_start = time.perf_counter()
    torch, _ = import_stack()
    from ..artifact.validate import validate_artifact
    from ..formats import open_source
    from .config import edited_fields, hf_config
    from .modules import swapped_modules
    from .reference import FP16, FP32, build_reference, source_config
    from .skeleton import model_class

    dt = torch_dtype(dtype)
    if dt is not None and dt not in (torch.float16, torch.bfloat16):
        raise ModelError(f"dtype {dtype!r}: the converted layers run float16 or bfloat16 activations")
    dtype = None if dt is None else str(dt).removeprefix("torch.")
    folder, cfg = read_converted_config(path)
    report = ModelReport(model=str(folder), source=str(against), dtype=dtype)
    stage = _Stages(report, progress)
    # With a device map the references run on the CPU and ours where the map puts it.
    device = resolve_device("cpu") if device_map is not None else _pick_device(gpu)
    lazy = device_map is not None  # a model spread over GPUs may not fit the host in fp32 either
    report.device = str(device)
    with contextlib.ExitStack() as stack:
        with stage("checking the artifact and the source"):
            vrep, art = validate_artifact(folder)
            recorded = {f.name: f.sha256 for f in art.manifest.source.files} if art.manifest else {}
            stored = {name: info.dtype for name, info in art.file.infos.items()}
            art.close()
            if not vrep.ok:
                for p in vrep.problems:
                    if p.severity == "error":
                        report.add(P.ARTIFACT, f"artifact: {p.message}", p.tensor)
                return _finish(report, t_start)
            source = open_source(against)
            stack.callback(source.close)
            _, src_cfg = source_config(source)
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
            # a config.json no model can be built from is bad input, refused as load_model would
            cfg_path = folder / "config.json"
            model_class(hf_config(cfg, path=cfg_path), cfg, path=cfg_path)
            # The references are built from the source's config.json and ours from the
            # folder's: a field edited there (rope scaling, the context length, which also
            # sets the input's length) would go unseen at the lengths checked.
            edits = edited_fields(cfg, src_cfg)
            for field, what in edits:
                report.add(
                    P.CONFIG_DIFFERS,
                    f"{cfg_path}: {field}: {what}",
                    field,
                    severity="warning" if allow_source_mismatch else "error",
                )
            if edits and not allow_source_mismatch:
                return _finish(report, t_start)
            ids, report.input = input_ids(folder, cfg, text)
            plans = {lp.name: lp for lp in source.plan().layers}
        stack.enter_context(_true_fp32(torch, device))
        gpus: list[int] = []  # whose peaks the report gives
        if device_map is not None and torch.cuda.is_available():
            gpus = list(range(torch.cuda.device_count()))
        elif device.type == "cuda":
            gpus = [device.index if device.index is not None else torch.cuda.current_device()]
        for g in gpus:
            torch.cuda.reset_peak_memory_stats(g)
        cupy_peak = 0
        encoder = None
        ppl_ids = None
        with stage("fp32 reference dequantized from the source"):
            ref, _ = build_reference(source, FP32, device, attn_implementation=attn_implementation, lazy=lazy)
            y32, report.output = _run(ref, ids, device)
            del ref
            _free(device)
            encoder = report.output == "last_hidden_state"
            decisions = None if encoder else reference_decisions(y32)
        where = f"spread by device_map={device_map!r}" if device_map is not None else f"on {device}"
        with stage(f"converted model {where}"):
            if device_map is not None:
                model, load = build_spread(
                    folder,
                    device_map,
                    max_memory=max_memory,
                    attn_implementation=attn_implementation,
                    dtype=dtype,
                )
                report.device = load.device
            else:
                model, load = build_converted(
                    folder,
                    device,
                    strict=False,
                    attn_implementation=attn_implementation,
                    validate=False,
                    kernel_factory=kernel_factory,
                    dtype=dtype,
                )
            report.architecture, report.kind, report.load = load.architecture, load.kind, load.to_json()
            ppl_ids = ids if text is not None and load.kind == CAUSAL_LM else None
            probe = _LayerProbe(source, plans)
            probe.attach(swapped_modules(model))
            y, _ = _run(model, ids, model.device if device_map is not None else device)
            probe.detach()
            _tensor_checks(
                model, load, source, report, cast=None if dtype is None else getattr(torch, dtype), stored=stored
            )
            if "cuda" in report.device:  # our kernel ran: its CuPy pool counts too
                from ..gpu.runtime import cupy_module

                cupy_peak = int(cupy_module().get_default_memory_pool().total_bytes())
            del model
            conv = output_metrics(y, y32, encoder=encoder, ids=ppl_ids)
            conv_top = None if encoder else position_errors(y, y32)[0]
            del y
            _free(device)
        # weights in the 16-bit type the converted layers' activations ran in (the probe
        # saw them), not the one config.json names: they can differ
        half = torch.bfloat16 if any(d[0] == "bfloat16" for d in probe.dtypes.values()) else torch.float16
        with stage(f"{'bf16' if half == torch.bfloat16 else 'fp16'}-dequantized reference from the source"):
            ref, _ = build_reference(
                source,
                FP16,
                device,
                attn_implementation=attn_implementation,
                lazy=lazy,
                half=half,
                dtype=None if dtype is None else getattr(torch, dtype),
            )
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
            report.bar["reference_weights"] = str(half).removeprefix("torch.")
        if gpus:
            peaks = {f"cuda:{g}": int(torch.cuda.max_memory_allocated(g)) for g in gpus}
            report.gpu_peak_by_device = peaks
            report.gpu_peak_bytes = sum(peaks.values()) + cupy_peak
    return _finish(report, t_start)


def _finish(report: ModelReport, t_start: float) -> ModelReport:
    report.wall_s = round(time.perf_counter() - t_start, 3)
    report.peak_rss_bytes = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return report
