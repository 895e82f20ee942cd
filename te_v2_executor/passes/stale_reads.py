"""Pass ``stale_reads``: make a backward that reads a tensor after an in-place write into it
raise, as eager's does."""

from __future__ import annotations

from thunder.core.trace import TraceCtx

from te_v2_executor.passes._trace import before_return, returned_grads
from te_v2_executor.passes._writes import Writes, describe
from te_v2_executor.symbols import REFUSE_BACKWARD, in_backward


def refuse_stale_reads(trace: TraceCtx) -> TraceCtx:
    """Make a backward that reads a tensor after an in-place write into it raise, as eager's does.

    Thunder's backward reads what the forward saved by its storage, so a write into it after the
    save changes the gradient, silently. The forward still runs, as eager's does, and a
    ``te_v2_refuse_backward`` that reads the returned gradients (so that Thunder's split puts it
    at the end of the backward, before they are returned) raises the error naming the tensor and
    the write. The forward is Thunder's and is left as it is."""
    writes = Writes(trace)
    stale = next((s for s in writes.stale_reads() if in_backward(s.reader)), None)
    grads = returned_grads(trace)
    if stale is None or not grads:
        return trace
    return before_return(trace, REFUSE_BACKWARD.bind(*grads, message=describe(writes, stale), output=None))
