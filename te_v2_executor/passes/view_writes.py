"""Pass ``view_writes``: a write through one name of a storage, then read through another (the
base of a written slice, another view of it), which Thunder 0.2.6 orders only for the ops it
renames, and differentiates as if the write had not happened.

Thunder renames a written storage's aliases (``update_aliases``) before each op that reads one
after the write, so that the op waits for the write; it skips the trace's return. ``v = x * 2;
y = l(v); v[:, :4].mul_(3); return y, v`` returns ``v`` under its name from before the write,
which nothing orders after the write: Thunder's split into forward and backward put the write in
the backward, and the returned ``v`` lacked it, silently; a write through a view of an input
(``x[:, :4].mul_(3)``), which the return's list of inputs names from before the write, was lost
the same way, with or without gradients, and so was one through a view Thunder takes for a copy
(``ravel``). ``order_stale_reads`` has every such read wait for the write, as the renamed
readers do.

Thunder's gradient transform takes ``update_aliases`` to be the identity. The gradient of a value
read through another name than the write's own then reaches what the storage held before the
write, as if the write had not happened (``w = lin.weight * 1.0; w[0].zero_(); F.linear(x, w)``
gives row 0 of the weight a gradient), and the write's source gets none through it.
``bypassed_writes`` finds such reads where a gradient may flow through them, for ``stale_reads``
to refuse the backward. Under ``torch.no_grad()`` it is the other way round: the write's own
name (``h`` after ``h.mul_(2)``) is differentiated as a tensor without gradient, where eager
differentiates it as before the write, and the base of a written slice is right;
``no_grad_writes_read`` finds those reads. Writing through the base itself (``h[:, :4] =
h[:, :4] * 3``, Thunder's ``setitem``) or out of place (``torch.where``, ``torch.cat``) is
differentiated right.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from thunder.core import utils
from thunder.core.proxies import ProxyTag, TensorProxy, variableify
from thunder.core.pytree import tree_flatten, tree_map
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from te_v2_executor.passes._trace import is_cast, ordered_read, replaced
from te_v2_executor.passes._writes import StaleRead, Writes, copy_source, reads_values, written_tensor
from te_v2_executor.symbols import in_backward

# The keys of a trace's return that hold what the forward returns: a joint trace's ``output``
# holds the gradients instead.
_FORWARD_OUTPUTS = {True: ("fw_flat_out",), False: ("output", "flat_output")}


def _returned(trace: TraceCtx, *, inputs: bool = False) -> tuple[dict, tuple[str, ...]]:
    """The return's dictionary, and the keys of it that hold the forward's outputs (and, with
    ``inputs``, its inputs as the call leaves them, ``flat_args``)."""
    ret = trace.bound_symbols[-1].args[0]
    if not isinstance(ret, dict):
        return {}, ()
    keys = _FORWARD_OUTPUTS["fw_flat_out" in ret] + (("flat_args",) if inputs else ())
    return ret, tuple(k for k in keys if k in ret)


def _forward_outputs(trace: TraceCtx, *, inputs: bool = False) -> list[TensorProxy]:
    """The tensors the forward of ``trace`` returns (not the gradients; its inputs with ``inputs``)."""
    ret, keys = _returned(trace, inputs=inputs)
    return [t for k in keys for t in tree_flatten(ret[k])[0] if isinstance(t, TensorProxy)]


def _forward_writes(writes: Writes, p: TensorProxy, before: int) -> list[BoundSymbol]:
    """The forward's writes into ``p``'s storage after ``p`` was made, before position ``before``."""
    found = (writes.bound_symbols[k] for k in writes.written_since_made(p, before))
    return [w for w in found if not in_backward(w)]


def order_stale_reads(trace: TraceCtx) -> TraceCtx:
    """``trace`` with each forward read of a tensor under a name from before a write into its
    storage made through ``te_v2_ordered`` after the last such write, which it waits for.

    Thunder renames a written storage's aliases before each op that reads one, but not in the
    return (its outputs, and its inputs as ``flat_args`` lists them for the split and autograd:
    ``x[:, :4].mul_(3)`` on an input was dropped) nor the aliases it takes for copies
    (``h.ravel()[:8].mul_(3); b(h)``: b read h before the write, which the split then dropped).
    A returned tensor counts as made where the tensor it renames was (``update_aliases``): Thunder
    renames an input after a write through an alias it takes for a copy (``F.dropout(x, p=0.0)``,
    the input itself) from the name before that write, and its split then dropped the write, so
    the input came back unwritten (fuzz ``--fuser thunderfx --seed 20261224`` program 319)."""
    writes = Writes(trace)
    ordered: dict[tuple[str, int], TensorProxy] = {}
    inserted: dict[int, list[BoundSymbol]] = {}

    def waiting(p: TensorProxy, before: int, *, renamed: bool = False) -> TensorProxy | None:
        p = writes.renamed_from(p) if renamed else p
        written = _forward_writes(writes, p, before)
        markers = [t for t in written[-1].flat_proxy_outs if isinstance(t, TensorProxy)] if written else []
        if not markers:
            return None
        key = (p.name, writes.position(written[-1]))
        if key not in ordered:
            wait, ordered[key] = ordered_read(trace, p, markers[:1])
            inserted.setdefault(key[1] + 1, []).append(wait)
        return ordered[key]

    def swaps(tensors: list[TensorProxy], before: int, *, renamed: bool = False) -> dict[Any, TensorProxy]:
        return {variableify(p): q for p in tensors if (q := waiting(p, before, renamed=renamed)) is not None}

    swapped: dict[int, BoundSymbol] = {}
    for at, reader in enumerate(trace.bound_symbols[:-1]):
        if in_backward(reader) or not reads_values(reader):
            continue
        if swap := swaps([p for p in reader.flat_proxy_args if isinstance(p, TensorProxy)], at):
            swapped[id(reader)] = reader.from_bsym_swap_proxies(swap, skip_output=True)
    ret_bsym = trace.bound_symbols[-1]
    if swap := swaps(_forward_outputs(trace, inputs=True), len(trace.bound_symbols) - 1, renamed=True):
        ret, keys = _returned(trace, inputs=True)
        renamed = {
            k: tree_map(lambda v: swap.get(variableify(v), v) if isinstance(v, TensorProxy) else v, ret[k])
            for k in keys
        }
        swapped[id(ret_bsym)] = ret_bsym.from_bsym(args=({**ret, **renamed}, *ret_bsym.args[1:]))
        # The backward names an output's gradient by the output's name.
        swapped.update(
            (id(b), b.from_bsym_swap_proxies(swap, skip_output=True))
            for b in trace.bound_symbols
            if b.sym.name == "get_grad" and variableify(b.args[0]) in swap
        )
    return replaced(trace, swapped, inserted=inserted)


def _detached(bsym: BoundSymbol) -> bool:
    """Whether Thunder differentiates nothing through ``bsym``: it ran under ``torch.no_grad()``,
    which tags its results, and Thunder's autodiff takes a symbol with such a result for a
    constant."""
    return any(
        ProxyTag.DETACHED_AUTOGRAD_GRAPH in t.tags for t in bsym.flat_proxy_outs if isinstance(t, TensorProxy)
    )


def _inputs(trace: TraceCtx) -> list[TensorProxy]:
    """The trace's tensor inputs: its arguments and what it unpacks from them."""
    inputs = [t for t in tree_flatten((trace.args, trace.kwargs))[0] if isinstance(t, TensorProxy)]
    inputs += [t for b in trace.bound_symbols if b.sym.name.startswith("unpack") for t in b.flat_proxy_outs]
    return [t for t in inputs if isinstance(t, TensorProxy)]


def _inputs_with_gradient(trace: TraceCtx) -> list[TensorProxy]:
    """The trace's inputs that require grad."""
    return [t for t in _inputs(trace) if t.requires_grad]


def _differentiable_storage(trace: TraceCtx, writes: Writes) -> set[str]:
    """The storage roots of the forward's tensors that may carry a gradient: those that read an
    input which requires one, through any op (a comparison's included: an over-approximation)
    but one under ``torch.no_grad()``: a write there gives its target no gradient (a buffer
    updated from the activations, as a running statistic is), and any other op's result none."""
    marked = {writes.root(t) for t in _inputs_with_gradient(trace)}
    for bsym in trace.bound_symbols:
        tensor_outs = [t for t in bsym.flat_proxy_outs if isinstance(t, TensorProxy)]
        if (
            not bsym.sym.name.startswith("unpack")
            and not in_backward(bsym)
            and not _detached(bsym)
            and not (written_tensor(bsym) is not None and bsym.kwargs.get("grad_enabled") is False)
            and any(writes.root(a) in marked for a in bsym.flat_proxy_args if isinstance(a, TensorProxy))
        ):
            marked.update(writes.root(t) for t in tensor_outs)
    return marked


def _used(trace: TraceCtx) -> set[int]:
    """The ids of the bound symbols whose results something uses: the return, the backward, a
    write, or a used result of a later one that is not under ``torch.no_grad()`` (no gradient
    flows back through that). A name ``update_aliases`` gives is used where the name it renames
    is, not where the others in its group are (Thunder renames a whole group of views at once,
    the unused ones too)."""
    ret = trace.bound_symbols[-1]
    names = {p.name for p in ret.flat_proxy_args}
    used = {id(ret)}
    for bsym in reversed(trace.bound_symbols[:-1]):
        outs = list(bsym.flat_proxy_outs)
        if not (in_backward(bsym) or written_tensor(bsym) is not None or any(o.name in names for o in outs)):
            continue
        used.add(id(bsym))
        if bsym.sym.name == "update_aliases":
            names.update(a.name for a, o in zip(bsym.args[0], outs, strict=False) if o.name in names)
        elif not _detached(bsym):
            names.update(a.name for a in bsym.flat_proxy_args)
    return used


# Reads whose results carry no gradient (comparisons, indices): Thunder's gradient is right there.
_NOT_DIFFERENTIABLE = frozenset(
    {"eq", "ne", "lt", "le", "gt", "ge", "argmax", "argmin", "logical_not", "sign"}
)


def _before_casts(p: Any, producers: Any) -> tuple[Any, BoundSymbol | None]:
    """``p`` before the dtype conversions that made it, and the bound symbol that made that."""
    made = producers.get(p, None)
    while is_cast(made):
        p = made.args[0]
        made = producers.get(p, None)
    return p, made


def _shifts_by_a_constant(writer: BoundSymbol, target: TensorProxy, producers: Any) -> bool:
    """Whether ``writer`` writes the target's old values plus or minus numbers (``h.add_(1.5)``,
    in a wider dtype too): the identity is its derivative, which is how Thunder differentiates it."""
    if writer.sym.name != "copy_":
        return False
    _, source = _before_casts(writer.args[0], producers)
    if source is None or source.sym.name not in ("add", "sub"):
        return False
    tensors = [a for a in source.flat_args if isinstance(a, TensorProxy)]
    return (
        len(tensors) == 1
        and source.args[0] is tensors[0]
        and _before_casts(tensors[0], producers)[0].name == target.name
    )


def _reads_by_storage(
    trace: TraceCtx, writes: Writes
) -> dict[str, list[tuple[int, BoundSymbol, TensorProxy]]]:
    """(position, reader, tensor) of each forward read whose result is used, the return's of the
    forward's outputs included, by the storage of the tensor read; not a ``copy_``'s destination,
    whose values it overwrites unread."""
    used, ret = _used(trace), trace.bound_symbols[-1]
    outputs = {t.name for t in _forward_outputs(trace)}
    found: dict[str, list[tuple[int, BoundSymbol, TensorProxy]]] = {}
    for at, reader in enumerate(trace.bound_symbols):
        if (
            in_backward(reader)
            or id(reader) not in used
            or reader.sym.name in _NOT_DIFFERENTIABLE
            or _detached(reader)
            or not (reads_values(reader) or reader is ret)
        ):
            continue
        overwritten = written_tensor(reader) if copy_source(reader) is not None else None
        for p in reader.flat_proxy_args:
            if (
                isinstance(p, TensorProxy)
                and p is not overwritten
                and (reader is not ret or p.name in outputs)
            ):
                found.setdefault(writes.root(p), []).append((at, reader, p))
    return found


def writes_into_inputs_with_gradient(trace: TraceCtx) -> Iterator[StaleRead]:
    """The forward's writes, with gradients, into the storage of an input of the trace that
    requires grad (an activation passed in, a view of one, ``x.to(x.dtype)`` of one), each as a
    read of the input by its writer: Thunder 0.2.6 differentiates every such write wrong, the
    input's gradient or that of what the write reads None or short of the write's factor
    (``x.mul_(3); return x`` gives a third of eager's gradient, ``x.add_(r)`` none to ``r``)."""
    return _forward_writes_into(trace, _inputs_with_gradient(trace))


def gradient_writes_into_inputs(trace: TraceCtx) -> Iterator[StaleRead]:
    """The forward's writes of a value that requires grad into the storage of an input of the
    trace that does not (``x0.copy_(x0 + x1)``), each as a read of the input by its writer. Eager
    gives the caller's tensor the write's autograd history; Thunder 0.2.6 writes into it without
    any, so a gradient through it after the call is silently lost: through
    ``te_v2_executor.thunderfx``, Dynamo returns such an input itself, not the region's output
    (fuzz ``--fuser thunderfx --seed 20261223`` program 57: ``x1.grad`` 0.73 off)."""
    plain = [t for t in _inputs(trace) if not t.requires_grad]
    return _forward_writes_into(trace, plain, carrying=_carrying_gradient(trace))


def _forward_writes_into(
    trace: TraceCtx, inputs: list[TensorProxy], *, carrying: set[str] | None = None
) -> Iterator[StaleRead]:
    """The forward's writes with gradients into the storage of one of ``inputs`` (or into what
    Thunder renames with one), each as a read of the input by its writer; with ``carrying``, only
    those that write a value named there."""
    writes, thunders = Writes(trace), _thunders_alias_groups(trace)
    roots = {writes.root(t): t for t in inputs}
    groups = {thunders(t.name): t for t in inputs}
    for writer in trace.bound_symbols:
        target = written_tensor(writer)
        if (
            target is None
            or in_backward(writer)
            or writer.kwargs.get("grad_enabled") is False
            or _detached(writer)
        ):
            continue
        if carrying is not None and not any(
            t.name in carrying
            for t in writer.flat_proxy_args
            if isinstance(t, TensorProxy) and t is not target
        ):
            continue
        written = roots.get(writes.root(target))
        if written is None:
            written = groups.get(thunders(target.name))
        if written is not None:
            yield StaleRead(writer, written, writer)


def written_inputs_returned(trace: TraceCtx) -> Iterator[StaleRead]:
    """The forward's outputs that are an input of the trace which does not require grad, written
    in place with a value that does (``x0.add_(lin(x1)); return x0 * 0.3, x0``), each as a read of
    the input by its last writer. Thunder 0.2.6 returns the written input as the caller passed it,
    without the write's autograd history, while its backward waits for that output's gradient
    (``get_grad``): the gradient through it is silently lost where other outputs carry gradient
    (``l0.weight.grad`` a twelfth of eager's, fuzz seed 20261219 program 27), and ``backward`` raises
    where none does. A ``shallow_copy`` of it (``x0.view(x0.shape)``) loses it the same way; a
    view of another shape does not."""
    thunders = _thunders_alias_groups(trace, as_returned=True)
    plain = [t for t in _inputs(trace) if not t.requires_grad]
    awaited = {b.args[0].name for b in trace.bound_symbols if b.sym.name == "get_grad"}
    differentiable = _carrying_gradient(trace)

    def same(a: TensorProxy, b: TensorProxy) -> bool:
        return thunders(a.name) == thunders(b.name)

    for out in _forward_outputs(trace):
        if (
            out.name not in awaited
            or out.name not in differentiable
            or (written := next((t for t in plain if same(out, t)), None)) is None
        ):
            continue
        writer = next(
            (
                b
                for b in reversed(trace.bound_symbols)
                if (target := written_tensor(b)) is not None and not in_backward(b) and same(target, written)
            ),
            None,
        )
        if writer is not None:
            yield StaleRead(writer, written, writer)


def _carrying_gradient(trace: TraceCtx) -> set[str]:
    """The names of the forward's tensors a gradient may flow through, by name, not storage: those
    computed from an input that requires grad by symbols other than ``detach`` and those under
    ``torch.no_grad()`` (a value written into an input from ``v.detach()`` gives it none)."""
    marked = {t.name for t in _inputs_with_gradient(trace)}
    for bsym in trace.bound_symbols:
        if (
            not in_backward(bsym)
            and bsym.sym.name != "detach"
            and not _detached(bsym)
            and bsym.kwargs.get("grad_enabled") is not False
            and any(a.name in marked for a in bsym.flat_proxy_args if isinstance(a, TensorProxy))
        ):
            marked.update(t.name for t in bsym.flat_proxy_outs if isinstance(t, TensorProxy))
    return marked


def _thunders_alias_groups(trace: TraceCtx, *, as_returned: bool = False) -> Callable[[str], str]:
    """The groups of names Thunder takes to share storage, as its ``update_aliases`` renames them
    together, by a representative name: a dtype-changing cast of an input is one of the input's
    (``x.to(torch.bfloat16)``), which Thunder then differentiates as the input written (fuzz
    ``--fuser inductor --seed 20261215`` program 173: ``x.grad`` None). With ``as_returned``, a
    write's result is one with what it wrote into (``copy_`` returns its target itself) and a
    ``shallow_copy`` (``x.view(x.shape)``) one with its input, so that a group holds the names
    Thunder returns as one input, across its writes."""
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        while parent.get(name, name) != name:
            name = parent[name]
        return name

    def union(a: str, b: str) -> None:
        parent[find(a)] = find(b)

    for bsym in trace.bound_symbols:
        if bsym.sym.name != "update_aliases":
            continue
        names = [a.name for a in bsym.args[0]]
        for name in names[1:]:
            union(name, names[0])
        for out, name in zip(bsym.flat_proxy_outs, names, strict=False):
            union(out.name, name)
    if as_returned:
        for bsym in trace.bound_symbols:
            same = written_tensor(bsym) if bsym.sym.name != "shallow_copy" else bsym.args[0]
            if same is not None:
                for out in bsym.flat_proxy_outs:
                    union(out.name, same.name)
    return find


def bypassed_writes(trace: TraceCtx) -> Iterator[StaleRead]:
    """The forward's reads, the return's included, of a written storage through a name that does
    not carry the write on (the written slice's base, another view), where a gradient may flow."""
    return _reads_after_writes(trace, no_grad=False)


def no_grad_writes_read(trace: TraceCtx) -> Iterator[StaleRead]:
    """The forward's reads, the return's included, through the name a write under
    ``torch.no_grad()`` gave a tensor that carries gradient (the write's result, or what
    renames it), where a gradient may flow: Thunder differentiates that name as a tensor without
    gradient, where eager differentiates the tensor as it was before the write. A write through a
    slice is read through its base's name, which Thunder differentiates as eager does."""
    return _reads_after_writes(trace, no_grad=True)


def _reads_after_writes(trace: TraceCtx, *, no_grad: bool) -> Iterator[StaleRead]:
    """The forward's reads after a write (one under ``torch.no_grad()`` where ``no_grad``, else
    one with gradients) into a storage that may carry gradient, where a gradient may flow: through
    the names that carry the write on where ``no_grad``, else through the others."""
    writes, producers = Writes(trace), utils.producers(trace)
    differentiable, reads = _differentiable_storage(trace, writes), _reads_by_storage(trace, writes)
    for writer in trace.bound_symbols:
        target = written_tensor(writer)
        if (
            target is None
            or in_backward(writer)
            or (writer.kwargs.get("grad_enabled") is False) is not no_grad
            or writes.root(target) not in differentiable
            or (not no_grad and _shifts_by_a_constant(writer, target, producers))
        ):
            continue
        at, carriers = writes.position(writer), writes.carriers(writer)
        for read_at, reader, p in reads.get(writes.root(target), []):
            if read_at > at and (p.name in carriers) is no_grad:
                yield StaleRead(reader, p, writer)
