"""Pass ``dead_writes``: an in-place write into the output of a te_v2 GEMM that nothing reads
afterwards is dropped, with the work only it read.

``y = linear(x); y.mul_(0.5)`` with y never read again is a write no one can observe. Thunder
keeps it (``copy_`` is never dead code to it), and where the GEMM is te_v2's, Thunder's dataflow
fusion (thunderfx's) made a trace that ran the dead GEMM and the write after its return, which
Thunder then refused (an AssertionError in ``unwrap_return_value`` or in
``split_into_forward_and_backward``). The write is dropped only where its storage was made by a
te_v2 GEMM (no input, parameter or view of one) and no bound symbol after it reads any tensor of
that storage, the return included; Thunder's dead-code elimination then removes what only the
write read.
"""

from __future__ import annotations

from thunder.core import utils
from thunder.core.trace import TraceCtx
from thunder.core.transform_common import dce

from te_v2_executor.passes._trace import with_bound_symbols
from te_v2_executor.passes._writes import Writes, written_tensor
from te_v2_executor.symbols import ACCUMULATE_ARG, LINEAR_DGRAD, LINEAR_FWD, LINEAR_WGRAD, UNQUANTIZED_SYMBOLS

_GEMMS = (LINEAR_FWD, LINEAR_DGRAD, LINEAR_WGRAD, *UNQUANTIZED_SYMBOLS)


def drop_dead_writes(trace: TraceCtx) -> TraceCtx:
    """``trace`` without the in-place writes into te_v2 GEMM outputs that nothing reads after them
    (see the module docstring), and without what only those writes read."""
    writes = Writes(trace)
    consumers = utils.consumers(trace)
    dead = set()
    for bsym in trace.bound_symbols:
        target = written_tensor(bsym)
        if target is None or bsym.sym in ACCUMULATE_ARG:
            continue
        origin = writes.origin(target)
        if origin is None or origin.sym not in _GEMMS:
            continue
        at = writes.position(bsym)
        later = (
            r
            for p in writes.storage_tensors(target)
            for r in consumers.get(p, [])
            if r is not bsym and writes.position(r) > at
        )
        if next(later, None) is None:
            dead.add(id(bsym))
    if not dead:
        return trace
    return dce(with_bound_symbols(trace, [b for b in trace.bound_symbols if id(b) not in dead]))
