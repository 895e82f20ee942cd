"""In-place writes against te_v2's passes: no fold moves a read past a write, a backward that
reads a tensor written after it was saved raises as eager's does, one that Thunder would
differentiate past a write through a view raises, an output written through a view is returned
written, and an output written in place still carries the forward flush."""

from __future__ import annotations

import warnings

import pytest
import thunder
import thunder.torch as ltorch
import torch
from thunder.dynamo import thunderfx
from thunder.executors import torchex
from thunder.executors.torch_compile import torch_compile_ex
from torch import nn
from torch.utils.checkpoint import checkpoint

from te_v2_executor import ClaimPolicy, TEv2FallbackWarning, current_scaling, explain, make_te_v2
from te_v2_executor.passes._writes import Writes, _auto_registered_function, written_tensor
from te_v2_executor.passes.stale_reads import RefusedProgram
from te_v2_executor.symbols import UNQUANTIZED_FWD, arg
from tests.helpers import CLAIM_ALL, assert_like_eager, bsyms_of, forward_trace
from tests.models import (
    SavedThenWritten,
    SumBesideAWrite,
    WriteAfterAdapter,
    WriteIntoInputBeforeAdapter,
    WrittenGemmOutputTimesAWeight,
    WrittenThroughAnotherName,
)

# The default policy runs these 64- and 16-feature linears unquantized, in float32: te_v2 must
# compute what eager computes, up to the summation order of a GEMM that accumulates.
TOLS = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
@pytest.mark.parametrize("model", [WriteAfterAdapter, WriteIntoInputBeforeAdapter], ids=lambda m: m.__name__)
def test_no_fold_moves_a_gemm_past_an_in_place_write(model, grad):
    assert_like_eager(model(), torch.randn(32, 64), [make_te_v2(backend="reference")], grad=grad, **TOLS)


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
@pytest.mark.parametrize("model", [WriteAfterAdapter, WriteIntoInputBeforeAdapter], ids=lambda m: m.__name__)
def test_a_fuser_ordering_by_data_keeps_each_write_after_te_v2s_reads(model, grad):
    """thunderfx fuses with Thunder's dataflow partitioner, which orders by data dependencies
    alone: a write fused into a torch.compile region went before the te_v2 GEMM that read the
    tensor earlier (no fuser takes te_v2's symbols in), which then read the written values."""
    executors = [make_te_v2(backend="reference"), torch_compile_ex]
    assert_like_eager(model(), torch.randn(32, 64), executors, grad=grad, jit=thunderfx, **TOLS)


def test_a_write_waits_for_every_earlier_reader_not_only_te_v2s():
    """A sum Thunder fused beside a te_v2 GEMM read a's output, which is then halved in place: the
    dataflow partitioner put the write's region before the sum's, so the sum read halved values
    (found by ``python -m tests.fuzz --fuser torch.compile --seed 12``, program 39)."""
    executors = [make_te_v2(backend="reference", claim=ClaimPolicy(min_features=32)), torch_compile_ex]
    assert_like_eager(SumBesideAWrite(), torch.randn(64, 32), executors, grad=False, jit=thunderfx, **TOLS)


@pytest.mark.parametrize("jit", [thunder.jit, thunderfx], ids=["jit", "thunderfx"])
def test_no_fuser_recomputes_a_read_of_a_te_v2_output_written_in_place(jit):
    """The fused region wrote into the linear's output, its input; the fuser's rematerialization
    saved that input and recomputed ``v * -1`` from it in the backward, from the written values:
    ``w``'s gradient came out negated."""
    executors = [make_te_v2(backend="reference"), torch_compile_ex]
    assert_like_eager(
        WrittenGemmOutputTimesAWeight(), torch.randn(16, 64), executors, grad=True, jit=jit, **TOLS
    )


def test_the_fold_away_from_the_write_is_still_made():
    """Of B's and base's GEMMs, base's can take the sum without crossing the write: it does."""
    jitted = thunder.jit(WriteAfterAdapter(), executors=[make_te_v2(backend="reference")])
    jitted(torch.randn(32, 64))
    accumulating = [
        b for b in bsyms_of(forward_trace(jitted), UNQUANTIZED_FWD) if arg(b, "accumulate_into") is not None
    ]
    assert [b.kwargs["site"].split("(")[0] for b in accumulating] == ["t_base_weight"]


@pytest.mark.parametrize("through", ["tensor", "slice", "view"])
@pytest.mark.parametrize("claim", [ClaimPolicy(), ClaimPolicy(unquantized=False)], ids=["te_v2", "thunder"])
def test_a_backward_reading_a_tensor_written_after_it_was_saved_raises_as_eager_does(claim, through):
    model, x = SavedThenWritten(through=through), torch.randn(32, 64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    jitted = thunder.jit(model, executors=[make_te_v2(backend="reference", claim=claim)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TEv2FallbackWarning)
        y = jitted(x)
    torch.testing.assert_close(y, model(x), **TOLS)  # the forward runs, as eager's does
    model.zero_grad(set_to_none=True)
    with pytest.raises(
        RuntimeError, match=r"te_v2: tensor t\d+ .* modified by an in-place operation \(copy_ at"
    ):
        y.sum().backward()
    assert all(p.grad is None for p in model.parameters())


class _ActivationInPlace(nn.Module):
    """A linear, an activation of its output in place (``inplace=True``), a linear."""

    def __init__(self, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(getattr(nn.functional, self.activation)(self.a(x), inplace=True))


@pytest.mark.parametrize("activation", ["silu", "elu"])
def test_an_activation_in_place_whose_backward_reads_its_input_refuses_the_backward(activation):
    """Thunder traces ``F.silu(h, inplace=True)`` as the op itself, with no write, and its backward
    reads h, which then holds silu(h): a.weight's gradient came out wrong, no error, with or
    without te_v2 (eager's is right). The write is now seen, so te_v2 refuses that backward, as it
    did where Thunder traces the write as a ``copy_`` (ELU)."""
    model, x = _ActivationInPlace(activation), torch.randn(4, 16)
    model(x).square().sum().backward()
    expected = model.a.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    thunder.jit(model)(x).square().sum().backward()
    assert not torch.allclose(model.a.weight.grad, expected, **TOLS)  # Thunder alone: silently wrong
    model.zero_grad(set_to_none=True)
    y = thunder.jit(model, executors=[make_te_v2(backend="reference")])(x)
    torch.testing.assert_close(y, model(x), **TOLS)  # the forward runs, as eager's does
    with pytest.raises(RuntimeError, match=r"te_v2: tensor t\d+ .* modified by an in-place operation"):
        y.square().sum().backward()


@pytest.mark.parametrize("activation", ["relu", "hardtanh", "leaky_relu"])
def test_an_activation_in_place_whose_backward_reads_what_the_write_keeps_trains_as_eager(activation):
    """ReLU's backward reads only where its input was positive, which the write keeps."""
    assert_like_eager(
        _ActivationInPlace(activation),
        torch.randn(4, 16),
        [make_te_v2(backend="reference")],
        grad=True,
        **TOLS,
    )


def test_an_fp8_linear_saves_its_own_copy_so_a_later_write_is_harmless():
    """In FP8, b's wgrad reads the transposed FP8 copy its forward saved, not h: nothing to refuse."""
    model, x = SavedThenWritten(), torch.randn(32, 64)
    jitted = thunder.jit(model, executors=[make_te_v2(backend="reference", claim=CLAIM_ALL)])
    jitted(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_an_input_written_in_place_and_returned_carries_the_forward_flush():
    linear = nn.Linear(64, 64).requires_grad_(False)  # with a gradient, refused (test below)

    def write_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out.copy_(linear(x))
        return out

    jitted = thunder.jit(write_into, executors=[make_te_v2(backend="reference", claim=CLAIM_ALL)])
    x, out = torch.randn(32, 64), torch.zeros(32, 64)
    assert jitted(x, out) is out
    torch.testing.assert_close(out, linear(x), rtol=0.2, atol=0.2)
    (row,) = explain(jitted).linears
    assert row.recipe == "delayed"
    assert not torch.equal(row.state.scaling(forward=True).scale, torch.ones(2))  # flushed once


@pytest.mark.parametrize(
    ("name", "writes"),
    [("__getitem__", False), ("__matmul__", False), ("mul_", True), ("__imul__", True)],
)
def test_a_dunder_method_writes_only_when_it_is_an_in_place_one(name, writes):
    """thunderfx's traces call ``Tensor.__getitem__`` for indexing; read as an in-place op (its name
    ends in an underscore), every index marked its tensor written, and ``recompute_guard`` kept the
    indexed reads of a Hugging Face Llama out of the fusers' recomputation."""
    from thunder.core.proxies import TensorProxy
    from thunder.core.symbol import Symbol
    from thunder.core.trace import TraceCtx, tracectx

    with tracectx(TraceCtx()):
        t = TensorProxy(shape=(4,), device=thunder.devices.cpu, dtype=thunder.dtypes.float32)
        out = TensorProxy(like=t)
    bsym = Symbol(name=name, meta=None).bind(t, 0, output=out)
    assert (written_tensor(bsym) is t) is writes


class _DeadWriteIntoOutput(torch.nn.Module):
    """Frozen linears, one output written in place with another's and never read again (fuzzer
    seed 5, program 0, with torch.compile): the program returns its input's view."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = torch.nn.Linear(64, 16, bias=False)
        self.l1 = torch.nn.Linear(64, 32, bias=False)
        self.l2 = torch.nn.Linear(32, 16, bias=False)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.view(2, 16, 64)
        y = self.l2(self.l1(v))
        y.add_(self.l0(v))
        return v


def test_a_dead_write_into_a_linear_output_is_dropped_under_dataflow_fusion():
    """Thunder's dataflow fusion put the dead GEMMs and the write after the trace's return, which
    Thunder refused (an AssertionError in unwrap_return_value); te_v2 drops the write and what
    only it read."""
    te_v2 = make_te_v2(backend="reference", recipe=current_scaling(), claim=ClaimPolicy(min_features=32))
    jitted = thunder.jit(_DeadWriteIntoOutput(), executors=[te_v2, torch_compile_ex], fusion_type="dataflow")
    x = torch.randn(32, 64)
    assert torch.equal(jitted(x), x.view(2, 16, 64))


class _DeadWritesAfterAnInputWrite(torch.nn.Module):
    """An input halved in place, then a sum of it written twice in place and never read again
    (fuzzer seed 2041, program 33, with torch.compile, shrunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = torch.nn.Linear(64, 16, bias=False)
        self.requires_grad_(False)

    def forward(self, x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
        x1.mul_(0.5)
        v = x0 + x1
        y = self.l0(v)
        u = v * 3
        v.add_(x1)
        v.mul_(2)
        return y + u[:, :16]


def test_a_dead_write_after_an_input_write_leaves_the_input_written_once():
    """The fusers' rematerialization recomputed the dead writes' operands in their region, the
    input's halving included, so ``x1`` came out quartered; te_v2 drops both dead writes."""
    model = _DeadWritesAfterAnInputWrite()
    te_v2 = make_te_v2(backend="reference", recipe=current_scaling())
    jitted = thunder.jit(model, executors=[te_v2, torch_compile_ex], fusion_type="dataflow")
    x0, x1 = torch.randn(32, 64), torch.randn(32, 64)
    ex0, ex1 = x0.clone(), x1.clone()
    torch.testing.assert_close(jitted(x0, x1), model(ex0, ex1), **TOLS)
    assert torch.equal(x1, ex1) and torch.equal(x0, ex0)
    ran = [s for b in forward_trace(jitted).bound_symbols for s in (b.subsymbols if b.sym.is_fusion else [b])]
    assert [b.sym.name for b in ran if written_tensor(b) is not None] == ["mul_"]


@pytest.mark.parametrize("claim", [ClaimPolicy(), CLAIM_ALL], ids=["default", "fp8"])
@pytest.mark.parametrize("way", WrittenThroughAnotherName.REFUSED)
def test_a_read_through_another_name_of_a_written_storage_refuses_the_backward(way, claim):
    """Thunder differentiates a read of a storage through another name than the write's (the
    written slice's base, another view) as if the write had not happened: the gradients came
    out silently wrong, with every linear claimed in FP8 too (a.weight's off by 23 of 32)."""
    _assert_backward_refused(way, claim, r"(through another name of it|modified by an in-place operation)")


@pytest.mark.parametrize("claim", [ClaimPolicy(), CLAIM_ALL], ids=["default", "fp8"])
def test_a_read_after_a_whole_tensor_write_under_no_grad_refuses_the_backward(claim):
    """``with torch.no_grad(): h.clamp_(...)`` then ``b(h)``: Thunder differentiates the written h
    as a tensor without gradient, so a's weight got only what eager's autograd sends it through
    the other paths, nothing here (eager takes the write's derivative to be the identity)."""
    _assert_backward_refused(
        "no_grad whole", claim, r"after copy_ at .* wrote into it under torch.no_grad\(\)"
    )


class _BufferUpdatedUnderNoGrad(nn.Module):
    """A buffer written from the activations under ``torch.no_grad()``, as a running statistic
    is, then read beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.register_buffer("mean", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.copy_(x.mean(0))
        return self.a(x + self.mean)


def test_a_buffer_without_gradient_written_under_no_grad_trains_as_eager():
    """The write gives the buffer no gradient, in eager mode as in Thunder: it was refused as one
    that Thunder differentiates as a tensor without gradient where eager would not (found by an
    adversarial helper)."""
    assert_like_eager(
        _BufferUpdatedUnderNoGrad(),
        torch.randn(4, 16, requires_grad=True),
        [make_te_v2(backend="reference")],
        grad=True,
        **TOLS,
    )


class _WriteAroundNoGrad(nn.Module):
    """A write that Thunder differentiates as if it had not happened, around an op under
    ``torch.no_grad()``: read under no_grad through a view of the written tensor ("read"), or
    through a checkpointed frozen linear of that view ("read by a frozen linear"), or into a
    tensor made under no_grad, read by a frozen linear and returned ("made")."""

    def __init__(self, way: str) -> None:
        super().__init__()
        self.way = way
        self.a, self.b = nn.Linear(64, 64, bias=False), nn.Linear(64, 16, bias=False)
        self.c = nn.Linear(64, 64, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.a(x)
        if self.way in ("read", "read by a frozen linear"):
            v = h.view(4, 8, 64)
            h.mul_(-1.0)
            if self.way == "read by a frozen linear":
                v = checkpoint(self.c, v, use_reentrant=False)
            with torch.no_grad():
                u = self.a(v)
            return (self.b(u),)
        with torch.no_grad():
            u = self.a(h)
        v = nn.functional.dropout(u, p=0.0)
        y = self.b(self.c(v))
        v.mul_(-1.0)
        return y, u


@pytest.mark.parametrize("way", ["read", "read by a frozen linear", "made"])
def test_a_write_around_an_op_under_no_grad_carries_no_gradient_and_trains_as_eager(way):
    """No gradient flows through what runs under no_grad, nor to what only it reads, so Thunder
    differentiating the write as if it had not happened changes nothing: all three were refused
    (fuzz seeds 20261209 program 25, 20261208 program 138)."""
    assert_like_eager(
        _WriteAroundNoGrad(way), torch.randn(32, 64), [make_te_v2(backend="reference")], grad=True, **TOLS
    )


class _CopiedOverTwice(nn.Module):
    """``x`` written through ``v``, which is ``x`` itself, then copied over again."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32, bias=False), nn.Linear(8, 32, bias=False)
        self.c = nn.Linear(32, 8, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        v = nn.functional.dropout(x, p=0.0)
        y = self.c(v)
        v.copy_(h)
        x.copy_(h)
        return self.b(y)


def test_a_copy_over_a_written_tensor_does_not_read_it():
    """``x.copy_(h)`` overwrites x without reading it, so it is no read of x after the write
    through ``v``: it was refused as one (fuzz seed 20261210, program 287)."""
    assert_like_eager(
        _CopiedOverTwice(), torch.randn(16, 32), [make_te_v2(backend="reference")], grad=True, **TOLS
    )


class _InputWrittenThroughAnAliasThenRead(nn.Module):
    """Fuzz seed 20261213, program 419: a write into the input through ``F.dropout(x, p=0.0)``,
    which is the input itself, before a linear reads the input."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = nn.functional.dropout(x, p=0.0)
        v.mul_(0.5)
        return self.a(x), v


def test_an_input_written_through_an_alias_before_its_first_read_trains_as_eager():
    """The linear reads the input after the write, in the forward and, through what it saved,
    in the backward: no read of values from before the write, as for a tensor an op made over
    its input's storage. It was refused as a stale backward read."""
    assert_like_eager(
        _InputWrittenThroughAnAliasThenRead(),
        torch.randn(16, 32),
        [make_te_v2(backend="reference")],
        grad=True,
        **TOLS,
    )


def _scaled_in_place(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x.mul_(3.0)
    return x


def _shifted_by_another(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x.add_(r)
    return x


def _through_a_no_op_cast(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    c = x.to(x.dtype)  # x itself
    c.mul_(3.0)
    return nn.functional.linear(c, w)


def _into_a_cast_read_before(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    c = x.to(torch.bfloat16)  # a copy, which Thunder renames with x
    f = c.float()
    c.mul_(-1.0)
    return nn.functional.linear(f, w)


WRITES_INTO_AN_INPUT = {
    "x.mul_(3); return x": _scaled_in_place,
    "x.add_(r); return x": _shifted_by_another,
    "x.to(x.dtype).mul_(3); linear": _through_a_no_op_cast,
    "c = x.to(bfloat16); linear(c.float()) after c.mul_(-1)": _into_a_cast_read_before,
}


@pytest.mark.parametrize("program", WRITES_INTO_AN_INPUT)
def test_a_write_into_an_input_that_requires_grad_is_refused(program):
    """Thunder 0.2.6 differentiates every in-place write into an input that requires grad (an
    activation passed in) wrong: a third of eager's gradient after ``x.mul_(3)``, none for ``r``
    after ``x.add_(r)``, none for ``x`` through ``x.to(x.dtype)``, and none for ``x`` where the
    write goes into a bfloat16 copy of it, which Thunder renames with ``x`` (fuzz ``--fuser
    inductor --seed 20261215`` program 173), silently. te_v2 refuses the forward with gradients;
    without them it runs, with eager's values."""
    fn = WRITES_INTO_AN_INPUT[program]
    g = torch.Generator().manual_seed(0)
    leaf, r, w = (torch.randn(16, 16, generator=g, requires_grad=True) for _ in range(3))
    eager = fn(leaf * 1.0, r, w)
    jitted = thunder.jit(fn, executors=[make_te_v2(backend="reference")])
    with pytest.raises(RuntimeError, match="which requires grad, is written in place by"):
        jitted(leaf * 1.0, r, w)
    with torch.no_grad():
        torch.testing.assert_close(jitted(leaf * 1.0, r, w), eager.detach(), **TOLS)


def test_thunder_alone_differentiates_a_write_into_an_input_wrong():
    """Why the refusal above: Thunder without te_v2 gives ``x.mul_(3); return x`` a third of
    eager's gradient. Should a Thunder release fix it, this fails, and the refusal can go."""
    grads = []
    for fn in (_scaled_in_place, thunder.jit(_scaled_in_place)):
        leaf = torch.ones(4, 4, requires_grad=True)
        fn(leaf * 1.0, None, None).square().sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1] * 3, grads[0])


def _returned_after_a_write(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x.add_(nn.functional.linear(r, w))
    return x * 0.3, x


def _returned_as_a_same_shape_view(
    x: torch.Tensor, r: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    x.copy_(nn.functional.linear(r, w))
    return x * 0.3, x.view(x.shape)


def _a_slice_returned_after_a_write(
    x: torch.Tensor, r: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    x.add_(nn.functional.linear(r, w))
    return x * 0.3, x[1:]


def _returned_after_a_write_without_gradient(
    x: torch.Tensor, r: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    y = nn.functional.linear(r, w)
    x.add_(y.detach())
    return y * 0.3, x


RETURNED_WRITTEN_INPUTS = {
    "x.add_(linear); return x * 0.3, x": (_returned_after_a_write, True),
    "x.copy_(linear); return x * 0.3, x.view(x.shape)": (_returned_as_a_same_shape_view, True),
    "x.add_(linear); return x * 0.3, x[1:]": (_a_slice_returned_after_a_write, False),
    "x.add_(linear.detach()); return y * 0.3, x": (_returned_after_a_write_without_gradient, False),
}


@pytest.mark.parametrize("program", RETURNED_WRITTEN_INPUTS)
def test_an_input_returned_after_a_write_with_gradient_is_refused(program):
    """An input that does not require grad, written in place with a value that does and returned
    as it is (or as a view of its own shape), loses the gradient through that output in Thunder
    0.2.6: the written input comes back as the caller passed it (fuzz seed 20261219 program 27,
    ``l0.weight.grad`` a tenth of eager's; seed 20261220 program 6, ``x1.grad`` None). te_v2
    refuses the forward; a slice of it returned, or a value without gradient written, Thunder
    differentiates right, and those run with eager's gradients."""
    fn, refused = RETURNED_WRITTEN_INPUTS[program]
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(16, 16, generator=g) for _ in range(2))
    w = torch.randn(16, 16, generator=g, requires_grad=True)
    eager = fn(x.clone(), r, w)
    (expected,) = torch.autograd.grad(sum(o.square().sum() for o in eager), w)
    jitted = thunder.jit(fn, executors=[make_te_v2(backend="reference")])
    if refused:
        with pytest.raises(RuntimeError, match="which does not require grad, is returned after"):
            jitted(x.clone(), r, w)
        return
    (got,) = torch.autograd.grad(sum(o.square().sum() for o in jitted(x.clone(), r, w)), w)
    torch.testing.assert_close(got, expected, **TOLS)


def test_thunder_alone_loses_the_gradient_of_a_written_input_returned():
    """Why the refusal above: Thunder without te_v2 returns the written input without the write's
    history, so the weight's gradient lacks that output's part. Should a Thunder release fix it,
    this fails, and the refusal can go."""
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(16, 16, generator=g) for _ in range(2))
    w = torch.randn(16, 16, generator=g, requires_grad=True)
    grads = []
    for fn in (_returned_after_a_write, thunder.jit(_returned_after_a_write)):
        outputs = fn(x.clone(), r, w)
        grads.append(torch.autograd.grad(sum(o.square().sum() for o in outputs if o.requires_grad), w)[0])
    torch.testing.assert_close(grads[1], grads[0] * 0.09 / 1.09)  # (0.3 x)^2 kept, x^2 lost


class _WriteAfterAGraphBreak(nn.Module):
    """Two regions: the second gets ``h`` from the first, an activation that requires grad, and
    writes into it in place before a linear reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        h.mul_(2.0)
        return self.b(h)


def test_te_v2s_thunderfx_runs_a_region_it_refuses_eagerly(dynamo_reset_after):
    """A region whose input, an activation a graph break hands over, is written in place is
    refused when compiled (Thunder 0.2.6 differentiates it wrong: both of ``a``'s gradients and
    ``x``'s below come out wrong without te_v2). Through ``te_v2_executor.thunderfx`` that region
    runs eagerly instead, with one warning naming it, and the step gets eager's gradients; the
    first region stays Thunder's. Through Thunder's own ``thunderfx`` the refusal stands."""
    import te_v2_executor

    torch.manual_seed(0)
    model, x = _WriteAfterAGraphBreak(), torch.randn(8, 32, requires_grad=True)

    def gradients(fn):
        for t in (*model.parameters(), x):
            t.grad = None
        fn(x).square().sum().backward()
        return [t.grad for t in (*model.parameters(), x)]

    expected = gradients(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = te_v2_executor.thunderfx(model, executors=[make_te_v2(backend="reference")])
        got = gradients(ours)
        again = gradients(ours)
    refusals = [w for w in caught if "runs eagerly" in str(w.message)]
    assert len(refusals) == 1 and issubclass(refusals[0].category, TEv2FallbackWarning)
    message = str(refusals[0].message)
    assert "region thunder_0 of Dynamo's graph 1 runs eagerly" in message and "which requires grad" in message
    for g, a, e in zip(got, again, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert [len(info.thunder_compiled_fns) for info in ours._backend.subgraph_infos] == [1, 0]
    torch._dynamo.reset()
    theirs = thunderfx(model, executors=[make_te_v2(backend="reference")])
    with pytest.raises(RefusedProgram, match="which requires grad, is written in place"):
        gradients(theirs)
    torch._dynamo.reset()
    thunders = gradients(thunderfx(model))
    assert not torch.equal(thunders[0], expected[0]) and not torch.equal(thunders[-1], expected[-1])


class _InputWrittenWithGradient(nn.Module):
    """Fuzz ``--fuser thunderfx --seed 20261223`` program 57: ``x0``, which does not require grad,
    gets a value that does, and Dynamo returns ``x0`` itself, not anything the region returns."""

    def forward(self, x0: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v1 = x0 + x1
        x0.copy_(v1)
        return v1, x0


def test_a_thunderfx_region_writing_a_gradient_into_an_input_is_refused(dynamo_reset_after):
    """Through thunderfx the trace does not return the written input (Dynamo does), so the rule
    for a written input returned does not see it: in a Dynamo region any write of a value with
    gradient into an input without is refused. ``te_v2_executor.thunderfx`` runs the region
    eagerly, with eager's gradients; Thunder's thunderfx with te_v2 raises; Thunder alone gives
    ``x1`` a wrong gradient."""
    import te_v2_executor

    model = _InputWrittenWithGradient()

    def gradient(fn):
        g = torch.Generator().manual_seed(0)
        x0, x1 = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g, requires_grad=True)
        v1, x0_after = fn(x0, x1)
        (v1.square().sum() + (x0_after * 3).sum()).backward()
        return x1.grad

    expected = gradient(model)
    with pytest.warns(TEv2FallbackWarning, match="which does not require grad, is written in place by"):
        got = gradient(te_v2_executor.thunderfx(model, executors=[make_te_v2(backend="reference")]))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch._dynamo.reset()
    with pytest.raises(RefusedProgram, match="which does not require grad, is written in place by"):
        gradient(thunderfx(model, executors=[make_te_v2(backend="reference")]))
    torch._dynamo.reset()
    assert not torch.equal(gradient(thunderfx(model)), expected)


def _scaled_sum_written(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = nn.functional.linear(a * 2 + b * 3, w)
    y.mul_(1.0)
    return y


def _scaled_sum(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(a * 2 + b * 3, w)


ALIASED_ARGUMENTS = {
    "x, x": lambda base: (base[:, :16],) * 2,
    "x[:, :16], x[:, 16:]": lambda base: (base[:, :16], base[:, 16:]),
}


@pytest.mark.parametrize("aliased", ALIASED_ARGUMENTS)
@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_inputs_sharing_storage_in_a_function_that_writes_in_place_are_refused(aliased, grad):
    """Thunder 0.2.6 reads each input of a group sharing storage as the group's first, where the
    function writes in place anywhere: ``f(x[:, :16], x[:, 16:])`` computes with ``x[:, :16]``
    twice, and ``f(x, x)`` gets twice eager's gradient. te_v2 refuses it with gradients; without,
    ``f(x, x)`` runs and each call checks that the inputs are one view, so the same trace called
    with two halves raises. Without the write, or with inputs of their own, it runs with eager's
    values."""
    g = torch.Generator().manual_seed(0)
    leaf = torch.randn(16, 32, generator=g, requires_grad=True)
    w = torch.randn(16, 16, generator=g)

    def call(fn, args_of):
        with torch.set_grad_enabled(grad):
            return fn(*args_of(leaf * 1.0), w)

    args_of = ALIASED_ARGUMENTS[aliased]
    jitted = thunder.jit(_scaled_sum_written, executors=[make_te_v2(backend="reference")])
    if grad:
        with pytest.raises(RefusedProgram, match="share one storage"):
            call(jitted, args_of)
    elif aliased == "x, x":
        torch.testing.assert_close(call(jitted, args_of), call(_scaled_sum_written, args_of), **TOLS)
        with pytest.raises(RuntimeError, match="share one storage"):
            call(jitted, ALIASED_ARGUMENTS["x[:, :16], x[:, 16:]"])
    else:
        with pytest.raises(RuntimeError, match="share one storage"):
            call(jitted, args_of)
    for fn, args in (
        (_scaled_sum, args_of),
        (_scaled_sum_written, lambda b: [t.clone() for t in args_of(b)]),
    ):
        expected = call(fn, args)
        got = call(thunder.jit(fn, executors=[make_te_v2(backend="reference")]), args)
        torch.testing.assert_close(got, expected, **TOLS)


def test_thunder_alone_reads_a_view_input_as_another():
    """Why the refusal above: Thunder without te_v2 computes ``f(x[:, :16], x[:, 16:])`` from
    ``x[:, :16]`` twice. Should a Thunder release fix it, this fails, and the refusal can go."""
    x, w = torch.randn(16, 32), torch.eye(16)
    with torch.no_grad():
        got = thunder.jit(_scaled_sum_written)(x[:, :16], x[:, 16:], w)
    torch.testing.assert_close(got, x[:, :16] * 5)


class _MadeThenWrittenThroughAnAlias(nn.Module):
    """Fuzz seed 20261216, program 479 (``maker="cast"``): a cast of the input written through
    ``F.dropout(v, p=0.0)``, which is the cast itself, before a linear reads the cast. With
    ``maker="exp"`` the tensor is made by ``exp``, whose backward reads it."""

    def __init__(self, maker: str) -> None:
        super().__init__()
        self.maker = maker
        self.a = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.to(torch.float64).float() if self.maker == "cast" else torch.exp(x)
        alias = nn.functional.dropout(v, p=0.0)
        alias.add_(v)
        return self.a(v)


class _InputWrittenThroughDropout(nn.Module):
    """Fuzz ``--fuser thunderfx --seed 20261224`` program 319: ``F.dropout(x0, p=0.0)`` is ``x0``
    itself, which Thunder takes for a copy, so its split dropped the write through it and the
    input came back without it; a trainable linear makes the trace one with gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(64, 64, bias=False).requires_grad_(False)
        self.l5 = nn.Linear(64, 8, bias=False)

    def forward(self, x0: torch.Tensor) -> tuple[torch.Tensor]:
        v1 = self.l1(x0)
        x0.mul_(-1.0)
        nn.functional.dropout(x0, p=0.0).copy_(v1)
        self.l5(x0)
        return (x0,)


@pytest.mark.parametrize("jit", [thunder.jit, thunderfx], ids=["jit", "thunderfx"])
def test_an_input_written_through_dropout_comes_back_written(jit, dynamo_reset_after):
    model = _InputWrittenThroughDropout()
    x = torch.randn(64, 64)
    expected_x = x.clone()
    (expected,) = model(expected_x)
    (got,) = jit(model, executors=[make_te_v2(backend="reference", claim=ClaimPolicy(min_features=512))])(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(x, expected_x, rtol=0, atol=0)


def test_a_cast_written_through_an_alias_before_its_first_read_trains_as_eager():
    """A cast's backward reads none of its values, so the linear's read after the write is where
    the weight gradient's values were taken: no stale read (it was refused as one)."""
    x = torch.randn(16, 32)
    assert_like_eager(
        _MadeThenWrittenThroughAnAlias("cast"), x, [make_te_v2(backend="reference")], grad=True, **TOLS
    )


def test_a_result_its_maker_reads_written_through_an_alias_refuses_the_backward():
    """``exp`` reads its result in its backward, which the write changed: eager raises, and so
    does te_v2's backward, where Thunder would use the written values."""
    x = torch.randn(16, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _MadeThenWrittenThroughAnAlias("exp")(x).sum().backward()
    jitted = thunder.jit(_MadeThenWrittenThroughAnAlias("exp"), executors=[make_te_v2(backend="reference")])
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        jitted(x).sum().backward()


class _CopiedIntoACastsView(nn.Module):
    """Fuzz seed 20261213, program 422: a copy of ``b`` into a cast of ``a``, returned through a
    view of the cast, so the output's values, and in eager its gradient, are ``b``'s."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        source = b.to(torch.bfloat16)
        cast = a.to(torch.bfloat16)
        view = cast.view(4, 16, 64)
        cast.copy_(source)
        return view


def test_a_write_thunder_differentiates_to_no_gradient_is_refused_in_the_forward():
    """Thunder's gradient transform gives the program above no gradient at all, so its output
    did not require grad where eager's does, and ``b`` silently got none; with no backward to
    refuse, te_v2 refuses the forward (Thunder alone fails in its backward with an assertion).
    The cast of ``a`` is one Thunder renames with ``a``, so the refusal of writes into an input
    that requires grad comes first; the read through another name with no gradient at all is
    refused after it."""
    a, b = (torch.randn(64, 64, requires_grad=True) for _ in range(2))
    _CopiedIntoACastsView()(a, b).float().sum().backward()
    assert b.grad is not None and b.grad.abs().sum() > 0
    jitted = thunder.jit(_CopiedIntoACastsView(), executors=[make_te_v2(backend="reference")])
    with pytest.raises(RuntimeError, match="which requires grad, is written in place by"):
        jitted(a, b)
    with torch.no_grad():
        torch.testing.assert_close(jitted(a, b), _CopiedIntoACastsView()(a, b), rtol=0, atol=0)


def _assert_backward_refused(way: str, claim: ClaimPolicy, match: str) -> None:
    """``WrittenThroughAnotherName(way)`` under te_v2: the forward runs (with eager's values where
    nothing is quantized), its backward raises an error matching ``match``, and no gradient is
    written."""
    model, x = WrittenThroughAnotherName(way), torch.randn(32, 64)
    jitted = thunder.jit(model, executors=[make_te_v2(backend="reference", claim=claim)])
    outputs = jitted(x)
    if claim is not CLAIM_ALL:
        torch.testing.assert_close(outputs, model(x), **TOLS)
    with pytest.raises(RuntimeError, match=match):
        sum(o.sum() for o in outputs).backward()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("jit", [thunder.jit, thunderfx], ids=["jit", "thunderfx"])
def test_an_output_written_through_a_slice_after_the_last_read_is_returned_written(jit):
    """Thunder renames a written storage's other names before each op that reads one, not before
    the return: ``h`` came back without the write into its slice, with no gradient (x needs none,
    and under no_grad) and with one (the split then put the write in the backward)."""
    for grad in (False, True):
        model = WrittenThroughAnotherName("returned slice").requires_grad_(grad)
        assert_like_eager(
            model, torch.randn(32, 64), [make_te_v2(backend="reference")], grad=False, jit=jit, **TOLS
        )


@pytest.mark.parametrize("way", WrittenThroughAnotherName.RIGHT)
def test_what_thunder_differentiates_right_is_not_refused(way):
    """``h[:, :8] = h[:, :8] * 3`` writes through h itself; a reshape of a transposed h copied, so
    the write is not in it: where they run, the storage check tells (no refusal)."""
    model = WrittenThroughAnotherName(way)
    assert_like_eager(model, torch.randn(32, 64), [make_te_v2(backend="reference")], grad=True, **TOLS)


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_an_input_written_through_a_view_is_written(grad):
    """The return lists the inputs by their names from before a write through a view of one, so
    Thunder's split left the write out: ``x[:, :4].mul_(3)`` did not reach x, silently."""
    linear = nn.Linear(16, 16)

    def write_into_a_slice(x: torch.Tensor) -> torch.Tensor:
        y = linear(x)
        x[:, :4].mul_(3.0)
        return y

    jitted = thunder.jit(write_into_a_slice, executors=[make_te_v2(backend="reference")])
    x = torch.randn(8, 16)
    expected_x = x.clone()
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(jitted(x), write_into_a_slice(expected_x), **TOLS)
    torch.testing.assert_close(x, expected_x, rtol=0, atol=0)


def test_a_region_input_written_through_a_view_is_returned_written(dynamo_reset_after):
    """thunderfx gave the region ``v`` as an input (the splitter put its ``detach`` outside), so
    the write through its slice was a write through a view of an input, and ``v`` came back
    without it (Thunder alone raises there). The region also gets ``v.detach()``, over ``v``'s
    storage, in a trace with gradients (the linear's): refused, so ``te_v2_executor.thunderfx``
    runs the region eagerly."""
    import te_v2_executor

    class DetachedRead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            v = x * 2
            y = self.l(v.detach() * 1)
            v[:, :4].mul_(3)
            return y, v

    model = DetachedRead()
    with pytest.warns(TEv2FallbackWarning, match="share one storage"):
        assert_like_eager(
            model,
            torch.randn(4, 16),
            [make_te_v2(backend="reference")],
            grad=False,
            jit=te_v2_executor.thunderfx,
            **TOLS,
        )


# Ops that return their input itself: Thunder's dropout decomposes into ``shallow_copy``; PyTorch
# runs ``alpha_dropout`` and ``positive``, which Thunder registered automatically.
RETURN_THEIR_INPUT = {
    "dropout p=0": lambda x: nn.functional.dropout(x, p=0.0),
    "dropout eval": lambda x: nn.functional.dropout(x, p=0.5, training=False),
    "alpha_dropout p=0": lambda x: nn.functional.alpha_dropout(x, p=0.0),
    "positive": torch.positive,
    "adjoint": torch.adjoint,
}


@pytest.mark.parametrize("op", RETURN_THEIR_INPUT.values(), ids=RETURN_THEIR_INPUT.keys())
def test_a_write_through_an_op_that_returns_its_input_reaches_the_input(op):
    """``F.dropout(x, p=0.0)`` returns ``x`` itself, so the write doubles ``x``; taken for a fresh
    tensor that nothing reads, it was dropped as dead, silently (fuzz seed 20261207, program
    117)."""
    te_v2 = make_te_v2(backend="reference", recipe=current_scaling(), claim=ClaimPolicy(min_features=512))

    def write_through(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        v = op(x)
        y = nn.functional.linear(x, w)
        v.mul_(2.0)
        return y

    x, w = torch.randn(64, 64), torch.randn(32, 64)
    expected_x, actual_x = x.clone(), x.clone()
    expected = write_through(expected_x, w)
    torch.testing.assert_close(thunder.jit(write_through, executors=[te_v2])(actual_x, w), expected, **TOLS)
    torch.testing.assert_close(actual_x, expected_x, rtol=0, atol=0)


def test_only_ops_registered_automatically_run_on_fake_tensors():
    """The torch executor names its symbols by the bare function name, which ops of other modules
    share (``torch.linalg.matmul`` runs as ``matmul``): keyed by that name, every matmul of a
    trace ran on fake tensors, taken for ``torch.linalg.matmul``."""
    for op, function in [(ltorch.positive, torch.positive), (ltorch.matmul, None)]:
        for sym in (op, torchex.ex.implmap[op.id].symbol):
            assert _auto_registered_function(sym) is function, sym.id


class _ReadThroughAnAliasAroundAWrite(nn.Module):
    """``v`` is ``h`` itself (``F.dropout(h, p=0.0)``); a linear reads ``v`` after ``h.add_(v)``
    doubled both ("after"), or before ``h.mul_(2)`` ("before")."""

    def __init__(self, when: str) -> None:
        super().__init__()
        self.when = when
        self.a = nn.Linear(32, 32, bias=False).requires_grad_(False)
        self.b = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        v = nn.functional.dropout(h, p=0.0)
        if self.when == "after":
            h.add_(v)
            return self.b(v)
        y = self.b(v)
        h.mul_(2.0)
        return y


def test_a_read_through_an_alias_after_a_write_trains_as_eager():
    """Thunder renames only the views it knows of after a write, so the forward reads ``v`` after
    the write under its old name, with the written values, as eager does; b's wgrad reads the
    same values. It was refused as a read of values written after ``v`` was made (fuzz seed
    20261208, program 32)."""
    model = _ReadThroughAnAliasAroundAWrite("after")
    assert_like_eager(model, torch.randn(8, 32), [make_te_v2(backend="reference")], grad=True, **TOLS)


class _ReadThroughAnAliasBetweenWrites(nn.Module):
    """Fuzz ``--fuser thunderfx --seed 20261224`` program 155, shrunk: ``v`` is the input itself
    (``F.dropout(x, p=0.0)``); the input is copied over, a linear reads ``v``, and the input is
    written again."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32).requires_grad_(False)
        self.b = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        v = nn.functional.dropout(x, p=0.0)
        x.copy_(h)
        y = self.b(v)
        x.mul_(-1.0)
        return y


def test_a_read_through_an_alias_between_writes_refuses_the_backward():
    """b's wgrad needs ``v`` as b read it, after the copy, which ``x.mul_(-1)`` then negated:
    eager raises. The linear reads ``v`` through ``te_v2_ordered`` (it waits for the copy), and
    that read was not taken for the forward's first read of ``v``, so b's weight gradient came out
    negated, silently, as Thunder alone computes it."""
    model = _ReadThroughAnAliasBetweenWrites()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(8, 32)).sum().backward()
    y = thunder.jit(model, executors=[make_te_v2(backend="reference")])(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match=r"te_v2: tensor t\d+ .* modified by an in-place operation"):
        y.sum().backward()


def test_a_read_through_an_alias_before_a_write_refuses_the_backward():
    """b's wgrad needs ``v`` as b read it, which ``h.mul_(2)`` then overwrote: eager raises."""
    model, x = _ReadThroughAnAliasAroundAWrite("before"), torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    y = thunder.jit(model, executors=[make_te_v2(backend="reference")])(x)
    with pytest.raises(RuntimeError, match=r"te_v2: tensor t\d+ .* modified by an in-place operation"):
        y.sum().backward()


NEW_TENSORS = {
    "dropout p=0.5": lambda x: nn.functional.dropout(x, p=0.5),
    "absolute": torch.absolute,
    "alpha_dropout p=0.5": lambda x: nn.functional.alpha_dropout(x, p=0.5, training=True),
}


@pytest.mark.parametrize(
    ("op", "aliases"),
    [*((op, True) for op in RETURN_THEIR_INPUT.values()), *((op, False) for op in NEW_TENSORS.values())],
    ids=[*RETURN_THEIR_INPUT, *NEW_TENSORS],
)
def test_only_an_op_that_returns_its_input_shares_its_storage(op, aliases):
    """An op that makes a new tensor does not share its input's storage: taking it for a view
    would refuse folds for nothing."""
    jitted = thunder.jit(lambda x: op(x) * 1.0)
    jitted(torch.randn(4, 4))
    trace = thunder.last_traces(jitted)[0]
    made = next(b for b in trace.bound_symbols if b.sym.name not in ("unpack_trivial", "mul"))
    assert Writes(trace).same_storage(made.output, made.args[0]) is aliases


class _WriteThroughAViewThenThroughTheTensor(nn.Module):
    """``v`` is ``x`` (a dropout of probability 0 returns a view); ``v.add_(x)`` doubles ``x``,
    which ``x.mul_(0.5)`` then halves back (fuzz seed 6001, program 134)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(32, 16, bias=False).requires_grad_(False)
        self.l2 = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = nn.functional.dropout(x, p=0.0)
        h = self.l1(v)
        v.add_(x)
        y = self.l2(h)
        x.mul_(0.5)
        return y


def test_a_read_after_a_write_that_waits_for_te_v2_waits_for_the_write():
    """The first write waits for the te_v2 GEMM that read x before it; the second write's read of
    x, which Thunder ties to the first by trace order only, went into a region before the first
    write under dataflow fusion: x came out halved instead of unchanged."""
    te_v2 = make_te_v2(backend="reference", recipe=current_scaling(), claim=ClaimPolicy(min_features=512))
    model = _WriteThroughAViewThenThroughTheTensor()
    jitted = thunder.jit(model, executors=[te_v2, torch_compile_ex], fusion_type="dataflow")
    x = torch.randn(64, 32)
    expected_x, actual_x = x.clone(), x.clone()
    expected = model(expected_x)
    torch.testing.assert_close(jitted(actual_x), expected, rtol=0, atol=0)
    torch.testing.assert_close(actual_x, expected_x, rtol=0, atol=0)


class _CopyIntoAnActivationReadBefore(nn.Module):
    """``v.copy_(x)`` writes v, not x: the write must wait for ``l0(v)``, which the shape rule
    leaves to Thunder (24 outputs) and the fuser then put after the write (fuzz seed 6001,
    program 402)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(64, 24, bias=False).requires_grad_(False)
        self.l1 = nn.Linear(64, 16, bias=False).requires_grad_(False)
        self.l2 = nn.Linear(16, 24, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        doubled = x + x
        x.mul_(-1.0)
        v = nn.functional.silu(doubled) * x
        y = self.l0(v)
        v.copy_(x)
        return y + self.l2(self.l1(v))


def test_tensor_copy_writes_its_first_argument():
    te_v2 = make_te_v2(backend="reference", recipe=current_scaling(), claim=ClaimPolicy(min_features=512))
    model = _CopyIntoAnActivationReadBefore()
    jitted = thunder.jit(model, executors=[te_v2, torch_compile_ex], fusion_type="dataflow")
    x = torch.randn(4, 8, 64)
    torch.testing.assert_close(jitted(x.clone()), model(x.clone()), rtol=1e-5, atol=1e-5)


class _DeadReadThroughAnotherName(nn.Module):
    """``v`` is ``h`` (a dropout of probability 0 returns a view); ``v.copy_(...)`` writes ``h``,
    which ``g.add_(h)`` then reads by its first name, a read Thunder differentiates as if the
    write had not happened, but whose result nothing reads: ``g`` is not read after it (fuzz seed
    7001, program 145)."""

    def __init__(self) -> None:
        super().__init__()
        self.l2 = nn.Linear(16, 32, bias=False)
        self.l6 = nn.Linear(32, 32, bias=False).requires_grad_(False)
        self.l7 = nn.Linear(32, 16, bias=False).requires_grad_(False)
        self.l8 = nn.Linear(16, 32, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l2(x)
        g = self.l6(h)
        v = nn.functional.dropout(h, p=0.0)
        w = self.l8(self.l7(v))
        v.copy_(w)
        y = g + w
        g.add_(h)
        return y


def test_a_dead_read_through_another_name_is_not_refused():
    """A write nothing reads afterwards is dropped before the stale reads are judged, with the
    read only it used, so the backward computes eager's gradient instead of refusing."""
    te_v2 = make_te_v2(backend="reference", recipe=current_scaling(), claim=ClaimPolicy(min_features=512))
    model = _DeadReadThroughAnotherName()
    jitted = thunder.jit(model, executors=[te_v2, torch_compile_ex], fusion_type="dataflow")
    x = torch.randn(2, 16, 16)
    jitted(x).square().sum().backward()
    grad, model.l2.weight.grad = model.l2.weight.grad, None
    model(x).square().sum().backward()
    torch.testing.assert_close(grad, model.l2.weight.grad, rtol=1e-5, atol=1e-5)


class _SelfCopy(nn.Module):
    """``x.copy_(x)`` between a view of ``x`` and the linear that reads the view (fuzz seed 7001,
    program 380, shrunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(48, 48, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = nn.functional.dropout(x, p=0.0)
        x.copy_(x)
        return self.l(v)


def test_a_copy_of_a_tensor_into_itself_writes_nothing():
    """It changes no value, so the wgrad's read of the input after it is not refused as stale."""
    te_v2 = make_te_v2(backend="reference", recipe=current_scaling(), claim=ClaimPolicy(min_features=512))
    model = _SelfCopy()
    jitted = thunder.jit(model, executors=[te_v2, torch_compile_ex], fusion_type="dataflow")
    x = torch.randn(32, 48)
    jitted(x.clone()).square().sum().backward()
    grad, model.l.weight.grad = model.l.weight.grad, None
    model(x.clone()).square().sum().backward()
    torch.testing.assert_close(grad, model.l.weight.grad, rtol=1e-5, atol=1e-5)


class _CopyThenWriteTheSource(nn.Module):
    """``x.copy_(v)``, then ``v.add_(x)`` with ``v`` a linear's output (fuzz seed 7002, program
    39)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(64, 64, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.l0(x)
        x.copy_(v)
        v.add_(x)
        return v


@pytest.mark.parametrize("fusion_type", [None, "dataflow"])
def test_a_write_into_a_copys_source_runs_in_another_region_than_the_copy(fusion_type):
    """te_v2's GEMM leaves ``v`` an input of the region after it, and TorchInductor, given the copy
    and the write in one region, stored ``v``'s new value into ``x`` too: ``x`` came out twice
    ``v``, silently. The write now reads ``v`` through ``te_v2_ordered``, which no fuser takes in."""
    te_v2 = make_te_v2(backend="reference", recipe=current_scaling(), claim=ClaimPolicy(min_features=512))
    model = _CopyThenWriteTheSource()
    options = {"fusion_type": fusion_type} if fusion_type else {}
    jitted = thunder.jit(model, executors=[te_v2, torch_compile_ex], **options)
    x = torch.randn(4, 8, 64)
    expected_x, actual_x = x.clone(), x.clone()
    expected = model(expected_x)
    torch.testing.assert_close(jitted(actual_x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual_x, expected_x, rtol=1e-5, atol=1e-5)
