"""The ``narrowings`` pass: peft's float32 LoRA adapters read the bfloat16 tensors their float32
inputs and gradients were widened from, with the gradients of the widened GEMMs; never across an
in-place write, and not where the float32 operand is the larger."""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
from thunder.core.proxies import TensorProxy

from te_v2_executor import make_te_v2
from te_v2_executor.symbols import UNQUANTIZED_SYMBOLS
from tests.helpers import backward_trace, forward_trace

DIM, RANK = 512, 16  # the base linears run in FP8, the rank-16 adapters unquantized


class PeftLinear(torch.nn.Module):
    """A frozen bfloat16 linear with a float32 LoRA adapter, computed as peft computes it: the
    base's output plus the adapter's of the input cast to float32, times the scaling, in float32,
    cast back. ``write`` writes the input in place after its cast: "after_cast", before the
    adapter reads the copy, or "after_gemm", after it."""

    def __init__(self, write: str = "") -> None:
        super().__init__()
        self.write = write
        self.base = torch.nn.Linear(DIM, DIM, bias=False, dtype=torch.bfloat16).requires_grad_(False)
        self.lora_a = torch.nn.Linear(DIM, RANK, bias=False)
        self.lora_b = torch.nn.Linear(RANK, DIM, bias=False)
        torch.nn.init.normal_(self.lora_b.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        wide = x.to(torch.float32)
        if self.write == "after_cast":
            x.mul_(0.5)
        h = self.lora_a(wide)
        if self.write == "after_gemm":
            x.mul_(0.5)
        return (result + self.lora_b(h) * 2.0).to(torch.bfloat16)


class TwoAdapted(torch.nn.Module):
    def __init__(self, write: str = "") -> None:
        super().__init__()
        self.first, self.second = PeftLinear(), PeftLinear(write)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x * 1.0))


def _step(model: torch.nn.Module, skip: list[str], tokens: int = 64):
    torch.manual_seed(0)
    x = torch.randn(tokens, DIM, dtype=torch.bfloat16, requires_grad=True)
    jitted = thunder.jit(model, executors=[make_te_v2(backend="reference", skip_passes=skip)])
    y = jitted(x)
    y.float().square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return jitted, y, {**grads, "x": x.grad}


def _float32_activations(jitted, tokens: int = 64) -> list[str]:
    """The unquantized GEMMs, forward and backward, that read a float32 activation-sized
    operand (tokens x DIM)."""
    return [
        b.sym.name
        for trace in (forward_trace(jitted), backward_trace(jitted))
        for b in trace.bound_symbols
        if b.sym in UNQUANTIZED_SYMBOLS
        for p in b.args[:2]
        if isinstance(p, TensorProxy) and p.dtype == thunder.float32 and tuple(p.shape) == (tokens, DIM)
    ]


def test_adapter_gemms_read_the_bfloat16_tensors_with_the_same_gradients():
    model = TwoAdapted()
    twin = copy.deepcopy(model)
    jitted, y, grads = _step(model, skip=[])
    plain, plain_y, plain_grads = _step(twin, skip=["narrowings"])
    # without the pass, x @ A^T and dh^T @ x read x's float32 copy, dy @ B and dy^T @ h dy's
    fwd, dgrad, wgrad = (f"te_v2_unquantized_{k}" for k in ("fwd", "dgrad", "wgrad"))
    assert sorted(_float32_activations(plain)) == sorted([fwd, dgrad, wgrad, wgrad] * 2)
    assert _float32_activations(jitted) == []
    # on the CPU the mixed product widens the bfloat16 operand: the same GEMMs, bit for bit
    torch.testing.assert_close(y, plain_y, rtol=0, atol=0)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=0, msg=name)


def _float32_activation_casts(jitted) -> int:
    """How many casts, forward and backward, make a float32 activation-sized tensor."""
    return sum(
        b.sym.name in ("to", "convert_element_type", "te_v2_widen")
        and isinstance(p, TensorProxy)
        and p.dtype == thunder.float32
        and tuple(p.shape) == (64, DIM)
        for trace in (forward_trace(jitted), backward_trace(jitted))
        for b in trace.bound_symbols
        for p in b.flat_proxy_outs
    )


def test_no_float32_copy_of_an_adapter_operand_is_made():
    jitted, _, _ = _step(TwoAdapted(), skip=[])
    plain, _, _ = _step(TwoAdapted(), skip=["narrowings"])
    # per block: x's copy in the forward and again in the backward (``widenings``), dy's
    assert _float32_activation_casts(plain) - _float32_activation_casts(jitted) == 2 * 3


@pytest.mark.parametrize("write", ["after_cast", "after_gemm"])
def test_an_input_written_after_its_cast_is_read_through_its_float32_copy(write):
    """The copy holds the values from before the write; the bfloat16 tensor no longer does. Thunder
    has the GEMMs read the copy through ``update_aliases`` wherever the write stands, which no
    narrowing looks through, so neither the second block's forward nor its wgrad reads x."""
    model = TwoAdapted(write)
    twin, reference = copy.deepcopy(model), copy.deepcopy(model)
    jitted, y, grads = _step(model, skip=[])
    _, plain_y, plain_grads = _step(twin, skip=["narrowings"])
    fwd, _, wgrad = UNQUANTIZED_SYMBOLS
    reads_of_x = [
        (b.sym.name, b.args[0 if b.sym is fwd else 1].dtype)
        for trace in (forward_trace(jitted), backward_trace(jitted))
        for b in trace.bound_symbols
        if (b.sym is fwd and b.output.shape[-1] == RANK) or (b.sym is wgrad and b.output.shape == (RANK, DIM))
    ]
    # x @ A^T of the first block and of the second, then dh^T @ x of the second and the first
    assert reads_of_x == [
        ("te_v2_unquantized_fwd", thunder.bfloat16),
        ("te_v2_unquantized_fwd", thunder.float32),
        ("te_v2_unquantized_wgrad", thunder.float32),
        ("te_v2_unquantized_wgrad", thunder.bfloat16),
    ]
    torch.testing.assert_close(y, plain_y, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=0, msg=name)
    torch.manual_seed(0)
    x = torch.randn(64, DIM, dtype=torch.bfloat16, requires_grad=True)
    reference(x).float().square().sum().backward()
    # eager's adapter gradients, up to the FP8 base linears' rounding
    for name in ("first.lora_a.weight", "second.lora_a.weight"):
        expected = dict(reference.named_parameters())[name].grad
        assert torch.nn.functional.cosine_similarity(grads[name].flatten(), expected.flatten(), dim=0) > 0.99


def test_a_float32_operand_as_large_as_the_widened_one_keeps_the_widening():
    """With 16 tokens, x's float32 copy (16 x 512) is no larger than the adapter's A (16 x 512):
    splitting A into bfloat16 pieces would cost more than the cast saves."""
    jitted, _, _ = _step(TwoAdapted(), skip=[], tokens=16)
    forwards = [b for b in forward_trace(jitted).bound_symbols if b.sym is UNQUANTIZED_SYMBOLS[0]]
    assert [b.args[0].dtype for b in forwards if b.output.shape[-1] == RANK] == [thunder.float32] * 2
