"""``load_model``: a converted model folder as a ready-to-run transformers model."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import PRODUCER_NAME, TINYLOOP_MESSAGE
from ..errors import ConverterError, GpuUnavailableError
from ..jsonio import link_out_of, not_regular
from . import ModelError
from .build import (
    apply_binding,
    check_depth,
    check_skeleton,
    config_dtype,
    hf_config,
    import_stack,
    materialize_missing,
    model_class,
    weights_bytes,
)
from .config import torch_dtype
from .fuse import enabled as fuse_enabled
from .guard import offline
from .layers import ConvertedLayers, KernelFactory, LoadReport, dequantized_weight
from .names import missing_names, untie

__all__ = [
    "KernelFactory",
    "LoadReport",
    "build_converted",
    "check_weight_file",
    "dequantized_weight",
    "load_model",
    "read_converted_config",
    "resolve_device",
]


def read_converted_config(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """``(folder, config.json dict)`` of a converted model folder.

    Raises:
        ConverterError: the path does not exist.
        ModelError: not a folder, no ``config.json``, a ``config.json`` that
            ``marlin-convert`` did not write, or a ``.tinyloop`` conversion.
    """
    from ..formats.hf_checkpoint import read_json_file

    folder = Path(path)
    if not folder.exists():
        raise ConverterError("no such file or directory", path=folder)
    hint = (
        "a model is loaded from the folder that marlin-convert IN OUTDIR writes "
        "(config.json, the artifact, the tokenizer)"
    )
    if not folder.is_dir():
        raise ModelError(f"not a converted model folder: {hint}, not from a single file", path=folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        try:
            mode = cfg_path.stat().st_mode  # through a symlink, as the read would go
        except OSError:
            raise ModelError(f"not a converted model folder: no config.json; {hint}", path=folder) from None
        raise ModelError(f"{not_regular(mode)}; a converted folder's config.json is a file", path=cfg_path)
    real = link_out_of(cfg_path, folder)
    if real is not None:  # as the artifact's files (resolve_artifact) and a source's
        raise ModelError(
            f"is a symbolic link to {real}, outside the model folder; links that leave it are not followed "
            "(copy the file into the folder)",
            path=cfg_path,
        )
    cfg = read_json_file(cfg_path)
    qc = cfg.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != PRODUCER_NAME:
        raise ModelError(
            f"not a converted model folder: quantization_config.quant_method is {method!r}, not {PRODUCER_NAME!r} "
            "(a source checkpoint? convert it first: marlin-convert IN OUTDIR)",
            path=cfg_path,
            tensor="quantization_config",
        )
    if cfg.get("model_type") == "tinyloop" or qc.get("source_format") == "tinyloop":
        raise ModelError(TINYLOOP_MESSAGE, path=folder)
    if "weight_file" in qc:  # load_model reads the folder's artifact whatever it says: refused as from_pretrained does
        check_weight_file(folder, qc["weight_file"])
    return folder, cfg


def check_weight_file(folder: Path | None, weight_file: Any) -> None:
    """``quantization_config.weight_file`` must name the artifact that load_model and
    marlin-verify read in ``folder``: transformers takes the unconverted tensors
    (embeddings, norms) from the file it names, and another file there would give the
    model other weights than the checked ones.

    Args:
        folder: the converted folder, or None (a hub id: the name's form is checked only).

    Raises:
        ModelError: not a safetensors file or index name, or another file than the artifact.
        ArtifactError: the folder holds no single artifact.
    """
    from ..artifact.sharded_reader import resolve_artifact

    cfg_path = folder / "config.json" if folder is not None else "config.json"
    if (
        not isinstance(weight_file, str)
        or Path(weight_file).name != weight_file
        or not weight_file.endswith((".safetensors", ".safetensors.index.json"))
    ):
        raise ModelError(
            f"{weight_file!r} is not the name of a safetensors file or index beside config.json",
            path=cfg_path,
            tensor="quantization_config.weight_file",
        )
    if folder is None:
        return
    index, files = resolve_artifact(folder)
    artifact = Path(index.path).name if index is not None else files[0].name
    if weight_file != artifact:
        raise ModelError(
            f"names {weight_file!r}, but the folder's artifact is {artifact!r} (what load_model and "
            "marlin-verify read): transformers would take the unconverted tensors from another file",
            path=cfg_path,
            tensor="quantization_config.weight_file",
        )


def resolve_device(device: Any) -> Any:
    """A ``torch.device``; for CUDA also checks that CuPy, an sm_80+ GPU and torch's CUDA are there.

    Raises:
        GpuUnavailableError: CUDA asked for but not usable (one line saying why).
        ModelError: a device string torch does not parse.
    """
    torch, _ = import_stack()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelError(f"device {device!r} is not a torch device ({exc})") from None
    if dev.type == "cuda":
        from ..gpu.runtime import require_gpu

        require_gpu()
        if not torch.cuda.is_available():
            raise GpuUnavailableError("torch has no CUDA support here (torch.cuda.is_available() is False)")
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ModelError(f"device {device!r}: only 'cpu' and 'cuda' are supported")
    return dev


def _marlin_kernel(
    name: str,
    size_k: int,
    size_n: int,
    group_size: int,
    B: np.ndarray,
    scales: np.ndarray,
    delta: np.ndarray,
    perm: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    padded_n: int,
) -> Any:
    """The default kernel factory: :class:`~converter.gpu.api.MarlinLinearModule` on the current GPU."""
    from ..gpu.api import MarlinLinear, MarlinLinearModule
    from ..gpu.runtime import cupy_module

    layer = MarlinLinear(name, size_k, size_n, group_size, B, scales, delta, perm, bias, padded_n=padded_n)
    module = MarlinLinearModule(layer)  # copies the operands into torch's memory
    del layer
    # CuPy's pool would keep the layer's (now unused) device memory cached: a second copy of the model.
    cupy_module().get_default_memory_pool().free_all_blocks()
    return module


def build_converted(
    path: str | Path,
    device: Any = "cuda",
    *,
    strict: bool = True,
    attn_implementation: str | None = None,
    validate: bool = True,
    kernel_factory: KernelFactory | None = None,
    fuse: bool | None = None,
    dtype: Any = None,
) -> tuple[Any, LoadReport]:
    """Build the converted model; see :func:`load_model` (this also returns the report).

    Args:
        validate: run the ``--shapes`` checks first (``marlin-verify --model`` has run them).
        kernel_factory: makes the fast-path module of a converted layer; default our GPU
            kernel when ``device`` is CUDA. Given on the CPU (tests), it replaces the
            exact path so the kernel swap logic runs without a GPU.
    """
    folder, cfg = read_converted_config(path)
    import_stack()
    if attn_implementation is not None:
        from . import attention

        if attn_implementation == attention.NAME:
            attention.register()
    dev = resolve_device(device)
    cfg_path = folder / "config.json"
    with offline(cfg_path):
        layers = ConvertedLayers(folder, cfg, validate=validate)
        try:
            return _build(layers, folder, cfg, dev, strict, attn_implementation, kernel_factory, fuse, dtype)
        finally:
            layers.close()


def _build(
    layers: ConvertedLayers,
    folder: Path,
    cfg: dict[str, Any],
    dev: Any,
    strict: bool,
    attn_implementation: str | None,
    kernel_factory: KernelFactory | None,
    fuse: bool | None = None,
    asked: Any = None,
) -> tuple[Any, LoadReport]:
    """Check before building: the layer count against the artifact; then a skeleton on
    the meta device, its names and shapes bound to the artifact and its bytes bounded
    (:func:`~converter.model.build.check_skeleton`); only then the real skeleton."""
    cfg_path = folder / "config.json"
    infos = layers.art.file.infos
    check_depth(cfg, infos, path=cfg_path, what="artifact")
    config = hf_config(cfg, path=cfg_path)
    mc = model_class(config, cfg, path=cfg_path)
    asked = torch_dtype(asked)  # "auto" is None: each tensor its own, as from_pretrained's default
    dtype = asked or config_dtype(cfg)
    skeleton = mc.build(config, dtype=dtype, attn_implementation=attn_implementation, path=cfg_path, meta=True)
    b, _ = layers.bind(skeleton, arch=mc.name, strict=strict)
    check_skeleton(skeleton, b.swaps, weight_bytes=weights_bytes(infos), path=cfg_path, what="artifact")
    del skeleton, b
    if dev.type == "cuda":
        from ..gpu.runtime import cupy_module

        cupy_module().cuda.Device(dev.index).use()
    factory = kernel_factory or (_marlin_kernel if dev.type == "cuda" else None)
    model = mc.build(config, dtype=dtype, attn_implementation=attn_implementation, path=cfg_path)
    report = LoadReport(str(folder), str(dev), mc.name, mc.kind)
    b, groups = layers.bind(model, arch=mc.name, strict=strict)
    if factory is not None and fuse_enabled(fuse):
        layers.plan_fusion(b.swaps)
    art = layers.art
    report.warnings += untie(b, lambda a, o: same_tensor(art.file, a, art.file, o))
    apply_binding(
        model,
        b,
        make_layer=lambda module, layer: layers.module(module, layer, dev, report, factory),
        load_tensor=layers.tensor if asked is None else lambda name: _float_as(layers.tensor(name), dtype),
        path=folder,
    )
    materialize_missing(model, missing_names(groups, b.missing))
    report.tensors = {t: list(n) for t, n in b.loads.items()}
    report.missing = list(b.missing)
    report.unused = list(b.unused)
    model.to(dev)
    return model, report


def _float_as(t: Any, dtype: Any) -> Any:
    """``t`` in ``dtype`` if it is floating point (embeddings, norms, heads), else as is."""
    return t.to(dtype) if t.is_floating_point() else t


def build_spread(
    path: str | Path,
    device_map: str | dict[str, Any],
    *,
    max_memory: dict[Any, Any] | None = None,
    attn_implementation: str | None = None,
    dtype: Any = None,
) -> tuple[Any, LoadReport]:
    """The converted model spread by ``device_map`` (``"auto"``, ``"balanced"``,
    ``"sequential"`` or a dict of modules to devices, with ``max_memory``): transformers'
    ``from_pretrained`` through this package's quantizer (docs/serving.md), with the class
    ``load_model`` would build, offline, no remote code; ``dtype`` (a torch dtype or its
    name) as ``load_model``'s: given, it holds even where it equals config.json's; None:
    each tensor its own. Returns the model and its load report.

    Raises:
        ModelError: as ``from_pretrained`` with ``import converter`` (a map that offloads to
            disk, a converted layer on the CPU beside a GPU, ...).
    """
    from ..hf_hook import register_now

    folder, cfg = read_converted_config(path)
    import_stack()
    if not register_now():
        raise ModelError(f"the transformers quantizer of {PRODUCER_NAME} could not be registered")
    cfg_path = folder / "config.json"
    config = hf_config(cfg, path=cfg_path)
    mc = model_class(config, cfg, path=cfg_path)
    asked = torch_dtype(dtype)
    kwargs: dict[str, Any] = {
        "device_map": device_map,
        "trust_remote_code": False,
        # "auto": each tensor its own dtype, as load_model (config.json's would cast a
        # folder whose config names none to fp32)
        "dtype": asked or "auto",
    }
    if max_memory is not None:
        kwargs["max_memory"] = max_memory
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    from .hf_quantizer import dtype_asked

    with offline(cfg_path), dtype_asked() if asked is not None else contextlib.nullcontext():
        model = (mc.auto or mc.cls).from_pretrained(folder, **kwargs)
    return model.eval(), model.marlin_report


def same_tensor(fa: Any, a: str, fb: Any, b: str) -> bool:
    """Whether tensor ``a`` of file ``fa`` and ``b`` of ``fb`` have one dtype, shape and bytes."""
    ia, ib = fa.infos[a], fb.infos[b]
    return (ia.dtype, tuple(ia.shape)) == (ib.dtype, tuple(ib.shape)) and bytes(fa.raw(a)) == bytes(fb.raw(b))


def load_model(
    path: str | Path,
    device: Any = "cuda",
    *,
    strict: bool = True,
    attn_implementation: str | None = None,
    fuse: bool | None = None,
    dtype: Any = None,
) -> Any:
    """Load a converted model folder as a ``transformers`` model, offline.

    The model is built from the folder's ``config.json`` (its ``quantization_config`` is
    ignored) with transformers' own classes (``AutoModelForCausalLM`` / ``AutoModel`` ...
    ``.from_config``, the class ``architectures`` names), never with remote code
    (``trust_remote_code=False``), offline whatever the environment says: any network
    attempt while building is a ModelError naming ``config.json``
    (:mod:`converter.model.guard`). A ``config.json`` that names remote code or a hub id,
    asks for more layers than the artifact holds, or describes tensors whose shapes or
    bytes the artifact does not justify is refused on a skeleton built on the meta
    device, before anything is allocated. Then:

    * every converted layer replaces its linear module: on CUDA our Marlin kernel
      (``MarlinLinearModule``; a layer outside its limits runs the exact path and is
      listed), on the CPU an exact path from the artifact's own tensors
      (``(q - 8) * s + delta`` in fp32, act-order gather, fp16 input and output);
    * a quantized layer that passed through unconverted runs through its exact
      dequantization rounded to fp16 (listed: not on the fast path);
    * every other tensor (embeddings, norms, unquantized heads, biases, tied weights)
      loads in its own dtype; a tied weight is one tensor under every tied name.

    Tensor names are matched with and without the model's ``base_model_prefix`` (a
    ``bert.``-prefixed checkpoint loads into ``BertModel``).

    After ``import converter``, transformers' ``from_pretrained(path, device_map=...)``
    builds the same model (:mod:`converter.model.hf_quantizer`): the same modules from
    the same code (:class:`~converter.model.layers.ConvertedLayers`), the same dtypes,
    bitwise the same outputs.

    Args:
        path: the converted model folder (``marlin-convert IN OUTDIR``).
        device: ``"cuda"`` (default, needs CuPy and an sm_80+ GPU) or ``"cpu"``.
        strict: refuse a model parameter the artifact does not feed (default); with
            False it keeps its initial value and is listed in the report's ``missing``.
        attn_implementation: passed to transformers (``"eager"``, ``"sdpa"``); None for its default.
        fuse: on the GPU, run sibling layers that read one input (``q/k/v_proj``,
            ``gate/up_proj``) as one kernel (:mod:`converter.model.fuse`); None: on unless
            the environment sets ``MARLIN_FUSE=0``.
        dtype: as ``from_pretrained``'s: every floating-point tensor outside the
            converted and pass-through layers (embeddings, norms, unquantized heads) loads
            in it, and the model is built in it (buffers such as RoPE's stay fp32 as
            transformers computes them; ``model.to(dtype)`` would round those too). None
            or ``"auto"``: each tensor in its own dtype. The converted layers keep their
            operands either way.

    Returns:
        The model in eval mode, on ``device``; ``model.marlin_report`` is a
        :class:`LoadReport`. Swapped modules take and return activations in any float
        dtype ``(..., K)`` -> ``(..., N)``.

    Raises:
        ModelError: not a converted model folder; a ``.tinyloop`` conversion; an
            architecture or ``model_type`` transformers does not know; layers no module
            matches or quantized modules without a layer (all named); a tensor whose
            shape disagrees with the model; missing tensors (``strict``); transformers
            or torch not installed.
        ArtifactError: the artifact fails ``marlin-verify --shapes``.
        GpuUnavailableError: ``device="cuda"`` without CuPy, a GPU, or torch CUDA.
    """
    model, report = build_converted(
        path, device, strict=strict, attn_implementation=attn_implementation, fuse=fuse, dtype=dtype
    )
    model.marlin_report = report
    return model
