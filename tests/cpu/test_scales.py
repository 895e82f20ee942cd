"""The reference backend's scales are TE's to the bit: ``fp8_max / amax`` rounded once in float32,
as TE's kernels divide (``__fdiv_rn`` for current scaling, ``scaled_max / amax`` for delayed),
so the FP8 values it casts, and the FP8 all-gather's hooks with them, are TE's."""

from __future__ import annotations

import pytest
import torch

from te_v2_executor import current_scaling, delayed_scaling
from te_v2_executor.backends import reference


def _amaxes() -> torch.Tensor:
    """Amaxes over float32's normal range, log-uniform, each a float32."""
    g = torch.Generator().manual_seed(0)
    return torch.exp2(torch.empty(100_000, dtype=torch.float64).uniform_(-100, 100, generator=g)).float()


def _quotient(numerator: float, amax: torch.Tensor) -> torch.Tensor:
    """``numerator / amax`` rounded once to float32 (float64's quotient rounds correctly again)."""
    return (numerator / amax.double()).float()


@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
def test_current_scaling_scales_are_quotients_rounded_once(fp8_max):
    amax = _amaxes()
    scale = reference.scale_from_amax(amax, fp8_max, current_scaling())
    assert torch.equal(scale, _quotient(fp8_max, amax))


@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_scaling_scales_are_quotients_rounded_once(margin):
    recipe = delayed_scaling(amax_history_len=1, margin=margin)
    amax = _amaxes()
    history, scale = torch.zeros(1, amax.numel()), torch.ones(amax.numel())
    reference.update_delayed_scaling(amax, [history], [scale], recipe, forward=True)
    assert torch.equal(scale, _quotient(recipe.fp8_max(forward=True) / 2**margin, amax))
