"""Shared test utilities: trace inspection, accuracy measures, the eager FP8 emulation."""

from __future__ import annotations

import collections
import contextlib
import io
from collections.abc import Callable, Iterator
from typing import Any

import thunder
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from te_v2_executor import ClaimPolicy
from te_v2_executor.backends import Backend, reference
from te_v2_executor.checks import LinearOperands, decide
from te_v2_executor.recipes import RecipeSpec

# The tests' small models sit below the default claim policy's threshold; tests of what te_v2
# runs claim every linear TE can run, and the policy has tests of its own.
CLAIM_ALL = ClaimPolicy(min_features=0)

# The fusion executors a user lists after te_v2: none, Thunder's torch.compile executor, nvFuser.
FUSERS = ("none", "torch.compile", "nvfuser")


def nvfuser_installed() -> bool:
    """Whether Thunder found nvFuser (``thunder.executors.nvfuserex.nvfuserex`` is not None)."""
    from thunder.executors.nvfuserex import nvfuserex

    return nvfuserex is not None


def fusers_named(name: str) -> list:
    """The executors to list after te_v2 for ``name``, one of ``FUSERS``; an nvFuser case skips,
    with the reason, where nvFuser is not installed."""
    if name == "torch.compile":
        from thunder.executors.torch_compile import torch_compile_ex

        return [torch_compile_ex]
    if name == "nvfuser":
        import pytest
        from thunder.executors.nvfuserex import nvfuserex

        if not nvfuser_installed():
            pytest.skip(
                "nvFuser is not installed (its CUDA 13 wheels need torch 2.10; the GPU kit's shim loads it)"
            )
        return [nvfuserex]
    assert name == "none", name
    return []


def bsyms_of(trace: thunder.core.trace.TraceCtx | None, sym) -> list:
    """Top-level bound symbols of ``trace`` calling ``sym`` (by identity); none for no trace."""
    if trace is None:
        return []
    return [b for b in trace.bound_symbols if b.sym is sym]


def recast_copies(trace: thunder.core.trace.TraceCtx) -> dict[str, tuple[Any, Any]]:
    """The W^T copies ``trace`` casts again for dgrads (``weight_recasts``), by the name of their
    state's weight: each copy, and the scales snapshot it is cast with, whether a recast of its
    own makes it or a batch of them (``recast_batches``)."""
    from te_v2_executor.symbols import LINEAR_FWD, RECAST_WEIGHTS, arg, is_recast

    found = {}
    for b in trace.bound_symbols:
        if b.sym is LINEAR_FWD and is_recast(b):
            found[b.kwargs["state"].name] = (b.output[2], arg(b, "replay"))
        elif b.sym is RECAST_WEIGHTS:
            for state, copy in zip(b.kwargs["states"], b.output, strict=True):
                found[state.name] = (copy, b.args[0])
    return found


def forward_trace(jitted) -> thunder.core.trace.TraceCtx:
    return thunder.last_traces(jitted)[-1]


def backward_trace(jitted) -> thunder.core.trace.TraceCtx | None:
    traces = thunder.last_backward_traces(jitted)
    return traces[-1] if traces else None


def assert_one_sync_per_pass_after_linear_work(jitted, n: int) -> None:
    """The traces ``jitted`` ran last hold one forward flush of ``n`` linears' states, after every
    te_v2 forward, and one backward flush of them, the backward's last work."""
    from thunder.core import prims

    from te_v2_executor.symbols import BACKWARD_SYNC, FORWARD_SYNC, LINEAR_FWD

    def work(trace) -> list:
        return [b for b in trace.bound_symbols if b.sym not in (prims.python_del, prims.python_return)]

    fwd, bwd = forward_trace(jitted), backward_trace(jitted)
    (fsync,) = bsyms_of(fwd, FORWARD_SYNC)
    forward_work = work(fwd)
    assert all(forward_work.index(b) < forward_work.index(fsync) for b in bsyms_of(fwd, LINEAR_FWD))
    assert len(fsync.kwargs["group"].states) == n
    (bsync,) = bsyms_of(bwd, BACKWARD_SYNC)
    assert work(bwd)[-1] is bsync
    assert len(bsync.kwargs["group"].states) == n
    assert not bsyms_of(fwd, BACKWARD_SYNC) and not bsyms_of(bwd, FORWARD_SYNC)


def sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``expected``, in dB."""
    expected = expected.detach().double()
    noise = (actual.detach().double() - expected).norm()
    return float("inf") if noise == 0 else float(20 * torch.log10(expected.norm() / noise))


def route(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: RecipeSpec, claim: ClaimPolicy
) -> str:
    """How te_v2 runs ``F.linear(x, w, bias)``: "fp8", "unquantized" or "fallback"."""
    op = LinearOperands(
        x_shape=tuple(x.shape),
        w_shape=tuple(w.shape),
        bias_shape=None if bias is None else tuple(bias.shape),
        dtypes=(x.dtype, w.dtype) + (() if bias is None else (bias.dtype,)),
        device_type=x.device.type,
        compute_capability=None,
    )
    decision = decide(op, recipe, Backend.REFERENCE, claim)
    if decision.fp8:
        return "fp8"
    return "unquantized" if decision.by_policy else "fallback"


class _EmulatedLinear(torch.autograd.Function):
    """One linear te_v2 runs in FP8, eagerly on the reference kernels, with fresh scaling state."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: RecipeSpec
    ) -> torch.Tensor:
        scaling = reference.ScalingState(recipe, forward=True, device=x.device)
        y, x_saved, w_saved = reference.linear_fwd(
            x, w, bias, scaling, compute_output=True, save_input=True, save_weight=True
        )
        ctx.save_for_backward(x_saved, w_saved)
        ctx.recipe, ctx.has_bias, ctx.x_shape, ctx.dtypes = (
            recipe,
            bias is not None,
            tuple(x.shape),
            (x.dtype, w.dtype),
        )
        # A copy: y may be a view of the GEMM's result, which autograd would not let the program
        # write into in place (the values are the same).
        return y.clone()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_saved, w_saved = ctx.saved_tensors
        scaling = reference.ScalingState(ctx.recipe, forward=False, device=dy.device)
        dy_q, dbias = reference.quantize_grad_output(
            dy, scaling, rowwise=True, columnwise=True, bgrad=ctx.has_bias
        )
        dx = reference.linear_dgrad(dy_q, w_saved, ctx.recipe, input_shape=ctx.x_shape, dtype=ctx.dtypes[0])
        dw = reference.linear_wgrad(dy_q, x_saved, ctx.recipe, dtype=ctx.dtypes[1])
        return dx, dw, dbias, None


@contextlib.contextmanager
def eager_emulation(recipe: RecipeSpec, *, claim: ClaimPolicy = CLAIM_ALL) -> Iterator[list[str]]:
    """Run every ``F.linear`` (so every ``nn.Linear``) eagerly as te_v2 would, without Thunder:
    the linears it claims for FP8 through the reference kernels (fresh scaling state: what
    te_v2's first step computes), the others as plain ``F.linear``. Yields the routes taken
    ("fp8", "unquantized", "fallback"), appended call by call."""
    original = torch.nn.functional.linear
    routes: list[str] = []

    def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        routes.append(route(x, w, bias, recipe, claim))
        if routes[-1] == "fp8":
            return _EmulatedLinear.apply(x, w, bias, recipe)
        return original(x, w, bias)

    torch.nn.functional.linear = linear
    try:
        yield routes
    finally:
        torch.nn.functional.linear = original


def saved_nbytes(t: torch.Tensor) -> int:
    """Device bytes a saved tensor holds: the data and scales inside an FP8 tensor subclass
    (TE's Float8Tensor, the reference's carrier), else its own storage."""
    inner = (
        [v for v in vars(t).values() if isinstance(v, torch.Tensor)] if type(t) is not torch.Tensor else []
    )
    planes = [p for p in (getattr(t, "rowwise", None), getattr(t, "columnwise", None)) if p is not None]
    if planes:
        return sum(p.nbytes for p in planes)
    return sum(saved_nbytes(v) for v in inner) if inner else t.nbytes


def assert_like_eager(
    model: torch.nn.Module,
    x: torch.Tensor,
    executors: list,
    *,
    grad: bool,
    jit: Callable = thunder.jit,
    **tols,
) -> None:
    """``model`` compiled by ``jit`` with ``executors`` gives eager's outputs and, with ``grad``,
    eager's parameter gradients for a sum-of-squares loss (None-ness exact), within ``tols``. Each
    run gets its own copy of ``x``, which the model may write into."""
    jitted = jit(model, executors=executors)
    with torch.set_grad_enabled(grad):
        expected, actual = model(x.clone()), jitted(x.clone())
    expected, actual = tree_leaves(expected), tree_leaves(actual)
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, **tols)
    if not grad:
        return
    grads = []
    for outputs in (actual, expected):
        model.zero_grad(set_to_none=True)
        sum((o.float() ** 2).sum() for o in outputs).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert (g is None) == (grads[1][name] is None), name
        if g is not None:
            torch.testing.assert_close(g, grads[1][name], **tols)


def train_steps(
    fn: Callable,
    opt: torch.optim.Optimizer,
    xs: list[torch.Tensor],
    autocast: Callable = contextlib.nullcontext,
) -> list[torch.Tensor]:
    """One ``opt`` step per input on ``mean(fn(x)**2)``, the forward under ``autocast()``; the
    losses."""
    losses = []
    for x in xs:
        opt.zero_grad()
        with autocast():
            loss = fn(x).float().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def assert_trained_alike(model: torch.nn.Module, twin: torch.nn.Module, run: tuple, twin_run: tuple) -> None:
    """Two trainings of copies of one model, each run a (compiled function, losses, input
    gradients) triple, ended bitwise alike: losses, input gradients, parameters and quantization
    state."""
    from te_v2_executor import quantization_state_dict

    (fn, losses, x_grads), (twin_fn, twin_losses, twin_x_grads) = run, twin_run
    assert torch.equal(torch.stack(list(losses)), torch.stack(list(twin_losses)))
    for a, b in zip(x_grads, twin_x_grads, strict=True):
        assert torch.equal(a, b)
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert_state_dicts_equal(quantization_state_dict(fn), quantization_state_dict(twin_fn))


def trained_with_and_without(
    model: torch.nn.Module, train: Callable[[torch.nn.Module, tuple[str, ...]], tuple], skip: tuple[str, ...]
) -> tuple[tuple, tuple]:
    """``train(model, ())`` and ``train(copy, skip)`` of a copy of ``model`` (each a compiled
    function, losses, input gradients triple), asserted to end bitwise alike; both runs."""
    import copy

    twin = copy.deepcopy(model)
    run, apart = train(model, ()), train(twin, skip)
    assert_trained_alike(model, twin, run, apart)
    return run, apart


def assert_state_dicts_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Two quantization state dicts hold the same names and bitwise equal tensors."""
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_resume_continues_bitwise(
    resumable: Callable[[int], tuple[torch.nn.Module, torch.optim.Optimizer]],
    compile_fn: Callable[[torch.nn.Module], Callable],
    xs: list[torch.Tensor],
    autocast: Callable = contextlib.nullcontext,
) -> dict[str, torch.Tensor]:
    """Train over ``xs``; or over half, checkpoint the model, the optimizer and the quantization
    state through ``torch.save``, load them into a fresh model and optimizer (``resumable(seed)``)
    compiled anew, the quantization state before its first call, and train over the other half:
    the losses, the weights and every quantization state end bitwise equal. Returns the
    checkpoint's quantization state."""
    from te_v2_executor import load_quantization_state_dict, quantization_state_dict

    half = len(xs) // 2
    model, opt = resumable(0)
    jitted = compile_fn(model)
    losses = train_steps(jitted, opt, xs, autocast)

    first, first_opt = resumable(0)
    first_jitted = compile_fn(first)
    losses_before = train_steps(first_jitted, first_opt, xs[:half], autocast)
    saved = quantization_state_dict(first_jitted)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict(), "quant": saved}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)

    resumed, resumed_opt = resumable(1)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    resumed_jitted = compile_fn(resumed)
    load_quantization_state_dict(resumed_jitted, checkpoint["quant"])
    assert_state_dicts_equal(quantization_state_dict(resumed_jitted), saved)
    losses_after = train_steps(resumed_jitted, resumed_opt, xs[half:], autocast)

    assert torch.equal(torch.stack(losses), torch.stack(losses_before + losses_after))
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert_state_dicts_equal(quantization_state_dict(resumed_jitted), quantization_state_dict(jitted))
    return saved


class TapedGraph(TorchDispatchMode):
    """The ATen operations a "capture" runs, each with the tensors it ran on, so that a "replay"
    runs them again on the same tensors and nothing else: like a CUDA graph's, it runs no Python
    of the traced function, so whatever that Python decided at capture holds on every replay.
    Only operations that go through the dispatcher are seen (not Inductor's CPU kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a value read to the host while capturing, which a CUDA graph cannot")
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                new = func(*args, **kwargs)
                for mine, value in zip(tree_leaves(out), tree_leaves(new), strict=True):
                    if isinstance(mine, torch.Tensor) and not _same_memory(mine, value):
                        mine.copy_(value)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def capture_taped(self: Any, fn: Callable, args: list[Any], static_args_mask: tuple[bool, ...]) -> tuple:
    """A CPU stand-in for ``CUDAGraphRunner.build_cuda_graph`` (monkeypatched in): as Thunder's,
    three warm-up calls on the runner's copies of the arguments it does not read in place, then one
    call taped (``TapedGraph``), whose outputs the replays rewrite."""
    static = tuple(
        a if in_place else self.get_static_buffer(a)
        for a, in_place in zip(args, static_args_mask, strict=True)
    )
    for _ in range(3):
        fn(*static)
    tape = TapedGraph()
    with tape:
        outputs = fn(*static)
    return tape, static, outputs


@contextlib.contextmanager
def file_store_process_group(
    backend: str, store_path: str, *, rank: int = 0, world_size: int = 1, **options: Any
) -> Iterator[None]:
    """A ``backend`` process group of ``world_size`` ranks (this process alone by default) over a
    file store at ``store_path``, destroyed on exit."""
    import torch.distributed as dist

    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **options)
    try:
        yield
    finally:
        dist.destroy_process_group()


def gathered_on_one_rank(weight: torch.Tensor, recipe: RecipeSpec | None) -> tuple[Any, torch.Tensor]:
    """What ``fp8_all_gather``'s hooks gather of ``weight`` on a mesh of one rank on its device:
    the FP8 bytes with their scale's inverse (a ``GatheredFP8``), and the weight the hooks make
    of them in ``weight``'s dtype."""
    from torch.distributed.device_mesh import init_device_mesh

    from te_v2_executor.fsdp import FP8GatheredWeight
    from te_v2_executor.gathered_weights import GatheredFP8

    shard = FP8GatheredWeight(weight.detach().clone(), recipe)
    mesh = init_device_mesh(weight.device.type, (1,))
    (data,), metadata = shard.fsdp_pre_all_gather(mesh, weight.shape, weight.stride(), None, None)
    fp8 = GatheredFP8(data.view(torch.float8_e4m3fn), metadata[0].reshape(1))
    return fp8, shard.fsdp_post_all_gather((data,), metadata, weight.dtype)[0]


def forward_and_dgrad_through_gathered_weight(
    numerics: Any, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, recipe: RecipeSpec
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """te_v2's forward GEMM and dgrad (``numerics``, a backend module) through ``weight`` gathered
    by ``fp8_all_gather``'s hooks on one rank: (y, dx) from the gathered FP8 bytes, then (y, dx)
    from the cast of the gathered weight. The dgrad reads the saved column-wise weight copy."""
    fp8, gathered = gathered_on_one_rank(weight, recipe)
    results = []
    for w_gathered in (fp8, None):
        forward = numerics.ScalingState(recipe, forward=True, device=x.device)
        backward = numerics.ScalingState(recipe, forward=False, device=x.device)
        y, _, w_saved = numerics.linear_fwd(
            x,
            gathered,
            None,
            forward,
            compute_output=True,
            save_input=False,
            save_weight=True,
            w_gathered=w_gathered,
        )
        dy_q, _ = numerics.quantize_grad_output(dy, backward, rowwise=True, columnwise=False, bgrad=False)
        results.append(
            (y, numerics.linear_dgrad(dy_q, w_saved, recipe, input_shape=tuple(x.shape), dtype=x.dtype))
        )
    return results[0], results[1]


@contextlib.contextmanager
def counted_weight_reads(*, cast_all: bool = False) -> Iterator[collections.Counter]:
    """How te_v2's FP8 linears got their weights while the block runs, under current scaling:
    "gathered" where they read the FP8 bytes FSDP2 gathered, "cast" where they cast the weight;
    with ``cast_all``, te_v2 casts every weight (``gathered_weights.find`` finds nothing)."""
    from te_v2_executor import gathered_weights
    from te_v2_executor.recipes import Scaling

    counts, find = collections.Counter(), gathered_weights.find

    def counting(w: torch.Tensor, recipe: RecipeSpec) -> Any:
        found = None if cast_all else find(w, recipe)
        counts["gathered" if found is not None else "cast"] += recipe.scaling is Scaling.CURRENT
        return found

    gathered_weights.find = counting
    try:
        yield counts
    finally:
        gathered_weights.find = find
