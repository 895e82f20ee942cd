"""The SwiGLU fold (``passes/swiglu.py``) on the CPU reference backend: where it is made and where
not, and that a folded SwiGLU trains bitwise as the unfolded one (the reference backend computes
both with PyTorch's own kernels)."""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
from thunder.executors.torch_compile import torch_compile_ex

from te_v2_executor import delayed_scaling, make_te_v2
from te_v2_executor.symbols import LINEAR_FWD, QUANTIZE_GRAD_OUTPUT, SILU, SILU_BACKWARD, arg
from tests.helpers import (
    CLAIM_ALL,
    assert_trained_alike,
    backward_trace,
    bsyms_of,
    forward_trace,
    train_steps,
)
from tests.models import SwiGLUMLP

DIM, HIDDEN, TOKENS = 64, 128, 32


def _mlps(**kw) -> torch.nn.Module:
    return torch.nn.Sequential(SwiGLUMLP(DIM, HIDDEN, **kw), SwiGLUMLP(DIM, HIDDEN, **kw)).to(torch.bfloat16)


def _compiled(model: torch.nn.Module, *fusers, skip: tuple[str, ...] = ()) -> thunder.ThunderModule:
    te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=delayed_scaling(), skip_passes=skip)
    return thunder.jit(model, executors=[te_v2, *fusers])


def _step(jitted) -> None:
    jitted(torch.randn(TOKENS, DIM, dtype=torch.bfloat16, requires_grad=True)).float().sum().backward()


def _folds(jitted) -> tuple[list[bool], list[tuple[bool, bool]]]:
    """Per forward, whether it reads a SwiGLU; per dy quantization, whether it quantizes a SwiGLU
    operand's gradient, and whether the gate's."""
    forwards = [arg(b, "up") is not None for b in bsyms_of(forward_trace(jitted), LINEAR_FWD)]
    quantized = bsyms_of(backward_trace(jitted), QUANTIZE_GRAD_OUTPUT)
    return forwards, [(arg(b, "swiglu_gate") is not None, arg(b, "swiglu_up") is not None) for b in quantized]


@pytest.mark.parametrize("fusers", [(), (torch_compile_ex,)], ids=["alone", "torch.compile-after"])
def test_each_swiglu_folds_into_the_cast_after_it_and_its_backward_into_the_casts_before(fusers):
    """Nothing of the SiLU, the product or their gradients is left to run on its own, and the
    forward computes no SiLU (it would, to save silu(g) for the backward)."""
    jitted = _compiled(_mlps(), *fusers)
    _step(jitted)
    forwards, grads = _folds(jitted)
    assert forwards == [False, False, True] * 2
    # backward order: down, up (the product's), gate (the SiLU's), per MLP from the last
    assert grads == [(False, False), (True, False), (True, True)] * 2
    for trace in (forward_trace(jitted), backward_trace(jitted)):
        names = {s.sym.name for b in trace.bound_symbols for s in (b, *b.subsymbols)}
        assert not names & {SILU.name, SILU_BACKWARD.name, "silu", "exp", "mul"}, names & {
            "silu",
            "exp",
            "mul",
        }


def test_a_folded_swiglu_trains_bitwise_as_the_unfolded_one():
    model = _mlps()
    twin = copy.deepcopy(model)
    runs = []
    for m, skip in ((model, ()), (twin, ("swiglus",))):
        jitted = _compiled(m, skip=skip)
        torch.manual_seed(1)
        xs = [torch.randn(TOKENS, DIM, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        losses = train_steps(jitted, torch.optim.SGD(m.parameters(), lr=0.1), xs)
        runs.append((jitted, losses, [x.grad for x in xs]))
    assert _folds(runs[0][0])[0] == [False, False, True] * 2
    assert _folds(runs[1][0])[0] == [False] * 6
    assert_trained_alike(model, twin, *runs)


def test_a_swiglu_a_lora_adapter_also_reads_is_not_folded():
    """LoRA on down: its base and its adapter read the product, so the forward cannot fold it; up's
    and the gate's gradients still can (the adapter adds its dgrad into the base's)."""
    jitted = _compiled(_mlps(lora=True))
    _step(jitted)
    forwards, _ = _folds(jitted)
    assert not any(forwards)
    assert len(bsyms_of(forward_trace(jitted), SILU)) == 2


class _WrittenUp(torch.nn.Module):
    """up's output is written in place after the product read it: a fold, which moves the read
    to down's forward, would read the written values."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = SwiGLUMLP(DIM, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.mlp.up(x)
        h = torch.nn.functional.silu(self.mlp.gate(x)) * u
        u.mul_(2.0)
        return self.mlp.down(h) + u.sum(-1, keepdim=True)


def test_no_fold_reads_past_an_in_place_write():
    model = _WrittenUp().to(torch.bfloat16)
    jitted = _compiled(copy.deepcopy(model))
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16)
    y = jitted(x)
    assert not any(_folds(jitted)[0])
    unfolded = _compiled(copy.deepcopy(model), skip=("swiglus",))
    assert torch.equal(y, unfolded(x))


class _SquaredSiLU(torch.nn.Module):
    """silu(g) * silu(g), one SiLU read twice, optionally under activation checkpointing."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.down = torch.nn.Linear(HIDDEN, DIM, bias=False)
        self.checkpointed = checkpointed

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.nn.functional.silu(self.gate(x))
        return self.down(a * a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self._mlp, x, use_reentrant=False)
        return self._mlp(x)


@pytest.mark.parametrize(
    ("checkpointed", "grad"), [(False, False), (True, True)], ids=["inference", "checkpointed"]
)
def test_a_silu_times_itself_keeps_the_silu_the_fold_reads(checkpointed, grad):
    """The folded forward reads the SiLU's output as up: the SiLU stays, though nothing else in the
    trace reads it (inference; a checkpoint, whose backward recomputes its own). Found by review:
    the SiLU was absorbed and the trace read an undefined name."""
    model = _SquaredSiLU(checkpointed).to(torch.bfloat16)
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16)
    results = []
    for skip in ((), ("swiglus",)):
        m = copy.deepcopy(model)
        jitted = _compiled(m, skip=skip)
        with torch.set_grad_enabled(grad):
            y = jitted(x)
            if grad:
                y.float().sum().backward()
        results.append([y, *(p.grad for p in m.parameters() if grad)])
        if not skip:
            assert _folds(jitted)[0] == [False, True]
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
