"""On the GPU: a fresh process that runs one GEMM compiles only the kernels that call
launches, each by itself (converter.gpu.build compiles on first use)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_ONE_CALL = """
import json, numpy as np, cupy as cp
from converter.gpu import build, kernels, runtime
k, n, m = 4096, 4096, 1
rng = np.random.default_rng(0)
B = cp.asarray(rng.integers(-2**31, 2**31, (k // 16, 2 * n), dtype=np.int64).astype(np.int32))
s = cp.asarray(rng.uniform(0.001, 0.01, (k // 128, n)).astype(np.float16))
a = cp.asarray(rng.normal(0, 1, (m, k)).astype(np.float16))
kernels.marlin_gemm(a, B, s, size_k=k, size_n=n, group_size=128)
cp.cuda.get_current_stream().synchronize()
plan = kernels.gemm_plan(m, k, n, 128)
print(json.dumps({"compiled": build.compiled, "kernel": plan.pipe.name(plan.gpi, False)}))
"""


def test_one_call_compiles_only_its_own_kernel(cp) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _ONE_CALL], cwd=REPO, capture_output=True, text=True, check=True, timeout=300
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    names = [name for _, names, _ in got["compiled"] for name in names]
    assert all(len(names) == 1 and act == "float16" for _, names, act in got["compiled"]), got
    assert got["kernel"] in names and len(names) <= 3, got  # + the A re-layout / gather where the route needs it
