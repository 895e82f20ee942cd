"""Saved-for-backward bytes per linear, measured through autograd's saved-tensor hooks."""

from __future__ import annotations

import pytest
import thunder
import torch

from tests.gpu.common import DTYPE, builtin_executors, requires_te_gpu, te_v2_claiming_all, torch_linear
from tests.helpers import FUSERS, fusers_named, saved_nbytes
from tests.models import LlamaLikeBlock

pytestmark = requires_te_gpu

IN, OUT, TOKENS = 4096, 4096, 4096


def _saved_bytes(fn, x, recipe, parameters) -> int:
    """Bytes saved for the backward, less the parameters: those are alive anyway."""
    import transformer_engine.pytorch as te

    total = 0
    alive = {p.data_ptr() for p in parameters}

    def pack(t):
        nonlocal total
        if t.data_ptr() not in alive:
            total += saved_nbytes(t)
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        te.autocast(enabled=True, recipe=recipe),
    ):
        fn(x).float().sum().backward()
    return total


@pytest.mark.parametrize(
    ("weight_trains", "input_grad", "skip", "expected"),
    [
        (False, True, (), 0),  # frozen weight: its W^T is cast again in the backward
        (False, True, ("weight_recasts",), OUT * IN),  # ... or saved, in FP8 (plus its scale)
        (True, False, (), TOKENS * IN),  # first layer: only x^T in FP8
    ],
    ids=["frozen-weight", "frozen-weight-saved", "first-layer"],
)
@pytest.mark.parametrize("fuser", FUSERS)
def test_saves_less_than_the_builtin_executor(weight_trains, input_grad, skip, expected, fuser):
    import transformer_engine.common.recipe as te_recipe

    recipe = te_recipe.DelayedScaling()
    model = torch_linear(IN, OUT, False).requires_grad_(weight_trains)
    x = torch.randn(TOKENS, IN, device="cuda", dtype=DTYPE, requires_grad=input_grad)
    te_v2 = te_v2_claiming_all(skip_passes=skip)
    ours = _saved_bytes(
        thunder.jit(model, executors=[te_v2, *fusers_named(fuser)]), x, recipe, model.parameters()
    )
    executors, transforms = builtin_executors()
    builtin = thunder.jit(model, executors=executors, transforms=transforms)
    theirs = _saved_bytes(builtin, x, recipe, model.parameters())
    print(
        f"\n[{'frozen W' if not weight_trains else 'no input grad'}{', W^T saved' if skip else ''}] saved for "
        f"backward per linear beyond the parameters: te_v2 {ours / 2**20:.1f} MiB, built-in {theirs / 2**20:.1f} MiB"
    )
    assert expected <= ours < expected + 1024
    assert ours < theirs


@pytest.mark.parametrize("fuser", FUSERS)
def test_linears_reading_one_input_save_one_copy_of_it(fuser):
    """A Llama-like block: with ``shared_inputs`` q/k/v save one x^T, gate/up one; without it k, v
    and up save three more, in FP8 (plus their scales). Without ``input_recasts``, which saves
    none of them."""
    import transformer_engine.common.recipe as te_recipe

    recipe = te_recipe.DelayedScaling()
    dim = 1024
    model = LlamaLikeBlock(dim).to(device="cuda", dtype=DTYPE)
    x = torch.randn(TOKENS, dim, device="cuda", dtype=DTYPE, requires_grad=True)
    shared, apart = (
        _saved_bytes(
            thunder.jit(model, executors=[te_v2_claiming_all(skip_passes=skip), *fusers_named(fuser)]),
            x,
            recipe,
            model.parameters(),
        )
        for skip in (("input_recasts",), ("input_recasts", "shared_inputs"))
    )
    print(
        f"\n[Llama-like block] saved for backward: shared casts {shared / 2**20:.1f} MiB, apart {apart / 2**20:.1f} MiB"
    )
    assert 3 * TOKENS * dim <= apart - shared < 3 * TOKENS * dim + 1024
