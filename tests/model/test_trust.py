"""Issue 42, the model path: a model folder is data, never code or a network request;
config.json is checked before anything is built; --text is read as far as needed; the
top-1 rule of --model is fair to near-ties. Every refusal is one ModelError line."""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from converter.convert import convert
from converter.model import ModelError, load_model
from converter.model import inputs as model_inputs
from converter.model import verify as mv
from converter.model.guard import NetworkAttempt, check_config, offline, short
from converter.model.verify import input_ids, output_metrics, position_errors, reference_decisions, top1_verdict
from tests.helpers.artifact_edit import reseal_folder_files, rewrite_artifact_arrays
from tests.helpers.model_fixture import write_tiny_llama
from tests.helpers.paths import REPO


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("trust")
    src = write_tiny_llama(root / "src")
    convert(src, str(root / "out") + "/", pad=False)
    return src, root / "out"


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record every connection attempt that gets past the guard (there must be none)."""
    attempts: list[object] = []

    def connect(self: object, *args: object) -> None:
        attempts.append(args)
        raise OSError("test: network attempted")

    def create_connection(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise OSError("test: network attempted")

    def getaddrinfo(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise OSError("test: name lookup attempted")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts


def _edited(out: Path, to: Path, **fields: object) -> Path:
    shutil.copytree(out, to)
    cfg = json.loads((to / "config.json").read_text())
    for k, v in fields.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (to / "config.json").write_text(json.dumps(cfg))
    reseal_folder_files(to)
    return to


_DROP = object()


def _refused(folder: Path) -> str:
    with pytest.raises(ModelError) as ei:
        load_model(folder, "cpu")
    line = str(ei.value)
    assert "\n" not in line and len(line) < 2500, line
    return line


# --------------------------------------------------------------------------- 1. offline, code-free


def test_offline_forces_the_switches_and_closes_the_socket_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hc

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    before = (socket.socket.connect, socket.create_connection, socket.getaddrinfo)
    more = (socket.gethostbyname, socket.gethostbyname_ex, socket.gethostbyaddr, socket.socket.sendto)
    with offline("x/config.json"):
        assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
        assert hc.HF_HUB_OFFLINE is True
        with pytest.raises(NetworkAttempt, match=r"^x/config.json: asks for a network connection"):
            socket.create_connection(("example.com", 80))
        with pytest.raises(NetworkAttempt), socket.socket() as s:
            s.connect(("127.0.0.1", 9))
        with pytest.raises(NetworkAttempt):
            socket.getaddrinfo("huggingface.co", 443)
        # these reached the resolver or the network past the guard before (no getaddrinfo, no connect)
        for lookup in (socket.gethostbyname, socket.gethostbyname_ex, socket.gethostbyaddr):
            with pytest.raises(NetworkAttempt, match=r"^x/config.json: asks for a network connection"):
                lookup("huggingface.co")
        with pytest.raises(NetworkAttempt), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"x", ("127.0.0.1", 9))
    assert (socket.socket.connect, socket.create_connection, socket.getaddrinfo) == before
    assert (socket.gethostbyname, socket.gethostbyname_ex, socket.gethostbyaddr, socket.socket.sendto) == more
    assert os.environ["HF_HUB_OFFLINE"] == "0" and "TRANSFORMERS_OFFLINE" not in os.environ
    assert hc.HF_HUB_OFFLINE is False


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"model_type": "detr", "use_timm_backbone": False, "backbone": "evil/resnet"}, "backbone", "backbone fetched"),
        ({"use_timm_backbone": True}, "use_timm_backbone", "backbone fetched"),
        ({"auto_map": {"AutoModelForCausalLM": "evil.Model"}}, "auto_map", "names remote code"),
        ({"backbone_config": "evil/cfg"}, "backbone_config", "a config to fetch by name"),
        ({"text_config": {"auto_map": {"AutoConfig": "x.C"}}}, "text_config.auto_map", "names remote code"),
        ({"text_encoder_name_or_path": "evil/enc"}, "text_encoder_name_or_path", "another checkpoint"),
    ],
)
def test_config_naming_code_or_a_hub_id_is_refused_in_one_line(
    tiny: tuple[Path, Path], tmp_path: Path, no_network: list[object], fields: dict, field: str, words: str
) -> None:
    folder = _edited(tiny[1], tmp_path / "m", **fields)
    line = _refused(folder)
    assert line.startswith(f"{folder / 'config.json'}: {field}: ") and words in line, line
    assert no_network == []


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"use_timm_backbone": False, "backbone": "evil/resnet"}, "backbone", "backbone fetched"),
        ({"use_pretrained_backbone": True}, "use_pretrained_backbone", "backbone fetched"),
        ({"auto_map": {"AutoModelForCausalLM": "evil.Model"}}, "auto_map", "names remote code"),
        ({"backbone_config": "evil/cfg"}, "backbone_config", "a config to fetch by name"),
        ({"hidden_act": "evil"}, "hidden_act", "not an activation"),
        # a layer count the artifact cannot fill: refused before the skeleton is built (a
        # million layers took minutes and GBs of host memory before transformers failed)
        ({"num_hidden_layers": 100000}, "num_hidden_layers", "but the artifact holds 1 layer(s)"),
    ],
)
def test_from_pretrained_refuses_a_planted_config_before_building(
    tiny: tuple[Path, Path],
    tmp_path: Path,
    no_network: list[object],
    monkeypatch: pytest.MonkeyPatch,
    fields: dict,
    field: str,
    words: str,
) -> None:
    """``AutoModelForCausalLM.from_pretrained`` after ``import converter`` (our HfQuantizer)
    applies load_model's config checks in its first hook that sees the config: one line
    naming the field, no model class constructed, no connection attempted."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    import converter  # noqa: F401  (registers the quantizer)

    folder = _edited(tiny[1], tmp_path / "m", **fields)
    built: list[str] = []
    real_init = LlamaForCausalLM.__init__

    def init(self: object, *args: object, **kwargs: object) -> None:
        built.append("LlamaForCausalLM")
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "__init__", init)
    with pytest.raises(ModelError) as ei:
        AutoModelForCausalLM.from_pretrained(folder)
    line = str(ei.value)
    assert "\n" not in line and line.startswith(f"{folder / 'config.json'}: {field}: ") and words in line, line
    assert built == [] and no_network == []


def test_from_pretrained_refuses_a_weight_file_that_is_no_safetensors_naming_the_folder(
    tiny: tuple[Path, Path], tmp_path: Path, no_network: list[object]
) -> None:
    """quantization_config.weight_file pointing at a pickle (or out of the folder) is
    refused in one line that names the folder's config.json, before any file is opened."""
    from transformers import AutoModelForCausalLM

    import converter  # noqa: F401  (registers the quantizer)

    qc = json.loads((tiny[1] / "config.json").read_text())["quantization_config"]
    for i, wf in enumerate(["pytorch_model.bin", "../elsewhere/model.safetensors"]):
        folder = _edited(tiny[1], tmp_path / f"m{i}", quantization_config={**qc, "weight_file": wf})
        with pytest.raises(ModelError) as ei:
            AutoModelForCausalLM.from_pretrained(folder)
        line = str(ei.value)
        assert "\n" not in line and line.startswith(f"{folder / 'config.json'}: quantization_config.weight_file: ")
        assert repr(wf) in line
    assert no_network == []


def test_from_pretrained_refuses_a_weight_file_other_than_the_artifact(
    tiny: tuple[Path, Path], tmp_path: Path, no_network: list[object]
) -> None:
    """transformers takes the unconverted tensors from quantization_config.weight_file;
    another safetensors file there would give the model weights load_model and
    marlin-verify never read."""
    from transformers import AutoModelForCausalLM

    import converter  # noqa: F401

    qc = json.loads((tiny[1] / "config.json").read_text())["quantization_config"]
    folder = _edited(tiny[1], tmp_path / "m", quantization_config={**qc, "weight_file": "evil.safetensors"})
    shutil.copy(folder / "model.safetensors", folder / "evil.safetensors")
    with pytest.raises(ModelError) as ei:
        AutoModelForCausalLM.from_pretrained(folder)
    assert str(ei.value) == (
        f"{folder / 'config.json'}: quantization_config.weight_file: names 'evil.safetensors', but the folder's "
        "artifact is 'model.safetensors' (what load_model and marlin-verify read): transformers would take the "
        "unconverted tensors from another file"
    )
    assert no_network == []


def test_load_model_and_verify_model_refuse_a_weight_file_other_than_the_artifact(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """load_model and marlin-verify --model read the folder's artifact whatever
    weight_file says; they refuse the folder as from_pretrained does, so the three agree
    on which folders are converted models."""
    from tests.helpers.clirun import run_cli

    qc = json.loads((tiny[1] / "config.json").read_text())["quantization_config"]
    for i, wf in enumerate(["other.safetensors", "../base/model.safetensors", 5]):
        folder = _edited(tiny[1], tmp_path / f"m{i}", quantization_config={**qc, "weight_file": wf})
        with pytest.raises(ModelError) as ei:
            load_model(folder, device="cpu")
        line = str(ei.value)
        assert line.startswith(f"{folder / 'config.json'}: quantization_config.weight_file: {wf!r} ") or (
            line.startswith(f"{folder / 'config.json'}: quantization_config.weight_file: names {wf!r}, but the ")
        ), line
    res = run_cli("marlin-verify", folder, "--model", "--against", tiny[0], "--cpu")
    assert res.returncode == 2 and "quantization_config.weight_file: 5 is not the name of a safetensors" in res.stderr


@pytest.mark.parametrize("hook", ["ConvertedLayers", "module", "init"])
def test_from_pretrained_hooks_run_offline(
    tiny: tuple[Path, Path], no_network: list[object], monkeypatch: pytest.MonkeyPatch, hook: str
) -> None:
    """What our quantizer runs before and after weight loading, and the modules' __init__
    that transformers runs between two hooks (model_type "rwkv" fetches a kernel there), run
    with the socket layer closed: a connection attempted there is a NetworkAttempt, and none
    reaches the socket."""
    from transformers import AutoModelForCausalLM

    import converter  # noqa: F401
    from converter.model import hf_quantizer

    seen: list[str] = []

    def dial() -> None:
        seen.append(os.environ.get("HF_HUB_OFFLINE", ""))
        socket.create_connection(("huggingface.co", 443))

    if hook == "init":
        from transformers.models.llama import modeling_llama

        real_init = modeling_llama.LlamaRMSNorm.__init__

        def init(self: object, *args: object, **kwargs: object) -> None:
            dial()
            real_init(self, *args, **kwargs)

        monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "__init__", init)
    elif hook == "ConvertedLayers":
        real = hf_quantizer.ConvertedLayers

        def layers(*args: object, **kwargs: object) -> object:
            dial()
            return real(*args, **kwargs)

        monkeypatch.setattr(hf_quantizer, "ConvertedLayers", layers)
    else:
        real_module = hf_quantizer.ConvertedLayers.module

        def module(self: object, *args: object, **kwargs: object) -> object:
            dial()
            return real_module(self, *args, **kwargs)

        monkeypatch.setattr(hf_quantizer.ConvertedLayers, "module", module)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(NetworkAttempt, match="asks for a network connection"):
        AutoModelForCausalLM.from_pretrained(tiny[1])
    assert seen == ["1"] and no_network == []
    gc.collect()  # a load that failed between two hooks is released with its quantizer
    assert os.environ["HF_HUB_OFFLINE"] == "0"  # restored


def test_from_pretrained_refuses_a_tensor_shape_the_model_lacks_in_one_line(
    tiny: tuple[Path, Path], tmp_path: Path, no_network: list[object]
) -> None:
    """A pass-through tensor stored in another shape than the model's (model.norm.weight,
    its bytes unchanged): load_model refused it in one line, while from_pretrained printed
    transformers' size-mismatch table and raised a RuntimeError ("You set
    `ignore_mismatched_sizes` to `False`"); both now give the same line."""
    from transformers import AutoModelForCausalLM

    import converter  # noqa: F401  (registers the quantizer)

    folder = tmp_path / "m"
    shutil.copytree(tiny[1], folder)

    def fold(manifest: dict, tensors: dict) -> None:
        dtype, a = tensors["model.norm.weight"]
        tensors["model.norm.weight"] = (dtype, a.reshape(2, -1))

    art = folder / "model.safetensors"
    rewrite_artifact_arrays(art, art, fold)
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    want = f"{folder}: model.norm.weight: shape [2, {hidden // 2}], but model.norm.weight of the model is [{hidden}]"
    assert _refused(folder) == want
    with pytest.raises(ModelError) as ei:
        AutoModelForCausalLM.from_pretrained(folder)
    assert str(ei.value) == want
    assert no_network == []


def test_from_pretrained_still_loads_an_ordinary_folder(
    tiny: tuple[Path, Path], no_network: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole call, config object included (built before any quantizer hook), makes no
    connection and no name lookup for a local folder, with the hub's offline switches unset."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    from transformers import AutoModelForCausalLM

    import converter  # noqa: F401

    before = (socket.socket.connect, socket.create_connection, socket.getaddrinfo)
    model = AutoModelForCausalLM.from_pretrained(tiny[1])
    assert model.marlin_report.architecture == "LlamaForCausalLM" and no_network == []
    # offline from the first hook to the last, and back online after
    assert "HF_HUB_OFFLINE" not in os.environ and "TRANSFORMERS_OFFLINE" not in os.environ
    assert (socket.socket.connect, socket.create_connection, socket.getaddrinfo) == before


def test_tokenizer_remote_code_is_refused_and_never_imported(
    tiny: tuple[Path, Path], tmp_path: Path, no_network: list[object]
) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny[1], folder)
    marker = tmp_path / "MARKER"
    (folder / "evil_tok.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["evil_tok.Tok", None]}, "tokenizer_class": "Tok"})
    )
    (tmp_path / "t.txt").write_text("hello world " * 10)
    with pytest.raises(ModelError) as ei:
        input_ids(folder, {"vocab_size": 200}, tmp_path / "t.txt")
    assert str(ei.value).startswith(f"{folder / 'tokenizer_config.json'}: auto_map: names remote code")
    assert not marker.exists() and no_network == []


def test_tokenizer_panic_is_a_model_error(tiny: tuple[Path, Path], tmp_path: Path, monkeypatch) -> None:
    import transformers

    class PanicException(BaseException):  # what pyo3 raises for a Rust panic
        pass

    def boom(*args: object, **kwargs: object) -> None:
        raise PanicException("regex parse error:\n    (?<x)")

    folder = tmp_path / "m"
    shutil.copytree(tiny[1], folder)
    (folder / "tokenizer.json").write_text("{}")
    (tmp_path / "t.txt").write_text("hello")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    with pytest.raises(ModelError) as ei:
        input_ids(folder, {"vocab_size": 200}, tmp_path / "t.txt")
    assert str(ei.value) == f"{folder}: cannot load the folder's tokenizer: PanicException: regex parse error:"


# --------------------------------------------------------------------------- 2. check before you build


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"hidden_act": "nope"}, "hidden_act"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps"),
        ({"pad_token_id": 100000}, "pad_token_id"),
        ({"dtype": "float8_e4m3fn"}, "dtype"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"attn_implementation": "flash_attention_2"}, "attn_implementation"),
        ({"num_attention_heads": 3}, "attention heads"),  # transformers' own check (128 % 3)
    ],
)
def test_config_transformers_cannot_build_is_one_model_error(
    tiny: tuple[Path, Path], tmp_path: Path, no_network: list[object], fields: dict, field: str
) -> None:
    folder = _edited(tiny[1], tmp_path / "m", **fields)
    line = _refused(folder)
    assert line.startswith(f"{folder / 'config.json'}: "), line
    assert field in line, line
    assert no_network == []


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nested_non_finite_number_is_refused_by_both_loaders(
    tiny: tuple[Path, Path], tmp_path: Path, no_network: list[object], value: float
) -> None:
    """A NaN rope_theta inside rope_parameters loaded silently (NaN rotary frequencies,
    logits off by 3 on the real llama-tiny): both loaders refuse it, naming the path."""
    from transformers import AutoModelForCausalLM

    import converter  # noqa: F401  (registers the quantizer)

    rope = json.loads((tiny[1] / "config.json").read_text()).get("rope_parameters") or {"rope_type": "default"}
    folder = _edited(tiny[1], tmp_path / "m", rope_parameters={**rope, "rope_theta": value})
    want = (
        f"{folder / 'config.json'}: rope_parameters.rope_theta: is NaN or infinite: a config.json holds finite "
        "numbers only (marlin-convert writes standard JSON)"
    )
    assert _refused(folder) == want
    with pytest.raises(ModelError) as ei:
        AutoModelForCausalLM.from_pretrained(folder)
    assert str(ei.value) == want
    assert no_network == []


@pytest.mark.parametrize(("archs", "shown"), [("LlamaForCausalLM", "'LlamaForCausalLM'"), ([5], "[5]"), ([""], "['']")])
def test_architectures_that_is_no_list_of_names_is_refused(
    tiny: tuple[Path, Path], tmp_path: Path, archs: object, shown: str
) -> None:
    """It was read as naming no class, so load_model silently built AutoModel's
    (LlamaModel: hidden states, no logits) instead of the LlamaForCausalLM meant."""
    folder = _edited(tiny[1], tmp_path / "m", architectures=archs)
    assert _refused(folder) == (f"{folder / 'config.json'}: architectures: {shown} is not a list of model class names")


_BOMBS = r"""
import json, resource, shutil, sys, time
from pathlib import Path
from converter.model import ModelError, load_model
from tests.helpers.artifact_edit import reseal_folder_files, rewrite_artifact_arrays
out, tmp = Path(sys.argv[1]), Path(sys.argv[2])
for i, (k, v) in enumerate([("num_hidden_layers", 100000), ("hidden_size", 2**28), ("num_hidden_layers", 1000),
                            ("intermediate_size", 2**30), ("vocab_size", 2**34)]):
    f = tmp / f"b{i}"
    shutil.copytree(out, f)
    cfg = json.loads((f / "config.json").read_text()); cfg[k] = v
    (f / "config.json").write_text(json.dumps(cfg)); reseal_folder_files(f)
    t = time.perf_counter()
    try:
        load_model(f, "cpu")
        print(json.dumps({"field": k, "error": None}))
    except ModelError as e:
        print(json.dumps({"field": k, "error": str(e), "s": time.perf_counter() - t}))
print(json.dumps({"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_config_bombs_are_refused_fast_without_allocating(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-c", _BOMBS, str(tiny[1]), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(ln) for ln in res.stdout.splitlines()]
    *bombs, mem = rows
    for row in bombs:
        assert row["error"] is not None, row
        assert "\n" not in row["error"] and len(row["error"]) < 2500 and row["s"] < 20, row
    assert "num_hidden_layers: is 100000, but the artifact holds 1 layer(s)" in bombs[0]["error"]
    assert "num_hidden_layers: is 1000, but the artifact holds 1 layer(s)" in bombs[2]["error"]
    assert "268435456" in bombs[1]["error"]
    # torch + transformers take about 0.5 GB; 2**28 hidden would take GBs
    assert mem["maxrss"] < 1_500_000_000, mem


def test_skeleton_bytes_beyond_what_the_weights_justify_are_refused(tiny: tuple[Path, Path]) -> None:
    import torch

    from converter.model.build import check_skeleton

    with torch.device("meta"):
        m = torch.nn.Module()
        m.register_buffer("position_ids", torch.zeros(1, 2**27, dtype=torch.int64))
        m.norm = torch.nn.LayerNorm(8)
    with pytest.raises(ModelError) as ei:
        check_skeleton(m, [], weight_bytes=1000, path=Path("c/config.json"), what="artifact")
    assert str(ei.value).startswith("c/config.json: the model config.json describes needs 1073741888 bytes")
    assert "position_ids 1073741824 bytes" in str(ei.value)
    check_skeleton(m, [], weight_bytes=2**30, path=Path("c/config.json"), what="artifact")


def test_names_in_messages_are_cut_with_length_and_hash() -> None:
    name = "x" * 5_000_000
    s = short(name)
    assert len(s) < 200 and "5000000 chars, sha256 " in s
    err = ModelError("layers: " + ", ".join(f"model.layers.{i}.q" for i in range(100_000)), tensor=name)
    assert len(str(err)) < 2500 and "\n" not in str(err) and "chars, sha256" in str(err)


def test_check_config_accepts_an_ordinary_config() -> None:
    check_config(
        {"model_type": "llama", "backbone": None, "use_timm_backbone": False, "_name_or_path": "x/y"}, path="c"
    )


# --------------------------------------------------------------------------- 3. --text reads what it needs


def test_text_reads_only_what_the_token_budget_needs(
    tiny: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "m"
    shutil.copytree(tiny[1], folder)
    words = [f"w{i}" for i in range(190)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    text = tmp_path / "big.txt"
    rng = np.random.default_rng(0)
    line = " ".join(rng.choice(words, 1000)) + "\n"
    with text.open("w") as f:
        for _ in range(24 * 1024 * 1024 // len(line)):
            f.write(line)
    seen: list[int] = []
    real = model_inputs._encode
    monkeypatch.setattr(
        model_inputs, "_encode", lambda tok, content, path: seen.append(len(content)) or real(tok, content, path)
    )
    t = time.perf_counter()
    ids, info = input_ids(folder, {"vocab_size": 200, "max_position_embeddings": 256}, text)
    assert info["tokens"] == 256 and ids.shape == (1, 256)
    assert max(seen) <= model_inputs.TEXT_CHUNK_CHARS and time.perf_counter() - t < 10
    # the prefix gives the same tokens as the whole text's beginning
    whole = tok.encode(text.read_text()[:100_000]).ids[:256]
    assert ids[0].tolist() == whole


# --------------------------------------------------------------------------- 4. a fair top-1 rule


def _near_tie_logits(seed: int = 0, positions: int = 512, vocab: int = 300) -> tuple[np.ndarray, list[int]]:
    """fp32 logits with 8 near-tie positions (top-2 within 1e-4)."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((1, positions, vocab)).astype(np.float32) * 3
    ties = list(range(5, positions, positions // 8))[:8]
    for p in ties:
        top = int(np.argmax(ref[0, p]))
        other = (top + 1) % vocab
        ref[0, p, other] = ref[0, p, top] + 20
        ref[0, p, top] = ref[0, p, other] - 1e-4
    return ref, ties


def _flip(y: np.ndarray, ref: np.ndarray, p: int) -> None:
    a, b = np.argsort(ref[0, p])[-2:]  # b: ref's top-1
    y[0, p, a], y[0, p, b] = ref[0, p, b] + 1e-4, ref[0, p, a]


def test_a_perfect_conversion_with_near_ties_passes_and_a_planted_mistake_fails() -> None:
    ref, ties = _near_tie_logits()
    rng = np.random.default_rng(1)
    f16 = ref + rng.standard_normal(ref.shape).astype(np.float32) * 2e-3
    conv = ref + rng.standard_normal(ref.shape).astype(np.float32) * 2e-3
    _flip(f16, ref, ties[0])  # fp16 rounding flips one near-tie ...
    for p in ties[:4]:
        _flip(conv, ref, p)  # ... a perfect conversion four: noise of the same size as fp16's
    m_conv = output_metrics(conv, ref, encoder=False, ids=None)
    m_f16 = output_metrics(f16, ref, encoder=False, ids=None)
    # the old rule (all positions, fp16's minus 0.5 %) fails this perfect conversion
    assert m_conv["top1"] < m_f16["top1"] - mv.TOP1_MARGIN
    ref_top, margin = reference_decisions(ref)
    f16_top, f16_err = position_errors(f16, ref)
    conv_top, _ = position_errors(conv, ref)
    v = top1_verdict(ref_top, margin, f16_top, f16_err, conv_top)
    assert v["ok"] and 450 < v["decided"] <= 512 - 8 and v["converted"] == 1.0 and v["fp16"] == 1.0
    # a planted mistake (one wrong column shifts every position's logits) fails the same rule
    bad = ref.copy()
    bad[..., 7] += 8.0
    bad_top, _ = position_errors(bad, ref)
    v = top1_verdict(ref_top, margin, f16_top, f16_err, bad_top)
    assert not v["ok"] and v["converted"] < 0.9


def test_judge_reports_the_decided_rule(tiny: tuple[Path, Path]) -> None:
    """The model_top1 finding names the decided positions."""
    from converter.model.report import ModelReport

    class Load:
        layers: dict = {}
        modules: dict = {}
        missing: list = []
        not_converted: dict = {}
        kernel_fallback: dict = {}
        warnings: list = []
        unused: list = []

    class Probe:
        stats: dict = {}

    rep = ModelReport(model="m", source="s")
    rep.output = "logits"
    conv = {"mean_rel_err": 1e-3, "top1": 0.5}
    f16 = {"mean_rel_err": 1e-3, "top1": 0.99}
    verdict = {"positions": 512, "decided": 500, "converted": 0.9, "fp16": 1.0, "min": 0.995, "ok": False}
    mv._judge(rep, Load(), Probe(), {}, conv, f16, {}, verdict)
    msgs = [p.message for p in rep.problems if p.code.value == "model_top1"]
    assert len(msgs) == 1 and "at its 500 decided positions (of 512" in msgs[0] and "0.9000" in msgs[0]
    assert rep.bar["top1_min"] == 0.995 and conv["top1_decided"] == 0.9


def test_a_config_json_that_is_no_file_is_named_as_such(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny[1], folder)
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")
    assert _refused(folder) == (
        f"{folder / 'config.json'}: not a regular file (a FIFO); a converted folder's config.json is a file"
    )
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("/dev/zero")
    assert _refused(folder) == (
        f"{folder / 'config.json'}: not a regular file (a device); a converted folder's config.json is a file"
    )


def test_links_out_of_a_converted_folder_are_not_followed(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """A converted folder's files stay in it, as a source checkpoint's do: the artifact,
    config.json or a manifest-listed file that links outside (here to an identical copy,
    so only the link is wrong) is refused by name and not read; a link inside the folder
    and the hub cache's links into blobs/ still load."""
    from converter.errors import ArtifactError
    from tests.helpers.clirun import run_cli

    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("model.safetensors", "config.json"):
        folder = tmp_path / f"link_{name}"
        shutil.copytree(tiny[1], folder)
        shutil.move(folder / name, outside / name)
        (folder / name).symlink_to(outside / name)
        error, whose = {
            "model.safetensors": (ArtifactError, "the artifact's"),
            "config.json": (ModelError, "the model"),
        }[name]
        with pytest.raises(error) as ei:
            load_model(folder, device="cpu")
        assert str(ei.value) == (
            f"{folder / name}: is a symbolic link to {outside / name}, outside {whose} folder; links that leave it "
            "are not followed (copy the file into the folder)"
        )
        res = run_cli("marlin-verify", folder, "--shapes")
        if name == "model.safetensors":
            assert res.returncode == 2 and "outside the artifact's folder" in res.stderr, res.stderr
        else:  # config.json is a manifest-listed file beside the artifact: reported, not read
            assert res.returncode == 1, res.stdout + res.stderr
            assert f"config.json: a symbolic link to {outside / name}, outside the artifact's folder" in res.stdout
        (outside / name).unlink()
    # inside the folder, and the hub cache's layout: followed
    inner = tmp_path / "inner"
    shutil.copytree(tiny[1], inner)
    (inner / "sub").mkdir()
    shutil.move(inner / "model.safetensors", inner / "sub" / "m.safetensors")
    (inner / "model.safetensors").symlink_to(Path("sub") / "m.safetensors")
    assert run_cli("marlin-verify", inner, "--shapes", "-q").returncode == 0
    snap = tmp_path / "models--org--m" / "snapshots" / "abc"
    shutil.copytree(tiny[1], snap)
    blobs = tmp_path / "models--org--m" / "blobs"
    blobs.mkdir()
    for f in list(snap.iterdir()):
        shutil.move(f, blobs / f.name)
        f.symlink_to(Path("..") / ".." / "blobs" / f.name)
    assert type(load_model(snap, device="cpu")).__name__ == "LlamaForCausalLM"
