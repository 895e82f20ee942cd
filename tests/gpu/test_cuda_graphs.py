"""te_v2 under TEv2CUDAGraphTransform on TransformerEngine: the replayed graphs compute exactly
what the same trace computes without them, state updates included, and the flushes stay out."""

from __future__ import annotations

import contextlib
import copy

import pytest
import thunder
import torch
from thunder.core.proxies import ProxyTag
from thunder.executors.torch_compile import torch_compile_ex
from thunder.transforms.cudagraph import CUDAGraphTransform

from te_v2_executor import TEv2CUDAGraphTransform, quantization_update_scope
from te_v2_executor.cuda_graphs import _saved_tensors
from tests.gpu.common import (
    DTYPE,
    delayed_recipe,
    jit_te_v2,
    requires_te_gpu,
    te_v2_claiming_all,
    te_v2_states,
    torch_linear,
    train_step_gemms,
)
from tests.helpers import forward_trace
from tests.models import BrokenBlock, LoRAStack, Stack

pytestmark = requires_te_gpu

DIM, TOKENS, STEPS = 256, 512, 4
FUSERS = {"thunder": [], "torch.compile": [torch_compile_ex]}


def _model(scenario: str) -> torch.nn.Module:
    if scenario == "lora":
        return LoRAStack([DIM] * 3, rank=16, factory=torch_linear)
    if scenario == "bias":
        return Stack([DIM] * 3, bias=True, factory=torch_linear)
    # GELUs, no bias: te_v2's GELU-and-cast kernel runs forward and backward inside the graphs
    return Stack([DIM] * 3, act=torch.nn.functional.gelu, factory=torch_linear)


def _graphed(model: torch.nn.Module, fusers: list, transform=None):
    transform = transform or TEv2CUDAGraphTransform()
    return thunder.jit(model, executors=[te_v2_claiming_all(), *fusers], transforms=[transform])


def _train(fn, model, xs, recipe) -> list[list[torch.Tensor]]:
    """Per step: the output and every trained parameter's gradient (as autograd left it, not a
    copy); SGD in between, so each replay reads updated weights and a new input."""
    import transformer_engine.pytorch as te

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record = []
    for x in xs:
        opt.zero_grad()
        with te.autocast(enabled=True, recipe=recipe):
            y = fn(x)
        y.float().square().mean().backward()
        # the output is a graph buffer the next replay overwrites; .grad must not be one
        record.append([y.detach().clone(), *(p.grad for p in model.parameters() if p.requires_grad)])
        opt.step()
    return record


def _assert_states_equal(ours, theirs):
    """Bitwise equal histories and scales; a linear with no dgrad or wgrad has no backward state."""
    for (fwd, bwd), (other_fwd, other_bwd) in zip(ours, theirs, strict=True):
        for mine, other in ((fwd, other_fwd), (bwd, other_bwd)):
            assert (mine is None) == (other is None)
            if mine is not None:
                torch.testing.assert_close(mine.amax_history, other.amax_history, rtol=0, atol=0)
                torch.testing.assert_close(mine.scale, other.scale, rtol=0, atol=0)


@pytest.mark.parametrize("fuser", FUSERS)
@pytest.mark.parametrize("scenario", ["full", "bias", "lora"])
def test_graphs_replay_exactly_what_the_trace_computes(scenario, fuser):
    recipe = delayed_recipe()
    model = _model(scenario)
    graphed_model = copy.deepcopy(model)
    xs = [torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE) for _ in range(STEPS)]
    plain = jit_te_v2(model, *FUSERS[fuser])
    transform = TEv2CUDAGraphTransform()
    graphed = _graphed(graphed_model, FUSERS[fuser], transform)
    expected, got = _train(plain, model, xs, recipe), _train(graphed, graphed_model, xs, recipe)
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        for a, b in zip(want, have, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"step {step}")
    _assert_states_equal(te_v2_states(graphed), te_v2_states(plain))
    assert transform.cuda_graph_runner.cuda_graph_cache, "no CUDA graph was captured"
    assert any(b.sym.name.startswith("CUDAGraph") for b in forward_trace(graphed).bound_symbols)
    x = xs[0]
    assert train_step_gemms(graphed, x, recipe)[0] == train_step_gemms(plain, x, recipe)[0]


class _Checkpointed(torch.nn.Module):
    """Two linears under ``torch.utils.checkpoint`` before two more: the backward recomputes them
    with the scales the forward sync snapshot."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = (
            Stack([DIM] * 3, factory=torch_linear),
            Stack([DIM] * 3, factory=torch_linear),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.outer(checkpoint(self.inner, x, use_reentrant=False))


def test_graphs_replay_checkpointed_linears_exactly():
    recipe = delayed_recipe()
    model = _Checkpointed().to(device="cuda", dtype=DTYPE)
    graphed_model = copy.deepcopy(model)
    xs = [torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE) for _ in range(STEPS)]
    expected = _train(jit_te_v2(model), model, xs, recipe)
    got = _train(_graphed(graphed_model, []), graphed_model, xs, recipe)
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        for a, b in zip(want, have, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"step {step}")


def test_update_scope_holds_back_the_updates_of_graphed_passes():
    """The flushes run outside the graphs, so the scope decides on every call, not once at capture."""
    import transformer_engine.pytorch as te

    recipe = delayed_recipe()
    model = _model("full")
    graphed_model = copy.deepcopy(model)
    plain, graphed = jit_te_v2(model), _graphed(graphed_model, [])
    micro_batches = [torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE) for _ in range(3)]
    for fn in (plain, graphed):
        for scoped in (False, True, False):
            with quantization_update_scope() if scoped else contextlib.nullcontext():
                for mb in micro_batches:
                    with te.autocast(enabled=True, recipe=recipe):
                        y = fn(mb)
                    y.float().sum().backward()
    _assert_states_equal(te_v2_states(graphed), te_v2_states(plain))
    (fwd, _), *_ = te_v2_states(graphed)
    assert int((fwd.amax_history.abs().sum(1) > 0).sum()) == 3 + 1 + 3  # one update for the scope


def test_a_region_called_for_each_layer_replays_each_layers_graphs():
    """Dynamo compiles one region for three blocks (a graph break in each) and calls it with each
    block's weight: each block replays graphs of its own, and four steps train bitwise as without
    graphs (Thunder's runner replayed the first block's graph for all three, copying each block's
    weight into the first block's)."""
    from thunder.dynamo import thunderfx

    recipe = delayed_recipe()
    # inputs that need a gradient, as the blocks after the first get: one region for all three
    xs = [torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(STEPS)]
    runs, transform = [], TEv2CUDAGraphTransform()
    for transforms in ([], [transform]):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(BrokenBlock(DIM) for _ in range(3))).to("cuda", DTYPE)
        compiled = thunderfx(model, executors=[te_v2_claiming_all()], transforms=transforms)
        runs.append(_train(compiled, model, xs, recipe))
    torch._dynamo.reset()
    for step, (want, have) in enumerate(zip(*runs, strict=True)):
        for a, b in zip(want, have, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"step {step}")
    names = [key[0] for key in transform.cuda_graph_runner.cuda_graph_cache]
    assert max(names.count(n) for n in names) == 3, names


def test_gradients_are_the_graphs_memory_not_copies():
    """With the gradients set to None between steps, ``.grad`` is the backward graph's memory: a
    backward leaves nothing allocated beyond what the step had before it, where with
    ``copy_gradients=True`` it leaves a copy of every weight gradient; both train bitwise alike."""
    import transformer_engine.pytorch as te

    recipe = delayed_recipe()
    xs = [torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE) for _ in range(STEPS)]
    left, runs = {}, {}
    for copy_gradients in (True, False):
        torch.manual_seed(0)
        model = _model("full")
        graphed = _graphed(model, [], TEv2CUDAGraphTransform(copy_gradients=copy_gradients))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for x in xs:
            before = torch.cuda.memory_allocated()
            with te.autocast(enabled=True, recipe=recipe):
                loss = graphed(x).float().square().mean()
            loss.backward()
            left[copy_gradients] = torch.cuda.memory_allocated() - before
            losses.append(loss.detach().clone())
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs[copy_gradients] = [*losses, *model.parameters()]
    for a, b in zip(runs[True], runs[False], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())
    assert left[True] >= gradients and left[False] <= left[True] - gradients, (left, gradients)


def test_thunders_own_cuda_graph_transform_is_refused():
    import transformer_engine.pytorch as te

    graphed = _graphed(_model("full"), [], CUDAGraphTransform())
    x = torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE)
    with (
        pytest.raises(RuntimeError, match="TEv2CUDAGraphTransform"),
        te.autocast(enabled=True, recipe=delayed_recipe()),
    ):
        graphed(x)


def test_a_second_forward_before_the_backward_raises():
    """Two micro-batches' losses summed before one backward: the second replay overwrites the
    activations the first forward saved, and autograd refuses them rather than computing the first
    micro-batch's gradients from the second one's activations."""
    import transformer_engine.pytorch as te

    graphed = _graphed(_model("full"), [])
    xs = [torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE) for _ in range(2)]
    with te.autocast(enabled=True, recipe=delayed_recipe()):
        graphed(xs[0]).float().sum().backward()  # captures the graphs
        first = graphed(xs[0]).float().sum()
        second = graphed(xs[1]).float().sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (first + second).backward()


@pytest.mark.parametrize("scenario", ["full", "lora"])
def test_graphs_through_thunderfx_follow_the_same_steps_without_them(scenario):
    """A Hugging Face Llama through thunderfx: Thunder's transform found a backward's saved tensors
    at fixed trace positions, which thunderfx's regions need not keep; the replayed steps give the
    losses and gradients of the same steps without graphs. The same steps: both make every recast
    (under graphs te_v2 does; here the suite's fixture makes the steps without graphs do too), as
    the norms' outputs ``input_recasts`` casts again in the backward are computed by eager's
    rounding rather than the forward region's, which moves the trajectory of four steps
    (``test_hf_models`` bounds what that does to one step's gradients)."""
    pytest.importorskip("transformers", reason="needs transformers (the [bench] extra)")
    pytest.importorskip("peft", reason="needs peft (the [bench] extra)")
    import transformer_engine.pytorch as te
    from thunder.dynamo import thunderfx

    from benchmarks.hf import family_grads, grad_cosines, llama, loss_of
    from te_v2_executor import executors
    from tests.gpu.test_hf_models import SMALL

    recipe = delayed_recipe()
    model = llama(SMALL, scenario)
    graphed_model = copy.deepcopy(model)
    batches = torch.randint(
        0, 512, (STEPS, 2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    runs = []
    for m, transforms in ((model, []), (graphed_model, [TEv2CUDAGraphTransform()])):
        compiled = thunderfx(m, executors=executors(te_v2_claiming_all()), transforms=transforms)
        step = loss_of(compiled)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05)
        losses = []
        for ids in batches:
            opt.zero_grad()
            with te.autocast(enabled=True, recipe=recipe):
                loss = step(ids)
            loss.backward()
            losses.append(loss.item())
            grads = family_grads(m)
            opt.step()
        runs.append((losses, grads))
    (losses, grads), (graphed_losses, graphed_grads) = runs
    fns = [fn for info in compiled._backend.subgraph_infos for fn in info.thunder_compiled_fns]
    backwards = [t for fn in fns for t in thunder.last_backward_traces(fn)[-1:]]
    saved = [p for t in backwards for p in _saved_tensors(t) or ()]
    assert any(ProxyTag.STATIC_MEMORY_LOCATION in p.tags for p in saved), "every saved tensor is copied"
    torch.testing.assert_close(graphed_losses, losses, rtol=1e-3, atol=0)
    cosines = grad_cosines(graphed_grads, grads)
    assert all(c > 0.9999 for c in cosines.values()), cosines
