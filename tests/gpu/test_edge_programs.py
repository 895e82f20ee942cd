"""Programs at the edges, on TransformerEngine: in-place writes around folded GEMMs, a backward
that reads a tensor written after it was saved, or that Thunder would differentiate past a write
through a view, batches of no tokens, a checkpointed function no gradient flows through."""

from __future__ import annotations

import warnings

import pytest
import thunder
import torch
from torch.utils.checkpoint import checkpoint

from te_v2_executor import TEv2FallbackWarning, executors, explain, make_te_v2, thunderfx
from te_v2_executor.symbols import LINEAR_FWD
from tests.gpu.common import DTYPE, delayed_recipe, jit_te_v2, requires_te_gpu, train_step
from tests.helpers import CLAIM_ALL, assert_like_eager
from tests.models import (
    SavedThenWritten,
    Stack,
    WriteAfterAdapter,
    WriteIntoInputBeforeAdapter,
    WrittenThroughAnotherName,
)

pytestmark = requires_te_gpu

# The default policy runs these models' linears unquantized in BF16 (cuBLAS): eager's products,
# up to the rounding of a GEMM that accumulates into its summand instead of a separate add.
BF16_TOLS = {"rtol": 1.6e-2, "atol": 1e-2}


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
@pytest.mark.parametrize("model", [WriteAfterAdapter, WriteIntoInputBeforeAdapter], ids=lambda m: m.__name__)
def test_no_fold_moves_a_gemm_past_an_in_place_write(model, grad):
    net = model(device="cuda", dtype=DTYPE)
    x = torch.randn(128, 64, device="cuda", dtype=DTYPE)
    assert_like_eager(net, x, [make_te_v2()], grad=grad, **BF16_TOLS)


def test_a_backward_reading_a_tensor_written_after_it_was_saved_is_refused():
    jitted = thunder.jit(SavedThenWritten(device="cuda", dtype=DTYPE), executors=[make_te_v2()])
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        jitted(torch.randn(128, 64, device="cuda", dtype=DTYPE)).sum().backward()


@pytest.mark.parametrize("way", WrittenThroughAnotherName.REFUSED)
def test_a_read_past_a_write_through_a_view_refuses_the_backward_in_fp8(way):
    """Every linear FP8 on TE: the forward runs, the backward Thunder would get wrong raises."""
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te

    model = WrittenThroughAnotherName(way, dim=128, device="cuda", dtype=DTYPE)
    jitted = thunder.jit(model, executors=[make_te_v2(claim=CLAIM_ALL)])
    with te.autocast(recipe=te_recipe.DelayedScaling()):
        outputs = jitted(torch.randn(128, 128, device="cuda", dtype=DTYPE))
    assert {r.recipe for r in explain(jitted).linears} == {"delayed"}
    with pytest.raises(RuntimeError, match=r"through another name of it|modified by an in-place operation"):
        sum(o.float().sum() for o in outputs).backward()


@pytest.mark.parametrize("way", WrittenThroughAnotherName.RIGHT)
def test_what_thunder_differentiates_right_past_a_write_runs(way):
    model = WrittenThroughAnotherName(way, device="cuda", dtype=DTYPE)
    assert_like_eager(
        model, torch.randn(128, 64, device="cuda", dtype=DTYPE), [make_te_v2()], grad=True, **BF16_TOLS
    )


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling"])
@pytest.mark.parametrize("shape", [(0, 256), (0, 4, 256), (4, 0, 256)], ids=str)
def test_a_batch_of_no_tokens_runs_and_leaves_the_state_alone(shape, recipe, grad):
    import transformer_engine.common.recipe as te_recipe

    model = Stack([256] * 3, act=torch.nn.functional.gelu, bias=True, device="cuda", dtype=DTYPE)
    jitted = jit_te_v2(model)
    fp8 = getattr(te_recipe, recipe)()
    train_step(jitted, torch.randn(128, 256, device="cuda", dtype=DTYPE), fp8)
    states = [r.state for r in explain(jitted).linears]
    before = [s.scaling(forward=True).scale.clone() for s in states if s.recipe.stateful]
    model.zero_grad(set_to_none=True)
    x = torch.randn(*shape, device="cuda", dtype=DTYPE, requires_grad=grad)
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("error", TEv2FallbackWarning)
        y = train_step(jitted, x, fp8)
    assert y.shape == (*shape[:-1], 256)
    assert {r.recipe for r in explain(jitted).linears} == {"unquantized"}
    if grad:
        assert x.grad.shape == x.shape
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    after = [s.scaling(forward=True).scale for s in states if s.recipe.stateful]
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))


class _CheckpointedMLP(torch.nn.Module):
    """An MLP whose two linears run under ``checkpoint`` (``checkpointed``), or called directly."""

    def __init__(self, dim: int = 512) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, 2 * dim, device="cuda", dtype=DTYPE)
        self.down = torch.nn.Linear(2 * dim, dim, device="cuda", dtype=DTYPE)
        self.checkpointed = True

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.mlp, x, use_reentrant=False) if self.checkpointed else self.mlp(x)


def test_a_checkpointed_function_without_gradients_runs_its_linears_in_fp8(dynamo_reset_after):
    """Under ``torch.no_grad()``, through ``te_v2_executor.thunderfx``, the checkpointed function is
    called inline: both linears run in te_v2's FP8 forward on TE, without a warning, and the
    output equals the same model's without the checkpoint, bitwise. Thunder alone would keep the
    call whole and run them in BF16."""
    import transformer_engine.pytorch as te

    model, x = _CheckpointedMLP(), torch.randn(256, 512, device="cuda", dtype=DTYPE)
    outputs = []
    for checkpointed in (True, False):
        torch._dynamo.reset()
        model.checkpointed = checkpointed
        compiled = thunderfx(model, executors=executors(make_te_v2(claim=CLAIM_ALL)))
        with warnings.catch_warnings(), torch.no_grad(), te.autocast(enabled=True, recipe=delayed_recipe()):
            warnings.simplefilter("error", TEv2FallbackWarning)
            outputs.append(compiled(x))
        fns = compiled._backend.subgraph_infos[-1].thunder_compiled_fns
        forwards = [b for fn in fns for b in thunder.last_traces(fn)[-1].bound_symbols if b.sym is LINEAR_FWD]
        assert len(forwards) == 2
        assert compiled._backend.inlined_checkpoints == int(checkpointed)
    assert torch.equal(*outputs)
