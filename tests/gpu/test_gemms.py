"""te_v2's FP8 GEMMs on TransformerEngine: two per-tensor FP8 operands go to TE's extension without
``general_gemm``'s wrapper, and must give bitwise what ``general_gemm`` gives for the same
operands and flags; anything else goes through ``general_gemm``."""

from __future__ import annotations

import pytest
import torch

from te_v2_executor.recipes import RecipeSpec
from tests.gpu.common import DTYPE, requires_te_gpu

pytestmark = requires_te_gpu

M, K, N = 272, 528, 1040  # multiples of 16 (TE's FP8 GEMMs), not of 128
SPEC = RecipeSpec()


@pytest.fixture
def operands():
    """x (M, K), W (N, K) and dy (M, N) quantized as te_v2's symbols quantize them: x and W
    row-wise for the forward and column-wise as saved for the backward, dy both ways."""
    from te_v2_executor.backends import te as kernels

    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=DTYPE)
    w = torch.randn(N, K, device="cuda", dtype=DTYPE) * 0.05
    dy = torch.randn(M, N, device="cuda", dtype=DTYPE) * 0.01
    forward = kernels.ScalingState(SPEC, forward=True, device=x.device)
    backward = kernels.ScalingState(SPEC, forward=False, device=x.device)
    for q in forward.quantizers:
        q.set_usage(rowwise=True, columnwise=False)
    x_row, w_row = (q.quantize_impl(t) for q, t in zip(forward.quantizers, (x, w), strict=True))
    _, x_col, w_col = kernels.linear_fwd(
        x, w, None, forward, compute_output=False, save_input=True, save_weight=True
    )
    dy_q, _ = kernels.quantize_grad_output(dy, backward, rowwise=True, columnwise=True, bgrad=False)
    return {"x_row": x_row, "w_row": w_row, "x_col": x_col, "w_col": w_col, "dy_q": dy_q}


# (gemm, A, B, layout, result shape): as te.Linear calls general_gemm
CASES = [
    ("fprop", "w_row", "x_row", "TN", (M, N)),
    ("dgrad", "w_col", "dy_q", "NN", (M, K)),
    ("wgrad", "x_col", "dy_q", "NT", (N, K)),
]


def _general_gemm(a, b, layout, *, gemm, bias=None, out=None):
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    from te_v2_executor.backends import te as kernels

    result, *_ = general_gemm(
        a,
        b,
        out_dtype=DTYPE,
        layout=layout,
        accumulate=out is not None,
        out=out,
        bias=bias,
        grad=gemm != "fprop",
        use_split_accumulator=kernels._split_accumulator(SPEC, gemm),
    )
    return result


@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulate"])
@pytest.mark.parametrize(("gemm", "a", "b", "layout", "shape"), CASES, ids=[c[0] for c in CASES])
def test_direct_gemm_is_general_gemm_bitwise(operands, monkeypatch, gemm, a, b, layout, shape, accumulate):
    from te_v2_executor.backends import te as kernels

    start = torch.randn(shape, device="cuda", dtype=DTYPE) if accumulate else None
    expected = _general_gemm(
        operands[a], operands[b], layout, gemm=gemm, out=None if start is None else start.clone()
    )

    def refuse(*args, **kwargs):
        raise AssertionError("two FP8 operands went through general_gemm")

    monkeypatch.setattr(kernels, "general_gemm", refuse)
    out = None if start is None else start.clone()
    got = kernels._gemm(operands[a], operands[b], SPEC, gemm=gemm, dtype=DTYPE, out=out)
    assert got.shape == shape
    assert torch.equal(got, expected)
    if accumulate:
        assert got.data_ptr() == out.data_ptr()
        assert not torch.equal(got, _general_gemm(operands[a], operands[b], layout, gemm=gemm))


def test_direct_forward_gemm_adds_the_bias_as_general_gemm_does(operands):
    from te_v2_executor.backends import te as kernels

    bias = torch.randn(N, device="cuda", dtype=DTYPE)
    got = kernels._gemm(operands["w_row"], operands["x_row"], SPEC, gemm="fprop", dtype=DTYPE, bias=bias)
    assert torch.equal(
        got, _general_gemm(operands["w_row"], operands["x_row"], "TN", gemm="fprop", bias=bias)
    )
    without = kernels._gemm(operands["w_row"], operands["x_row"], SPEC, gemm="fprop", dtype=DTYPE)
    assert not torch.equal(got, without)


def test_other_operands_go_through_general_gemm(monkeypatch):
    """BF16 operands (what TE's wrapper would dequantize or dispatch) are general_gemm's."""
    from te_v2_executor.backends import te as kernels

    calls = []
    real = kernels.general_gemm

    def spy(*args, **kwargs):
        calls.append(kwargs["layout"])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "general_gemm", spy)
    w = torch.randn(N, K, device="cuda", dtype=DTYPE)
    x = torch.randn(M, K, device="cuda", dtype=DTYPE)
    got = kernels._gemm(w, x, SPEC, gemm="fprop", dtype=DTYPE)
    assert calls == ["TN"]
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-2, atol=1e-2)


def test_dgrad_accumulates_into_a_non_contiguous_buffer(operands):
    """A transposed summand is added into a contiguous copy, which is returned."""
    from te_v2_executor.backends import te as kernels

    summand = torch.randn(K, M, device="cuda", dtype=DTYPE).t()
    assert not summand.is_contiguous()
    expected = kernels.linear_dgrad(
        operands["dy_q"],
        operands["w_col"],
        SPEC,
        input_shape=(M, K),
        dtype=DTYPE,
        accumulate_into=summand.contiguous(),
    )
    got = kernels.linear_dgrad(
        operands["dy_q"], operands["w_col"], SPEC, input_shape=(M, K), dtype=DTYPE, accumulate_into=summand
    )
    assert torch.equal(got, expected)
    plain = kernels.linear_dgrad(operands["dy_q"], operands["w_col"], SPEC, input_shape=(M, K), dtype=DTYPE)
    assert not torch.equal(got, plain)
