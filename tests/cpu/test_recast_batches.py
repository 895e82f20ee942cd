"""The ``recast_batches`` pass: weight recasts that follow one another in the backward are one
``te_v2_recast_weights``, within ``BATCH_BYTES`` of copies, after the first one's gradient, with
bitwise the same training (reference backend, CPU)."""

from __future__ import annotations

import pytest
import thunder
import torch
from thunder.executors.torch_compile import torch_compile_ex

from te_v2_executor import (
    Backend,
    TEv2Config,
    TEv2Executor,
    current_scaling,
    delayed_scaling,
    explain,
    make_te_v2,
    thunderfx,
)
from te_v2_executor.compiled import compiled_functions
from te_v2_executor.passes import recast_batches
from te_v2_executor.symbols import LINEAR_DGRAD, QUANTIZE_GRAD_OUTPUT, RECAST_WEIGHTS, is_recast
from tests.cpu.test_recasts import MODELS, _train
from tests.helpers import CLAIM_ALL, trained_with_and_without
from tests.models import Stack

DIM, TOKENS = 128, 128


@pytest.mark.parametrize("name", MODELS)
def test_batched_recasts_train_bitwise_as_single_ones(name):
    """Three delayed-scaling steps, so that each batch must cast with the scales its forwards
    used, not the updated ones."""
    train = lambda model, skip: _train(model, delayed_scaling(), skip)  # noqa: E731
    trained_with_and_without(MODELS[name](), train, ("recast_batches",))


def _backward(model: torch.nn.Module, recipe=None) -> list:
    """The bound symbols of ``model``'s backward through thunderfx, te_v2 then torch.compile's
    executor (whose dataflow fusion orders the backward anew), after one step."""
    te_v2 = make_te_v2(backend="reference", recipe=recipe, claim=CLAIM_ALL)
    compiled = thunderfx(model, executors=[te_v2, torch_compile_ex])
    compiled(torch.randn(TOKENS, DIM, requires_grad=True)).sum().backward()
    (jitted,) = compiled_functions(compiled)
    assert sum(r.recasts_weight_t for r in explain(jitted).linears) == 4
    return thunder.last_backward_traces(jitted)[-1].bound_symbols


@pytest.mark.parametrize("batch_bytes", [4 * DIM * DIM, 2 * DIM * DIM])
def test_consecutive_recasts_are_cast_together_within_the_batch_bytes(monkeypatch, batch_bytes):
    """Four recasts of DIM x DIM weights: one batch of four, or two of two; each batch runs after
    the gradient its first weight's dgrad reads, and before every dgrad that reads its copies."""
    monkeypatch.setattr(recast_batches, "BATCH_BYTES", batch_bytes)
    order = _backward(Stack([DIM] * 5))
    assert not any(map(is_recast, order))
    batches = [at for at, b in enumerate(order) if b.sym is RECAST_WEIGHTS]
    assert [len(order[at].kwargs["states"]) for at in batches] == [batch_bytes // (DIM * DIM)] * len(batches)
    dy_q_at = {id(b.kwargs["state"]): i for i, b in enumerate(order) if b.sym is QUANTIZE_GRAD_OUTPUT}
    for at in batches:
        batch = order[at]
        assert dy_q_at[id(batch.kwargs["states"][0])] < at
        copies = {c.name for c in batch.output}
        readers = [
            i
            for i, b in enumerate(order)
            if b.sym is LINEAR_DGRAD and copies & {a.name for a in b.flat_proxy_args}
        ]
        assert len(readers) == len(batch.output) and min(readers) > at


def test_recasts_of_stateless_recipes_stay_apart():
    """Current scaling casts each weight with a scale of its own amax: no snapshot to batch by."""
    order = _backward(Stack([DIM] * 5), current_scaling())
    assert not any(b.sym is RECAST_WEIGHTS for b in order)
    assert sum(map(is_recast, order)) == 4


class _Recording(TEv2Executor):
    """te_v2 that keeps the joint trace its fusion pass returns."""

    def fusion_pass(self, trace):
        self.returned = super().fusion_pass(trace)
        return self.returned


def test_a_batch_casts_once_per_state():
    """Two recasts of one state (the joint trace with ``recast_batches`` skipped, its first recast
    repeated after its second) go to two batches: the state's replay scaling is rescaled per cast."""
    config = TEv2Config(backend=Backend.REFERENCE, claim=CLAIM_ALL, skip_passes=frozenset({"recast_batches"}))
    te_v2 = _Recording(config, name="te_v2_recorded")
    jitted = thunder.jit(Stack([DIM] * 5), executors=[te_v2])
    jitted(torch.randn(TOKENS, DIM, requires_grad=True)).sum().backward()
    trace = te_v2.returned
    bsyms = list(trace.bound_symbols)
    at = [i for i, b in enumerate(bsyms) if is_recast(b)]
    assert len(at) == 4
    bsyms.insert(at[1] + 1, bsyms[at[0]])
    trace.bound_symbols = bsyms
    assert [len(run) for run in recast_batches._batches(trace)] == [2, 3]
