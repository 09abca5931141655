"""The report of ``marlin-verify OUTDIR --model``: data classes, JSON, and the console view."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..artifact.problems import ProblemCode, Severity


@dataclasses.dataclass(frozen=True)
class Finding:
    """One finding of the whole-model check.

    Attributes:
        code: stable identifier (:class:`~converter.artifact.problems.ProblemCode`):
            ``model_error``, ``model_top1``, ``layer_error``, ``missing_tensor``,
            ``missing_bias``, ``tensor_dtype``, ``tensor_bytes``, ``tensor_not_in_source``,
            ``layer_not_in_source``, ``artifact``, ``source_differs``, ``config_differs``
            (errors; the last two warnings with ``allow_source_mismatch``); ``not_converted``,
            ``kernel_fallback``, ``unused_tensors``, ``tied_differs``, ``layer_not_run``
            (warnings).
        message: one line naming the layer or tensor and the rule.
        tensor: the layer or tensor concerned ("" for the whole model).
        severity: ``"error"`` (fails the check) or ``"warning"``.
    """

    code: ProblemCode
    message: str
    tensor: str = ""
    severity: Severity = "error"


@dataclasses.dataclass
class ModelReport:
    """Outcome of :func:`~converter.model.verify.verify_model`; ``to_json`` is what ``--json`` prints.

    Attributes:
        model, source: the converted folder and the source checkpoint.
        device: where the three models ran.
        architecture, kind: the transformers class and ``causal-lm`` / ``masked-lm`` /
            ``encoder`` / ``other``.
        output: what is compared: ``logits`` or ``last_hidden_state``.
        input: ``{"from": "text" | "fixed", "text": path or None, "sequences", "tokens"}``.
        metrics: ``{"converted": {...}, "fp16_dequant": {...}, "fp32": {...}}``; the first
            two hold ``mean_rel_err`` (mean |y - y32| / mean |y32|), ``max_rel_err``
            (logits: max |y - y32| / mean |y32|; hidden states: max over positions of
            ||y - y32|| / ||y32||), ``top1`` (share of positions whose argmax
            agrees with fp32's) and ``top5`` (mean overlap of the top-5 sets, /5), both
            None for hidden states; for encoders ``cosine`` (lowest over sequences of the
            mean-pooled embedding's cosine with fp32's), for causal LMs on ``--text``
            ``ppl`` and ``ppl_rel_diff``
            (against fp32's ``ppl``).
        bar: the pass rule's numbers: ``mean_rel_err_limit`` (1.5 x fp16's),
            ``top1_min`` (fp16's - 0.005; None for hidden states), ``reference_weights``
            (the 16-bit reference's weight type: bf16 where the converted layers ran bf16
            activations, else fp16).
        layers: per swapped layer ``{name, module, path, rel_err, fp16_rel_err, dtypes, ok}``:
            its output on the model's own activations against the source layer in fp32,
            ours and a 16-bit linear of the dequantized weight (``fp16_rel_err``: in bf16
            for a bf16 model, whose layers run bf16); ``dtypes``: ``[input, output]`` of
            the layer's kernel as it ran (None if it never ran).
        load: :class:`~converter.model.loader.LoadReport` as JSON.
        problems: every :class:`Finding`.
        stages: ``[{"stage", "seconds"}]``; wall_s: total seconds.
        peak_rss_bytes: the process's peak resident memory; gpu_peak_bytes: torch's peak
            allocation plus CuPy's pool (CUDA only; with a device map, summed over the
            GPUs); gpu_peak_by_device: ``{"cuda:i": torch's peak on GPU i}`` where the run
            used CUDA.
    """

    model: str
    source: str
    device: str = ""
    #: the dtype the model was asked to run in (``--dtype``), None: each tensor's own
    dtype: str | None = None
    architecture: str = ""
    kind: str = ""
    output: str = ""
    input: dict[str, Any] = dataclasses.field(default_factory=dict)
    metrics: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    bar: dict[str, Any] = dataclasses.field(default_factory=dict)
    layers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    load: dict[str, Any] = dataclasses.field(default_factory=dict)
    problems: list[Finding] = dataclasses.field(default_factory=list)
    stages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    peak_rss_bytes: int = 0
    gpu_peak_bytes: int | None = None
    gpu_peak_by_device: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def add(self, code: ProblemCode, message: str, tensor: str = "", severity: Severity = "error") -> None:
        self.problems.append(Finding(ProblemCode(code), message, tensor, severity))

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["problems"] = [{**dataclasses.asdict(p), "code": p.code.value} for p in self.problems]
        d["ok"] = self.ok
        d["check"] = "model"
        return d


def _fmt(v: Any, spec: str = ".2e") -> str:
    return "-" if v is None else format(v, spec)


def render(report: ModelReport, out: Any, err: Any, *, quiet: bool = False) -> None:
    """Print the report: a metrics table, the problems, a status line; ``quiet``: only the
    errors and, when there are any, the status line (as ``marlin-verify -q`` elsewhere).

    Args:
        out: rich console for the table, problems and status (stdout).
        err: rich console for notes (stderr).
    """
    from rich.markup import escape as _escape
    from rich.table import Table

    from ..errors import printable

    # the 16-bit reference's weight type (bf16 for a model whose layers ran bf16)
    ref16 = {"bfloat16": "bf16"}.get(report.bar.get("reference_weights", ""), "fp16")

    def escape(text: str) -> str:  # names from files: no control character reaches the terminal
        return _escape(printable(text))

    m = report.metrics
    if not quiet and m:
        # The title is a line of its own: a table's title wraps at the table's width and is padded to it.
        out.print(
            escape(
                f"{report.architecture} on {report.device}{f' in {report.dtype}' if report.dtype else ''}: "
                f"{report.output} against the fp32 model dequantized "
                f"from the source, {report.input.get('sequences')} x {report.input.get('tokens')} tokens"
            ),
            soft_wrap=True,
        )
        table = Table()
        extra = [k for k in ("cosine", "ppl", "ppl_rel_diff") if k in m.get("converted", {})]
        # Hidden states have no top-1 / top-5 (an argmax over features means nothing).
        tops = m.get("converted", {}).get("top1") is not None
        max_col = "max rel err" if tops else "max rel err (per position, of its norm)"
        for col in ["model", "mean rel err", max_col, *(["top-1", "top-5"] if tops else []), *extra]:
            table.add_column(col)
        for key, label in (
            ("converted", "converted (ours)"),
            ("fp16_dequant", f"{ref16} dequantized"),
            ("fp32", "fp32 dequantized"),
        ):
            row = m.get(key, {})
            if not row:
                continue
            cells = [
                label,
                _fmt(row.get("mean_rel_err")),
                _fmt(row.get("max_rel_err")),
                *([_fmt(row.get("top1"), ".4f"), _fmt(row.get("top5"), ".4f")] if tops else []),
            ]
            for k in extra:
                cells.append(_fmt(row.get(k), ".6f" if k == "cosine" else (".4g" if k == "ppl" else ".2e")))
            table.add_row(*cells)
        out.print(table)
        worst = sorted(
            report.layers,
            key=lambda r: -(r["rel_err"] / max(r["fp16_rel_err"], 1e-30) if r["rel_err"] is not None else float("inf")),
        )[:3]
        if worst:
            shown = ", ".join(
                f"{r['name']} {_fmt(r['rel_err'])} (16-bit dequantized {_fmt(r['fp16_rel_err'])})" for r in worst
            )
            # rel_err: the layer's output on the model's own activations against the fp32 source layer's
            out.print(
                f"largest per-layer error against the source (relative to 16-bit dequantized's): {escape(shown)}",
                soft_wrap=True,
            )
    for p in report.problems:
        if quiet and p.severity != "error":
            continue
        tag = "[red]problem[/]" if p.severity == "error" else "[yellow]warning[/]"
        out.print(f"{tag} {escape(f'[{p.code}]')} {escape(p.message)}", soft_wrap=True)
    paths: dict[str, int] = {}
    for path in report.load.get("layers", {}).values():
        paths[path] = paths.get(path, 0) + 1
    if quiet and report.ok:
        return
    conv, f16, bar = m.get("converted", {}), m.get("fp16_dequant", {}), report.bar
    status = "OK" if report.ok else f"FAILED: {sum(p.severity == 'error' for p in report.problems)} problem(s)"
    if conv:
        layers = ", ".join(f"{n} {k}" for k, n in sorted(paths.items()))
        out.print(
            f"{status}: {escape(report.architecture)} on {report.device}, {sum(paths.values())} layers ({layers}); "
            f"{report.output} mean rel err {_fmt(conv.get('mean_rel_err'))} "
            f"({ref16} dequantized {_fmt(f16.get('mean_rel_err'))}, "
            f"limit {_fmt(bar.get('mean_rel_err_limit'))})"
            + (
                # the rule's own numbers: agreement at the decided positions (the table has all)
                f", top-1 at {conv['decided_positions']} decided positions {_fmt(conv.get('top1_decided'), '.4f')} "
                f"({ref16} {_fmt(f16.get('top1_decided'), '.4f')}, min {_fmt(bar.get('top1_min'), '.4f')})"
                if conv.get("top1") is not None and "decided_positions" in conv
                else f", top-1 {_fmt(conv.get('top1'), '.4f')} ({ref16} {_fmt(f16.get('top1'), '.4f')})"
                if conv.get("top1") is not None
                else f", cosine {_fmt(conv.get('cosine'), '.6f')} ({ref16} {_fmt(f16.get('cosine'), '.6f')})"
                if "cosine" in conv
                else ""
            )
            + f"; {report.wall_s:.1f} s",
            soft_wrap=True,
        )
    else:
        out.print(f"{status}: the models were not run", soft_wrap=True)
