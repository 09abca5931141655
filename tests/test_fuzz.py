"""Fuzzing in CI (issue 5, item 2), with a small budget: 200 examples per target.

Hypothesis drives the mutators and targets of ``tests/helpers/fuzzing.py``
(``scripts/fuzz.py`` runs the same for 10^5+ examples): a valid seed file, 1-4 byte or structural JSON mutations,
then the parser and the code that consumes it.  Only ConverterError may escape, and
each example must finish within a time limit (SIGALRM; a hang fails the test).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import fuzzing as FUZZ

BUDGET = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return FUZZ.build_seeds(tmp_path_factory.mktemp("fuzzseeds"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzzwork")


def _check(kind: str, data: bytes, workdir: Path, seeds: dict[str, Path]) -> None:
    problem = FUZZ.check_one(kind, data, workdir, seeds, timeout=30)
    assert problem is None, problem


@pytest.mark.parametrize("kind", ["safetensors", "artifact", "tinyloop", "gptq_config"])
def test_seeds_are_valid(kind: str, seeds: dict[str, Path], workdir: Path) -> None:
    """The unmutated seeds parse without error (so mutations start from valid input)."""
    stats = Counter()
    assert FUZZ.check_one(kind, seeds[kind].read_bytes(), workdir, seeds, stats=stats) is None
    assert stats["accepted"] == 1


@BUDGET
@given(rnd=st.randoms(use_true_random=False))
def test_fuzz_safetensors_reader(seeds, workdir, rnd: random.Random) -> None:
    _check("safetensors", FUZZ.mutate(seeds["safetensors"].read_bytes(), "safetensors", rnd), workdir, seeds)


@BUDGET
@given(rnd=st.randoms(use_true_random=False))
def test_fuzz_artifact_header_and_manifest(seeds, workdir, rnd: random.Random) -> None:
    _check("artifact", FUZZ.mutate(seeds["artifact"].read_bytes(), "artifact", rnd), workdir, seeds)


@BUDGET
@given(rnd=st.randoms(use_true_random=False))
def test_fuzz_tinyloop_parser(seeds, workdir, rnd: random.Random) -> None:
    _check("tinyloop", FUZZ.mutate(seeds["tinyloop"].read_bytes(), "tinyloop", rnd), workdir, seeds)


@BUDGET
@given(rnd=st.randoms(use_true_random=False))
def test_fuzz_gptq_config_mutations(seeds, workdir, rnd: random.Random) -> None:
    _check("gptq_config", FUZZ.mutate(seeds["gptq_config"].read_bytes(), "gptq_config", rnd), workdir, seeds)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
CONFIG_KEYS = [
    "bits",
    "group_size",
    "sym",
    "desc_act",
    "checkpoint_format",
    "format",
    "quant_method",
    "pack_dtype",
    "lm_head",
    "modules_to_not_convert",
    "dynamic",
    "is_marlin_format",
    "static_groups",
    "true_sequential",
]


@BUDGET
@given(cfg=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON, max_size=8), base=st.booleans())
def test_fuzz_gptq_config_structured(seeds, workdir, cfg: dict, base: bool) -> None:
    """Arbitrary JSON values for the known quant-config fields (over a valid config or alone)."""
    start = json.loads(seeds["gptq_config"].read_bytes()) if base else {}
    start.update(cfg)
    _check("gptq_config", json.dumps(start).encode(), workdir, seeds)


def test_regression_deep_manifest_nesting(seeds, workdir) -> None:
    """Found by scripts/fuzz.py: a manifest nested 5000 deep raised RecursionError."""
    rnd = random.Random(0)
    data = seeds["artifact"].read_bytes()
    start, n = FUZZ._header_span(data, "artifact")
    header = json.loads(data[start : start + n])
    from converter.artifact.manifest import checksum

    text = "[" * 5000 + "]" * 5000
    header["__metadata__"]["marlin.manifest"] = text
    header["__metadata__"]["marlin.manifest_checksum"] = checksum(text.encode())
    _check(
        "artifact",
        FUZZ._replace_header(data, "artifact", start, n, json.dumps(header).encode(), keep_len=False),
        workdir,
        seeds,
    )
    del rnd


def test_regression_lone_surrogate_in_manifest(seeds, workdir) -> None:
    """Found by scripts/fuzz.py: a '\\ud800' escape in the manifest raised UnicodeEncodeError."""
    data = seeds["artifact"].read_bytes()
    start, n = FUZZ._header_span(data, "artifact")
    header = json.loads(data[start : start + n])
    header["__metadata__"]["marlin.manifest"] = header["__metadata__"]["marlin.manifest"][:-1] + ',"x":"\ud800"}'
    raw = json.dumps(header).encode()  # ensure_ascii: the surrogate is written as an escape
    _check("artifact", FUZZ._replace_header(data, "artifact", start, n, raw, keep_len=False), workdir, seeds)


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e400"])
def test_regression_non_finite_size_in_manifest(seeds, workdir, value: str) -> None:
    """Found by scripts/fuzz.py: ``"size_k": Infinity`` raised OverflowError in int()."""
    data = seeds["artifact"].read_bytes()
    start, n = FUZZ._header_span(data, "artifact")
    header = json.loads(data[start : start + n])
    from converter.artifact.manifest import checksum

    manifest = json.loads(header["__metadata__"]["marlin.manifest"])
    manifest["layers"][0]["size_k"] = "@@"
    text = json.dumps(manifest).replace('"@@"', value)
    header["__metadata__"]["marlin.manifest"] = text
    header["__metadata__"]["marlin.manifest_checksum"] = checksum(text.encode())
    _check(
        "artifact",
        FUZZ._replace_header(data, "artifact", start, n, json.dumps(header).encode(), keep_len=False),
        workdir,
        seeds,
    )
