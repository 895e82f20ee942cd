"""The ``weight_recasts`` pass on TransformerEngine: dgrads that read W^T cast in the backward train
bitwise as with the forward's saved copy, over steps whose delayed scales move, with the same
GEMMs."""

from __future__ import annotations

import copy

import pytest
import thunder
import torch

from te_v2_executor import explain, quantization_state_dict
from tests.gpu.common import DTYPE, delayed_recipe, requires_te_gpu, te_v2_claiming_all, train_step_gemms
from tests.helpers import assert_state_dicts_equal, train_steps
from tests.models import LoRAStack, Stack, every_even

pytestmark = requires_te_gpu

DIM, TOKENS, STEPS = 256, 512, 5


def _current_recipe():
    from transformer_engine.common.recipe import Float8CurrentScaling

    return Float8CurrentScaling()


RECIPES = {"delayed": delayed_recipe, "current": _current_recipe}
MODELS = {
    "stack": lambda: Stack([DIM] * 5, frozen=every_even),
    "lora": lambda: LoRAStack([DIM] * 3),
}


def _train(model, recipe, skip):
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    jitted = thunder.jit(model, executors=[te_v2_claiming_all(skip_passes=skip)])
    xs = [torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(STEPS)]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    losses = train_steps(jitted, opt, xs, autocast=lambda: te.autocast(enabled=True, recipe=recipe))
    return jitted, torch.stack(losses), [x.grad for x in xs]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", MODELS)
def test_recast_weights_train_bitwise_as_saved_ones(name, recipe):
    model = MODELS[name]().to(device="cuda", dtype=DTYPE)
    twin = copy.deepcopy(model)
    jitted, losses, x_grads = _train(model, RECIPES[recipe](), ())
    saved, saved_losses, saved_x_grads = _train(twin, RECIPES[recipe](), ("weight_recasts",))

    rows = explain(jitted).linears
    assert any(r.recasts_weight_t for r in rows)
    assert not any(r.saves_weight_t for r in rows)
    assert torch.equal(losses, saved_losses)
    for a, b in zip(x_grads, saved_x_grads, strict=True):
        assert torch.equal(a, b)
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert_state_dicts_equal(quantization_state_dict(jitted), quantization_state_dict(saved))

    x = torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE, requires_grad=True)
    gemms, _ = train_step_gemms(jitted, x, RECIPES[recipe]())
    saved_gemms, _ = train_step_gemms(saved, x, RECIPES[recipe]())
    assert gemms == saved_gemms
