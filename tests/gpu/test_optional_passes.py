"""The passes that save memory, on TransformerEngine, on and off: ``weight_recasts`` (dgrads read
W^T cast in the backward), ``shared_inputs`` (one cast of an input several forwards read) and
``input_recasts`` (wgrads read x^T cast in the backward: down_proj's, from the SwiGLU's operands
through te_v2's fused kernel), and ``recast_batches`` (consecutive weight recasts as one TE
multi-tensor cast) train bitwise as without them, over steps whose delayed scales move, with the
same GEMMs."""

from __future__ import annotations

import copy

import pytest
import thunder
import torch

from te_v2_executor import explain
from te_v2_executor.symbols import RECAST_WEIGHTS
from tests.gpu.common import DTYPE, delayed_recipe, requires_te_gpu, te_v2_claiming_all, train_step_gemms
from tests.helpers import assert_trained_alike, train_steps
from tests.models import LlamaLikeBlock, LoRAStack, Stack, every_even

pytestmark = requires_te_gpu

DIM, TOKENS, STEPS = 256, 512, 5


def _current_recipe():
    from transformer_engine.common.recipe import Float8CurrentScaling

    return Float8CurrentScaling()


RECIPES = {"delayed": delayed_recipe, "current": _current_recipe}
MODELS = {
    "stack": lambda: Stack([DIM] * 5, frozen=every_even),
    "lora": lambda: LoRAStack([DIM] * 3),
    "block": lambda: LlamaLikeBlock(DIM),
    "frozen-block": lambda: LlamaLikeBlock(DIM, frozen=("q", "k", "v", "gate", "up")),
}


def _reported(sign):
    """Whether the report shows ``sign`` on any linear of a compiled function."""
    return lambda jitted: any(map(sign, explain(jitted).linears))


def _batched_recasts(jitted) -> bool:
    return any(b.sym is RECAST_WEIGHTS for b in thunder.last_backward_traces(jitted)[-1].bound_symbols)


# each pass, the models and recipes it changes, and its sign that it acted on a compiled function
PASSES = {
    "weight_recasts": (
        ("stack", "lora"),
        RECIPES,
        _reported(lambda r: r.recasts_weight_t and not r.saves_weight_t),
    ),
    "shared_inputs": (("block", "frozen-block"), RECIPES, _reported(lambda r: r.shares_input)),
    "input_recasts": (("block",), RECIPES, _reported(lambda r: r.recasts_input_t and not r.saves_input_t)),
    # delayed scaling's recasts only: a stateless recipe's have no snapshot to batch by
    "recast_batches": (("stack", "block"), ("delayed",), _batched_recasts),
}
CASES = [(p, m, r) for p, (models, recipes, _) in PASSES.items() for m in models for r in recipes]


def _train(model, recipe, skip):
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    jitted = thunder.jit(model, executors=[te_v2_claiming_all(skip_passes=skip)])
    xs = [torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(STEPS)]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    losses = train_steps(jitted, opt, xs, autocast=lambda: te.autocast(enabled=True, recipe=recipe))
    return jitted, torch.stack(losses), [x.grad for x in xs]


@pytest.mark.parametrize(("pass_name", "name", "recipe"), CASES)
def test_a_pass_trains_bitwise_as_without_it(pass_name, name, recipe):
    model = MODELS[name]().to(device="cuda", dtype=DTYPE)
    twin = copy.deepcopy(model)
    # shared_inputs' kernel count is that of the casts the forward makes, which input_recasts moves
    base = ("input_recasts",) if pass_name == "shared_inputs" else ()
    run = _train(model, RECIPES[recipe](), base)
    apart_run = _train(twin, RECIPES[recipe](), (*base, pass_name))
    jitted, apart = run[0], apart_run[0]

    acted = PASSES[pass_name][2]
    assert acted(jitted)
    assert not acted(apart)
    assert_trained_alike(model, twin, run, apart_run)

    x = torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE, requires_grad=True)
    gemms, kernels = train_step_gemms(jitted, x, RECIPES[recipe]())
    apart_gemms, apart_kernels = train_step_gemms(apart, x, RECIPES[recipe]())
    assert gemms == apart_gemms
    if pass_name == "shared_inputs":
        print(f"{name} {recipe}: kernels per step {len(kernels)} shared, {len(apart_kernels)} apart")
        # delayed: per group a cast, the zeroing of its amax scratch and one foreach max into the
        # histories, in place of three casts (q/k/v) or two (gate/up)
        assert (
            len(kernels) == len(apart_kernels) + 1
            if recipe == "delayed"
            else len(kernels) < len(apart_kernels)
        )
    if pass_name == "recast_batches":
        print(f"{name} {recipe}: kernels per step {len(kernels)} batched, {len(apart_kernels)} apart")
        assert len(kernels) < len(apart_kernels)
