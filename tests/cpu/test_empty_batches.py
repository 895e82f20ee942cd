"""A batch of no tokens (an empty batch, an expert that received none) has nothing to quantize:
te_v2 runs its linears unquantized, without a warning, and their gradients come out zero."""

from __future__ import annotations

import warnings

import pytest
import thunder
import torch
from torch import nn

from te_v2_executor import TEv2FallbackWarning, current_scaling, delayed_scaling, explain, make_te_v2
from tests.helpers import CLAIM_ALL


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("shape", [(0, 64), (0, 4, 64), (4, 0, 64)], ids=str)
def test_a_batch_of_no_tokens_runs_unquantized_and_gives_zero_gradients(shape, recipe, grad):
    spec = delayed_scaling() if recipe == "delayed" else current_scaling()
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    jitted = thunder.jit(model, executors=[make_te_v2(backend="reference", recipe=spec, claim=CLAIM_ALL)])
    x = torch.randn(*shape, requires_grad=True)
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("error", TEv2FallbackWarning)
        y = jitted(x)
        if grad:
            y.sum().backward()
    assert y.shape == (*shape[:-1], 32)
    assert {r.recipe for r in explain(jitted).linears} == {"unquantized"}
    assert all("empty GEMM" in r.unquantized for r in explain(jitted).linears)
    if grad:
        assert x.grad.shape == x.shape
        for p in model.parameters():
            assert torch.equal(p.grad, torch.zeros_like(p))
