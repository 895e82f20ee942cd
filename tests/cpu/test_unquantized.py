"""The unquantized GEMMs (``backends/unquantized.py``): products, scales and accumulation against float64."""

from __future__ import annotations

import pytest
import thunder
import torch

from te_v2_executor.backends import unquantized


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 0.375])
@pytest.mark.parametrize("accumulate", [False, True])
def test_forward_dgrad_and_wgrad(scale, accumulate):
    torch.manual_seed(0)
    x, w, dy = torch.randn(2, 8, 24), torch.randn(40, 24), torch.randn(2, 8, 40)
    acc_y, acc_dx = torch.randn(2, 8, 40), torch.randn(2, 8, 24)
    expected_y = scale * x.double() @ w.double().T + (acc_y.double() if accumulate else 0)
    expected_dx = scale * dy.double() @ w.double() + (acc_dx.double() if accumulate else 0)
    expected_dw = scale * dy.double().reshape(-1, 40).T @ x.double().reshape(-1, 24)

    y_into, dx_into = acc_y.clone(), acc_dx.clone()
    y = unquantized.linear_fwd(x, w, None, y_into if accumulate else None, scale=scale)
    dx = unquantized.linear_dgrad(dy, w, dx_into if accumulate else None, input_shape=(2, 8, 24), scale=scale)
    _close(y, expected_y)
    _close(dx, expected_dx)
    _close(unquantized.linear_wgrad(dy, x, scale=scale), expected_dw)
    if accumulate:  # in the given buffers
        assert y.data_ptr() == y_into.data_ptr() and dx.data_ptr() == dx_into.data_ptr()


def test_a_non_contiguous_buffer_is_summed_into_a_copy():
    x, w = torch.randn(8, 24), torch.randn(40, 24)
    into = torch.randn(40, 8).T  # (8, 40), not contiguous
    expected = into.double() + x.double() @ w.double().T
    _close(unquantized.linear_fwd(x, w, None, into), expected)


def test_the_plain_forward_keeps_its_bias():
    x, w, b = torch.randn(8, 24), torch.randn(40, 24), torch.randn(40)
    _close(unquantized.linear_fwd(x, w, b), x.double() @ w.double().T + b.double())


@pytest.mark.parametrize("dim", [0, 1])
def test_bfloat16_pieces_sum_to_the_float32_tensor_exactly(dim):
    torch.manual_seed(0)
    magnitudes = torch.logspace(-32, 38, 40, base=10.0)  # above 2^-110
    t = (torch.rand(24, 40) * 0.5 + 0.5) * magnitudes * torch.randn(24, 40).sign()
    t[0, :3] = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 0.0])
    pieces = unquantized.bfloat16_pieces(t, dim)
    assert pieces.dtype == torch.bfloat16 and pieces.shape[dim] == unquantized.PIECES
    torch.testing.assert_close(pieces.double().sum(dim), t.double(), rtol=0, atol=0)


@pytest.mark.parametrize("along", [0, 1])
@pytest.mark.parametrize("transposed", [False, True])
def test_a_matrix_of_pieces_holds_them_in_order(along, transposed):
    torch.manual_seed(0)
    t = torch.randn(40, 24).t() if transposed else torch.randn(24, 40)
    matrix = unquantized._pieces_matrix(t, along)
    assert matrix.shape == ((3 * 24, 40) if along == 0 else (24, 3 * 40))
    pieces = matrix.view(3, 24, 40) if along == 0 else matrix.reshape(24, 3, 40).transpose(0, 1)
    torch.testing.assert_close(pieces.double().sum(0), t.double(), rtol=0, atol=0)
    assert (pieces[1:].double().abs() <= pieces[:1].double().abs() * 2**-7).all()  # largest first


@pytest.mark.parametrize("scale", [1.0, 0.375])
@pytest.mark.parametrize("accumulate", [False, True])
def test_a_bfloat16_operand_times_a_float32_one_is_the_widened_product(scale, accumulate):
    """Off the GPU the bfloat16 operand is widened: the float32 GEMMs' results, bit for bit."""
    torch.manual_seed(0)
    x, a = torch.randn(2, 8, 24, dtype=torch.bfloat16), torch.randn(16, 24)
    dy, h = torch.randn(2, 8, 40, dtype=torch.bfloat16), torch.randn(2, 8, 16)
    b, acc = torch.randn(40, 16), torch.randn(2, 8, 16)
    y = unquantized.linear_fwd(x, a, None, acc.clone() if accumulate else None, scale=scale)
    dh = unquantized.linear_dgrad(dy, b, None, input_shape=(2, 8, 16), scale=scale)
    expected_y = unquantized.linear_fwd(x.float(), a, None, acc.clone() if accumulate else None, scale=scale)
    assert y.dtype == dh.dtype == torch.float32
    torch.testing.assert_close(y, expected_y, rtol=0, atol=0)
    expected_dh = unquantized.linear_dgrad(dy.float(), b, None, input_shape=(2, 8, 16), scale=scale)
    torch.testing.assert_close(dh, expected_dh, rtol=0, atol=0)
    for wgrad, expected in (
        (unquantized.linear_wgrad(dy, h, scale=scale), unquantized.linear_wgrad(dy.float(), h, scale=scale)),
        (unquantized.linear_wgrad(h, x, scale=scale), unquantized.linear_wgrad(h, x.float(), scale=scale)),
    ):
        torch.testing.assert_close(wgrad, expected, rtol=0, atol=0)


def test_only_bfloat16_and_float32_operands_mix():
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import TraceCtx, tracectx

    from te_v2_executor.symbols import UNQUANTIZED_FWD

    with tracectx(TraceCtx()):
        x = TensorProxy(shape=(8, 24), device=thunder.core.devices.cpu, dtype=thunder.float16)
        w = TensorProxy(shape=(16, 24), device=thunder.core.devices.cpu, dtype=thunder.float32)
        with pytest.raises(RuntimeError, match="only bfloat16 by float32 mixes dtypes"):
            UNQUANTIZED_FWD.meta(x, w, None, site="x")
        assert (
            UNQUANTIZED_FWD.meta(x, TensorProxy(like=w, dtype=thunder.float16), None, site="x").dtype
            == thunder.float16
        )
