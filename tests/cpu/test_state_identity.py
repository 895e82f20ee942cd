"""Which quantization state a linear gets across retraces, checkpoints of that state, and two
lowering fixes: a float64 GELU's gradient, two te_v2 executors in one list (reference backend)."""

from __future__ import annotations

import contextlib
import re

import pytest
import thunder
import torch
from thunder.executors.torch_compile import torch_compile_ex

from te_v2_executor import (
    current_scaling,
    delayed_scaling,
    explain,
    load_quantization_state_dict,
    lowering,
    make_te_v2,
    quantization_state_dict,
    quantization_update_scope,
)
from te_v2_executor.compiled import compiled_functions
from te_v2_executor.state import registry_for
from te_v2_executor.symbols import GELU_BACKWARD, LINEAR_FWD
from tests.helpers import (
    CLAIM_ALL,
    assert_resume_continues_bitwise,
    assert_state_dicts_equal,
    backward_trace,
    bsyms_of,
    forward_trace,
    train_steps,
)
from tests.models import Checkpointed, GraphBroken, SharedWeight, Stack

DIM, TOKENS = 64, 32
RECIPE = delayed_scaling(amax_history_len=16)


def _jit(model: torch.nn.Module, recipe=RECIPE, **options):
    return thunder.jit(
        model, executors=[make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=recipe)], **options
    )


def _states(fn) -> dict:
    """Every state of a ``thunder.jit`` callable, by key."""
    return registry_for(thunder.compile_data(fn)).states


def _forward_scales(fn) -> dict:
    return {key: s.scaling(forward=True).scale.clone() for key, s in _states(fn).items()}


def _steps(fn, model, xs) -> list[torch.Tensor]:
    """One SGD step per input; the losses."""
    return train_steps(fn, torch.optim.SGD(model.parameters(), lr=0.1), xs)


def _inputs(n: int, tokens: int = TOKENS) -> list[torch.Tensor]:
    return [torch.randn(tokens, DIM) for _ in range(n)]


# ---- A: one state per (weight source, ordinal, recipe, backend), whatever the retrace -------


def _with_dropout() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, DIM), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(DIM, DIM)
    )


def _plain(model):
    return contextlib.nullcontext()


def _autocast(model):
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _eval(model):
    model.eval()
    return contextlib.nullcontext()


def _frozen(model):
    model[0].weight.requires_grad_(False)
    return contextlib.nullcontext()


def _unfrozen(model):
    model[0].weight.requires_grad_(True)
    return contextlib.nullcontext()


def _no_grad(model):
    return torch.no_grad()


# name: (how the 3 training steps run, what the retraced call changes, its batch's tokens).
# "autocast-off": Thunder 0.2.6 keeps tracing a function with autocast's casts once a call of it
# ran under torch.autocast (its compile data's autocast stack is pushed per call, never popped).
RETRACES = {
    "eval": (_plain, _eval, TOKENS),
    "autocast-on": (_plain, _autocast, TOKENS),
    "autocast-off": (_autocast, _plain, TOKENS),
    "freeze": (_plain, _frozen, TOKENS),
    "unfreeze": (_frozen, _unfrozen, TOKENS),
    "batch-shape": (_plain, _plain, 2 * TOKENS),
    "grad-mode": (_plain, _no_grad, TOKENS),
}


@pytest.mark.parametrize("case", RETRACES)
def test_a_retrace_runs_the_trained_states(case):
    """Linear -> ReLU -> Dropout -> Linear, 3 steps, then a call Thunder retraces for: its trace
    runs the trained states (inside an update scope, so that this call updates none yet)."""
    train, retrace, tokens = RETRACES[case]
    model = _with_dropout()
    jitted = _jit(model)
    with train(model):
        _steps(jitted, model, _inputs(3))
    trained, scales = _states(jitted), _forward_scales(jitted)
    assert len(trained) == 2 and all(not torch.equal(s, torch.ones(2)) for s in scales.values())
    traces = len(thunder.compile_stats(jitted).interpreter_cache)
    with quantization_update_scope(), retrace(model):
        jitted(torch.randn(tokens, DIM))
        assert len(thunder.compile_stats(jitted).interpreter_cache) == traces + 1  # a retrace
        assert _states(jitted) == trained
        assert [r.state for r in explain(jitted).linears] == list(trained.values())
        for key, scale in _forward_scales(jitted).items():
            assert torch.equal(scale, scales[key]), key


def test_a_recipe_change_and_back_finds_the_delayed_states_again(monkeypatch):
    """Delayed, current, delayed again: the second delayed trace runs the first one's states. (On
    a GPU, te.autocast's recipe guard retraces; here the lowering's recipe is swapped and every
    call retraces.)"""
    active = [RECIPE]
    monkeypatch.setattr(lowering, "active_recipe", lambda configured: active[0])
    model = Stack([DIM] * 3)
    jitted = _jit(model, recipe=None, cache="no caching")
    _steps(jitted, model, _inputs(3))
    delayed, scales = _states(jitted), _forward_scales(jitted)
    active[0] = current_scaling()
    _steps(jitted, model, _inputs(1))
    assert len(_states(jitted)) == 4  # 2 linears, 2 recipes
    active[0] = RECIPE
    with quantization_update_scope():
        jitted(torch.randn(TOKENS, DIM))
        assert [r.state for r in explain(jitted).linears] == list(delayed.values())
        for key, scale in scales.items():
            assert torch.equal(delayed[key].scaling(forward=True).scale, scale), key


class Reused(torch.nn.Module):
    """One linear called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.relu(self.linear(x)))


class Sliced(torch.nn.Module):
    """Two linears on the two halves of one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = DIM // 2
        top = torch.nn.functional.linear(x, self.weight[:half])
        bottom = torch.nn.functional.linear(torch.relu(x), self.weight[half:])
        return torch.cat([top, bottom], dim=-1)


@pytest.mark.parametrize(
    ("make", "sites"),
    [
        (Reused, ["linear_weight.0", "linear_weight.1"]),
        (Sliced, ["weight.0", "weight.1"]),
        (lambda: SharedWeight(DIM), ["a_weight.0", "b_weight.0"]),  # Thunder unpacks both names
    ],
    ids=["reused", "sliced", "tied"],
)
def test_a_weight_used_twice_has_a_state_per_use(make, sites):
    model = make()
    jitted = _jit(model)
    _steps(jitted, model, _inputs(2))
    assert [key.site for key in _states(jitted)] == sites
    first, second = (s.scaling(forward=True).scale for s in _states(jitted).values())
    assert not torch.equal(first, second)  # the second linear reads another input
    assert sorted({name.rsplit(".", 2)[0] for name in quantization_state_dict(jitted)}) == sites


class Computed(torch.nn.Module):
    """Two weight-normalized linears (each weight ``g * v / |v|``, computed from two parameters),
    of magnitudes far apart, called in either order."""

    def __init__(self) -> None:
        super().__init__()
        self.va, self.vb = (torch.nn.Parameter(torch.randn(DIM, DIM)) for _ in range(2))
        self.ga, self.gb = (torch.nn.Parameter(torch.full((DIM, 1), m)) for m in (0.05, 20.0))

    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        def linear(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, g * v / v.norm(dim=1, keepdim=True))

        a, b = (lambda: linear(self.va, self.ga)), (lambda: linear(self.vb, self.gb))
        return torch.cat([b(), a()] if swap else [a(), b()], dim=-1)


def test_a_computed_weight_keeps_its_state_across_retraces():
    """A weight computed from several tensors is named by the trace inputs it reads, neither by
    its proxy's name nor by its ops: a retrace calling the two linears in the other order gives
    each its own state (by proxy name, the first weight computed took the other's name and
    scale: 0.998 of the output wrong), and a call without grad runs the trained state (Thunder
    names the division otherwise there: by ops, the state was new, with scale 1)."""
    jitted, trained = _swapped_after_training(Computed(), ["computed(ga,va).0", "computed(gb,vb).0"])
    with quantization_update_scope(), torch.no_grad():
        jitted(torch.randn(TOKENS, DIM))
        assert [r.state for r in explain(jitted).linears] == list(trained.values())
    assert _states(jitted) == trained


def _swapped_after_training(model: torch.nn.Module, sites: list[str]) -> tuple:
    """``model`` (two linears, in the other order with ``swap=True``) jitted and trained 3 steps,
    its states at ``sites``; then called swapped, which runs the two states swapped and makes
    none. Returns the jitted model and its trained states, by key."""
    jitted = _jit(model)
    _steps(jitted, model, _inputs(3))
    trained = _states(jitted)
    assert [key.site for key in trained] == sites
    with quantization_update_scope():
        jitted(torch.randn(TOKENS, DIM), swap=True)
        assert [r.state for r in explain(jitted).linears] == list(trained.values())[::-1]
    assert _states(jitted) == trained
    return jitted, trained


class ThroughHelper(torch.nn.Module):
    """Two linears whose weights, of magnitudes far apart, a local function reads under one name
    (``w``), in either order."""

    def __init__(self) -> None:
        super().__init__()
        self.wa, self.wb = (torch.nn.Parameter(torch.randn(DIM, DIM) * m) for m in (0.01, 10.0))

    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        def linear(w: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, w)

        first, second = (self.wb, self.wa) if swap else (self.wa, self.wb)
        return torch.cat([linear(first), linear(second)], dim=-1)


def test_a_parameter_keeps_its_state_whatever_local_name_thunder_gave_it():
    """Thunder names a parameter's proxy after the local name it was first read under, so the
    retrace reading ``wb`` first names it ``w``, the name ``wa`` had: states are keyed by the
    parameters' qualified names, which the prologue gives (by proxy name, ``wb`` took ``wa``'s
    state and scale)."""
    jitted, _ = _swapped_after_training(ThroughHelper(), ["wa.0", "wb.0"])
    assert [r.name for r in explain(jitted).linears] == ["wb", "wa"]


class HalfThenWhole(torch.nn.Module):
    """One linear on the first half of the batch, then on the whole batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x[: x.shape[0] // 2]).sum(0) + self.linear(x)


@pytest.mark.filterwarnings("ignore::te_v2_executor.TEv2FallbackWarning")
def test_a_use_of_the_weight_that_falls_back_keeps_its_ordinal():
    """With 48 tokens the first call's 24 are not divisible by 16 and it falls back: the second
    call keeps ordinal 1 and its trained state."""
    model = HalfThenWhole()
    jitted = _jit(model)
    _steps(jitted, model, _inputs(2))
    trained = _states(jitted)
    assert [key.site for key in trained] == ["linear_weight.0", "linear_weight.1"]
    with quantization_update_scope():
        jitted(torch.randn(48, DIM))
        assert explain(jitted).linears[0].state is trained[list(trained)[1]]
        assert explain(jitted).linears[1].fallback
    assert _states(jitted) == trained


def test_a_checkpoint_recompute_runs_its_forwards_state():
    model = Checkpointed(DIM)
    jitted = _jit(model)
    _steps(jitted, model, _inputs(1))
    states = list(_states(jitted).values())
    assert len(states) == 4
    forwards = [b.kwargs["state"] for b in bsyms_of(forward_trace(jitted), LINEAR_FWD)]
    recomputes = [b.kwargs["state"] for b in bsyms_of(backward_trace(jitted), LINEAR_FWD)]
    assert forwards == states and recomputes
    assert all(any(r is s for s in states) for r in recomputes)


# ---- B: checkpoints of the state ------------------------------------------------------------


def _resumable(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Stack([DIM] * 4, bias=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_a_run_resumed_from_a_checkpoint_continues_bitwise():
    """10 steps, or 5 steps, a checkpoint, a fresh model and optimizer loaded from it and compiled
    anew, 5 more steps (``assert_resume_continues_bitwise``)."""
    saved = assert_resume_continues_bitwise(_resumable, _jit, _inputs(10))
    assert len(saved) == 3 * 4  # 3 linears: forward and backward histories and scales
    assert all(type(t) is torch.Tensor and not t.requires_grad for t in saved.values())


def _trained(recipe=RECIPE):
    model = Stack([DIM] * 3)
    jitted = _jit(model, recipe)
    _steps(jitted, model, _inputs(1))
    return jitted


def test_loading_refuses_names_no_linear_has():
    saved = quantization_state_dict(_trained())
    extra = {**saved, "other_weight.0.forward.scale": torch.ones(2)}
    jitted = _trained()
    with pytest.raises(ValueError, match=r"no delayed-scaling linear .*'other_weight\.0\.forward\.scale'"):
        load_quantization_state_dict(jitted, extra)
    load_quantization_state_dict(jitted, extra, strict=False)
    assert_state_dicts_equal(quantization_state_dict(jitted), saved)

    fresh = _jit(Stack([DIM] * 3))
    with pytest.raises(ValueError, match=re.escape("'linears_0_weight.0.forward'")):  # not a tensor's name
        load_quantization_state_dict(fresh, {"linears_0_weight.0.forward": torch.ones(2)})
    load_quantization_state_dict(fresh, extra)  # held: names are checked at the first trace
    with pytest.raises(ValueError, match=re.escape("'other_weight.0.forward.scale'")):
        fresh(torch.randn(TOKENS, DIM))


def test_loading_refuses_another_shape_naming_the_state():
    saved = quantization_state_dict(_trained())
    jitted = _trained(delayed_scaling(amax_history_len=8))
    with pytest.raises(ValueError, match=r"'linears_0_weight.0.forward.amax_history' has shape \(16, 2\)"):
        load_quantization_state_dict(jitted, saved)


def test_states_of_two_delayed_recipes_are_named_with_their_recipe(monkeypatch):
    """One linear traced with two delayed recipes has two states; their names carry the recipe,
    and a function that has run one of the two recipes loads that one's."""
    active = [RECIPE]
    monkeypatch.setattr(lowering, "active_recipe", lambda configured: active[0])
    model = Stack([DIM] * 2)
    jitted = _jit(model, recipe=None, cache="no caching")
    _steps(jitted, model, _inputs(1))
    active[0] = delayed_scaling(amax_history_len=8)
    _steps(jitted, model, _inputs(1))
    saved = quantization_state_dict(jitted)
    assert sorted({name.rsplit(".", 2)[0] for name in saved}) == [
        "linears_0_weight.0.delayed(amax_history_len=16)",
        "linears_0_weight.0.delayed(amax_history_len=8)",
    ]
    fresh_model = Stack([DIM] * 2)
    fresh = _jit(fresh_model, recipe=active[0])
    _steps(fresh, fresh_model, _inputs(1))
    load_quantization_state_dict(fresh, saved, strict=False)
    tag = "linears_0_weight.0.delayed(amax_history_len=8)"
    expected = {name.replace(f"{tag}.", "linears_0_weight.0."): t for name, t in saved.items() if tag in name}
    assert_state_dicts_equal(quantization_state_dict(fresh), expected)


def test_thunderfx_state_dict_covers_every_region_and_loads_after_a_first_forward():
    """Saved from one thunderfx function, loaded into a fresh one after its first forward (which
    compiled its regions), one more step: both end bitwise equal."""
    from thunder.dynamo import thunderfx

    executors = [make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=RECIPE)]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GraphBroken(DIM)
    compiled = thunderfx(model, executors=executors)
    _steps(compiled, model, _inputs(2))
    saved = quantization_state_dict(compiled)
    assert len(saved) == 4 * 4  # 4 linears in 2 regions

    torch.manual_seed(0)
    twin = GraphBroken(DIM)
    twin.load_state_dict(model.state_dict())
    compiled_twin = thunderfx(twin, executors=executors)
    with pytest.raises(ValueError, match=r"compiled no region yet.*call it once first"):
        load_quantization_state_dict(compiled_twin, saved)
    compiled_twin(torch.randn(TOKENS, DIM))  # a forward alone, with grad enabled
    load_quantization_state_dict(compiled_twin, saved)
    assert_state_dicts_equal(quantization_state_dict(compiled_twin), saved)
    x = _inputs(1)
    assert torch.equal(_steps(compiled, model, x)[0], _steps(compiled_twin, twin, x)[0])
    assert_state_dicts_equal(quantization_state_dict(compiled_twin), quantization_state_dict(compiled))


def test_a_thunderfx_region_compiled_anew_takes_the_old_state_from_a_state_dict():
    """A new batch shape makes Dynamo compile new regions, whose first call starts from fresh
    states; the state dict saved before that call gives them the old regions' states."""
    from thunder.dynamo import thunderfx

    torch._dynamo.reset()
    model = GraphBroken(DIM)
    compiled = thunderfx(model, executors=[make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=RECIPE)])
    _steps(compiled, model, _inputs(2))
    saved = quantization_state_dict(compiled)
    compiled(torch.randn(3 * TOKENS // 2, DIM))  # Dynamo recompiles: 2 more regions
    regions = [registry_for(thunder.compile_data(f)) for f in compiled_functions(compiled)]
    assert len(regions) == 4
    assert any(not torch.equal(t, saved[name]) for name, t in regions[2].state_dict().items())
    load_quantization_state_dict(compiled, saved)
    for region in regions:
        assert_state_dicts_equal(region.state_dict(), {name: saved[name] for name in region.state_dict()})


# ---- C: a float64 GELU's gradient ------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::te_v2_executor.TEv2FallbackWarning")  # float64 linears
@pytest.mark.parametrize("fusers", [[torch_compile_ex], []], ids=["handed-back", "te_v2-alone"])
def test_a_float64_gelu_gradient_is_float64_accurate(fusers):
    """te_v2 claims GELUs of any dtype; handed back to a fusion executor as torch ops, or run
    by PyTorch's kernels, a float64 one's input gradient is that of eager float64."""

    def run(executors):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(DIM, DIM), torch.nn.GELU(), torch.nn.Linear(DIM, DIM)
        ).double()
        fn = thunder.jit(model, executors=executors) if executors is not None else model
        x = torch.randn(TOKENS, DIM, dtype=torch.float64, requires_grad=True)
        y = fn(x)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape))
        return fn, x.grad

    _, expected = run(None)
    jitted, dx = run([make_te_v2(backend="reference", claim=CLAIM_ALL), *fusers])
    assert bool(bsyms_of(backward_trace(jitted), GELU_BACKWARD)) == (not fusers)
    assert ((dx - expected).norm() / expected.norm()).item() < 1e-12


# ---- D: one te_v2 executor per list ------------------------------------------------------------


def test_two_te_v2_executors_in_one_list_are_refused_naming_both():
    first, second = make_te_v2(backend="reference"), make_te_v2(backend="reference")
    jitted = thunder.jit(torch.nn.Linear(DIM, DIM), executors=[first, second])
    with pytest.raises(ValueError, match="only one may be listed") as refused:
        jitted(torch.randn(TOKENS, DIM))
    assert first.name in str(refused.value) and second.name in str(refused.value)
