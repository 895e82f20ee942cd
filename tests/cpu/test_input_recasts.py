"""The ``input_recasts`` pass: a wgrad reads an FP8 copy of its input cast in the backward, with the
scale the forward used, where the backward keeps that input (or what it is a view of) anyway, so
the forward saves no copy; bitwise the same training; other inputs keep their saved copy
(reference backend, CPU)."""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
from thunder.executors.torch_compile import torch_compile_ex

from te_v2_executor import block_scaling, current_scaling, delayed_scaling, explain, make_te_v2
from te_v2_executor.compiled import compiled_functions
from te_v2_executor.symbols import LINEAR_WGRAD, is_input_recast
from tests.helpers import CLAIM_ALL, saved_nbytes, train_steps, trained_with_and_without
from tests.models import LlamaLikeBlock, SwiGLUMLP

DIM, TOKENS, HEADS = 128, 128, 4


class ViewOfKept(torch.nn.Module):
    """A linear reading a transposed, copied and reshaped tanh output, which tanh's backward keeps
    (as o_proj reads the attention's output, which the attention's backward keeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x.view(TOKENS, HEADS, DIM // HEADS).transpose(0, 1))
        return self.proj(h.transpose(0, 1).contiguous().reshape(TOKENS, DIM))


class WrittenAfterTheForward(ViewOfKept):
    """As ``ViewOfKept``, with the kept tensor written in place after the linear read it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x)
        y = self.proj(h)
        h.mul_(2)
        return y


MODELS = {
    "swiglu": lambda: SwiGLUMLP(DIM, 2 * DIM),
    "view": ViewOfKept,
    "block": lambda: LlamaLikeBlock(DIM),
}
# the linears of each model whose input the backward casts again: in the block, gate/up's input
# is the second norm's product (its input times its rsqrt), o's q times a sigmoid, down's the
# SwiGLU's, each made of tensors the backward keeps; q/k/v's is the product of the block's input,
# which code outside the trace could write before the backward, too large to snapshot
RECAST = {"swiglu": {"down"}, "view": {"proj"}, "block": {"o", "gate", "down"}}
# under block scaling k and v (64 outputs) run on Thunder's default path, whose backward keeps
# their input, which q's recast then reads
RECAST_BLOCK_SCALED = {**RECAST, "block": {"q", "o", "gate", "down"}}
RECIPES = {"delayed": delayed_scaling, "current": current_scaling, "block": block_scaling}


def _te_v2(recipe=None, skip=()):
    return make_te_v2(backend="reference", recipe=recipe, claim=CLAIM_ALL, skip_passes=skip)


def _train(model: torch.nn.Module, recipe, skip: tuple[str, ...], fusers=(), dtype=torch.float32):
    torch.manual_seed(1)
    jitted = thunder.jit(model, executors=[_te_v2(recipe, skip), *fusers])
    xs = [torch.randn(TOKENS, DIM, dtype=dtype, requires_grad=True) for _ in range(3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return jitted, train_steps(jitted, opt, xs), [x.grad for x in xs]


def _rows(jitted) -> dict[str, object]:
    return {r.name.split("_")[-2]: r for r in explain(jitted).linears}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", MODELS)
def test_recast_inputs_train_bitwise_as_saved_ones(name, recipe):
    """Three steps, so that delayed scaling's scales move between each forward and its backward:
    a recast with the updated scale instead of the forward's would change every wgrad."""
    train = lambda model, skip: _train(model, RECIPES[recipe](), skip)  # noqa: E731
    run, saved_run = trained_with_and_without(MODELS[name](), train, ("input_recasts",))
    rows, saved_rows = _rows(run[0]), _rows(saved_run[0])
    recast = (RECAST_BLOCK_SCALED if recipe == "block" else RECAST)[name]
    assert {n for n, r in rows.items() if r.recasts_input_t} == recast
    for n in recast:
        assert (rows[n].saves_input_t, saved_rows[n].saves_input_t) == (False, True)
        assert not saved_rows[n].recasts_input_t


def test_the_forward_saves_the_copy_less():
    """The SwiGLU MLP's forward saves down's x^T no more (its scale the recast reads is in the
    snapshot the weight recasts read already)."""
    model = SwiGLUMLP(DIM, 2 * DIM)

    def saved(skip):
        jitted = thunder.jit(copy.deepcopy(model), executors=[_te_v2(delayed_scaling(), skip)])
        x = torch.randn(TOKENS, DIM, requires_grad=True)
        jitted(x).sum().backward()
        found = {}
        with torch.autograd.graph.saved_tensors_hooks(lambda t: found.setdefault(id(t), t), lambda t: t):
            jitted(x).sum().backward()
        return sum(saved_nbytes(t) for t in found.values() if not isinstance(t, torch.nn.Parameter))

    copy_bytes = TOKENS * 2 * DIM
    assert copy_bytes <= saved(("input_recasts",)) - saved(()) < copy_bytes + 64


def test_an_input_written_after_the_forward_keeps_its_saved_copy():
    """The tanh output is written in place after the linear read it: a copy cast in the backward
    would read the written values, so the forward's copy stays (and the backward refuses, as eager
    autograd does, because tanh's backward reads the written output)."""
    jitted = thunder.jit(WrittenAfterTheForward(), executors=[_te_v2(delayed_scaling())])
    out = jitted(torch.randn(TOKENS, DIM, requires_grad=True))
    (row,) = explain(jitted).linears
    assert (row.saves_input_t, row.recasts_input_t) == (True, False)
    with pytest.raises(RuntimeError, match="in-place"):
        out.sum().backward()


def test_each_recast_runs_right_before_its_wgrad_after_its_gradient():
    """Through torch.compile's fusion, which orders the backward anew: the recast waits for the
    gradient its wgrad reads, so its copy is not alive through the whole backward."""
    model = SwiGLUMLP(DIM, 2 * DIM)
    jitted = thunder.jit(model, executors=[_te_v2(delayed_scaling()), torch_compile_ex])
    jitted(torch.randn(TOKENS, DIM, requires_grad=True)).sum().backward()
    (compiled,) = compiled_functions(jitted)
    order = thunder.last_backward_traces(compiled)[-1].bound_symbols
    (recast_at,) = [at for at, b in enumerate(order) if is_input_recast(b)]
    state = order[recast_at].kwargs["state"]
    (wgrad_at,) = [at for at, b in enumerate(order) if b.sym is LINEAR_WGRAD and b.kwargs["state"] is state]
    gradient = order[recast_at].kwargs["after"]
    made_at = next(at for at, b in enumerate(order) if gradient.name in {o.name for o in b.flat_proxy_outs})
    assert made_at < recast_at < wgrad_at


def test_with_a_fuser_the_swiglu_trains_bitwise_and_a_fusible_leaf_keeps_its_copy():
    """With torch.compile's fuser after te_v2: down_proj's recast reads the gate's and up's outputs,
    which te_v2's GEMMs make and the SwiGLU's backward keeps, and trains bitwise as without it;
    the tanh output of ``ViewOfKept`` is the fuser's, which may compute it again in the backward
    rather than save it, so its linear keeps its saved copy."""
    fused = [torch_compile_ex]
    train = lambda model, skip: _train(model, delayed_scaling(), skip, fused)  # noqa: E731
    run, _ = trained_with_and_without(SwiGLUMLP(DIM, 2 * DIM), train, ("input_recasts",))
    assert {n for n, r in _rows(run[0]).items() if r.recasts_input_t} == {"down"}
    jitted, *_ = _train(ViewOfKept(), delayed_scaling(), (), fused)
    assert not _rows(jitted)["proj"].recasts_input_t


def _saved_bytes(jitted, dtype: torch.dtype) -> int:
    """The bytes one training step of ``jitted`` saves for its backward, parameters aside."""
    x = torch.randn(TOKENS, DIM, dtype=dtype, requires_grad=True)
    found = {}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: found.setdefault(id(t), t), lambda t: t):
        out = jitted(x)
    out.sum().backward()
    return sum(saved_nbytes(t) for t in found.values() if not isinstance(t, torch.nn.Parameter))


def _step_grads(model: torch.nn.Module, executors, xs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each parameter's gradient at each of the steps on ``xs`` (eager without ``executors``)."""
    fn = thunder.jit(model, executors=executors) if executors else model
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    grads = []
    for x in xs:
        opt.zero_grad()
        fn(x).float().square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def test_with_a_fuser_a_norms_output_is_cast_again_from_the_norms_input_and_scale():
    """With torch.compile's fuser after te_v2, gate's input, the block's second norm, is the
    fuser's: the backward computes it again, with the fuser's ops, from the residual sum and the
    norm's scale, which the norm's backward keeps. The forward then saves gate's and down's copies
    less and nothing more, and trains bitwise as with them in float32. q's input, the first norm's,
    is made of the block's input, which code outside the trace could write before the backward: q
    keeps its copy."""
    fused = [torch_compile_ex]
    train = lambda model, skip: _train(model, delayed_scaling(), skip, fused)  # noqa: E731
    run, apart = trained_with_and_without(LlamaLikeBlock(DIM), train, ("input_recasts",))
    assert {n for n, r in _rows(run[0]).items() if r.recasts_input_t} == {"gate", "down"}
    copy_bytes = TOKENS * DIM + TOKENS * 2 * DIM
    less = _saved_bytes(apart[0], torch.float32) - _saved_bytes(run[0], torch.float32)
    assert copy_bytes <= less < copy_bytes + 64


def test_with_a_fuser_in_bfloat16_a_recast_norm_output_trains_as_close_to_eager():
    """In bfloat16 Inductor computes the forward's norm from the residual sum it keeps in float32,
    the recast from the sum the backward keeps, rounded as eager rounds it, and it groups the
    backward's ops differently: not bitwise, but each step's gradients are as far from eager's as
    with the forward's copies (relative error within 5%), under delayed scales that move."""
    torch.manual_seed(0)
    model = LlamaLikeBlock(DIM).to(torch.bfloat16)
    xs = [torch.randn(TOKENS, DIM, dtype=torch.bfloat16) for _ in range(3)]
    runs = [
        _step_grads(copy.deepcopy(model), executors, xs)
        for executors in (
            [_te_v2(delayed_scaling()), torch_compile_ex],
            [_te_v2(delayed_scaling(), ("input_recasts",)), torch_compile_ex],
            None,
        )
    ]
    for recast, saved, eager in zip(*runs, strict=True):
        for a, b, e in zip(recast, saved, eager, strict=True):
            assert (a - e).float().norm() <= 1.05 * (b - e).float().norm()


class ScaledNorm(torch.nn.Module):
    """A linear reading an RMSNorm's output, ``w * n``; ``n * s`` keeps n for the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(DIM) + 0.5)
        self.s = torch.nn.Parameter(torch.rand(DIM))
        self.proj = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.proj(self.w * n) + n * self.s


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_a_norm_weight_written_through_data_before_the_backward_does_not_reach_the_wgrad(frozen):
    """The recast computes ``w * n`` again in the backward; a write into w through ``.data`` (which
    no version counter sees) between forward and backward must not reach it, as eager's wgrad
    reads the product the forward made: the forward snapshots w. Frozen, with an input that needs
    no gradient, nothing else saves w, so the backward reads no parameter a version check covers."""
    grads = []
    for skip in ((), ("input_recasts",)):
        torch.manual_seed(0)
        model = ScaledNorm()
        model.w.requires_grad_(not frozen)
        jitted = thunder.jit(model, executors=[_te_v2(delayed_scaling(), skip)])
        loss = jitted(torch.randn(TOKENS, DIM, requires_grad=not frozen)).square().mean()
        model.w.data.mul_(3)
        loss.backward()
        (row, *_) = explain(jitted).linears
        assert row.recasts_input_t == (not skip)
        grads.append(model.proj.weight.grad)
    assert torch.equal(*grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_through_thunderfx_a_llamas_norm_outputs_are_cast_again_but_the_embeddings(dtype):
    """A Hugging Face Llama through ``te_v2_executor.thunderfx`` with torch.compile's fuser: every
    norm's output is cast again from the norm's input and scale (q's, gate's, the head's) but the
    first layer's input norm's, whose input is the embedding, which the fuser would compute again
    from the ids and the table rather than save (in float32 HF's widening is Thunder's
    ``shallow_copy`` of it); down's from the SwiGLU's operands. On the CPU the attention is the
    fuser's, so o_proj keeps its copy."""
    pytest.importorskip("transformers", reason="needs transformers (the [bench] extra)")
    import re

    import te_v2_executor
    from te_v2_executor import executors
    from tests.models import tiny_llama

    model = tiny_llama(128, dtype)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = te_v2_executor.thunderfx(model, executors=executors(_te_v2()))
    compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    recast = set()
    for row in explain(compiled).linears:
        if row.recasts_input_t:
            found = re.search(r"layers_modules_(\d+)_.*_(\w+_proj)_", row.name)
            recast.add((int(found[1]), found[2]) if found else "lm_head")
    expected = {(0, "gate_proj"), (0, "down_proj"), (1, "q_proj"), (1, "gate_proj"), (1, "down_proj")}
    assert recast == expected | {"lm_head"}, recast
