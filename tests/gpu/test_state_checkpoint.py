"""Checkpoints of delayed-scaling state on TransformerEngine: a run resumed from one continues
as the uninterrupted run does (the twin of the CPU test in tests/cpu/test_state_identity.py)."""

from __future__ import annotations

import torch

from tests.gpu.common import DTYPE, delayed_recipe, jit_te_v2, requires_te_gpu, torch_linear
from tests.helpers import assert_resume_continues_bitwise
from tests.models import Stack

pytestmark = requires_te_gpu

DIM, TOKENS, STEPS = 256, 512, 10


def _resumable(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Stack([DIM] * 4, bias=True, factory=torch_linear)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def test_a_run_resumed_from_a_checkpoint_continues_bitwise():
    """10 steps, or 5 steps, a checkpoint, a fresh model and optimizer loaded from it and compiled
    anew, 5 more steps (``assert_resume_continues_bitwise``). TE's kernels are deterministic on one
    GPU, as the checkpointing test of test_state_sync.py relies on: losses, weights and every
    history and scale end bitwise equal."""
    import transformer_engine.pytorch as te

    recipe = delayed_recipe()
    xs = [torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE) for _ in range(STEPS)]
    saved = assert_resume_continues_bitwise(
        _resumable, jit_te_v2, xs, autocast=lambda: te.autocast(enabled=True, recipe=recipe)
    )
    assert len(saved) == 3 * 4  # 3 linears: forward and backward histories and scales
    assert all(t.device.type == "cuda" for t in saved.values())
