"""Saved-for-backward bytes per linear, measured through autograd's saved-tensor hooks."""

from __future__ import annotations

import pytest
import thunder
import torch

from tests.gpu.common import DTYPE, builtin_executors, jit_te_v2, requires_te_gpu, torch_linear
from tests.helpers import saved_nbytes

pytestmark = requires_te_gpu

IN, OUT, TOKENS = 4096, 4096, 4096


def _saved_bytes(fn, x, recipe) -> int:
    import transformer_engine.pytorch as te

    total = 0

    def pack(t):
        nonlocal total
        total += saved_nbytes(t)
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        te.autocast(enabled=True, recipe=recipe),
    ):
        fn(x).float().sum().backward()
    return total


@pytest.mark.parametrize(
    ("weight_trains", "input_grad", "expected"),
    [
        (False, True, OUT * IN),  # frozen weight: only W^T in FP8 (plus its scale)
        (True, False, TOKENS * IN),  # first layer: only x^T in FP8
    ],
    ids=["frozen-weight", "first-layer"],
)
def test_saves_less_than_the_builtin_executor(weight_trains, input_grad, expected):
    import transformer_engine.common.recipe as te_recipe

    recipe = te_recipe.DelayedScaling()
    model = torch_linear(IN, OUT, False).requires_grad_(weight_trains)
    x = torch.randn(TOKENS, IN, device="cuda", dtype=DTYPE, requires_grad=input_grad)
    ours = _saved_bytes(jit_te_v2(model), x, recipe)
    executors, transforms = builtin_executors()
    theirs = _saved_bytes(thunder.jit(model, executors=executors, transforms=transforms), x, recipe)
    print(
        f"\n[{'frozen W' if not weight_trains else 'no input grad'}] saved for backward per linear: te_v2 {ours / 2**20:.1f} MiB, built-in {theirs / 2**20:.1f} MiB"
    )
    assert expected <= ours < expected + 1024
    assert ours < theirs
