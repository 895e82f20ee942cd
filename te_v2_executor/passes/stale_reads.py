"""Pass ``stale_reads``: make a backward that would compute with the wrong values of a tensor
written in place raise: one that reads it after the write, as eager's raises, one through a
write Thunder differentiates as if it had not happened, and one through a write under
``torch.no_grad()`` Thunder differentiates as a cut (``view_writes``)."""

from __future__ import annotations

import itertools

from thunder.core import devices, dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, tracectx
from torch.utils._pytree import tree_flatten

from te_v2_executor.passes._trace import before_return, returned_grads, spliced, with_bound_symbols
from te_v2_executor.passes._writes import Writes, describe, written_tensor
from te_v2_executor.passes.view_writes import (
    bypassed_writes,
    gradient_writes_into_inputs,
    no_grad_writes_read,
    writes_into_inputs_with_gradient,
    written_inputs_returned,
)
from te_v2_executor.symbols import REFUSE_BACKWARD, SAME_VIEWS, SHARES_STORAGE

_BYPASSED_WRITE = (
    "te_v2: {tensor} is read by {reader} after {writer} wrote into its storage through another "
    "name of it (a slice or view of it, or the tensor it is a view of). Thunder differentiates "
    "that read as if the write had not happened, so the gradients would be silently wrong. Write "
    "through the tensor itself (`h[:, :4] = h[:, :4] * 3` rather than `h[:, :4].mul_(3)`) or out "
    "of place (`torch.where`, `torch.cat`), or run this without gradients."
)
_INPUT_WRITE = (
    "te_v2: {tensor}, which requires grad, is written in place by {writer} (itself, or through "
    "another name Thunder takes for it: a view, a cast of it). Thunder 0.2.6 "
    "differentiates a write into an input that requires grad wrong (the input's gradient, or that "
    "of what the write reads, comes out None or without the write's factor), so the gradients would "
    "be silently wrong. Write into a copy (`x = x * 3`, or `x = x.clone()` first), pass an input "
    "that does not require grad, or call it under torch.no_grad()."
)
_RETURNED_INPUT_WRITE = (
    "te_v2: {tensor}, which does not require grad, is returned after {writer} wrote a value that "
    "does into it in place. Thunder 0.2.6 returns such an input as the caller passed it, without "
    "the write's autograd history, so the gradient through that output would be silently lost. "
    "Return a new tensor (`x = x + v` rather than `x.add_(v)`, or `return x.clone()`), or pass an "
    "input that requires grad into a copy of it."
)
_GRADIENT_WRITE = (
    "te_v2: {tensor}, which does not require grad, is written in place by {writer} with a value "
    "that does. Eager gives the caller's tensor the write's autograd history; Thunder 0.2.6 writes "
    "into it without any, so a gradient through it after the call (Dynamo returns such an input "
    "itself) would be silently lost. Return a new tensor (`x = x + v` rather than `x.add_(v)`), or "
    "write a value without gradient (`x.copy_(v.detach())`)."
)
_NO_GRAD_WRITE = (
    "te_v2: {tensor} is read by {reader} after {writer} wrote into it under torch.no_grad(). "
    "Thunder differentiates what reads it after such a write as a tensor without gradient, where "
    "eager differentiates it as it was before the write, so the gradients would be silently "
    "wrong. Write out of place with the gradient you mean (`h = h + (h.clamp(-1, 1) - h).detach()` "
    "passes the gradient through as eager does)."
)


# The Thunder compile option ``te_v2_executor.thunderfx`` sets on its regions: each runs eagerly
# where te_v2 refuses it (``dynamo.EagerOnRefusal``).
EAGER_FALLBACK_OPTION = "te_v2_eager_fallback"


class RefusedProgram(RuntimeError):
    """A forward te_v2 refuses while compiling it, before anything of it runs, because Thunder
    0.2.6 would differentiate it wrong without a word. ``te_v2_executor.thunderfx`` runs such a
    region as Dynamo captured it, eagerly, instead (``dynamo.EagerOnRefusal``)."""


_ALIASED_INPUTS = (
    "te_v2: inputs {names} of the compiled function share one storage (the same tensor passed "
    "twice, or views of one tensor), and the function writes in place. Thunder 0.2.6 then reads "
    "every input of such a group as the group's first one, reshaped, and returns the first one's "
    "gradient for each, so values and gradients would be silently wrong (`f(x[:, :2], x[:, 2:])` "
    "computes with `x[:, :2]` twice). Pass tensors of their own (`.clone()` all but one), or write "
    "out of place."
)


def refuse_aliased_inputs(trace: TraceCtx, aliased: list[list[int]]) -> TraceCtx:
    """``trace``, or an error where inputs share storage when it is compiled (``aliased``: groups
    of positions among its flattened arguments, as Thunder's cache records them) and it writes in
    place: Thunder 0.2.6's ``insert_alias_updates`` then replaces each input of a group with the
    group's first, which is the same tensor only where both are one view, and even then hands
    each position the whole gradient (twice eager's for ``f(x, x)``). A copy of a tensor into
    itself counts as a write, as Thunder's replacement counts it; without writes Thunder keeps
    such inputs apart, and gets them right.

    Without gradients a group of inputs of one shape (``f(x, x)``) runs: ``te_v2_same_views``
    checks at each call that they are one view (Thunder's cache would reuse the trace for
    ``x[:, :2], x[:, 2:]``) and raises otherwise. With gradients every such group is refused,
    ``v`` and ``v.detach()`` too (thunderfx's split hands a region both): Thunder's split would
    move a check that returns nothing into the backward."""
    if not aliased or not any(
        written_tensor(b) is not None or b.sym.name in ("copy_", "update_aliases")
        for b in trace.bound_symbols
    ):
        return trace
    flat = tree_flatten((trace.args, trace.kwargs))[0]
    checks = []
    for group in aliased:
        tensors = [flat[i] for i in group if i < len(flat) and isinstance(flat[i], TensorProxy)]
        message = _ALIASED_INPUTS.format(names=", ".join(t.name for t in tensors))
        if len(tensors) != len(group) or len({tuple(t.shape) for t in tensors}) > 1 or _with_gradients(trace):
            raise RefusedProgram(message)
        checks.append(SAME_VIEWS.bind(*tensors, message=message, output=None))
    unpacked = next((i for i, b in enumerate(trace.bound_symbols) if not b.sym.name.startswith("unpack")), 0)
    return with_bound_symbols(
        trace, [*trace.bound_symbols[:unpacked], *checks, *trace.bound_symbols[unpacked:]]
    )


def _with_gradients(trace: TraceCtx) -> bool:
    """Whether ``trace`` is a joint trace, forward and backward, whose return holds ``fw_flat_out``."""
    ret = trace.bound_symbols[-1].args[0]
    return isinstance(ret, dict) and "fw_flat_out" in ret


def _refuse_lost_gradients(trace: TraceCtx) -> None:
    """Raises where Thunder differentiated a program with gradients to nothing at all while the
    forward reads a written storage that carries gradient through another name (``view_writes``):
    Thunder then drops the gradient of that read, and with no backward there is nothing to refuse
    it in (``x0.to(torch.bfloat16).view(...)`` returned after a ``copy_`` into the cast: eager's
    output requires grad, Thunder's does not)."""
    if not _with_gradients(trace):
        return
    if (bypass := next(bypassed_writes(trace), None)) is not None:
        message = describe(Writes(trace), bypass, _BYPASSED_WRITE)
        raise RefusedProgram(
            f"{message} Here Thunder computes no gradient at all, so the forward is refused."
        )


def refuse_writes_into_inputs_with_gradient(trace: TraceCtx, *, dynamo_region: bool = False) -> TraceCtx:
    """``trace``, or an error where the forward of a trace with gradients writes in place into an
    input that requires grad (``view_writes.writes_into_inputs_with_gradient``), or returns an
    input that does not after writing a value that does into it (``written_inputs_returned``).
    The forward is refused, not only the backward: an input the function returns written is
    handed back to the caller as it is, with its autograd history from before the call, so no
    backward of Thunder's runs to refuse the write's gradient in (``x.add_(r); return x``: ``r``
    silently got none). In a ``dynamo_region`` (a thunderfx region), any write of a value that
    requires grad into an input that does not is refused (``gradient_writes_into_inputs``):
    Dynamo may return that input itself, which the trace does not show."""
    if not _with_gradients(trace):
        return trace
    if (write := next(writes_into_inputs_with_gradient(trace), None)) is not None:
        raise RefusedProgram(describe(Writes(trace), write, _INPUT_WRITE))
    if dynamo_region and (write := next(gradient_writes_into_inputs(trace), None)) is not None:
        raise RefusedProgram(describe(Writes(trace), write, _GRADIENT_WRITE))
    if (write := next(written_inputs_returned(trace), None)) is not None:
        raise RefusedProgram(describe(Writes(trace), write, _RETURNED_INPUT_WRITE))
    return trace


def refuse_stale_reads(trace: TraceCtx, *, eager_fallback: bool = False) -> TraceCtx:
    """Make a backward that would compute with the wrong values of a tensor written in place raise.

    Thunder's backward reads what the forward saved by its storage, so a write into it after the
    save changes the gradient, silently; eager's backward raises there. A read through another
    name of a written storage than the write's own is differentiated as if the write had not
    happened (``view_writes``), where the two names do share storage when it runs: a
    ``te_v2_shares_storage`` before the read says so (a ``reshape`` that copied does not). The
    forward still runs, and a ``te_v2_refuse_backward`` that reads the returned gradients (so that
    Thunder's split puts it at the end of the backward, before they are returned) raises the error
    naming the tensor and the write. The forward is otherwise Thunder's and is left as it is.

    With ``eager_fallback`` (a region ``te_v2_executor.thunderfx`` runs eagerly where refused), a
    program eager differentiates right, through a write under no_grad or one through another
    name, is refused when compiled (``RefusedProgram``), so that the region runs eagerly from its
    first call; one whose backward eager refuses as well still runs until its backward raises."""
    grads = returned_grads(trace)
    if not grads:
        _refuse_lost_gradients(trace)
        return trace
    writes = Writes(trace)
    if eager_fallback and (
        message := next(
            itertools.chain(
                (describe(writes, cut, _NO_GRAD_WRITE) for cut in no_grad_writes_read(trace)),
                (describe(writes, bypass, _BYPASSED_WRITE) for bypass in bypassed_writes(trace)),
            ),
            None,
        )
    ):
        raise RefusedProgram(message)
    refusals = itertools.chain(
        (describe(writes, s) for s in writes.stale_backward_reads()),
        (describe(writes, cut, _NO_GRAD_WRITE) for cut in no_grad_writes_read(trace)),
    )
    if message := next(refusals, None):
        return before_return(trace, REFUSE_BACKWARD.bind(grads, (), messages=(message,), output=None))
    checks: dict[tuple[str, str], tuple[BoundSymbol, str]] = {}
    inserted: dict[int, list[BoundSymbol]] = {}
    for bypass in bypassed_writes(trace):
        target = written_tensor(bypass.writer)
        if (bypass.tensor.name, target.name) in checks:
            continue
        with tracectx(trace):
            flag = TensorProxy(like=bypass.tensor, shape=(), device=devices.cpu, dtype=dtypes.bool8)
        check = SHARES_STORAGE.bind(bypass.tensor, target, output=flag)
        checks[bypass.tensor.name, target.name] = (check, describe(writes, bypass, _BYPASSED_WRITE))
        inserted.setdefault(writes.position(bypass.reader), []).append(check)
    if not checks:
        return trace
    flags, messages = zip(*((c.output, m) for c, m in checks.values()), strict=True)
    refuse = REFUSE_BACKWARD.bind(grads, flags, messages=messages, output=None)
    return before_return(with_bound_symbols(trace, spliced(trace, {}, inserted=inserted)), refuse)
