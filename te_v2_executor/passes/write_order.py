"""Pass ``write_order``: every in-place write waits for the earlier reads of the tensor it writes.

Thunder keeps an in-place op in the trace as a write, with ``update_aliases`` renaming the written
tensor for the readers after it; a reader before the write has no data dependency on it. A fuser
that orders by data dependencies alone (Thunder's dataflow fusion, which thunderfx selects) may
then fuse the write into a region that runs before such a reader. Without te_v2 the whole program
is one region, whose code keeps the order; te_v2's symbols, which no fuser takes in, split it, and
the write went before a te_v2 GEMM that read the tensor (``y = linear(h); h.mul_(2)`` gave a
doubled ``y``), or before the region of a sum that came after one (``v = a(x); s = v + b(x);
v.mul_(0.5)`` halved ``s``), silently. Here the write reads its tensor through ``te_v2_ordered``,
which returns it unchanged and takes an output of each earlier reader the write does not already
depend on, in the same half of the trace (the backward runs after the whole forward anyway), and
of an earlier copy from it even where the write depends on the copy, so that the two never share
a TorchInductor region (``_copied_from``).
"""

from __future__ import annotations

from typing import Any

from thunder.core import utils
from thunder.core.proxies import Proxy, TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from te_v2_executor.passes._trace import ordered_read, replaced
from te_v2_executor.passes._writes import Writes, copy_source, reads_values, written_tensor
from te_v2_executor.symbols import in_backward


def _marker(bsym: BoundSymbol) -> Proxy | None:
    """An output of ``bsym`` to wait for: a non-tensor one where it has one (a forward's
    ``amax_ready``), which keeps no memory alive; else its first tensor."""
    outs = list(bsym.flat_proxy_outs)
    return next((o for o in outs if not isinstance(o, TensorProxy)), outs[0] if outs else None)


def _copied_from(bsym: BoundSymbol, target: TensorProxy, writes: Writes) -> bool:
    """Whether ``bsym`` copies from ``target``'s storage: a write into that storage after it must
    not share a TorchInductor region with it, even where the write depends on the copy. Inductor
    (torch 2.11) then stores the source's new value into the copy as well (``x.copy_(v);
    v.add_(x)`` left ``x`` twice ``v``; fuzz seed 7002 program 39)."""
    source = copy_source(bsym)
    return source is not None and writes.same_storage(source, target)


def _ancestors(bsym: BoundSymbol, producers: Any) -> set[int]:
    """The ids of the bound symbols ``bsym`` depends on through its arguments."""
    found: set[int] = set()
    stack = [bsym]
    while stack:
        for a in stack.pop().flat_proxy_args:
            producer = producers.get(a, None)
            if producer is not None and id(producer) not in found:
                found.add(id(producer))
                stack.append(producer)
    return found


def _wait_later_readers(
    at: int, writer: BoundSymbol, target: TensorProxy, context: tuple, trace: TraceCtx
) -> None:
    """Have each later reader of ``writer``'s storage in the same half of the trace that does not
    depend on the write read through ``te_v2_ordered`` waiting for it: once the write waits for
    te_v2's readers, a fuser ordering by data alone could otherwise move a later reader, which
    Thunder links to the write by trace order only (``update_aliases`` of an older name), before
    the write (``v.add_(x); x.mul_(0.5)`` with v a view of x halved the unwritten x)."""
    writes, swapped, inserted = context
    marker = _marker(writer)
    if marker is None:
        return
    order = trace.bound_symbols
    after_write = {variableify(o) for o in writer.flat_proxy_outs}
    for position in range(at + 1, len(order) - 1):
        reader = swapped.get(id(order[position]), order[position])
        if any(variableify(p) in after_write for p in reader.flat_proxy_args):
            after_write.update(variableify(o) for o in reader.flat_proxy_outs)
            continue
        stale = {
            variableify(p): p
            for p in reader.flat_proxy_args
            if isinstance(p, TensorProxy) and writes.same_storage(p, target)
        }
        if not stale or in_backward(reader) != in_backward(writer):
            continue
        swap = {}
        for key, p in stale.items():
            wait, swap[key] = ordered_read(trace, p, [marker], backward=in_backward(reader))
            inserted.setdefault(position, []).append(wait)
        swapped[id(order[position])] = reader.from_bsym_swap_proxies(swap, skip_output=True)
        after_write.update(variableify(o) for o in reader.flat_proxy_outs)


def order_writes(trace: TraceCtx) -> TraceCtx:
    """Have each write into a tensor wait for the earlier readers of its storage it does not
    already depend on, and then each later reader of it wait for the write."""
    writes, producers = Writes(trace), utils.producers(trace)
    order = trace.bound_symbols
    swapped: dict[int, BoundSymbol] = {}
    inserted: dict[int, list[BoundSymbol]] = {}
    for at, writer in enumerate(order):
        target = written_tensor(writer)
        if target is None:
            continue
        ancestors = _ancestors(writer, producers)
        markers = [
            m
            for r in order[:at]
            if (id(r) not in ancestors or _copied_from(r, target, writes))
            and reads_values(r)
            and in_backward(r) == in_backward(writer)
            and any(writes.same_storage(p, target) for p in r.flat_proxy_args if isinstance(p, TensorProxy))
            and (m := _marker(r)) is not None
        ]
        if not markers:
            continue
        wait, through = ordered_read(trace, target, markers, backward=in_backward(writer))
        inserted.setdefault(at, []).append(wait)
        swapped[id(writer)] = writer.from_bsym_swap_proxies({variableify(target): through}, skip_output=True)
        _wait_later_readers(at, writer, target, (writes, swapped, inserted), trace)
    return replaced(trace, swapped, inserted=inserted)
