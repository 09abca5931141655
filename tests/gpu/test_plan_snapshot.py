"""The planner's decisions, pinned: every route and launch plan over the grid of
:mod:`tests.gpu.plan_grid` (7 models' layer shapes x M x group sizes x sm_80..90) is
what ``tests/data/plan_snapshot.json.gz`` recorded. A routing change is meant to fail
here: regenerate with ``python -m tests.gpu.plan_grid --write`` and say why in the
commit (docs/notes/routing.md)."""

from __future__ import annotations

import pytest

from tests.gpu import plan_grid


@pytest.fixture(scope="module")
def snap() -> dict:
    return plan_grid.load()


def test_snapshot_covers_the_grid(snap: dict) -> None:
    assert snap["ms"] == list(plan_grid.MS) and snap["plan_ms"] == list(plan_grid.PLAN_MS)
    assert snap["regs"] == plan_grid.REGS
    assert set(snap["digests"]) == {plan_grid.key_name(*key) for key in plan_grid.keys()}


def _mismatches(snap: dict, what: str, ms: tuple[int, ...], plan: bool) -> list[str]:
    return [
        name
        for key in plan_grid.keys()
        for name in [plan_grid.key_name(*key)]
        if plan_grid.digest(*key, ms, plan=plan) != snap["digests"][name][what]
    ]


def test_routes_reproduce_the_snapshot(snap: dict) -> None:
    """Every (device, shape, group) x every M of the grid: kind, R, U, NS, gpi, smem, names."""
    assert _mismatches(snap, "routes", plan_grid.MS, plan=False) == []


def test_plans_reproduce_the_snapshot(snap: dict) -> None:
    """The launch plans (splits, tiles per split, blocks, ...) at the routes' edges."""
    bad = _mismatches(snap, "plans", plan_grid.PLAN_MS, plan=True)
    detail = [
        (key, want, got)
        for key, want in snap["sample"].items()
        for dev, kn, g, m in [key.split()]
        for k, n in [map(int, kn.split("x"))]
        for d in [next(d for d in plan_grid.DEVICES if d.arch == dev)]
        for got in [plan_grid.decide(int(m[1:]), k, n, int(g[1:]), d)]
        if got != want
    ]
    assert bad == [] and detail == []


@pytest.mark.slow
def test_every_plan_reproduces_the_snapshot(snap: dict) -> None:
    """The launch plans at every M of the grid (about 20 s)."""
    assert _mismatches(snap, "plans_all", plan_grid.MS, plan=True) == []
