"""Pass ``write_order``: every in-place write waits for te_v2's reads of the tensor it writes.

Thunder keeps an in-place op in the trace as a write, with ``update_aliases`` renaming the written
tensor for the readers after it; a reader before the write has no data dependency on it. A fuser
that orders by data dependencies alone (Thunder's dataflow fusion, which thunderfx selects) may
then put the write, fused into a region with the ops around it, before a te_v2 symbol that reads
the tensor: no fuser takes te_v2's symbols into its regions, so nothing keeps them in place. The
te_v2 symbol then reads the written values, silently (``y = linear(h); h.mul_(2)`` gave a
doubled ``y``). Here the write reads its tensor through ``te_v2_ordered``, which returns it
unchanged and takes an output of each te_v2 symbol that read it before, in the same half of the
trace (the backward runs after the whole forward anyway).
"""

from __future__ import annotations

from thunder.core.proxies import Proxy, TensorProxy, variableify
from thunder.core.symbol import BoundSymbol, BoundSymbolTag
from thunder.core.trace import TraceCtx, tracectx

from te_v2_executor.passes._trace import replaced
from te_v2_executor.passes._writes import Writes, written_tensor
from te_v2_executor.symbols import ORDERED, in_backward, is_te_v2


def _marker(bsym: BoundSymbol) -> Proxy | None:
    """An output of ``bsym`` to wait for: a non-tensor one where it has one (a forward's
    ``amax_ready``), which keeps no memory alive; else its first tensor."""
    outs = list(bsym.flat_proxy_outs)
    return next((o for o in outs if not isinstance(o, TensorProxy)), outs[0] if outs else None)


def order_writes(trace: TraceCtx) -> TraceCtx:
    """Have each write into a tensor that a te_v2 symbol read before it wait for that symbol."""
    writes = Writes(trace)
    order = trace.bound_symbols
    swapped: dict[int, BoundSymbol] = {}
    inserted: dict[int, list[BoundSymbol]] = {}
    for at, writer in enumerate(order):
        target = written_tensor(writer)
        if target is None or is_te_v2(writer):
            continue
        markers = [
            m
            for r in order[:at]
            if is_te_v2(r)
            and in_backward(r) == in_backward(writer)
            and any(writes.same_storage(p, target) for p in r.flat_proxy_args if isinstance(p, TensorProxy))
            and (m := _marker(r)) is not None
        ]
        if not markers:
            continue
        with tracectx(trace):
            through = TensorProxy(like=target)
        wait = ORDERED.bind(target, *markers, output=through)
        if in_backward(writer):
            wait.tags.add(BoundSymbolTag.BACKWARD)
        inserted.setdefault(at, []).append(wait)
        swapped[id(writer)] = writer.from_bsym_swap_proxies({variableify(target): through}, skip_output=True)
    return replaced(trace, swapped, inserted=inserted)
