"""What the passes share: rebuilding a trace, folding bound symbols into one, and the shapes of
the elementwise ops they recognise (casts, exact widenings, sole readers)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from thunder.core import dtypes, utils
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol, BoundSymbolTag
from thunder.core.trace import TraceCtx, from_trace, tracectx

from te_v2_executor.passes._writes import Writes
from te_v2_executor.symbols import ACCUMULATE_ARG, ORDERED, UNQUANTIZED_FWD, arg, in_backward

# A fold a pass may make: (the bound symbols it absorbs, the one that replaces the last of them),
# optionally followed by other bound symbols whose reads the replacement takes over while they
# stay for other readers (an op the absorbed ones shared with another), which ``fold`` checks too.
Fold = (
    tuple[tuple[BoundSymbol, ...], BoundSymbol]
    | tuple[tuple[BoundSymbol, ...], BoundSymbol, tuple[BoundSymbol, ...]]
)

# the longest name ``source_name`` gives a computed value
_LONGEST = 120

# (operand dtype, wider dtype) pairs whose round trip through the wider one is exact.
_EXACT_WIDENING = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}


def with_bound_symbols(trace: TraceCtx, bsyms: list[BoundSymbol]) -> TraceCtx:
    """A copy of ``trace`` (its signature, names and provenance) running ``bsyms`` instead."""
    new_trace = from_trace(trace)
    new_trace.bound_symbols = bsyms
    return new_trace


def spliced(
    trace: TraceCtx,
    swapped: dict[int, BoundSymbol],
    *,
    dropped: set[int] = frozenset(),
    inserted: dict[int, list[BoundSymbol]] | None = None,
) -> list[BoundSymbol]:
    """``trace``'s bound symbols with those keyed (by id) in ``swapped`` replaced, those in
    ``dropped`` removed, and each list in ``inserted`` placed before the bound symbol at its
    position."""
    inserted = inserted or {}
    bsyms = []
    for i, bsym in enumerate(trace.bound_symbols):
        bsyms += inserted.get(i, [])
        if id(bsym) not in dropped:
            bsyms.append(swapped.get(id(bsym), bsym))
    return bsyms


def replaced(
    trace: TraceCtx,
    swapped: dict[int, BoundSymbol],
    dropped: set[int] = frozenset(),
    inserted: dict[int, list[BoundSymbol]] | None = None,
) -> TraceCtx:
    """``trace`` spliced as ``spliced`` says; ``trace`` itself when nothing is swapped."""
    if not swapped:
        return trace
    return with_bound_symbols(trace, spliced(trace, swapped, dropped=dropped, inserted=inserted))


def made_in_backward(reader: BoundSymbol, producers: Any) -> TensorProxy | None:
    """The first tensor ``reader`` reads that the backward makes (a dgrad's ``dy_q``), for a
    symbol placed before ``reader`` to wait for; None when it reads only forward tensors."""
    for a in reader.flat_proxy_args:
        producer = producers.get(a, None) if isinstance(a, TensorProxy) else None
        if producer is not None and in_backward(producer):
            return a
    return None


def fold(trace: TraceCtx, folds: Callable[[BoundSymbol, Any, Any], Iterator[Fold]]) -> TraceCtx:
    """Apply ``folds(bsym, producers, consumers)`` to every bound symbol: of the folds it offers,
    (other bound symbols, a replacement[, shared ones]), the first whose replacement reads what
    they (and the shared ones) read, no write in between (``Writes.moved_reads_unchanged``), is
    made: the replacement takes ``bsym``'s place and the others, whose work it now does, are
    removed; the shared ones stay."""
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    writes = Writes(trace)
    dropped: set[int] = set()
    swapped: dict[int, BoundSymbol] = {}
    for bsym in trace.bound_symbols:
        at = writes.position(bsym)
        for absorbed, replacement, *shared in folds(bsym, producers, consumers):
            if writes.moved_reads_unchanged(
                [*absorbed, *(shared[0] if shared else ()), bsym], replacement, at
            ):
                swapped[id(bsym)] = replacement
                dropped.update(map(id, absorbed))
                break
    return replaced(trace, swapped, dropped)


def ordered_read(
    trace: TraceCtx, p: TensorProxy, markers: list[Any], *, backward: bool = False
) -> tuple[BoundSymbol, TensorProxy]:
    """``te_v2_ordered(p, *markers)``, tagged as the backward's where ``backward``, and the name
    under which its readers read ``p`` once the markers exist."""
    with tracectx(trace):
        through = TensorProxy(like=p)
    wait = ORDERED.bind(p, *markers, output=through)
    if backward:
        wait.tags.add(BoundSymbolTag.BACKWARD)
    return wait, through


def returned_grads(trace: TraceCtx) -> list[TensorProxy]:
    """The gradients a joint trace returns (none for an inference trace)."""
    ret = trace.bound_symbols[-1].args[0]
    return [g for g in ret["output"] if isinstance(g, TensorProxy)] if "fw_flat_out" in ret else []


def before_return(trace: TraceCtx, bsym: BoundSymbol) -> TraceCtx:
    """``trace`` with ``bsym`` inserted just before its return."""
    return with_bound_symbols(trace, [*trace.bound_symbols[:-1], bsym, trace.bound_symbols[-1]])


def source_input(producers: dict, p: TensorProxy) -> TensorProxy:
    """The trace input ``p`` derives from through single-input ops (casts, views, slices): what
    names a weight, for its state and in the report."""
    while p in producers and len(inputs := producers[p].flat_proxy_args) == 1:
        p = inputs[0]
    return p


def source_name(producers: dict, p: TensorProxy, inputs: Mapping[str, str]) -> str:
    """What ``p`` derives from, as ``explain`` shows it and a linear's ``StateKey`` names it: the
    name of the trace input it derives from through single-input ops (a module's parameter or
    buffer by its qualified name, ``inputs`` by proxy name: ``compiled.module_input_names``;
    another without Thunder's ``t_`` prefix), or, for a value computed from several (a weight
    ``g * v / v.norm()``, a merged adapter ``w + b @ a``), ``computed(`` the names of all the
    trace inputs it reads ``)``, in order of name: ``computed(g,v)``. A proxy's name would not do:
    a retrace numbers its proxies anew, so another linear's computed weight could get the name,
    and with it that linear's delayed-scaling history; nor would the computation's ops, which
    Thunder names otherwise with and without grad (``true_divide``, ``torch_div_prim_impl``). A
    name longer than ``_LONGEST`` characters is ``computed#`` and a digest of it."""

    def named(q: TensorProxy) -> str:
        return inputs.get(q.name, q.name.removeprefix("t_"))

    root = source_input(producers, p)
    if _is_trace_input(producers, root):
        return named(root)
    read, seen, pending = set(), set(), [root]
    while pending:
        q = pending.pop()
        if q.name in seen:
            continue
        seen.add(q.name)
        if _is_trace_input(producers, q):
            read.add(named(q))
        else:
            pending.extend(producers[q].flat_proxy_args)
    name = f"computed({','.join(sorted(read))})"
    return name if len(name) <= _LONGEST else f"computed#{hashlib.sha1(name.encode()).hexdigest()[:16]}"


def _is_trace_input(producers: dict, p: Any) -> bool:
    return p not in producers or producers[p].sym.name.startswith("unpack_")


def read_only_by(p: Any, reader: BoundSymbol, consumers: Any) -> bool:
    """Whether ``reader`` is the one bound symbol that reads ``p``."""
    readers = consumers.get(p, [])
    return len(readers) == 1 and readers[0] is reader


def known_numel(p: TensorProxy) -> int | None:
    """The number of elements of ``p``, or None where its shape is not numbers at trace time
    (``cache="symbolic values"``), where Thunder's ``numel`` raises outside a tracing context."""
    return math.prod(p.shape) if all(type(d) is int for d in p.shape) else None


def dtype(p: Any) -> torch.dtype | None:
    """``p``'s torch dtype, None for a non-tensor."""
    return dtypes.to_torch_dtype(p.dtype) if isinstance(p, TensorProxy) else None


def is_cast(bsym: BoundSymbol | None) -> bool:
    """A dtype conversion: Thunder's, or the torch executor's ``Tensor.to`` that runs it."""
    if bsym is None or bsym.sym.name not in ("convert_element_type", "to"):
        return False
    a, out = bsym.args[0], bsym.output
    return (
        isinstance(a, TensorProxy)
        and isinstance(out, TensorProxy)
        and (a.shape, a.device) == (out.shape, out.device)
    )


def exact_widening(bsym: BoundSymbol | None) -> bool:
    """A cast to a wider dtype that holds every value of the narrower one."""
    return is_cast(bsym) and (dtype(bsym.args[0]), dtype(bsym.output)) in _EXACT_WIDENING


def widened(p: Any, reader: BoundSymbol, producers: Any, consumers: Any) -> BoundSymbol | None:
    """The exact widening that produced ``p``, when ``reader`` alone reads ``p``."""
    cast = producers.get(p, None)
    return cast if exact_widening(cast) and read_only_by(p, reader, consumers) else None


def plain_product(gemm: BoundSymbol) -> bool:
    """Whether ``gemm`` computes its product alone: it adds it into no buffer and adds no bias,
    so that its output may take a scale, or another summand, without changing either."""
    if gemm.sym in ACCUMULATE_ARG and arg(gemm, "accumulate_into") is not None:
        return False
    return not (gemm.sym is UNQUANTIZED_FWD and arg(gemm, "bias") is not None)


def product(p: Any, producers: Any) -> tuple[TensorProxy, TensorProxy, list[BoundSymbol]] | None:
    """When tensor ``p`` is the product of two tensors of its dtype and shape (their multiply, or
    Thunder's way for bfloat16: in float32 between their exact widenings, then the cast back, which
    computes what PyTorch's ``a * b`` does): them, and the product's ops, from the one that makes
    ``p`` back."""
    last = producers.get(p, None)
    mul, chain = last, [last]
    wider = is_cast(last)  # multiplied in a wider dtype: each operand an exact widening
    if wider:
        mul = producers.get(last.args[0], None)
        chain.append(mul)
    if mul is None or mul.sym.name != "mul" or len(mul.args) != 2 or mul.kwargs:
        return None
    operands = []
    for a in mul.args:
        if not isinstance(a, TensorProxy):
            return None
        if wider:
            widening = producers.get(a, None)
            if not exact_widening(widening):
                return None
            chain.append(widening)
            a = widening.args[0]
        operands.append(a)
    if any(dtype(a) != dtype(p) or a.shape != p.shape for a in operands):
        return None
    return operands[0], operands[1], chain
