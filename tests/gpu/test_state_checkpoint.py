"""Checkpoints of delayed-scaling state on TransformerEngine: a run resumed from one continues
as the uninterrupted run does (the twin of the CPU test in tests/cpu/test_state_identity.py)."""

from __future__ import annotations

import io

import torch

from te_v2_executor import load_quantization_state_dict, quantization_state_dict
from tests.gpu.common import DTYPE, delayed_recipe, jit_te_v2, requires_te_gpu, torch_linear
from tests.models import Stack

pytestmark = requires_te_gpu

DIM, TOKENS, STEPS = 256, 512, 10


def _resumable(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Stack([DIM] * 4, bias=True, factory=torch_linear)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _steps(fn, opt, xs, recipe) -> list[torch.Tensor]:
    import transformer_engine.pytorch as te

    losses = []
    for x in xs:
        opt.zero_grad()
        with te.autocast(enabled=True, recipe=recipe):
            loss = fn(x).float().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _assert_state_dicts_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].device.type == "cuda", name
        assert torch.equal(a[name], b[name]), name


def test_a_run_resumed_from_a_checkpoint_continues_bitwise():
    """10 steps, or 5 steps, a checkpoint (model, optimizer, quantization state through
    torch.save), a fresh model and optimizer loaded from it and compiled anew, 5 more steps. TE's
    kernels are deterministic on one GPU, as the checkpointing test of test_state_sync.py relies
    on: losses, weights and every history and scale end bitwise equal."""
    recipe = delayed_recipe()
    xs = [torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE) for _ in range(STEPS)]
    model, opt = _resumable(0)
    jitted = jit_te_v2(model)
    losses = _steps(jitted, opt, xs, recipe)

    first, first_opt = _resumable(0)
    first_jitted = jit_te_v2(first)
    losses_before = _steps(first_jitted, first_opt, xs[: STEPS // 2], recipe)
    saved = quantization_state_dict(first_jitted)
    assert len(saved) == 3 * 4  # 3 linears: forward and backward histories and scales
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict(), "quant": saved}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)

    resumed, resumed_opt = _resumable(1)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    resumed_jitted = jit_te_v2(resumed)
    load_quantization_state_dict(resumed_jitted, checkpoint["quant"])  # before its first call
    losses_after = _steps(resumed_jitted, resumed_opt, xs[STEPS // 2 :], recipe)

    assert torch.equal(torch.stack(losses), torch.stack(losses_before + losses_after))
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
    _assert_state_dicts_equal(quantization_state_dict(resumed_jitted), quantization_state_dict(jitted))
