"""transformers' ``from_pretrained`` on a converted model folder: the quantization config and
``HfQuantizer`` of ``quant_method: "marlin-convert"``, registered by ``import converter``
(:mod:`converter.hf_hook`; this module imports torch and transformers).

How ``from_pretrained`` runs with them (transformers 5.17 and 5.25):

1. Our config holds ``config.json``'s ``quantization_config`` whole. The quantizer checks
   ``device_map`` and, in the hook transformers calls with the config before it resolves
   the weight files (``update_tp_plan`` in 5.17, ``update_attn_implementation`` in 5.25),
   sets ``config.transformers_weights`` to the artifact's weight file: folder mode writes
   a guard there instead, which stops a plain ``from_pretrained`` (no ``import converter``)
   before it builds anything (docs/serving.md).
2. Before weight loading (the skeleton is on ``meta``), the skeleton is bound to the
   artifact exactly as :func:`~converter.model.loader.load_model` binds its own, every
   quantized linear becomes a :class:`PendingLayer` (no tensors, so no fp16 weight is
   allocated, loaded or initialized for it), every other tensor's parameter takes the
   artifact tensor's own dtype (transformers casts to the parameter's dtype, and
   ``load_model`` keeps each tensor's own) unless ``from_pretrained`` was given a
   ``dtype`` other than the one ``"auto"`` resolves to, which they then take
   (:func:`_dtype_asked`), and the layers' own tensors are marked as
   expected in the checkpoint and unused by the model (no UNEXPECTED table).
3. transformers loads the other tensors and ties the tied ones.
4. After loading, each placeholder becomes the module ``load_model`` makes for that layer
   (:meth:`~converter.model.layers.ConvertedLayers.module`), with its buffers on the device
   ``device_map`` gives that module: our kernel on CUDA, the exact path on the CPU. It is
   built only now because transformers replaces every non-persistent buffer of the model
   with an empty one after loading (``_move_missing_keys_from_meta_to_device``).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import re
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..artifact.problems import ProblemCode
from ..constants import PRODUCER_NAME
from . import ModelError
from .build import check_load_shapes, model_kind, promote_plain_linears
from .config import model_fields
from .fuse import enabled as fuse_enabled
from .guard import check_config, offline
from .layers import ConvertedLayers, LoadReport
from .modules import _TORCH_DTYPES  # the one safetensors-code -> torch dtype table
from .names import candidates

#: The buffer of a :class:`PendingLayer` that stands for its layer's bytes.
SIZE_BUFFER = "marlin_bytes"


def _local_folder(config: Any) -> Path | None:
    """The local folder transformers built ``config`` from (None for a hub id)."""
    name = str(getattr(config, "name_or_path", "") or "")
    return Path(name) if name and Path(name).is_dir() else None


class MarlinConvertConfig(QuantizationConfigMixin):
    """``quantization_config`` of a converted folder (converter/artifact/hf_config.py writes
    it), every field kept as written; ``weight_file`` names the artifact beside config.json."""

    def __init__(self, weight_file: str | None = None, **kwargs: Any) -> None:
        kwargs.pop("quant_method", None)
        self.quant_method = PRODUCER_NAME
        self.weight_file = weight_file
        for key, value in kwargs.items():
            setattr(self, key, value)


class PendingLayer(nn.Module):
    """A quantized linear's place while transformers loads the other tensors: it holds no
    weight, so transformers neither allocates, loads nor initializes one for it; the
    quantizer replaces it with the layer's module once loading is done.

    Its one buffer, ``marlin_bytes`` (one byte, on ``meta``), stands for the layer's
    device memory when accelerate sizes the modules for a ``device_map`` such as ``"auto"``:
    the quantizer's :meth:`~MarlinConvertHfQuantizer.param_element_size` reports ``nbytes``
    for it, so a placement counts each layer at its size while loading allocates one byte."""

    def __init__(self, layer: str, in_features: int, out_features: int, nbytes: int = 1) -> None:
        super().__init__()
        self.layer_name, self.in_features, self.out_features = layer, in_features, out_features
        self.nbytes = max(1, int(nbytes))
        self.register_buffer(SIZE_BUFFER, torch.empty(1, dtype=torch.uint8, device="meta"), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ModelError("not loaded: from_pretrained stopped before building this layer", tensor=self.layer_name)


def device_of(module: str, device_map: Mapping[str, Any] | None) -> torch.device:
    """The device ``device_map`` gives module ``module`` (its longest matching key; no map: the CPU).

    Raises:
        ModelError: no key of the map covers the module.
    """
    if not device_map:
        return torch.device("cpu")
    keys = [k for k in device_map if k == "" or module == k or module.startswith(k + ".")]
    if not keys:
        raise ModelError(f"device_map gives no device to module {module}", tensor=module)
    value = device_map[max(keys, key=len)]
    dev = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _kernel_on(dev: torch.device) -> Any:
    """``loader._marlin_kernel`` with CuPy's and torch's current device set to ``dev``
    (the factory builds on the current device)."""
    from ..gpu.runtime import cupy_module
    from . import loader

    cp = cupy_module()

    def make(*args: Any, **kwargs: Any) -> Any:
        with cp.cuda.Device(dev.index), torch.cuda.device(dev):
            return loader._marlin_kernel(*args, **kwargs)

    return make


#: Set by :func:`dtype_asked`: from_pretrained's dtype was given on purpose, even where it
#: equals what "auto" resolves to (transformers hands the quantizer the resolved dtype only).
_ASKED: contextvars.ContextVar[bool] = contextvars.ContextVar("marlin_dtype_asked", default=False)


@contextlib.contextmanager
def dtype_asked() -> Iterator[None]:
    """Within it, ``from_pretrained(..., dtype=X)`` loads the unquantized tensors in ``X``
    whatever ``"auto"`` would resolve to (``load_model(dtype=X)``'s model)."""
    token = _ASKED.set(True)
    try:
        yield
    finally:
        _ASKED.reset(token)


def _dtype_asked(model: nn.Module, cfg: Mapping[str, Any], weights: Path) -> bool:
    """Whether ``from_pretrained`` was given a ``dtype`` other than the one ``"auto"`` (the
    default) resolves to: transformers has set the model's config to the dtype it
    resolved, and ``"auto"`` reads config.json's, or without one the first floating-point
    tensor of the weights file (asked of transformers itself). Then the other tensors
    load in that dtype, as for any model; otherwise each keeps the artifact tensor's own,
    as ``load_model`` keeps it (a bf16 embedding under a float16 config stays bf16)."""
    resolved = getattr(model.config, "dtype", None)
    if not isinstance(resolved, torch.dtype):
        return False
    if _ASKED.get():
        return True
    named = cfg.get("dtype") or cfg.get("torch_dtype")
    if named is not None:
        auto = getattr(torch, str(named).removeprefix("torch."), None)
    else:
        from transformers.modeling_utils import get_state_dict_dtype, load_state_dict

        auto = get_state_dict_dtype(load_state_dict(str(weights), map_location="meta", weights_only=True))
    return resolved != auto


def _retype(model: nn.Module, name: str, dtype: torch.dtype) -> None:
    """Give model tensor ``name`` (still on ``meta``) the dtype ``dtype``."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    for table in (mod._parameters, mod._buffers):
        t = table.get(attr)
        if t is not None and t.dtype != dtype:
            fresh = torch.empty(t.shape, dtype=dtype, device=t.device)
            table[attr] = nn.Parameter(fresh, requires_grad=False) if table is mod._parameters else fresh


class MarlinConvertHfQuantizer(HfQuantizer):
    """Loads a converted folder through ``from_pretrained`` (see the module docstring)."""

    requires_calibration = True  # only a converted folder: it quantizes nothing itself

    def __init__(self, quantization_config: MarlinConvertConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._layers: ConvertedLayers | None = None
        self._close: Any = None
        self._device_map: Mapping[str, Any] | None = None
        self._swaps: dict[str, str] = {}
        self._report: LoadReport | None = None
        self._checked = False
        # Offline from the first hook that sees a local folder's config (a hub id's: from
        # update_dtype, after its files are fetched) to the end of the load: transformers
        # builds the modules between two hooks, and a module's __init__ may fetch (model_type
        # "rwkv" asks the Hub for a kernel). A load that fails between two hooks is released
        # when the quantizer is collected.
        self._offline = contextlib.ExitStack()
        self._is_offline = False
        self._cfg_path = Path("config.json")
        weakref.finalize(self, self._offline.close)

    def update_dtype(self, dtype: Any) -> Any:  # the last hook before transformers builds the modules
        self._go_offline(self._cfg_path)
        return dtype

    def _go_offline(self, cfg_path: Path) -> None:
        if not self._is_offline:
            self._offline.enter_context(offline(cfg_path))
            self._is_offline = True

    def _back_online(self) -> None:
        self._offline.close()
        self._is_offline = False

    def validate_environment(self, *args: Any, device_map: Any = None, **kwargs: Any) -> None:
        """Check a ``device_map`` of modules to devices; transformers calls this with the map
        the caller gave, and again with the one accelerate inferred for ``"auto"``,
        ``"balanced"``, ``"sequential"`` (and ``max_memory``), which is kept for placing the
        layers. Registers the ``sdpa_kv_heads`` attention, so ``attn_implementation`` may name it.

        Raises:
            ModelError: a module on disk (a converted model is not offloaded), a device other
                than the CPU or CUDA, or a converted layer on the CPU beside a GPU.
            GpuUnavailableError: CUDA without CuPy or a usable GPU.
        """
        from .attention import register as register_attention
        from .loader import resolve_device

        register_attention()  # transformers is fully imported here; the model is not built yet
        if not isinstance(device_map, Mapping):
            return
        disk = sorted(k or "the whole model" for k, v in device_map.items() if v == "disk")
        if disk:
            more = f" and {len(disk) - 2} more" if len(disk) > 2 else ""
            raise ModelError(
                f"device_map puts {', '.join(disk[:2])}{more} on disk: a {PRODUCER_NAME} model is not offloaded; "
                "give the GPUs or the CPU more max_memory"
            )
        for value in device_map.values():
            resolve_device(f"cuda:{value}" if isinstance(value, int) else value)
        self._device_map = dict(device_map)
        self._check_placement(self._device_map)

    def _check_placement(self, device_map: Mapping[str, Any]) -> None:
        """A converted layer may sit on the CPU only when no module sits on a GPU: beside
        a GPU, accelerate runs a CPU-mapped module on the GPU with its weights offloaded,
        which a converted layer cannot do."""
        if not self._swaps or not any(device_of("", {"": v}).type == "cuda" for v in device_map.values()):
            return
        on_cpu = sorted(m for m in self._swaps if device_of(m, device_map).type == "cpu")
        if on_cpu:
            more = f" and {len(on_cpu) - 1} more" if len(on_cpu) > 1 else ""
            raise ModelError(
                f"device_map puts converted layer {on_cpu[0]}{more} on the CPU beside a GPU: accelerate would run "
                "it on the GPU with its weights offloaded, which a converted layer cannot do; map it to a GPU "
                "(max_memory) or put the whole model on the CPU",
                tensor=on_cpu[0],
            )

    def param_element_size(self, model: Any, param_name: str, param: Any) -> float:
        """Bytes an element of ``param_name`` takes on the device, for accelerate's module
        sizes: a :class:`PendingLayer`'s one-byte stand-in counts its whole layer."""
        if param_name.rpartition(".")[2] == SIZE_BUFFER:
            holder = model.get_submodule(param_name.rpartition(".")[0])
            if isinstance(holder, PendingLayer):
                return float(holder.nbytes)
        return float(param.element_size())

    def update_tp_plan(self, config: Any) -> Any:  # transformers 5.17 calls this before resolving the weights
        self._check_config(config)
        return self._claim_weights(config)

    def update_attn_implementation(self, config: Any) -> Any:  # transformers 5.25: same place
        self._check_config(config)
        return self._claim_weights(config)

    def _check_config(self, config: Any) -> None:
        """The checks of :func:`~converter.model.build.check_fields` (remote code, backbone
        repos, hub ids, sizes ...), offline, on the config transformers built and on the
        folder's ``config.json`` as written, and load_model's layer count against the
        artifact (:func:`~converter.model.build.check_depth`): the first hook that sees the
        config, before any weight file is resolved or any module built.

        Raises:
            ModelError: one line naming ``config.json`` and the field.
            ArtifactError: the folder's artifact cannot be opened.
        """
        from ..artifact.reader import open_artifact
        from ..formats.hf_checkpoint import read_json_file
        from .build import check_depth, check_fields

        if self._checked:
            return
        folder = _local_folder(config)
        cfg_path = folder / "config.json" if folder is not None else Path("config.json")
        self._cfg_path = cfg_path
        if folder is not None:  # a hub id's weights are fetched after this hook
            self._go_offline(cfg_path)
        with self._released_on_error(), offline(cfg_path):
            built = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
            check_config(model_fields(built), path=cfg_path)
            if folder is not None and cfg_path.is_file():
                raw = read_json_file(cfg_path)
                if isinstance(raw, dict):
                    check_fields(model_fields(raw), path=cfg_path)
                    # transformers builds every layer the config asks for before the
                    # weights are bound: a planted count would take unbounded time and memory
                    with open_artifact(folder) as art:
                        check_depth(raw, art.file.infos, path=cfg_path, what="artifact")
        self._checked = True

    @contextlib.contextmanager
    def _released_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self._back_online()
            raise

    def _claim_weights(self, config: Any) -> Any:
        """Point ``config.transformers_weights`` at the artifact, replacing folder mode's guard.

        Raises:
            ModelError: ``weight_file`` is not a safetensors file or index name, or not
                the folder's artifact.
        """
        wf = getattr(self.quantization_config, "weight_file", None)
        folder = _local_folder(config)
        from .loader import check_weight_file

        with self._released_on_error():
            check_weight_file(folder, wf)
        config.transformers_weights = wf
        return config

    def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        from .loader import read_converted_config

        files = kwargs.get("checkpoint_files")
        if not files:
            raise ModelError(f"a {PRODUCER_NAME} model loads from its folder's artifact: from_pretrained found none")
        with self._released_on_error():
            folder, cfg = read_converted_config(Path(files[0]).parent)
            with offline(folder / "config.json"):
                return self._before_weight_loading(model, folder, cfg, kwargs)

    def _before_weight_loading(self, model: Any, folder: Path, cfg: dict[str, Any], kwargs: dict[str, Any]) -> Any:
        from .build import check_fields

        check_fields(model_fields(cfg), path=folder / "config.json")  # the artifact's own folder, whatever the hub said
        given = kwargs.get("device_map")
        self._device_map = dict(given) if isinstance(given, Mapping) else None  # "auto": inferred later
        # A hub download holds config.json and the weights, not the tokenizer files the manifest lists.
        layers = ConvertedLayers(folder, cfg, tolerate=frozenset({ProblemCode.FOLDER_FILE_MISSING.value}))
        # Closed after loading, or with the quantizer if transformers stops before that.
        self._close = weakref.finalize(self, layers.close)
        try:
            asked = _dtype_asked(model, cfg, Path(kwargs["checkpoint_files"][0]))
            self._swap_in_placeholders(model, folder, layers, keep_own_dtypes=not asked)
        except BaseException:
            self._close()
            raise
        return model

    def _swap_in_placeholders(
        self, model: Any, folder: Path, layers: ConvertedLayers, *, keep_own_dtypes: bool = True
    ) -> None:
        arch = type(model).__name__
        ties = getattr(model, "all_tied_weights_keys", None)
        b, _ = layers.bind(model, arch=arch, strict=True, ties=ties)
        check_load_shapes(model, b, layers.art.file.infos, path=folder)  # as load_model refuses them, in one line
        for module, layer in b.swaps.items():
            parent_name, _, child = module.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            slot = layers.slots[layer]
            setattr(parent, child, PendingLayer(layer, slot.size_k, slot.size_n, layers.device_bytes(layer)))
        if fuse_enabled(None):
            layers.plan_fusion(b.swaps)  # applies to the layers that land on a GPU
        for target, source in list((ties or {}).items()):
            if {target.rpartition(".")[0], source.rpartition(".")[0]} & b.swaps.keys():
                del ties[target]  # a swapped module has no weight left to tie
        for tensor, names in b.loads.items() if keep_own_dtypes else ():
            dtype = _TORCH_DTYPES.get(layers.art.file.infos[tensor].dtype)
            if dtype is not None:
                for name in names:
                    _retype(model, name, dtype)
        prefix = model.base_model_prefix or ""
        ours = sorted({c for t in layers.owned_tensors(b) for c in candidates(t, prefix)})
        if ours:
            quiet = "^(?:" + "|".join(map(re.escape, ours)) + ")$"
            model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | {quiet}
        self._layers, self._swaps = layers, dict(b.swaps)
        self._report = LoadReport(str(folder), "", arch, model_kind(model))
        self._report.tensors = {t: list(n) for t, n in b.loads.items()}
        self._report.unused = list(b.unused)

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        layers, report = self._layers, self._report
        try:
            if layers is None or report is None:
                return model
            with offline(Path(report.folder) / "config.json"):
                return self._after_weight_loading(model, layers, report)
        finally:
            self._back_online()

    def _after_weight_loading(self, model: Any, layers: ConvertedLayers, report: LoadReport) -> Any:
        from ..safetensors_io import release_mapped_pages

        inferred = getattr(model, "hf_device_map", None)
        if self._device_map is None and isinstance(inferred, Mapping):
            self._device_map = dict(inferred)
        try:
            if self._device_map is not None:
                self._check_placement(self._device_map)
            devices = set()
            for module, layer in self._swaps.items():
                dev = device_of(module, self._device_map)
                devices.add(str(dev))
                factory = _kernel_on(dev) if dev.type == "cuda" else None
                parent_name, _, child = module.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, layers.module(module, layer, dev, report, factory))
                release_mapped_pages()  # the layer is copied: its pages of the artifact need not stay resident
        finally:
            self._close()
            self._layers = None
        promote_plain_linears(model)
        report.device = ",".join(sorted(devices)) or str(device_of("", self._device_map))
        model.marlin_report = report
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return False  # the swapped modules hold no state_dict: save the converted folder itself

    @property
    def is_compileable(self) -> bool:
        # generate's compile path (static cache) is skipped for a quantizer that says no; our
        # modules are plain torch, or the GEMM as a torch op with a fake implementation.
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Register :class:`MarlinConvertConfig` and :class:`MarlinConvertHfQuantizer` under
    ``quant_method: "marlin-convert"``; a second call does nothing."""
    # The registry module itself: this runs as soon as it has run (converter/hf_hook.py),
    # while the transformers.quantizers package may still be importing it.
    auto = importlib.import_module("transformers.quantizers.auto")

    if PRODUCER_NAME not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        auto.register_quantization_config(PRODUCER_NAME)(MarlinConvertConfig)
    if PRODUCER_NAME not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer(PRODUCER_NAME)(MarlinConvertHfQuantizer)
