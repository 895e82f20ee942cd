"""The ``shared_inputs`` pass: an input several te_v2 forwards read (q/k/v, gate/up) is cast to FP8
once and its column-wise copy saved once, with bitwise the training of one cast per linear,
quantization state included, also where traces that share and traces that do not take turns
(reference backend, CPU)."""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from te_v2_executor import (
    block_scaling,
    current_scaling,
    delayed_scaling,
    explain,
    make_te_v2,
    quantization_update_scope,
)
from te_v2_executor.symbols import QUANTIZE_INPUT
from tests.helpers import CLAIM_ALL, assert_trained_alike, bsyms_of, forward_trace, train_steps
from tests.models import LlamaLikeBlock

DIM, TOKENS = 256, 128
OFF = ("shared_inputs",)


class CheckpointedBlock(nn.Module):
    """A Llama-like block under ``torch.utils.checkpoint``: its forwards run again in the
    backward, with the scales the forward sync snapshots."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.block = LlamaLikeBlock(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


MODELS = {
    "block": lambda: LlamaLikeBlock(DIM),
    "some-frozen": lambda: LlamaLikeBlock(DIM, frozen=("q", "k", "gate")),
    "base-frozen": lambda: LlamaLikeBlock(DIM, frozen=("q", "k", "v", "gate", "up")),
    "checkpointed": lambda: CheckpointedBlock(DIM),
}
RECIPES = {"delayed": delayed_scaling, "current": current_scaling, "block": block_scaling}
# (shares x, saves x^T) of each linear of LlamaLikeBlock when every weight trains, without
# ``input_recasts``, which casts every saved copy of this block again in the backward
SHARED = {
    "q": (False, True),
    "k": (True, False),
    "v": (True, False),
    "o": (False, True),
    "gate": (False, True),
    "up": (True, False),
    "down": (False, True),
}


def _train(model: nn.Module, recipe, skip: tuple[str, ...], *, micro_batches: int = 1):
    torch.manual_seed(1)
    te_v2 = make_te_v2(backend="reference", recipe=recipe, claim=CLAIM_ALL, skip_passes=skip)
    jitted = thunder.jit(model, executors=[te_v2])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    xs = [torch.randn(TOKENS, DIM, requires_grad=True) for _ in range(3)]
    if micro_batches == 1:
        losses = train_steps(jitted, opt, xs)
    else:
        losses = []
        for x in xs:
            opt.zero_grad()
            with quantization_update_scope():
                for half in x.chunk(micro_batches):
                    loss = jitted(half).float().square().mean()
                    loss.backward()
                    losses.append(loss.detach())
            opt.step()
    return jitted, losses, [x.grad for x in xs]


def _assert_same_training(model: nn.Module, recipe, **kw) -> tuple:
    twin = copy.deepcopy(model)
    run, apart_run = _train(model, recipe, (), **kw), _train(twin, recipe, OFF, **kw)
    assert_trained_alike(model, twin, run, apart_run)
    return run[0], apart_run[0]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", MODELS)
def test_one_cast_per_input_trains_bitwise_as_one_per_linear(name, recipe):
    """Three SGD steps, so that delayed scaling's scales move: a k or v state whose history did
    not record the shared cast's amax would end with another state dict, and under checkpointing
    its recompute would cast with another scale."""
    jitted, apart = _assert_same_training(MODELS[name](), RECIPES[recipe]())
    # a recomputed linear casts on its own, replaying its own forward scale
    assert len(bsyms_of(forward_trace(jitted), QUANTIZE_INPUT)) == (0 if name == "checkpointed" else 2)
    assert not bsyms_of(forward_trace(apart), QUANTIZE_INPUT)
    assert not any(r.shares_input for r in explain(apart).linears)


def test_the_report_names_who_shares_and_who_saves():
    model = LlamaLikeBlock(DIM)
    twin = copy.deepcopy(model)
    run = _train(model, delayed_scaling(), ("input_recasts",))
    apart_run = _train(twin, delayed_scaling(), ("input_recasts", *OFF))
    assert_trained_alike(model, twin, run, apart_run)
    jitted, apart = run[0], apart_run[0]
    rows = dict(zip(SHARED, explain(jitted).linears, strict=True))
    assert {n: (r.shares_input, r.saves_input_t) for n, r in rows.items()} == SHARED
    assert all(r.saves_input_t for r in explain(apart).linears)
    assert "shares x" in str(explain(jitted))


def test_frozen_linears_share_a_cast_that_saves_no_copy():
    jitted, _ = _assert_same_training(MODELS["base-frozen"](), delayed_scaling())
    casts = bsyms_of(forward_trace(jitted), QUANTIZE_INPUT)
    assert [b.kwargs["columnwise"] for b in casts] == [False, False]
    assert not any(r.saves_input_t for r in explain(jitted).linears if r.name[0] in "qkvgu")


def test_histories_held_back_by_an_update_scope_stay_equal():
    _assert_same_training(LlamaLikeBlock(DIM), delayed_scaling(), micro_batches=2)


class WrittenBetweenReads(nn.Module):
    """q reads h, h is written in place, then k and v read it."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        q = self.q(h)
        h.mul_(0.5)
        return q + self.k(h) * self.v(h)


def test_a_write_between_two_readers_splits_the_group():
    jitted, _ = _assert_same_training(WrittenBetweenReads(), delayed_scaling())
    rows = explain(jitted).linears
    assert [r.shares_input for r in rows] == [False, False, True]


class WrittenInTrainingOnly(nn.Module):
    """q and k read h; in training h is written between them, so only inference traces share."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = (nn.Linear(DIM, DIM, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        a = self.q(h)
        if self.training or x.shape[0] > TOKENS:
            h.mul_(4.0)
        return a + self.k(h)


def _alternate(model: nn.Module, skip: tuple[str, ...], *, scoped: bool):
    """Three steps, each after a no-grad inference call on a large batch (which shares, and has
    no forward sync); or one step of two micro-batches in an update scope, the second of which
    does not share (after it q's and k's histories differ, and from then on the shared cast
    uses q's scale where k alone would use its own: equally exact, not bitwise equal)."""
    te_v2 = make_te_v2(backend="reference", recipe=delayed_scaling(), claim=CLAIM_ALL, skip_passes=skip)
    jitted = thunder.jit(model, executors=[te_v2])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(3)
    losses, x_grads = [], []
    for x in (torch.randn(TOKENS, DIM, requires_grad=True) for _ in range(1 if scoped else 3)):
        opt.zero_grad()
        if scoped:
            model.eval()  # no dropout here; eval() only selects the sharing branch
            with quantization_update_scope():
                for batch in (x, torch.cat([x, x])):
                    loss = jitted(batch).square().mean()
                    loss.backward()
                    losses.append(loss.detach())
        else:
            model.eval()
            with torch.no_grad():
                jitted(x.detach() * 100)
            model.train()
            loss = jitted(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        x_grads.append(x.grad)
    return jitted, losses, x_grads


@pytest.mark.parametrize("scoped", [False, True], ids=["no-grad-calls", "update-scope"])
def test_sharing_and_unsharing_traces_keep_every_history_exact(scoped):
    """Each linear records its own amax in every trace: the shared cast adds its amax into every
    sharer's history as it runs, not at a flush that some of the traces lack or that would apply
    one trace's sharing to the amaxes of another."""
    model = WrittenInTrainingOnly()
    twin = copy.deepcopy(model)
    assert_trained_alike(
        model, twin, _alternate(model, (), scoped=scoped), _alternate(twin, OFF, scoped=scoped)
    )
