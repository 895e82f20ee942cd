"""GEMM kernels per training step (torch.profiler): te_v2 runs exactly the GEMMs needed."""

from __future__ import annotations

import pytest
import thunder
import torch
from thunder.executors.torch_compile import torch_compile_ex

from benchmarks.measure import GEMM_KERNEL
from tests.gpu.common import (
    DTYPE,
    builtin_executors,
    jit_te_v2,
    requires_te_gpu,
    te_linear,
    torch_linear,
    train_step_gemms,
)
from tests.helpers import FUSERS, fusers_named
from tests.models import LoRAStack, Stack, copy_weights, every_even

pytestmark = requires_te_gpu

DIM, TOKENS = 1024, 2048

# (model builder, GEMMs a step needs with an input that needs no grad)
CASES = {
    # forward 4; dgrad where something upstream trains (linears 2, 3); wgrad of linears 1, 3
    "alternate-frozen": (lambda f: Stack([DIM] * 5, frozen=every_even, factory=f), 4 + 2 + 2),
    # per layer 3 forward GEMMs; layer 0: wgrad A, B and dgrad B; layer 1: also dgrad base and A
    "lora": (lambda f: LoRAStack([DIM] * 3, rank=16, factory=f), 6 + 8),
}


@pytest.mark.parametrize("fuser", FUSERS)
@pytest.mark.parametrize("case", list(CASES))
def test_te_v2_runs_only_the_gemms_needed(case, fuser):
    import transformer_engine.common.recipe as te_recipe

    build, needed = CASES[case]
    recipe = te_recipe.DelayedScaling()
    model = build(torch_linear)
    te_model = copy_weights(build(te_linear), model)
    builtin_model = copy_weights(build(torch_linear), model)
    executors, transforms = builtin_executors()
    builtin = thunder.jit(builtin_model, executors=[*executors, torch_compile_ex], transforms=transforms)
    x = torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE)

    ours, names = train_step_gemms(jit_te_v2(model, *fusers_named(fuser)), x, recipe)
    eager, _ = train_step_gemms(te_model, x, recipe)
    theirs, _ = train_step_gemms(builtin, x, recipe)
    print(
        f"\n[{case}, {fuser}] GEMM kernels per step: te_v2 {ours}, te.Linear eager {eager}, built-in TE executor {theirs}, needed {needed}"
    )
    print(f"[{case}, {fuser}] te_v2 kernels per step: {len(names)}")
    assert ours == needed, sorted(n for n in names)
    assert ours == eager
    assert ours < theirs


@pytest.mark.parametrize("scaling", [None, 0.5], ids=["plain", "peft-scaling"])
def test_default_policy_lora_leaves_torch_compile_nothing_to_run(scaling):
    """The default claim policy's rank-16 adapters run unquantized in te_v2, their sums folded
    into the GEMMs (cuBLAS's beta-add epilogue), PEFT's scaling into their alpha: the GEMMs a
    step needs, no add or multiply kernel, and of torch.compile's kernels only the ReLU between
    the layers (forward and backward)."""
    import transformer_engine.common.recipe as te_recipe

    from te_v2_executor import te_v2
    from te_v2_executor.config import DEFAULT_MIN_FEATURES

    needed = CASES["lora"][1]
    model = LoRAStack([DIM] * 3, rank=16, factory=torch_linear, scaling=scaling)
    assert min(model.layers[0].base.weight.shape) >= DEFAULT_MIN_FEATURES
    jitted = thunder.jit(model, executors=[te_v2, torch_compile_ex])
    x = torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE)

    def step(x: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)  # no add from accumulating into .grad
        return jitted(x)

    gemms, names = train_step_gemms(step, x, te_recipe.DelayedScaling())
    print(f"\n[lora, default policy] GEMM kernels per step {gemms}, all kernels {len(names)}")
    assert gemms == needed, sorted(names)
    elementwise = [
        n for n in names if ("add" in n.lower() or "mul" in n.lower()) and not GEMM_KERNEL.search(n)
    ]
    assert not elementwise, sorted(names)
    # beta = 1: the two adapter outputs, and the dgrads summed into the second layer's input grad
    assert sum("badd" in n for n in names) == 3
    triton = [n for n in names if n.startswith("triton")]
    assert len(triton) == 2 and all("where" in n for n in triton), triton
