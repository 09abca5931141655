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


@pytest.mark.parametrize("kind", ["safetensors", "artifact", "tinyloop", "gptq_config"])
@BUDGET
@given(rnd=st.randoms(use_true_random=False))
def test_fuzz_mutations(kind: str, seeds, workdir, rnd: random.Random) -> None:
    """safetensors reader; artifact header and manifest; tinyloop parser; gptq config."""
    _check(kind, FUZZ.mutate(seeds[kind].read_bytes(), kind, rnd), workdir, seeds)


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
    data = seeds["artifact"].read_bytes()
    _check("artifact", FUZZ.with_manifest(data, "[" * 5000 + "]" * 5000), workdir, seeds)


def test_regression_lone_surrogate_in_manifest(seeds, workdir) -> None:
    """Found by scripts/fuzz.py: a '\\ud800' escape in the manifest raised UnicodeEncodeError."""
    data = seeds["artifact"].read_bytes()
    text = FUZZ.manifest_text(data)[:-1] + ',"x":"\ud800"}'
    _check("artifact", FUZZ.with_manifest(data, text, reseal=False), workdir, seeds)


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e400"])
def test_regression_non_finite_size_in_manifest(seeds, workdir, value: str) -> None:
    """Found by scripts/fuzz.py: ``"size_k": Infinity`` raised OverflowError in int()."""
    data = seeds["artifact"].read_bytes()
    manifest = json.loads(FUZZ.manifest_text(data))
    manifest["layers"][0]["size_k"] = "@@"
    _check("artifact", FUZZ.with_manifest(data, json.dumps(manifest).replace('"@@"', value)), workdir, seeds)
