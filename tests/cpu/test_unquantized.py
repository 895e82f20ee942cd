"""The unquantized GEMMs (``backends/unquantized.py``): products, scales and accumulation against float64."""

from __future__ import annotations

import pytest
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
