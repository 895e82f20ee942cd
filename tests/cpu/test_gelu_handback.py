"""A GELU the ``gelus`` pass does not fold goes back to the fuser as torch ops that keep its
place: its backward's ops stay in the backward under Thunder's dataflow fusion (thunderfx's),
which keeps only what is tagged backward out of the forward's regions."""

from __future__ import annotations

import thunder
import torch
import torch.nn.functional as F
from thunder.executors.torch_compile import torch_compile_ex
from torch import nn

from te_v2_executor import ClaimPolicy, make_te_v2
from tests.helpers import backward_trace, forward_trace

# 48- and 64-feature linears stay unquantized under this policy, in float32.
TOLS = {"rtol": 1e-5, "atol": 1e-5}


def _dataflow_jit(model: nn.Module):
    ex = make_te_v2(backend="reference", claim=ClaimPolicy(min_features=512))
    return thunder.jit(model, executors=[ex, torch_compile_ex], fusion_type="dataflow")


def _symbol_names(trace) -> set[str]:
    names, todo = set(), list(trace.bound_symbols)
    while todo:
        bsym = todo.pop()
        names.add(bsym.sym.name)
        todo.extend(bsym.subsymbols)
    return names


class GelusBesideACopy(nn.Module):
    """Fuzzer seed 2026 program 203, shrunk: an input copied into in place, two GELUs, a frozen
    linear, a linear under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(48, 24, bias=False)
        self.l1 = nn.Linear(48, 64, bias=False)
        self.l2 = nn.Linear(64, 64, bias=False).requires_grad_(False)

    def forward(self, x0: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v0 = F.gelu(x0)
        v1 = v0 + x1
        x1.copy_(x0)
        v5 = F.gelu(self.l2(self.l1(v0)))
        with torch.no_grad():
            v6 = self.l0(v1)
        return v6, v5


def test_a_handed_back_gelu_backward_runs_in_the_backward():
    """Untagged, its ops were fused into a forward region that read the GELU's gradient:
    ``UnboundLocalError: cannot access local variable 't101'``."""
    model = GelusBesideACopy()
    x0 = torch.randn(2, 12, 48)
    x1 = torch.randn(2, 12, 48)
    runs = []
    for fn in (model, _dataflow_jit(model)):
        model.zero_grad(set_to_none=True)
        inputs = (x0.clone(), x1.clone())
        outputs = fn(*inputs)
        sum(o.square().sum() for o in outputs).backward()
        runs.append((outputs, inputs, {n: p.grad for n, p in model.named_parameters()}))
    (expected, expected_inputs, expected_grads), (actual, actual_inputs, actual_grads) = runs
    torch.testing.assert_close(actual, expected, **TOLS)
    torch.testing.assert_close(actual_inputs, expected_inputs, **TOLS)
    assert actual_grads.keys() == expected_grads.keys()
    for name, g in expected_grads.items():
        assert (g is None) == (actual_grads[name] is None), name
        if g is not None:
            torch.testing.assert_close(actual_grads[name], g, **TOLS)


def test_the_forward_computes_no_part_of_a_gelus_backward():
    """The GELU's derivative (its ``exp``) was computed in the forward and saved for the backward."""
    jitted = _dataflow_jit(nn.Sequential(nn.Linear(48, 64, bias=False), nn.GELU()))
    jitted(torch.randn(24, 48)).square().sum().backward()
    assert "exp" not in _symbol_names(forward_trace(jitted))
    assert "exp" in _symbol_names(backward_trace(jitted))
