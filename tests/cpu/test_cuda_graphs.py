"""What TEv2CUDAGraphTransform captures, and the flushes' refusal to be captured (CPU).

Replaying the graphs needs a GPU (tests/gpu/test_cuda_graphs.py); what goes into them is decided
on the trace, which the reference backend builds on the CPU.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import thunder
import torch
from thunder.core import prims
from thunder.core.proxies import ProxyTag
from thunder.core.trace import from_trace
from thunder.transforms.cudagraph import CUDAGraphRunner, CUDAGraphTransform
from torch.utils._pytree import tree_leaves

from te_v2_executor import (
    ClaimPolicy,
    TEv2CUDAGraphTransform,
    delayed_scaling,
    make_te_v2,
    quantization_state_dict,
    thunderfx,
)
from te_v2_executor.backends.reference import ReferenceQuantizedTensor
from te_v2_executor.cuda_graphs import _CheckedRunner, _Handed, _saved_tensors
from te_v2_executor.graph_memory import RELEASE_NAME, ReleasePoints, relocate_held
from te_v2_executor.inductor import inductor_ex
from te_v2_executor.passes._writes import Writes
from te_v2_executor.state import LinearQuantState
from te_v2_executor.symbols import BACKWARD_SYNC, FORWARD_SYNC, LINEAR_FWD, RECAST_WEIGHTS, arg
from tests.helpers import CLAIM_ALL, backward_trace, capture_taped, forward_trace
from tests.models import BrokenBlock, Checkpointed, LoRAStack, SharedWeight, Stack, tiny_llama

DIM, TOKENS = 64, 32
_OUTSIDE = {prims.PrimIDs.UNPACK_TRIVIAL, prims.PrimIDs.UNPACK_SEQUENCE, prims.PrimIDs.RETURN}


def _trained(model=None):
    """A trained step's traces, with every recast made, as under the transform (and as the
    suite makes them, ``tests/conftest.py``)."""
    te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL)
    jitted = thunder.jit(model or LoRAStack([DIM] * 3, rank=16), executors=[te_v2])
    jitted(torch.randn(TOKENS, DIM)).sum().backward()
    return jitted


def _top_level_work(trace) -> list:
    """Bound symbols left outside the graphs, besides unpacking, returns and collection bookkeeping."""
    return [
        b.sym
        for b in trace.bound_symbols
        if not b.sym.name.startswith("CUDAGraph")
        and b.sym.id not in _OUTSIDE
        and b.sym.name not in ("python_del", "clear_mutable_collection")
    ]


def test_graphs_hold_everything_but_the_flushes():
    jitted = _trained()
    transform = TEv2CUDAGraphTransform()
    fwd = transform.transform_trace_post_optimization(forward_trace(jitted))
    bwd = transform.transform_trace_post_optimization(backward_trace(jitted))
    assert _top_level_work(fwd) == [FORWARD_SYNC]
    assert _top_level_work(bwd) == [BACKWARD_SYNC]
    for trace in (fwd, bwd):
        assert [b for b in trace.bound_symbols if b.sym.name.startswith("CUDAGraph")]


def test_thunders_plain_transform_would_capture_the_flushes():
    """Why the subclass exists: the parent class puts the flush inside a graph."""
    jitted = _trained()
    fwd = CUDAGraphTransform().transform_trace_post_optimization(forward_trace(jitted))
    assert FORWARD_SYNC not in _top_level_work(fwd)


def test_recomputed_forwards_and_recasts_are_captured():
    """A checkpointed linear's recomputed forward and the backward's recasts quantize with the
    scales the forward sync snapshot, an input of the backward's graph."""
    jitted = _trained(Checkpointed(DIM))
    transform = TEv2CUDAGraphTransform()
    transform.transform_trace_post_optimization(forward_trace(jitted))
    backward = backward_trace(jitted)
    replaying = [b for b in backward.bound_symbols if b.sym in (LINEAR_FWD, RECAST_WEIGHTS)]
    assert {b.sym for b in replaying if b.sym is RECAST_WEIGHTS or arg(b, "replay") is not None} == {
        LINEAR_FWD,
        RECAST_WEIGHTS,
    }
    bwd = transform.transform_trace_post_optimization(backward)
    assert _top_level_work(bwd) == [BACKWARD_SYNC]


def test_a_flush_refuses_to_be_captured(reference_te_v2, monkeypatch):
    jitted = thunder.jit(LoRAStack([DIM] * 3, rank=16), executors=[reference_te_v2])
    x = torch.randn(TOKENS, DIM)
    jitted(x)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"TEv2CUDAGraphTransform\(\)"):
        jitted(x)


def _saved_first(trace):
    """``trace`` with the cotangents unpacked before the saved tensors, an order thunderfx's
    regions may have and Thunder's transform does not expect."""
    shifted = from_trace(trace)
    b = trace.bound_symbols
    shifted.bound_symbols = [*b[:2], *b[6:9], *b[2:6], *b[9:]]
    return shifted


def test_a_backwards_saved_tensors_are_found_by_name():
    jitted = _trained()
    backward = backward_trace(jitted)
    assert _saved_tensors(backward) == list(backward.bound_symbols[9].output)
    with pytest.raises(AssertionError):  # Thunder's transform reads fixed positions
        parent = CUDAGraphTransform()
        parent.transform_trace_post_optimization(forward_trace(jitted))
        parent.transform_trace_post_optimization(_saved_first(backward))
    transform = TEv2CUDAGraphTransform()
    transform.transform_trace_post_optimization(forward_trace(jitted))
    static = list(transform.outputs_from_forward)
    transform.transform_trace_post_optimization(_saved_first(backward))
    tagged = [ProxyTag.STATIC_MEMORY_LOCATION in p.tags for p in _saved_tensors(backward)]
    assert tagged == static and any(tagged)


def _capture(self, fn, args, static_args_mask):
    """A "capture" that calls ``fn`` once, whose "replay" does nothing and returns what that call
    returned, as a graph returns its static outputs."""
    return SimpleNamespace(replay=lambda: None), tuple(args), fn(*args)


def test_thunderfx_makes_one_graph_of_each_trace_but_the_flushes(monkeypatch, dynamo_reset_after):
    """thunderfx asks for Thunder's dataflow fusion, which never groups a symbol tagged as the
    backward's (te_v2's) with one that is not (a fusion region): a Llama's backward was one graph
    per run of either, each with its own pool and copies of its inputs (70 GiB above the model at
    1B under LoRA). The graphs compute what the same step without them does. Each compile starts
    with no Dynamo cache."""
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", _capture)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    grads = []
    for transforms in ([], [TEv2CUDAGraphTransform()]):
        torch._dynamo.reset()
        model = tiny_llama(32, torch.float32)
        te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL)
        compiled = thunderfx(model, executors=[te_v2, inductor_ex], transforms=transforms)
        compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    (fwd,), (bwd,) = compiled.last_traces, compiled.last_backward_traces
    for trace, sync in ((fwd, FORWARD_SYNC), (bwd, BACKWARD_SYNC)):
        graphs = [b for b in trace.bound_symbols if b.sym.name.startswith("CUDAGraph")]
        assert len(graphs) == 1 and _top_level_work(trace) == [sync]
    for without, with_graphs in zip(*grads, strict=True):
        assert torch.equal(with_graphs, without)


def _capture_copying(self, fn, args, static_args_mask):
    """A "capture" closer to a real one for a first call: it runs ``fn`` on the arguments it reads
    in place and on the runner's copies of the others, as the warm-up calls before a real capture
    do, and its "replay" runs ``fn`` there again (the first step's outputs are the same)."""
    static = tuple(
        a if in_place else self.get_static_buffer(a)
        for a, in_place in zip(args, static_args_mask, strict=True)
    )
    return SimpleNamespace(replay=lambda: fn(*static)), static, fn(*static)


class _WritesItsInputs(torch.nn.Module):
    """A LoRA linear whose forward halves its input in place and counts its calls in a buffer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(dim, dim, bias=False).requires_grad_(False)
        self.a = torch.nn.Linear(dim, 16, bias=False)
        self.b = torch.nn.Linear(16, dim, bias=False)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        y = self.base(x)
        x.mul_(0.5)
        return y + self.b(self.a(x))


@pytest.mark.parametrize("compile_with", ["thunder.jit", "thunderfx"])
def test_a_graphs_writes_into_its_inputs_reach_the_callers_tensors(
    monkeypatch, compile_with, dynamo_reset_after
):
    """A graph reads an input, or a buffer thunderfx passes, from a copy of it: a write into it
    (``x.mul_``, the buffer's ``add_``) is copied back after each replay. One it reads in place
    (a buffer thunder.jit passes) gets back the values it had before the warm-up calls."""
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", _capture_copying)
    runs = []
    for transforms in ([], [TEv2CUDAGraphTransform()]):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _WritesItsInputs(DIM)
        te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL)
        compile_ = thunder.jit if compile_with == "thunder.jit" else thunderfx
        compiled = compile_(model, executors=[te_v2, inductor_ex], transforms=transforms)
        x = torch.randn(TOKENS, DIM)
        loss = compiled(x).square().mean()
        loss.backward()
        runs.append([loss, x, model.calls, *(p.grad for p in model.parameters() if p.grad is not None)])
    assert float(runs[1][2]) == 1
    for without, with_graphs in zip(*runs, strict=True):
        assert torch.equal(with_graphs, without)


def _runner_replaying(monkeypatch, fn, in_place: tuple[bool, ...], names: list[str], capture=None):
    """te_v2's graph runner with ``fn`` registered as CUDAGraph1, "captured" by ``capture``
    (``_capture`` if None)."""
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", capture or _capture)
    runner = TEv2CUDAGraphTransform().cuda_graph_runner
    runner.python_callables["CUDAGraph1"] = (fn, in_place)
    runner.trace_symbols["CUDAGraph1"] = ([], [SimpleNamespace(name=n) for n in names], [])
    return runner


def test_a_replay_marks_what_it_wrote_and_not_what_it_read(monkeypatch):
    """The version bump that makes autograd refuse an overwritten saved tensor skips outputs that
    alias an argument the graph reads in place: a weight another function saved stays valid."""
    weight, activation = torch.zeros(4, 4), torch.zeros(4)
    runner = _runner_replaying(monkeypatch, lambda w: (activation, w.t()), (True,), ["t_weight"])
    for replays in (1, 2):
        runner.call_cuda_graph("CUDAGraph1", weight)
        assert (activation._version, weight._version) == (replays, 0)


def test_a_replay_refuses_a_parameter_whose_memory_moved(monkeypatch):
    """A graph reads its parameters at their addresses at capture. Another parameter in their
    place gets a graph of its own (Thunder's runner copied it into the captured one); one whose
    memory moved (FSDP2 unshards into memory it frees again) raises, naming it, rather than being
    read from stale memory."""
    weight, x = torch.nn.Parameter(torch.zeros(4, 4)), torch.zeros(4)
    runner = _runner_replaying(monkeypatch, lambda w, x: (w @ x,), (True, False), ["t_weight", "x"])
    runner.call_cuda_graph("CUDAGraph1", weight, x)
    (y,) = runner.call_cuda_graph("CUDAGraph1", torch.nn.Parameter(torch.ones(4, 4)), torch.ones(4))
    assert bool((weight == 0).all()) and bool((y == 4).all())
    assert len(runner.cuda_graph_cache) == 2
    weight.data = torch.zeros(4, 4)
    with pytest.raises(
        RuntimeError, match="t_weight, which CUDA graph CUDAGraph1 reads in place, is no longer"
    ):
        runner.call_cuda_graph("CUDAGraph1", weight, x)


def _capture_rewriting(self, fn, args, static_args_mask):
    """``_capture_copying`` whose "replay" also writes what ``fn`` returns into the outputs of
    the "capture", as a graph's replay rewrites its static outputs (an FP8 copy's data and
    scales)."""
    graph, static, outputs = _capture_copying(self, fn, args, static_args_mask)

    def replay():
        with torch.no_grad():
            for mine, new in zip(tree_leaves(outputs), tree_leaves(graph.replay()), strict=True):
                if isinstance(mine, ReferenceQuantizedTensor):
                    for usage in ("rowwise", "columnwise"):
                        if (plane := getattr(mine, usage)) is not None:
                            plane.data.copy_(new.plane(usage).data)
                            plane.scale_inv.copy_(new.plane(usage).scale_inv)
                elif isinstance(mine, torch.Tensor):
                    mine.copy_(new)

    return SimpleNamespace(replay=replay), static, outputs


@pytest.mark.parametrize("grad", [False, True])
def test_a_region_called_for_several_layers_gets_a_graph_for_each(monkeypatch, grad, dynamo_reset_after):
    """Thunder's runner found the first block's graph for every block (same layouts) and copied
    each block's weight into the first block's, which it then replayed: the first block's weight
    was overwritten and every output wrong, without a word (under autograd, the second block's
    replay overwrote the first one's saved tensors, which autograd refused)."""
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", _capture_rewriting)
    runs = []
    for transforms in ([], [TEv2CUDAGraphTransform()]):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(BrokenBlock(DIM) for _ in range(3)))
        weights = [p.detach().clone() for p in model.parameters()]
        te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL)
        compiled = thunderfx(model, executors=[te_v2, inductor_ex], transforms=transforms)
        x = torch.randn(TOKENS, DIM, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            y = compiled(x)
        if grad:
            y.square().mean().backward()
        assert all(map(torch.equal, model.parameters(), weights))
        runs.append([y, *((x.grad, *(p.grad for p in model.parameters())) if grad else ())])
    graphs = [key[0] for key in transforms[0].cuda_graph_runner.cuda_graph_cache]
    assert graphs.count(graphs[0]) == 3, graphs
    for without, with_graphs in zip(*runs, strict=True):
        assert torch.equal(with_graphs, without)


def test_each_backward_replays_the_graph_of_the_first(monkeypatch, dynamo_reset_after):
    """A backward's saved tensors are read where the forward's graph wrote them, and one the
    forward also returned is a new tensor there on each backward: it finds the graph captured
    for the first backward."""
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", _capture_copying)
    transform = TEv2CUDAGraphTransform()
    te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL)
    compiled = thunderfx(
        tiny_llama(32, torch.float32), executors=[te_v2, inductor_ex], transforms=[transform]
    )
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    counts = []
    for _ in range(3):
        compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        counts.append(len(transform.cuda_graph_runner.cuda_graph_cache))
    assert counts == [counts[0]] * 3, counts


class _Sliced(torch.nn.Module):
    """One weight read as two slices, whose gradients the backward pads and adds into one."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2 * dim, dim) / dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, bottom = self.w.chunk(2)
        return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, top)), bottom)


_MODELS = {
    "stack": lambda: Stack([DIM] * 4),
    "tied": lambda: SharedWeight(DIM),
    "sliced": lambda: _Sliced(DIM),
}


def _handed_memory(transform: TEv2CUDAGraphTransform) -> set[int]:
    """Where the memory a backward graph hands to autograd starts, for every graph."""
    return {h.storage.data_ptr() for r in transform.cuda_graph_runner.replayed.values() for h in r.handed}


@pytest.mark.parametrize("copy_gradients", [False, True])
@pytest.mark.parametrize("model_name", sorted(_MODELS))
@pytest.mark.parametrize("loop", ["zero_grad", "accumulate", "zeroed in place", "autograd.grad kept"])
def test_gradients_are_the_graphs_memory_and_keep_their_values(monkeypatch, loop, model_name, copy_gradients):
    """A backward graph's gradients become ``.grad`` without a copy: with the gradients set to
    None between steps, ``.grad`` is the graph's memory on every step. What still holds a gradient
    at the next replay (``.grad`` accumulating, zeroed in place, gradients returned by
    ``torch.autograd.grad`` and kept) reads what it read before: every gradient of three steps,
    kept as autograd left it, equals the same steps' without graphs. With ``copy_gradients`` too,
    where the kept gradients were the graph's outputs themselves before the hand-over existed."""
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", capture_taped)
    runs, addresses = [], []
    for transforms in ([], [TEv2CUDAGraphTransform(copy_gradients=copy_gradients)]):
        torch.manual_seed(0)
        model = _MODELS[model_name]()
        params = list(model.parameters())
        compiled = thunder.jit(
            model, executors=[make_te_v2(backend="reference", claim=CLAIM_ALL)], transforms=transforms
        )
        kept, held, addresses = [], [], []
        for step in range(3):
            x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(step))
            loss = compiled(x).square().mean()
            if loop == "autograd.grad kept":
                held.append(torch.autograd.grad(loss, params))
                kept.append([g.clone() for g in held[-1]])
                continue
            loss.backward()
            addresses.append([p.grad.data_ptr() for p in params])
            kept.append([p.grad.clone() for p in params])
            if loop != "zero_grad":
                held.append([p.grad for p in params])
            if loop != "accumulate":
                model.zero_grad(set_to_none=loop == "zero_grad")
        runs.append(kept + held)
    for without, with_graphs in zip(*runs, strict=True):
        for a, b in zip(without, with_graphs, strict=True):
            assert torch.equal(b, a)
    handed = _handed_memory(transforms[0])
    if copy_gradients:
        assert not handed
    elif loop == "zero_grad" and model_name != "tied":
        assert addresses == [addresses[0]] * 3
        assert all(a in handed for a in addresses[0])
    elif loop == "zero_grad":  # .grad is autograd's sum of the two uses' handed gradients
        assert not any(a in handed for a in addresses[0]) and len(handed) == 2


def test_copy_gradients_has_autograd_copy_them(monkeypatch):
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", capture_taped)
    model = Stack([DIM] * 3)
    transform = TEv2CUDAGraphTransform(copy_gradients=True)
    compiled = thunder.jit(
        model, executors=[make_te_v2(backend="reference", claim=CLAIM_ALL)], transforms=[transform]
    )
    compiled(torch.randn(TOKENS, DIM)).square().mean().backward()
    assert not _handed_memory(transform)
    outputs = {
        t.untyped_storage().data_ptr()
        for r in transform.cuda_graph_runner.replayed.values()
        for t in tree_leaves(r.outputs)
        if isinstance(t, torch.Tensor)
    }
    assert all(p.grad.untyped_storage().data_ptr() not in outputs for p in model.parameters())


def test_a_backward_graph_hands_over_memory_no_other_output_shares(monkeypatch):
    """Of a backward graph's outputs, those sharing memory go out as copies; another goes out as a
    new tensor over the graph's memory. A view of it, or its storage alone, kept to the next
    replay still reads what it read: that replay hands out a copy and gives the memory its values
    back. With nothing kept, the next replay hands out the graph's memory again."""

    def fn(x):
        pair = torch.stack([x, x + 1])
        return pair[0], pair[1], x * 3

    runner = _runner_replaying(monkeypatch, fn, (False,), ["x"], capture=capture_taped)
    runner.gradient_graphs.add("CUDAGraph1")
    first, second, tripled = runner.call_cuda_graph("CUDAGraph1", torch.ones(4))
    (replayed,) = runner.replayed.values()
    static = tree_leaves(replayed.outputs)
    assert {first.data_ptr(), second.data_ptr()}.isdisjoint(t.data_ptr() for t in static)
    assert tripled is not static[2] and tripled.data_ptr() == static[2].data_ptr()
    view = tripled[:2]
    del tripled
    *_, tripled = runner.call_cuda_graph("CUDAGraph1", torch.full((4,), 2.0))
    assert tripled.tolist() == [6.0] * 4 and tripled.data_ptr() != static[2].data_ptr()
    assert view.tolist() == [3.0] * 2
    del view, tripled
    *_, tripled = runner.call_cuda_graph("CUDAGraph1", torch.full((4,), 4.0))
    assert tripled.tolist() == [12.0] * 4 and tripled.data_ptr() == static[2].data_ptr()
    storage = tripled.untyped_storage()
    del tripled
    runner.call_cuda_graph("CUDAGraph1", torch.full((4,), 5.0))
    assert torch.empty(0).set_(storage, 0, (4,), (1,)).tolist() == [12.0] * 4


def _stacks_without_and_with_graphs(monkeypatch) -> Iterator[tuple[torch.nn.Module, Any]]:
    """A stack of three linears from one seed, compiled by te_v2 without graphs, then with them
    (taped)."""
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", capture_taped)
    for transforms in ([], [TEv2CUDAGraphTransform()]):
        torch.manual_seed(0)
        model = Stack([DIM] * 3)
        te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL)
        yield model, thunder.jit(model, executors=[te_v2], transforms=transforms)


def test_a_retained_output_gradient_is_each_steps_own(monkeypatch):
    """Each replay returns a new tensor over the graph's memory, so the gradient ``retain_grad``
    keeps on it is that step's, as without graphs (Thunder's runner returned one tensor on every
    replay, whose retained gradient was wrong from the second step on)."""
    runs = []
    for _, compiled in _stacks_without_and_with_graphs(monkeypatch):
        kept = []
        for step in range(3):
            y = compiled(torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(step)))
            y.retain_grad()
            y.square().mean().backward()
            kept.append(y.grad.clone())
        runs.append(kept)
    for without, with_graphs in zip(*runs, strict=True):
        assert torch.equal(with_graphs, without)


def _peft_llama() -> torch.nn.Module:
    """The tiny Llama with peft LoRA on every projection."""
    peft = pytest.importorskip("peft", reason="needs peft (the [bench] extra)")
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.get_peft_model(
        tiny_llama(32, torch.float32), peft.LoraConfig(r=4, target_modules=projections)
    )


_TRAINED = {
    "checkpointed": (lambda: Checkpointed(DIM), thunder.jit),
    "one linear": (lambda: torch.nn.Linear(DIM, DIM, bias=False), thunder.jit),
    "lora": (lambda: LoRAStack([DIM] * 3, rank=16), thunder.jit),
    "stack": (lambda: Stack([DIM] * 4), thunder.jit),
    "tied": (lambda: SharedWeight(DIM), thunder.jit),
    "sliced": (lambda: _Sliced(DIM), thunder.jit),
    "llama": (lambda: tiny_llama(32, torch.float32), thunderfx),
    "llama lora": (_peft_llama, thunderfx),
}


@pytest.mark.parametrize("model_name", sorted(_TRAINED))
def test_replays_train_as_the_same_steps_without_graphs(monkeypatch, model_name, dynamo_reset_after):
    """Four SGD steps whose graphs replay what their capture ran and nothing else (``tests.helpers.TapedGraph``)
    give the losses and gradients of the same steps without graphs (every recast made in both,
    ``tests/conftest.py``).
    A graph's function took each object's name from every trace its symbols were printed in: the
    checkpointed stack's captured backward quantized one linear's gradient with another linear's
    delayed-scaling state, which parted the two runs from the second step."""
    pytest.importorskip("transformers", reason="needs transformers (the [bench] extra)")
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", capture_taped)
    build, compile_ = _TRAINED[model_name]
    runs = []
    for transforms in ([], [TEv2CUDAGraphTransform()]):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build()
        te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL)
        compiled = compile_(model, executors=[te_v2], transforms=transforms)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(trained, lr=0.5)
        steps = []
        for step in range(4):
            generator = torch.Generator().manual_seed(step)
            if compile_ is thunderfx:
                ids = torch.randint(0, 64, (2, 8), generator=generator)
                loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
            else:
                loss = compiled(torch.randn(TOKENS, DIM, generator=generator)).square().mean()
            loss.backward()
            steps.append([loss.detach().clone(), *(p.grad.clone() for p in trained)])
            opt.step()
            opt.zero_grad()
        runs.append(steps)
    assert transforms[0].cuda_graph_runner.cuda_graph_cache, "nothing was captured"
    for step, (without, with_graphs) in enumerate(zip(*runs, strict=True)):
        for a, b in zip(without, with_graphs, strict=True):
            assert torch.equal(b, a), f"step {step}"


def test_a_graphs_function_names_each_object_after_its_own_trace(monkeypatch):
    """Each quantization state a graph's function passes is one global of it, under one name: the
    recomputed forward of a checkpointed linear, a copy of the forward's symbol, brought the name
    the forward trace gave its state, which the graph's own trace gave another linear's."""
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", capture_taped)
    transform = TEv2CUDAGraphTransform()
    te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL)
    jitted = thunder.jit(Checkpointed(DIM), executors=[te_v2], transforms=[transform])
    jitted(torch.randn(TOKENS, DIM)).square().mean().backward()
    runner = transform.cuda_graph_runner
    for name, (bsyms, _, _) in runner.trace_symbols.items():
        used = {id(s) for b in bsyms for s in tree_leaves(b.kwargs) if isinstance(s, LinearQuantState)}
        named = [
            id(v)
            for v in inspect.unwrap(runner.python_callables[name][0]).__globals__.values()
            if isinstance(v, LinearQuantState)
        ]
        assert used and sorted(named) == sorted(used), name


def test_arguments_over_one_memory_are_read_from_one_copy(monkeypatch):
    """A graph given a tensor and a view of it, writing through the view and returning the
    tensor: the write reaches the caller's tensor (Thunder's runner copied each argument on its
    own and wrote both copies back, the unwritten one last), and the returned tensor is the
    caller's, not the graph's copy. Arguments that share no memory get a graph of their own."""

    def fn(view, whole):
        view.add_(1)
        return (whole,)

    runner = _runner_replaying(monkeypatch, fn, (False, False), ["view", "whole"], capture=capture_taped)
    runner.written_arguments["CUDAGraph1"] = (0,)
    for step in range(1, 3):
        x = torch.zeros(4, 4)
        (out,) = runner.call_cuda_graph("CUDAGraph1", x[1], x)
        assert torch.equal(x[1], torch.ones(4)) and out is x, step
    x, y = torch.zeros(4), torch.zeros(4, 4)
    (out,) = runner.call_cuda_graph("CUDAGraph1", x, y)
    assert torch.equal(x, torch.ones(4)) and out is y
    assert len(runner.cuda_graph_cache) == 2


class _WritesInPlace(torch.nn.Module):
    """Frozen linears around an in-place write (found by ``python -m tests.fuzz --graphs``): into
    the input, twice, before a linear reads it; into a view of the input, after; into an
    intermediate another output was computed from, by linears te_v2 leaves to Thunder (8
    features), between the forward sync and the write."""

    def __init__(self, written: str) -> None:
        super().__init__()
        self.written = written
        self.l0 = torch.nn.Linear(DIM, DIM, bias=False).requires_grad_(False)
        self.l1 = torch.nn.Linear(DIM, DIM).requires_grad_(False)
        self.narrow = torch.nn.Linear(DIM, 8, bias=False).requires_grad_(False)  # left to Thunder
        self.wide = torch.nn.Linear(8, DIM, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.written == "input":
            x.mul_(2.0)
            x.mul_(2.0)
            return (self.l0(x),)
        if self.written == "view of the input":
            v0 = self.l0(x)
            v4 = x.view(4, -1, DIM)
            v5 = self.l1(v4)
            v4.add_(v5)
            return v5, v0, v4
        v5 = self.l0(x)
        v8 = self.wide(self.narrow(v5))
        v9 = v8 * 0.5
        v10 = self.l1(v5) + v9
        v9.copy_(v8)
        return v10, v9


@pytest.mark.parametrize("written", ["input", "view of the input", "intermediate"])
def test_graphs_writing_in_place_compute_as_without_graphs(monkeypatch, written):
    """Three delayed-scaling steps, outputs, inputs after the call and scaling states bitwise as
    without graphs. The warm-up calls before a capture doubled the input again each time, and the
    amaxes they recorded set the next step's scale; a view of the input written in a later graph
    did not reach the caller's input."""
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", capture_taped)
    runs = []
    for transforms in ([], [TEv2CUDAGraphTransform()]):
        torch.manual_seed(0)
        claim = ClaimPolicy(min_features=16)
        te_v2 = make_te_v2(backend="reference", claim=claim, recipe=delayed_scaling(amax_history_len=4))
        jitted = thunder.jit(_WritesInPlace(written), executors=[te_v2], transforms=transforms)
        steps = []
        for step in range(3):
            x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(step))
            steps.append([*(o.clone() for o in jitted(x)), x])
        runs.append((steps, quantization_state_dict(jitted)))
    (without, states), (with_graphs, graphed_states) = runs
    for step, (a, b) in enumerate(zip(without, with_graphs, strict=True)):
        assert all(map(torch.equal, b, a)), step
    assert states.keys() == graphed_states.keys()
    for name, value in states.items():
        assert torch.equal(graphed_states[name], value), name


def test_batches_of_no_rows_replay_as_without_graphs(monkeypatch):
    """Batches of 16, 0, 16 and 0 rows, gradients accumulating: every tensor of no elements is
    at address 0, so none may count as sharing memory with another (they were taken for views of
    one another's copies, and refused)."""
    runs = []
    for model, jitted in _stacks_without_and_with_graphs(monkeypatch):
        seen = []
        for step, rows in enumerate([16, 0, 16, 0]):
            x = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(step), requires_grad=True)
            jitted(x).square().sum().backward()
            seen += [x.grad, *(p.grad.clone() for p in model.parameters())]
        runs.append(seen)
    assert all(map(torch.equal, *runs))


class _ReturnsItsInput(torch.nn.Module):
    """A linear's output and the input itself (``dropout`` of 0 is the input, to Thunder)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = torch.nn.Linear(DIM, DIM, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.l0(x), torch.nn.functional.dropout(x, p=0.0)


def test_an_input_returned_is_the_callers_tensor(monkeypatch):
    """Without graphs Thunder returns the input itself, whose gradient autograd accumulates
    directly; a graph returned its copy of it (its gradient then went through Thunder's backward,
    summed in another order): the input's gradient is bitwise as without graphs."""
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", capture_taped)
    runs = []
    for transforms in ([], [TEv2CUDAGraphTransform()]):
        torch.manual_seed(0)
        jitted = thunder.jit(
            _ReturnsItsInput(),
            executors=[make_te_v2(backend="reference", claim=CLAIM_ALL)],
            transforms=transforms,
        )
        grads = []
        for step in range(2):
            x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(step), requires_grad=True)
            y, same = jitted(x)
            assert same is x
            (y.square().sum() + same.sin().sum()).backward()
            grads.append(x.grad)
        runs.append(grads)
    assert all(map(torch.equal, *runs))


def test_a_backward_graph_frees_each_saved_tensor_only_it_reads_after_its_last_reader(monkeypatch):
    """With ``reuse_saved_memory``, the forward graph's saved-only outputs are those the forward
    saves and neither returns to the caller nor reads outside its graphs; the backward graph calls
    ``release`` with each of them it reads, read by nothing after the graph, and with each input
    it reads from a copy of its own (a cotangent, a saved tensor made outside the graphs), once per call and after its last reader, and
    with nothing else (the capture's plan then frees their memory, on a GPU)."""
    monkeypatch.setattr(CUDAGraphRunner, "build_cuda_graph", capture_taped)
    jitted = _trained()
    transform = TEv2CUDAGraphTransform(reuse_saved_memory=True)
    forward = transform.transform_trace_post_optimization(forward_trace(jitted))
    backward_before = backward_trace(jitted)
    transform.transform_trace_post_optimization(backward_before)
    runner = transform.cuda_graph_runner
    ((fwd_graph, positions),) = runner.saved_only.items()
    outputs = runner.trace_symbols[fwd_graph][2]
    user, saved = forward.bound_symbols[-1].args
    user_names = {t.name for t in tree_leaves(user) if hasattr(t, "name")}
    saved_names = {t.name for t in tree_leaves(saved) if hasattr(t, "name")}
    saved_only = {outputs[i].name for i in positions}
    assert saved_only and saved_only <= saved_names and not saved_only & user_names
    assert saved_names - saved_only  # a weight and the sync's scales are saved, not the graph's alone
    ((bwd_graph, freed),) = runner.releasable.items()
    bsyms, inputs, _ = runner.trace_symbols[bwd_graph]
    freed_names = {inputs[i].name for i in freed}
    saved_before = {p.name for p in _saved_tensors(backward_before)}
    assert saved_only <= freed_names <= saved_before
    (copies,) = runner.copies_releasable.values()
    copied_names = {inputs[i].name for i in copies}
    assert copied_names - saved_before and not copied_names & freed_names  # a cotangent, and no saved-only
    points = ReleasePoints(backward_before, Writes(backward_before), lambda *t: None)
    with_releases = points.with_releases(bsyms, inputs, sorted((*freed, *copies)))
    for name in freed_names | copied_names:
        (at,) = [
            i for i, b in enumerate(with_releases) if b.sym.name == RELEASE_NAME and name in _arg_names(b)
        ]
        readers = [
            i
            for i, b in enumerate(with_releases)
            if b.sym.name not in ("python_del",) and name in _arg_names(b)
        ]
        assert max(readers) == at, name
        assert not any(name in _arg_names(b) for b in with_releases if b.sym.name == "python_del")
    calls: list[int] = []
    monkeypatch.setattr(_CheckedRunner, "release", lambda self, *tensors: calls.append(len(tensors)))
    graphed = TEv2CUDAGraphTransform(reuse_saved_memory=True)
    model = thunder.jit(
        LoRAStack([DIM] * 3, rank=16),
        executors=[make_te_v2(backend="reference", claim=CLAIM_ALL)],
        transforms=[graphed],
    )
    for _ in range(2):
        model(torch.randn(TOKENS, DIM)).sum().backward()
    (freeing,) = graphed.cuda_graph_runner.releasable.values()
    (copying,) = graphed.cuda_graph_runner.copies_releasable.values()
    assert sum(calls) == 4 * (
        len(freeing) + len(copying)
    )  # three warm-up calls and the capture; replays run no Python


def _arg_names(bsym) -> set[str]:
    return {p.name for p in bsym.flat_proxy_args}


@pytest.mark.parametrize("held", ["grad", "handed", "view", "kept after zero_grad"])
def test_a_held_gradient_is_moved_out_of_the_graphs_memory(held):
    """Before a forward replay that may write where a backward graph's gradient lies, each held
    gradient moves to memory of its own with its values, through every name autograd gave it
    (``.grad``, a detached copy of the tensor handed out) or the tensor handed out itself; one read
    otherwise (a view of it, or the tensor kept after ``.grad`` was set to None) raises."""
    graph_memory = torch.randn(8, 4)
    h = _Handed(0, graph_memory.untyped_storage())
    h.own, h.own_python = torch._C._storage_Use_Count(h.storage._cdata), sys.getrefcount(h.storage)
    handed = torch.empty((0,)).set_(h.storage, 0, (8, 4), (4, 1))
    last = {0: weakref.ref(handed)}
    weight = torch.nn.Parameter(torch.zeros(8, 4))
    weight.grad = handed.detach()
    reader = {
        "grad": weight.grad,
        "handed": handed,
        "view": weight.grad.view(-1),
        "kept after zero_grad": weight.grad,
    }[held]
    if held != "handed":
        del handed
    if held in ("view", "kept after zero_grad"):
        weight.grad = None
        with pytest.raises(RuntimeError, match="still read, other than through a parameter's"):
            relocate_held([h], last, [weight])
        return
    values = graph_memory.clone()
    relocate_held([h], last, [weight])
    graph_memory.zero_()
    assert torch.equal(reader, values) and reader.untyped_storage()._cdata != h.storage._cdata
    assert torch._C._storage_Use_Count(h.storage._cdata) == h.own
    relocate_held([h], last, [weight])  # nothing held any more: nothing moves


def test_a_backward_graph_returning_memory_it_freed_is_refused():
    """A backward graph whose output is a view of a saved tensor its capture freed (one the trace
    analysis took for new memory) would have its own later temporaries overwrite that output: the
    capture raises instead. A new output at a freed tensor's address is not such a view."""
    runner = TEv2CUDAGraphTransform(reuse_saved_memory=True).cuda_graph_runner
    saved, fresh = torch.randn(8, 4), torch.randn(8, 4)
    runner._released = {saved.untyped_storage().data_ptr(): saved.untyped_storage()._cdata}
    runner._check_nothing_returned_was_freed("CUDAGraph2", [fresh, None, 3])
    with pytest.raises(RuntimeError, match="returns a tensor over memory it gave back"):
        runner._check_nothing_returned_was_freed("CUDAGraph2", [fresh, saved[2:].t()])
