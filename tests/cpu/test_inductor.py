"""``inductor_ex``: Thunder's torch.compile executor whose regions are called without Dynamo. It
trains bitwise as Thunder's executor does, calls no region through Dynamo once compiled, and
compiles again (or hands the call to Dynamo) where an input's layout is not the one compiled for.
"""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
from thunder.executors.torch_compile import torch_compile_ex

from te_v2_executor import executors, inductor, make_te_v2, thunderfx
from te_v2_executor.compiled import compiled_functions
from te_v2_executor.fusers import fuses_elementwise
from te_v2_executor.inductor import MAX_LAYOUTS, DirectRegion, inductor_ex
from tests.helpers import CLAIM_ALL
from tests.models import tiny_llama


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """How often regions compile through Inductor and run through Dynamo while the test runs."""
    counts = {"compiled": 0, "dynamo": 0}
    compile_fx, through_dynamo = torch._inductor.compile, DirectRegion.through_dynamo

    def compiling(*args, **kwargs):
        counts["compiled"] += 1
        return compile_fx(*args, **kwargs)

    def dynamo(self, *args):
        counts["dynamo"] += 1
        return through_dynamo(self, *args)

    monkeypatch.setattr(torch._inductor, "compile", compiling)
    monkeypatch.setattr(DirectRegion, "through_dynamo", dynamo)
    return counts


def _steps(model: torch.nn.Module, fuser, ids: torch.Tensor, steps: int = 3):
    """Losses and gradients of ``steps`` SGD steps of ``model`` through thunderfx with a reference
    te_v2 then ``fuser``; and the compiled function. Dynamo starts with no cache: after other
    tests compiled the same model class on other shapes it would trace it with dynamic ones."""
    torch._dynamo.reset()
    te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL)
    fn = thunderfx(model, executors=[te_v2, fuser])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_llama_trains_bitwise_as_with_thunders_torch_compile_executor(dtype, counted):
    model = tiny_llama(32, dtype)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    expected_losses, expected_grads, _ = _steps(copy.deepcopy(model), torch_compile_ex, ids)
    losses, grads, fn = _steps(model, inductor_ex, ids)
    assert [loss.item() for loss in losses] == [loss.item() for loss in expected_losses]
    for step, expected in zip(grads, expected_grads, strict=True):
        assert step.keys() == expected.keys()
        for name, grad in step.items():
            assert torch.equal(grad, expected[name]), name
    traces = [
        t[-1]
        for jitted in compiled_functions(fn)
        for t in (thunder.last_traces(jitted), thunder.last_backward_traces(jitted))
        if t
    ]
    fusions = [b for t in traces for b in t.bound_symbols if b.sym.is_fusion]
    assert fusions and {b.sym.executor for b in fusions} == {inductor_ex}
    assert counted["dynamo"] == 0


def test_steps_after_the_first_call_compiled_regions_directly(counted):
    model = tiny_llama(32, torch.float32)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    fn = thunderfx(model, executors=[make_te_v2(backend="reference", claim=CLAIM_ALL), inductor_ex])
    fn(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    compiled = counted["compiled"]
    assert compiled > 0
    for _ in range(3):
        fn(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert counted["compiled"] == compiled, "steps after the first compiled nothing"
    assert counted["dynamo"] == 0


def _scaled_sum(a: torch.Tensor, b: torch.Tensor, c: float) -> list[torch.Tensor]:
    x = (a.float() * b).to(a.dtype)
    return [x + c, x.sum(0)]


def test_each_input_layout_compiles_once_and_computes_as_eager(counted):
    region = DirectRegion(_scaled_sum)
    a, b = torch.randn(16, 8), torch.randn(8)
    transposed = torch.randn(8, 16).t()
    for args in [(a, b, 2.0), (a, b, 2.0), (transposed, b, 2.0), (a[:8], b, 2.0), (transposed, b, 2.0)]:
        for got, want in zip(region(*args), _scaled_sum(*args), strict=True):
            torch.testing.assert_close(got, want)
    assert counted["compiled"] == len(region.compiled) == 3
    assert counted["dynamo"] == 0


def test_a_number_that_changes_on_one_tensor_layout_goes_through_dynamo(counted):
    """A seed or a step count would compile once per value; Dynamo makes it dynamic."""
    region = DirectRegion(_scaled_sum)
    a, b = torch.randn(16, 8), torch.randn(8)
    for c in (2.0, 3.0, 4.0, 2.0):
        torch.testing.assert_close(region(a, b, c)[0], _scaled_sum(a, b, c)[0])
    assert (counted["compiled"], counted["dynamo"]) == (1, 2), "2.0 stays compiled, 3.0 and 4.0 go to Dynamo"


class Boxed(torch.Tensor):
    """A tensor subclass, which the direct route does not key on."""


def test_what_a_layout_cannot_key_goes_through_dynamo(counted):
    region = DirectRegion(_scaled_sum)
    a, b = torch.randn(16, 8), torch.randn(8)
    for got, want in zip(region(a.as_subclass(Boxed), b, 2.0), _scaled_sum(a, b, 2.0), strict=True):
        torch.testing.assert_close(got.as_subclass(torch.Tensor), want)
    assert (counted["compiled"], counted["dynamo"]) == (0, 1)
    for rows in range(1, MAX_LAYOUTS + 3):
        torch.testing.assert_close(region(a[:rows], b, 2.0)[0], _scaled_sum(a[:rows], b, 2.0)[0])
    assert len(region.compiled) == MAX_LAYOUTS
    assert counted["dynamo"] == 1 + 2, "the layouts past MAX_LAYOUTS run through Dynamo"


def _written(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
    a.copy_(b * 2)
    return [a + b]


def test_a_region_that_writes_in_place_goes_through_dynamo(counted):
    """What it computes may depend on which inputs alias each other (here, when b is a), which
    Dynamo's guards see and a layout does not."""
    region = DirectRegion(_written)
    a = torch.randn(8)
    for b in (torch.randn(8), a):
        expected_a, got_a = a.clone(), a.clone()
        expected = _written(expected_a, expected_a if b is a else b)
        got = region(got_a, got_a if b is a else b)
        torch.testing.assert_close(got[0], expected[0])
        torch.testing.assert_close(got_a, expected_a)
    assert region.writes and region.compiled == {}
    assert (counted["compiled"], counted["dynamo"]) == (0, 2)


def test_executors_list_it_as_the_fuser_after_te_v2():
    assert fuses_elementwise(inductor_ex)
    assert executors()[-1] is inductor_ex
    assert thunder.extend.get_executor(inductor_ex.name) is inductor_ex
    assert inductor_ex.implmap is torch_compile_ex.implmap, (
        "the ops Thunder's executor claims, and only those"
    )
    assert inductor.__doc__
