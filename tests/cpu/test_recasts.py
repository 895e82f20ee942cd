"""The ``weight_recasts`` pass: a parameter's dgrad reads an FP8 copy cast in the backward with the
scale the forward used, so the forward saves none, with bitwise the same training; other weights
keep their saved copy (reference backend, CPU)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import thunder
import torch
import torch.nn.functional as F
from thunder.dynamo import thunderfx
from thunder.executors.torch_compile import torch_compile_ex

from te_v2_executor import (
    TEv2CUDAGraphTransform,
    block_scaling,
    current_scaling,
    delayed_scaling,
    explain,
    make_te_v2,
)
from te_v2_executor.compiled import compiled_functions
from te_v2_executor.symbols import QUANTIZE_GRAD_OUTPUT, is_recast
from tests.helpers import CLAIM_ALL, train_steps, trained_with_and_without
from tests.models import Checkpointed, LoRAStack, SharedWeight, Stack, every_even

DIM, TOKENS = 128, 128

MODELS = {
    "stack": lambda: Stack([DIM] * 5, frozen=every_even),
    "lora": lambda: LoRAStack([DIM] * 3),
    "checkpointed": lambda: Checkpointed(DIM),
    "tied": lambda: SharedWeight(DIM),
}
RECIPES = {"delayed": delayed_scaling, "current": current_scaling, "block": block_scaling}


def _te_v2(recipe=None, skip=()):
    return make_te_v2(backend="reference", recipe=recipe, claim=CLAIM_ALL, skip_passes=skip)


def _train(model: torch.nn.Module, recipe, skip: tuple[str, ...]):
    torch.manual_seed(1)
    jitted = thunder.jit(model, executors=[_te_v2(recipe, skip)])
    xs = [torch.randn(TOKENS, DIM, requires_grad=True) for _ in range(3)]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = train_steps(jitted, opt, xs)
    return jitted, losses, [x.grad for x in xs]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", MODELS)
def test_recast_copies_train_bitwise_as_saved_ones(name, recipe):
    """Three steps, so that delayed scaling's scales move between each forward and its backward:
    a recast with the updated scale instead of the forward's would change every dgrad."""
    train = lambda model, skip: _train(model, RECIPES[recipe](), skip)  # noqa: E731
    run, saved_run = trained_with_and_without(MODELS[name](), train, ("weight_recasts",))
    jitted, saved = run[0], saved_run[0]

    rows, saved_rows = explain(jitted).linears, explain(saved).linears
    assert any(r.dgrad for r in rows)
    for r, s in zip(rows, saved_rows, strict=True):
        # a checkpointed linear's recomputed forward casts the weight anyway
        cast_apart = r.dgrad and not r.recomputed
        assert (r.recasts_weight_t, r.saves_weight_t) == (cast_apart, False), r.name
        assert (s.recasts_weight_t, s.saves_weight_t) == (False, cast_apart), s.name


@pytest.mark.parametrize("jit", ["thunderfx", "thunder.jit"])
def test_each_recast_runs_between_its_dgrad_gradient_and_its_dgrad(jit):
    """Thunder's dataflow fusion (thunderfx's choice) orders the backward anew: a recast that read
    only its parameter went to the start of the backward, its copy alive through all of it (on the
    8B Llama's full fine-tuning, 296 MiB of FP8 weights at the backward's peak). Each recast on its
    own: ``recast_batches`` makes several where the first was (``test_recast_batches.py``)."""
    model = Stack([DIM] * 5)
    executors = [_te_v2(skip=("recast_batches",)), torch_compile_ex]
    if jit == "thunderfx":
        compiled = thunderfx(model, executors=executors)
    else:
        compiled = thunder.jit(model, executors=executors)
    compiled(torch.randn(TOKENS, DIM, requires_grad=True)).sum().backward()
    (compiled,) = compiled_functions(compiled)
    backward = thunder.last_backward_traces(compiled)
    order = backward[-1].bound_symbols
    recasts = [at for at, b in enumerate(order) if is_recast(b)]
    assert len(recasts) == sum(r.recasts_weight_t for r in explain(compiled).linears) == 4
    for at in recasts:
        state = order[at].kwargs["state"]
        (dy_q_at,) = [
            i for i, b in enumerate(order) if b.sym is QUANTIZE_GRAD_OUTPUT and b.kwargs["state"] is state
        ]
        assert dy_q_at < at, f"the recast of {state} runs before its gradient exists"


class Weights(torch.nn.Module):
    """One linear whose weight is a parameter read through a slice, one whose frozen parameter
    the forward writes in place after the linear, and one plain."""

    def __init__(self) -> None:
        super().__init__()
        self.sliced = torch.nn.Parameter(torch.randn(DIM, 2 * DIM) / DIM)
        self.written = torch.nn.Linear(DIM, DIM, bias=False).requires_grad_(False)
        self.plain = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.sliced[:, :DIM])
        y = self.written(torch.relu(h))
        self.written.weight.mul_(0.5)
        return self.plain(torch.relu(y))


def _x_grad(model: torch.nn.Module, skip: tuple[str, ...]):
    torch.manual_seed(2)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    jitted = thunder.jit(model, executors=[_te_v2(skip=skip)])
    jitted(x).sum().backward()
    return jitted, x.grad


def test_only_parameters_nothing_writes_are_recast():
    model = Weights()
    twin = copy.deepcopy(model)
    jitted, x_grad = _x_grad(model, ())
    rows = {r.name: r for r in explain(jitted).linears}
    assert (rows["plain_weight"].recasts_weight_t, rows["plain_weight"].saves_weight_t) == (True, False)
    for name in ("sliced", "written_weight"):
        assert (rows[name].recasts_weight_t, rows[name].saves_weight_t) == (False, True), name
    # the written weight's dgrad reads the copy its forward made, before the write
    _, saved_x_grad = _x_grad(twin, ("weight_recasts",))
    assert torch.equal(x_grad, saved_x_grad)
    assert torch.equal(model.written.weight, twin.written.weight)


class WrittenThroughAnAlias(torch.nn.Module):
    """A frozen weight and a buffer sharing its storage, which the forward writes after the
    linear: Thunder sees two inputs, and a write into the buffer only."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM, bias=False).requires_grad_(False)
        self.register_buffer("alias", self.linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.alias.mul_(0.5)
        return y


def test_a_write_into_another_input_keeps_the_saved_copy():
    model = WrittenThroughAnAlias()
    twin = copy.deepcopy(model)
    jitted, x_grad = _x_grad(model, ())
    (row,) = explain(jitted).linears
    assert (row.recasts_weight_t, row.saves_weight_t) == (False, True)
    _, saved_x_grad = _x_grad(twin, ("weight_recasts",))
    assert torch.equal(x_grad, saved_x_grad)


def test_a_weight_passed_in_keeps_its_saved_copy():
    w = torch.randn(DIM, DIM, requires_grad=True)
    jitted = thunder.jit(lambda x, w: F.linear(x, w), executors=[_te_v2()])
    jitted(torch.randn(TOKENS, DIM, requires_grad=True), w).sum().backward()
    (row,) = explain(jitted).linears
    assert (row.recasts_weight_t, row.saves_weight_t) == (False, True)


def test_a_parameter_written_between_forward_and_backward_is_refused():
    """Eager autograd refuses this backward; the recast would read the new values."""
    model = Stack([DIM] * 3)
    jitted = thunder.jit(model, executors=[_te_v2()])
    y = jitted(torch.randn(TOKENS, DIM, requires_grad=True))
    assert explain(jitted).linears[0].recasts_weight_t
    with torch.no_grad():
        model.linears[0].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.peak_policy
@pytest.mark.parametrize("graphed", [False, True])
def test_every_recast_under_cuda_graphs(graphed):
    """Few tokens put the peak at the end of the backward, where no recast lowers it; under
    TEv2CUDAGraphTransform, whose forward graph holds what it saves between steps, every recast is
    made. (Running the graphs needs a GPU; the traces are analysed first.)"""
    model = Stack([DIM] * 3)
    transforms = [TEv2CUDAGraphTransform()] if graphed else []
    jitted = thunder.jit(model, executors=[_te_v2()], transforms=transforms)
    with contextlib.suppress(RuntimeError):  # without CUDA, the analysed traces do not run
        jitted(torch.randn(16, DIM, requires_grad=True))
    rows = explain(jitted).linears
    assert [(r.saves_weight_t, r.recasts_weight_t) for r in rows] == [(not graphed, graphed)] * 2
