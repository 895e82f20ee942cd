"""The once-per-pass flush of delayed-scaling state (reference backend, CPU)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import thunder
import torch
from torch.utils.checkpoint import checkpoint

from te_v2_executor import delayed_scaling, explain, make_te_v2, quantization_update_scope
from tests.helpers import CLAIM_ALL, FUSERS, assert_one_sync_per_pass_after_linear_work, fusers_named
from tests.models import GraphBroken, Stack

DIM, TOKENS = 64, 32
RECIPE = delayed_scaling(amax_history_len=16)


class HalfCheckpointed(torch.nn.Module):
    """A stack whose first half of linears runs under torch.utils.checkpoint."""

    def __init__(self, n: int, *, use_checkpoint: bool) -> None:
        super().__init__()
        half = max(1, n // 2)
        self.head = Stack([DIM] * (half + 1))
        self.tail = Stack([DIM] * (n - half + 1)) if n > half else None
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.head, x, use_reentrant=False) if self.use_checkpoint else self.head(x)
        return x if self.tail is None else self.tail(torch.relu(x))


@pytest.mark.parametrize("fuser", FUSERS)
@pytest.mark.parametrize("use_checkpoint", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("n", [1, 4, 32])
def test_one_sync_per_pass_after_all_linear_work(n, use_checkpoint, fuser):
    ex = make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=RECIPE)
    jitted = thunder.jit(
        HalfCheckpointed(n, use_checkpoint=use_checkpoint), executors=[ex, *fusers_named(fuser)]
    )
    jitted(torch.randn(TOKENS, DIM, requires_grad=True)).sum().backward()
    assert_one_sync_per_pass_after_linear_work(jitted, n)


def _states(jitted) -> dict:
    return {r.name: r.state for r in explain(jitted).linears}


def _history(state, *, forward: bool) -> torch.Tensor:
    return state.scaling(forward=forward).amax_history


def _nonzero_rows(history: torch.Tensor) -> list[int]:
    return [i for i in range(history.shape[0]) if history[i].any()]


def test_each_pass_updates_state_once():
    jitted = thunder.jit(
        Stack([DIM] * 3), executors=[make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=RECIPE)]
    )
    x = torch.randn(TOKENS, DIM)
    for step in range(1, 4):
        jitted(x).sum().backward()
        for name, state in _states(jitted).items():
            for forward in (True, False):
                # each update rolls the history once and clears the current (first) row
                assert _nonzero_rows(_history(state, forward=forward)) == list(range(16 - step, 16)), name
    first = _states(jitted)["linears_0_weight"]
    assert torch.equal(_history(first, forward=True)[-1, 0], x.abs().amax())


def _train(model, x, steps=10):
    jitted = thunder.jit(model, executors=[make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=RECIPE)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = jitted(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return jitted, losses


def test_checkpointing_leaves_quantization_state_unchanged():
    """The recompute quantizes with the original forward's scales and records no amax."""
    plain = HalfCheckpointed(4, use_checkpoint=False)
    checkpointed = copy.deepcopy(plain)
    checkpointed.use_checkpoint = True
    x = torch.randn(TOKENS, DIM)
    jitted, losses = _train(plain, x)
    jitted_ckpt, losses_ckpt = _train(checkpointed, x)
    assert losses == losses_ckpt
    states, states_ckpt = _states(jitted), _states(jitted_ckpt)
    assert states.keys() == states_ckpt.keys()
    for name in states:
        for forward in (True, False):
            a, b = states[name].scaling(forward=forward), states_ckpt[name].scaling(forward=forward)
            assert torch.equal(a.amax_history, b.amax_history), name
            assert torch.equal(a.scale, b.scale), name
    for p, q in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(p, q)


def test_update_scope_flushes_once_at_exit():
    micro_batches = [torch.randn(TOKENS, DIM) for _ in range(4)]

    def run(scoped: bool):
        jitted = thunder.jit(
            Stack([DIM] * 3), executors=[make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=RECIPE)]
        )
        with quantization_update_scope() if scoped else contextlib.nullcontext():
            for mb in micro_batches:
                jitted(mb).sum().backward()
            if scoped:  # nothing updated before the scope exits
                assert not _history(_states(jitted)["linears_0_weight"], forward=True)[1:].any()
        return _states(jitted)

    scoped, per_pass = run(True), run(False)
    for name, state in scoped.items():
        for forward in (True, False):
            assert _nonzero_rows(_history(state, forward=forward)) == [15], name
            assert len(_nonzero_rows(_history(per_pass[name], forward=forward))) == 4, name
    # the one update sees the running max of the four micro-batches' amaxes
    per_pass_input_amaxes = _history(per_pass["linears_0_weight"], forward=True)[-4:, 0]
    assert torch.equal(_history(scoped["linears_0_weight"], forward=True)[-1, 0], per_pass_input_amaxes.max())


def test_nested_scopes_flush_at_the_outermost_exit():
    jitted = thunder.jit(
        Stack([DIM] * 2), executors=[make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=RECIPE)]
    )
    with quantization_update_scope():
        with quantization_update_scope():
            jitted(torch.randn(TOKENS, DIM)).sum().backward()
        state = _states(jitted)["linears_0_weight"]
        assert _nonzero_rows(_history(state, forward=True)) == [0]
    assert _nonzero_rows(_history(state, forward=True)) == [15]


@pytest.mark.parametrize("scoped", [False, True], ids=["per-region", "scope"])
def test_thunderfx_regions_flush_once_per_step_inside_an_update_scope(monkeypatch, scoped):
    """Each thunderfx region is a compiled function with its own flushes; wrapping the step in
    ``quantization_update_scope`` brings them back to one per direction."""
    from thunder.dynamo import thunderfx

    from te_v2_executor import state

    torch._dynamo.reset()
    compiled = thunderfx(
        GraphBroken(DIM), executors=[make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=RECIPE)]
    )
    updates = []
    real_update = state.update_delayed_scaling

    def counting_update(states, *, forward):
        states = list(states)
        updates.append((forward, len(states)))
        real_update(states, forward=forward)

    monkeypatch.setattr(state, "update_delayed_scaling", counting_update)
    with quantization_update_scope() if scoped else contextlib.nullcontext():
        compiled(torch.randn(TOKENS, DIM, requires_grad=True)).sum().backward()
    assert len(compiled.last_traces) == 2  # the two regions
    assert len(explain(compiled).linears) == 4  # explain lists the linears of both
    if scoped:
        assert sorted(updates) == [(False, 4), (True, 4)]
    else:
        assert sorted(updates) == [(False, 2), (False, 2), (True, 2), (True, 2)]
