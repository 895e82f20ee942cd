"""Which recasts te_v2 makes: only those that lower the step's peak memory (``passes/_peak.py``),
with the same training as saved copies (reference backend, CPU)."""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
import torch.nn.functional as F

from te_v2_executor import explain, make_te_v2
from tests.helpers import CLAIM_ALL
from tests.models import Stack

pytestmark = pytest.mark.peak_policy

RECASTS = ("weight_recasts", "input_recasts")


def _step(model: torch.nn.Module, tokens: int, skip: tuple[str, ...] = ()):
    """One forward and backward of ``model`` under te_v2; the jitted model and its gradients."""
    te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL, skip_passes=skip)
    jitted = thunder.jit(model, executors=[te_v2])
    torch.manual_seed(1)
    jitted(torch.randn(tokens, model.linears[0].in_features)).sum().backward()
    return jitted, [p.grad for p in model.parameters()]


def _recasts(jitted) -> list[tuple[bool, bool]]:
    """(weight recast, input recast) of each linear."""
    return [(r.recasts_weight_t, r.recasts_input_t) for r in explain(jitted).linears]


def _stack(dim: int) -> Stack:
    return Stack([dim, 4 * dim, dim, 4 * dim, dim], act=F.gelu)


def test_no_recast_where_the_weight_gradients_make_the_peak():
    """Few tokens through wide weights: the peak is the end of the backward, where every weight
    gradient is made and every saved copy already freed, so a recast would buy no memory for its
    call into TE (the main suite's full fine-tune at 2048 tokens)."""
    model = _stack(256)
    twin = copy.deepcopy(model)
    jitted, grads = _step(model, tokens=16)
    rows = explain(jitted).linears
    assert _recasts(jitted) == [(False, False)] * 4
    assert all(r.saves_weight_t for r in rows if r.dgrad)
    _, saved_grads = _step(twin, tokens=16, skip=RECASTS)
    assert all(map(torch.equal, grads, saved_grads))


def test_recasts_where_the_saved_activations_make_the_peak():
    """Many tokens through narrow weights: the peak is in the backward while the activations are
    alive, so the copies alive through it are recast. The last linear's copies are freed by its
    dgrad and wgrad, the backward's first GEMMs, before the peak: they stay saved."""
    model = _stack(64)
    twin = copy.deepcopy(model)
    jitted, grads = _step(model, tokens=2048)
    assert _recasts(jitted) == [(False, False), (True, True), (True, True), (False, False)]
    _, saved_grads = _step(twin, tokens=2048, skip=RECASTS)
    assert all(map(torch.equal, grads, saved_grads))


def _three_linears(x, a, b, c):
    return F.linear(F.gelu(F.linear(F.gelu(F.linear(x, a)), b)), c)


def test_symbolic_sizes_leave_the_estimate_out():
    """Under ``cache="symbolic values"`` sizes are not numbers when the passes run, where
    Thunder's ``numel`` raises outside a tracing context (and the compile with it): no estimate,
    and the step trains as with saved copies."""
    weights = [torch.randn(256, 64), torch.randn(64, 256), torch.randn(256, 64)]
    grads = []
    for skip in ((), RECASTS):
        te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL, skip_passes=skip)
        jitted = thunder.jit(_three_linears, executors=[te_v2], cache="symbolic values")
        ws = [w.clone().requires_grad_() for w in weights]
        torch.manual_seed(1)
        for tokens in (64, 32):
            jitted(torch.randn(tokens, 64, requires_grad=True), *ws).sum().backward()
        grads.append([w.grad for w in ws])
    assert all(map(torch.equal, *grads))
