"""``gradless_checkpoints.inline``: a checkpointed function no gradient flows through is called
inline in Dynamo's graph, so that te_v2 runs its linears, with the outputs te_v2 gives the same
model uncheckpointed; where one stays whole, te_v2 says its linears run unquantized."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import thunder
import torch
from thunder.dynamo import thunderfx as thunders_thunderfx
from torch.utils.checkpoint import checkpoint

from te_v2_executor import TEv2FallbackWarning, make_te_v2, thunderfx
from te_v2_executor.inductor import inductor_ex
from te_v2_executor.symbols import LINEAR_FWD
from tests.helpers import CLAIM_ALL

DIM = 64


class _Checkpointed(torch.nn.Module):
    """Three linears, the last two under ``checkpoint`` (c widens, so its warning differs from b's) (the last under a second one, nested, with
    ``nested``); ``checkpointed=False`` calls the same functions directly."""

    def __init__(self, nested: bool) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, DIM)
        self.c = torch.nn.Linear(DIM, 2 * DIM)
        self.nested = nested
        self.checkpointed = True

    def _call(self, fn, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(fn, h, use_reentrant=False) if self.checkpointed else fn(h)

    def inner(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.c(h))

    def block(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(h))
        return self._call(self.inner, h) if self.nested else self.inner(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(self.block, self.a(x))


def _forward_linears(compiled) -> int:
    """How many of te_v2's FP8 linear forwards the forward traces of ``compiled``'s regions hold."""
    fns = compiled._backend.subgraph_infos[-1].thunder_compiled_fns
    return sum(b.sym is LINEAR_FWD for fn in fns for b in thunder.last_traces(fn)[-1].bound_symbols)


def _frozen(model: torch.nn.Module):
    model.requires_grad_(False)
    return contextlib.nullcontext()


GRADLESS = {"no_grad": lambda model: torch.no_grad(), "frozen": _frozen}


@pytest.mark.parametrize("nested", [False, True], ids=["one", "nested"])
@pytest.mark.parametrize("gradless", GRADLESS)
def test_linears_of_a_gradless_checkpointed_function_run_in_te_v2(dynamo_reset_after, gradless, nested):
    """Under ``torch.no_grad()``, or with the model frozen, every checkpoint is called inline and all
    three linears run in te_v2's FP8 symbols, with no warning, giving the output te_v2 gives the
    model without checkpoints, bitwise."""
    model = _Checkpointed(nested)
    x = torch.randn(16, DIM)
    outputs = []
    for checkpointed in (True, False):
        torch._dynamo.reset()
        model.checkpointed = checkpointed
        compiled = thunderfx(model, executors=[make_te_v2(backend="reference", claim=CLAIM_ALL), inductor_ex])
        with warnings.catch_warnings(record=True) as caught, GRADLESS[gradless](model):
            warnings.simplefilter("always")
            outputs.append(compiled(x))
        assert not [w for w in caught if issubclass(w.category, TEv2FallbackWarning)]
        assert _forward_linears(compiled) == 3
        assert compiled._backend.inlined_checkpoints == (1 + nested) * checkpointed
    assert not outputs[0].requires_grad
    assert torch.equal(*outputs)


def test_a_checkpointed_function_gradients_flow_through_stays_checkpointed(dynamo_reset_after):
    """Where gradients flow, the checkpoint stays (its backward recomputes the function, which is
    what it is for), and te_v2 runs its linears through Thunder's backward as before."""
    model = _Checkpointed(nested=False)
    compiled = thunderfx(model, executors=[make_te_v2(backend="reference", claim=CLAIM_ALL), inductor_ex])
    compiled(torch.randn(16, DIM)).sum().backward()
    assert compiled._backend.inlined_checkpoints == 0
    assert _forward_linears(compiled) == 3
    assert all(p.grad is not None for p in model.parameters())


def test_thunders_thunderfx_warns_that_a_gradless_checkpoints_linears_run_unquantized(dynamo_reset_after):
    """Through ``thunder.dynamo.thunderfx``, which keeps a gradless checkpoint whole, te_v2 warns
    once per linear te_v2 would have run in FP8, naming te_v2_executor.thunderfx."""
    model = _Checkpointed(nested=False)
    compiled = thunders_thunderfx(
        model, executors=[make_te_v2(backend="reference", claim=CLAIM_ALL), inductor_ex]
    )
    with pytest.warns(TEv2FallbackWarning, match="checkpointed function") as caught, torch.no_grad():
        compiled(torch.randn(16, DIM))
    messages = [str(w.message) for w in caught if issubclass(w.category, TEv2FallbackWarning)]
    assert len(messages) == 2  # b's and c's, of two shapes: a is outside the checkpoint
    assert all("te_v2_executor.thunderfx" in m and "unquantized" in m for m in messages)
    assert _forward_linears(compiled) == 1


def test_no_warning_for_linears_the_claim_policy_keeps_unquantized(dynamo_reset_after):
    """Linears the claim policy would run unquantized anyway (64 features, below its 512) lose
    nothing inside a whole checkpoint: no warning."""
    model = _Checkpointed(nested=False)
    compiled = thunders_thunderfx(model, executors=[make_te_v2(backend="reference"), inductor_ex])
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        compiled(torch.randn(16, DIM))
    assert not [w for w in caught if issubclass(w.category, TEv2FallbackWarning)]
