"""The torch op's registration, without a GPU: its schema, its fake implementation (the
shape torch.compile traces with), and that dynamo traces it with no graph break.
The numbers it computes are tested on the GPU (tests/gpu/test_serving.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from converter.gpu import kernels, torch_op  # noqa: E402

K, N, N_OUT, GS = 256, 256, 200, 128


def _operands(device: str = "cpu") -> tuple:
    return (
        torch.zeros(3, K, dtype=torch.float16, device=device),
        torch.zeros(K // 16, 2 * N, dtype=torch.int32, device=device),
        torch.zeros(K // GS, N, dtype=torch.float16, device=device),
        torch.zeros(64, dtype=torch.int32, device=device),
    )


def _call(x, b, s, locks):
    return torch.ops.marlin_convert.gemm(x, b, s, None, None, None, locks, K, N, GS, N_OUT)


def test_the_op_is_registered_with_its_schema() -> None:
    schema = str(torch.ops.marlin_convert.gemm.default._schema)
    assert schema.startswith("marlin_convert::gemm(Tensor x, Tensor b, Tensor scales, Tensor? delta, Tensor? perm")
    # Python ints infer as SymInt; the module passes constants, so compile specializes them.
    assert schema.endswith(
        "Tensor? bias, Tensor locks, SymInt size_k, SymInt size_n, SymInt group_size, SymInt n_out) -> Tensor"
    )


def test_fake_gives_the_result_shape_and_dtype() -> None:
    with FakeTensorMode():
        y = _call(*_operands("cuda"))
        assert (tuple(y.shape), y.dtype, y.device.type) == ((3, N_OUT), torch.float16, "cuda")


def test_trace_keeps_the_op_as_one_node() -> None:
    g = make_fx(lambda *a: _call(*a) * 2, tracing_mode="fake")(*_operands())
    targets = [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
    assert targets == ["marlin_convert.gemm.default", "aten.mul.Tensor"]


def test_compile_fullgraph_has_no_graph_break() -> None:
    """dynamo traces a caller of the op whole (fullgraph raises at a break); a CPU
    kernel stands in for the CUDA one for the length of this test only."""
    lib = torch.library.Library("marlin_convert", "FRAGMENT")
    try:
        torch.library.register_kernel(
            "marlin_convert::gemm",
            "cpu",
            lambda x, *_: torch.full((x.shape[0], N_OUT), 7.0, dtype=torch.float16),
            lib=lib,
        )
        torch._dynamo.reset()
        compiled = torch.compile(lambda *a: _call(*a) + 1, fullgraph=True, backend="eager")
        y = compiled(*_operands())
        assert torch.equal(y, torch.full((3, N_OUT), 8.0, dtype=torch.float16))
    finally:
        lib._destroy()
        torch._dynamo.reset()


def test_units_mode_reads_the_b_form() -> None:
    assert torch_op.units_mode(torch.zeros(4, 8, dtype=torch.int32)) == 0
    assert torch_op.units_mode(torch.zeros(2, 4, 512, dtype=torch.int32)) == 1
    assert torch_op.units_mode(torch.zeros(2, 4, kernels.STAGE_RUN_INT32, dtype=torch.int32)) == 2


def test_the_cuda_implementation_refuses_a_cpu_input() -> None:
    from converter.errors import KernelError

    msg = r"expected a float16 or bfloat16 CUDA tensor \(M, 256\), got torch.float16 \(3, 256\)"
    with pytest.raises(KernelError, match=msg):
        torch_op.run_gemm(*_operands()[:3], None, None, None, _operands()[3], K, N, GS, N_OUT)
