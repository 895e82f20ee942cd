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


@pytest.mark.parametrize("reuse", [False, True], ids=["saved memory apart", "saved memory reused"])
@pytest.mark.parametrize("scenario", ["full", "lora"])
def test_graphs_through_thunderfx_follow_the_same_steps_without_them(scenario, reuse):
    """A Hugging Face Llama through thunderfx: Thunder's transform found a backward's saved tensors
    at fixed trace positions, which thunderfx's regions need not keep; the replayed steps give the
    losses and gradients of the same steps without graphs. The same steps: both make every recast
    (under graphs te_v2 does; here the suite's fixture makes the steps without graphs do too), as
    the norms' outputs ``input_recasts`` casts again in the backward are computed by eager's
    rounding rather than the forward region's, which moves the trajectory of four steps
    (``test_hf_models`` bounds what that does to one step's gradients). With
    ``reuse_saved_memory``, the backward graphs free the saved tensors into their forwards'
    pools."""
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
    transform = TEv2CUDAGraphTransform(reuse_saved_memory=reuse)
    for m, transforms in ((model, []), (graphed_model, [transform])):
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
    partners = [b for r in transform.cuda_graph_runner.replayed.values() for b in r.partners]
    assert bool(partners) == reuse, (
        "a backward graph was captured in its forward's pool" if partners else "none was"
    )
    cosines = grad_cosines(graphed_grads, grads)
    assert all(c > 0.9999 for c in cosines.values()), cosines


def _reuse_runs(reuse: bool | None, steps: int, *, accumulate: int = 1, set_to_none: bool = True):
    """Losses and trained weights after ``steps`` steps of a 4-linear GELU stack at sizes where
    the saved activations are a large part of the step's memory, with graphs (``reuse``: whether
    the backward graph reuses the saved tensors' memory) or without them (None); each step sums
    ``accumulate`` micro-batches' gradients in ``.grad``. Also the runner, and the peak above the
    model of the last step (allocated, plus what the graphs' pools hold idle)."""
    import transformer_engine.pytorch as te

    from benchmarks.measure import idle_in_graph_pools

    dim, tokens = 1024, 16384
    torch.manual_seed(0)
    model = Stack([dim] * 5, act=torch.nn.functional.gelu, factory=torch_linear)
    transform = None if reuse is None else TEv2CUDAGraphTransform(reuse_saved_memory=reuse)
    fn = thunder.jit(model, executors=[te_v2_claiming_all()], transforms=[transform] if transform else [])
    xs = torch.randn(steps, accumulate, tokens, dim, device="cuda", dtype=DTYPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        if step == steps - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        for x in xs[step]:
            with te.autocast(enabled=True, recipe=delayed_recipe()):
                loss = fn(x).float().square().mean()
            loss.backward()
            losses.append(loss.detach().clone())
            del loss
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline + idle_in_graph_pools(torch.cuda.memory_snapshot())
    runner = None if transform is None else transform.cuda_graph_runner
    return [*losses, *(p.detach().clone() for p in model.parameters())], runner, peak


def test_a_backward_graph_reuses_the_memory_its_forward_saved():
    """With ``reuse_saved_memory=True`` the backward graph is captured in its forward's pool and
    frees each saved tensor there after its last read, so that its gradients and temporaries may
    take that memory, and the steps give the same losses and weights, to the bit, as without
    graphs. The peaks are printed, not compared: at these sizes the pool's fragments cost more
    than the reuse saves (docs/performance.md)."""
    plain, _, _ = _reuse_runs(None, STEPS)
    apart, _, peak_apart = _reuse_runs(False, STEPS)
    reused, runner, peak_reused = _reuse_runs(True, STEPS)
    for a, b, c in zip(plain, apart, reused, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(c, a, rtol=0, atol=0)
    forwards = [r for r in runner.replayed.values() if r.partners]
    released = sum(len(b.released) for f in forwards for b in f.partners)
    freed = sum(t.untyped_storage().nbytes() for f in forwards for t in f.saved_only.values())
    print(
        f"peak above the model: {peak_apart >> 20} MiB apart, {peak_reused >> 20} MiB reused; "
        f"{released} saved tensors, {freed >> 20} MiB, freed to the backward"
    )
    assert forwards and released, "no backward graph was captured in its forward's pool"


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_held_across_the_next_forward_keep_their_values(set_to_none):
    """Two micro-batches a step: the first backward's gradients, kept in ``.grad`` while the next
    forward replays into the pool they may lie in, are moved out first and accumulate as without
    graphs (and, with ``zero_grad(set_to_none=False)``, across steps too)."""
    plain, _, _ = _reuse_runs(None, 3, accumulate=2, set_to_none=set_to_none)
    reused, _, _ = _reuse_runs(True, 3, accumulate=2, set_to_none=set_to_none)
    for a, b in zip(plain, reused, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def _reusing(model: torch.nn.Module):
    """``model`` under graphs whose backward reuses the saved memory, its graphs captured."""
    import transformer_engine.pytorch as te

    graphed = _graphed(model, [], TEv2CUDAGraphTransform(reuse_saved_memory=True))
    with te.autocast(enabled=True, recipe=delayed_recipe()):
        graphed(torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE)).float().sum().backward()
    return graphed


def test_a_second_backward_over_reused_memory_raises():
    """``retain_graph=True`` and a second backward: the first backward's replay wrote its
    temporaries where the forward saved, and autograd refuses the saved tensors rather than
    computing gradients from them."""
    import transformer_engine.pytorch as te

    graphed = _reusing(_model("full"))
    with te.autocast(enabled=True, recipe=delayed_recipe()):
        loss = graphed(torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE)).float().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("held", ["view", "kept after zero_grad"])
def test_a_gradient_held_outside_grad_across_the_next_forward_raises(held):
    """A gradient the next forward replay may overwrite, read other than through ``.grad``
    (which is moved out of the way), raises rather than changing under its reader."""
    import transformer_engine.pytorch as te

    model = _model("full")
    graphed = _reusing(model)
    kept = model.linears[0].weight.grad
    kept = kept.view(-1) if held == "view" else kept
    model.zero_grad(set_to_none=True)
    with (
        pytest.raises(RuntimeError, match=r"still read, other than through a parameter's \.grad"),
        te.autocast(enabled=True, recipe=delayed_recipe()),
    ):
        graphed(torch.randn(TOKENS, DIM, device="cuda", dtype=DTYPE))
    assert kept.numel()
