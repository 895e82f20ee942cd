"""Pass ``dead_writes``: an in-place write into storage the trace made, that nothing reads
afterwards, is dropped, with the work only it read.

``v = x0 + x1; y = linear(v); v.add_(x1)`` with ``v`` never read again is a write no one can
observe. Thunder keeps it (``copy_`` is never dead code to it), and once te_v2's symbols split the
program into several fusion regions such a write broke two of Thunder's fusion passes:

- Thunder's dataflow fusion (thunderfx's) put a dead te_v2 GEMM and the write into its output after
  the trace's return, which Thunder then refused (an AssertionError in ``unwrap_return_value`` or
  in ``split_into_forward_and_backward``).
- The fusers' rematerialization (``thunder.core.rematerialization.rematerialize``) takes a region's
  outputs that reach none of the next region's outputs to be recomputable there. A dead write's
  operands are such values; it recomputed them in the region of the write, an earlier in-place
  write included, so ``x1.mul_(0.5)`` halved ``x1`` twice, silently (fuzz ``--fuser torch.compile
  --seed 2041`` program 33).

A write into an input, a parameter or a returned tensor is read by the trace's return, so only
writes into storage the trace made can be dead. A write is dropped where no tensor of its storage
is a trace input and no bound symbol after it reads one, the return included; Thunder's dead-code
elimination then removes what only the write read. te_v2's accumulating GEMMs are kept: their
write is their result.
"""

from __future__ import annotations

from thunder.core import utils
from thunder.core.trace import TraceCtx
from thunder.core.transform_common import dce

from te_v2_executor.passes._trace import with_bound_symbols
from te_v2_executor.passes._writes import Writes, written_tensor
from te_v2_executor.symbols import ACCUMULATE_ARG


def drop_dead_writes(trace: TraceCtx) -> TraceCtx:
    """``trace`` without the in-place writes into storage it made that nothing reads after them
    (see the module docstring), and without what only those writes read; until none is left, as
    dropping a write can leave the one before it dead (``v.add_(a); v.mul_(2)``)."""
    while dead := _dead_writes(trace):
        trace = dce(with_bound_symbols(trace, [b for b in trace.bound_symbols if id(b) not in dead]))
    return trace


def _dead_writes(trace: TraceCtx) -> set[int]:
    """The ids of ``trace``'s writes into storage it made that no bound symbol after them reads."""
    writes = Writes(trace)
    consumers = utils.consumers(trace)
    dead = set()
    for bsym in trace.bound_symbols:
        target = written_tensor(bsym)
        if target is None or bsym.sym in ACCUMULATE_ARG or not writes.made_here(target):
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
    return dead
