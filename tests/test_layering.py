"""The layering the package's docstrings state, and the tests' own hygiene, checked on the source.

* ``converter/marlin/`` (the target layout, NumPy only) imports no reader, no artifact
  code and nothing of ``converter/gpu/``;
* only ``converter/gpu/`` imports CuPy (and torch), and only inside functions, so that
  importing it never needs a GPU; ``gpu/plan/`` imports neither, nor the runtime; the
  one exception is ``gpu/torch_op.py``, which registers a torch op when it is imported,
  and which the rest of ``gpu/`` imports only inside functions;
* readers (``converter/formats/``) never import ``converter/artifact/``;
* no test module imports another test module, and none loads a file by path.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

PACKAGE = REPO / "converter"


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(absolute module imported, at module level)`` for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [f"{mod}.{a.name}" for a in node.names]
            out += [(n, id(node) in top) for n in [mod, *names]]
    return out


def _sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def _violations(folder: Path, forbidden: tuple[str, ...], *, module_level_only: bool = False) -> list[str]:
    bad = []
    for path in _sources(folder):
        for mod, at_top in _imports(path):
            if (at_top or not module_level_only) and any(mod == f or mod.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(REPO)} imports {mod}")
    return sorted(set(bad))


def test_marlin_imports_no_reader_artifact_or_gpu() -> None:
    assert (
        _violations(PACKAGE / "marlin", ("converter.formats", "converter.artifact", "converter.gpu", "cupy", "torch"))
        == []
    )


def test_readers_never_import_the_artifact_layer() -> None:
    assert _violations(PACKAGE / "formats", ("converter.artifact", "converter.gpu", "cupy")) == []


def test_only_gpu_imports_cupy_and_only_lazily() -> None:
    outside = [p for p in PACKAGE.iterdir() if p.name != "gpu"]
    bad = [v for p in outside for v in (_violations(p, ("cupy",)) if p.is_dir() else [])]
    bad += [
        f"{p.name} imports cupy"
        for p in outside
        if p.suffix == ".py" and any(m == "cupy" or m.startswith("cupy.") for m, _ in _imports(p))
    ]
    assert bad == []
    torch_op = "converter/gpu/torch_op.py imports torch"
    assert _violations(PACKAGE / "gpu", ("cupy", "torch"), module_level_only=True) == [torch_op]
    assert _violations(PACKAGE / "gpu", ("converter.gpu.torch_op",), module_level_only=True) == []


def test_the_planner_is_pure() -> None:
    assert [
        m
        for path in sorted((PACKAGE / "gpu" / "plan").glob("*.py"))
        for m, _ in _imports(path)
        if m.split(".")[0] in ("cupy", "torch")
        or m.startswith(("converter.gpu.runtime", "converter.gpu.build", "converter.gpu.kernels"))
    ] == []


def _test_modules() -> list[Path]:
    return [p for p in _sources(REPO / "tests") if p.name.startswith("test_")]


@pytest.mark.parametrize("path", _test_modules(), ids=lambda p: str(p.relative_to(REPO / "tests")))
def test_tests_import_helpers_not_other_tests(path: Path) -> None:
    mods = [m for m, _ in _imports(path)]
    assert [m for m in mods if any(part.startswith("test_") for part in m.split("."))] == []
    assert [m for m in mods if m in ("importlib.util", "runpy")] == []
    tree = ast.parse(path.read_text())
    loaders = {"spec_from_file_location", "module_from_spec", "run_path", "exec_module"}
    assert [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in loaders] == []
