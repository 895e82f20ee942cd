"""Recipes follow te.autocast (a change retraces); what TE cannot run falls back, warned once."""

from __future__ import annotations

import pytest
import thunder
import torch

from te_v2_executor import RecipeSpec, Scaling, TEv2FallbackWarning, explain, make_te_v2
from tests.gpu.common import DTYPE, jit_te_v2, requires_te_gpu, torch_linear, train_step
from tests.helpers import CLAIM_ALL
from tests.models import Stack

pytestmark = requires_te_gpu


def test_a_recipe_change_takes_effect_on_the_next_call():
    import transformer_engine.common.recipe as te_recipe

    jitted = jit_te_v2(Stack([256] * 3, factory=torch_linear))
    x = torch.randn(128, 256, device="cuda", dtype=DTYPE)
    train_step(jitted, x, te_recipe.DelayedScaling())
    assert {r.recipe for r in explain(jitted).linears} == {"delayed"}
    train_step(jitted, x, te_recipe.Float8CurrentScaling())
    assert {r.recipe for r in explain(jitted).linears} == {"current"}
    assert thunder.cache_misses(jitted) == 2
    train_step(jitted, x, te_recipe.DelayedScaling())  # an equal recipe object: the first trace again
    assert thunder.cache_misses(jitted) == 2 and thunder.cache_hits(jitted) == 1


def test_outside_te_autocast_delayed_scaling_is_used():
    jitted = jit_te_v2(Stack([256] * 2, factory=torch_linear))
    jitted(torch.randn(128, 256, device="cuda", dtype=DTYPE)).sum().backward()
    assert explain(jitted).linears[0].recipe == "delayed"


def test_cpu_tensors_fall_back_with_the_rule():
    jitted = jit_te_v2(Stack([64, 64]))
    with pytest.warns(TEv2FallbackWarning, match="CUDA tensors only"):
        jitted(torch.randn(32, 64)).sum().backward()


def test_mxfp8_is_claimed_only_on_blackwell():
    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("this GPU is Blackwell: MXFP8 is claimed here")
    ex = make_te_v2(recipe=RecipeSpec(scaling=Scaling.MXFP8, fp8_format="E4M3"), claim=CLAIM_ALL)
    jitted = thunder.jit(Stack([256, 256], factory=torch_linear), executors=[ex])
    with pytest.warns(TEv2FallbackWarning, match="need a Blackwell GPU"):
        jitted(torch.randn(128, 256, device="cuda", dtype=DTYPE)).sum().backward()


def test_a_list_without_a_fuser_after_te_v2_warns_once_and_executors_does_not():
    """Thunder's default executors fuse nothing elementwise without nvFuser: te_v2 listed before
    them alone warns, naming the fix; ``executors()`` does not. (``executors()`` may warn of
    something else, the cuDNN attention it leaves out of Thunder's defaults: not counted.)"""
    import warnings

    from te_v2_executor import TEv2PerformanceWarning, executors
    from te_v2_executor.fusers import fuses_elementwise
    from tests.gpu.common import te_v2_claiming_all

    x = torch.randn(64, 256, device="cuda", dtype=DTYPE)
    ex = te_v2_claiming_all()
    bare = [ex, *thunder.get_default_executors()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for listed in (bare, bare, executors(ex)):
            train_step(thunder.jit(Stack([256, 256]).to("cuda", DTYPE), executors=listed), x, None)
    performance = [
        w
        for w in caught
        if issubclass(w.category, TEv2PerformanceWarning) and "fuses elementwise" in str(w.message)
    ]
    if any(fuses_elementwise(e) for e in thunder.get_default_executors()):  # nvFuser installed
        assert not performance
    else:
        assert len(performance) == 1, [str(w.message) for w in performance]
        assert "use executors=te_v2_executor.executors()" in str(performance[0].message)
