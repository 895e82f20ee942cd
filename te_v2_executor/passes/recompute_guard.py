"""Pass ``recompute_guard``: no forward read of a storage the forward writes later is recomputed in
the backward.

After te_v2's pass, the fusion executors rematerialize: of each forward fusion region whose values
the backward reads, they may save the region's inputs and recompute the values in the backward
(Thunder's ``rematerialize_forward_and_backward``, a minimum cut). The cut does not look at
in-place writes. Without te_v2 a region rarely writes into one of its inputs; with te_v2 it does
whenever the program writes in place into a te_v2 GEMM's output (``v = linear(x); v.mul_(-1);
v * w``): the region received ``v`` from the GEMM, wrote it, and the backward recomputed
``v * -1`` from the written ``v``, so ``w``'s gradient came out negated, silently (fuzz
``--fuser torch.compile --seed 2027`` program 9). Each forward bound symbol that reads a storage a
later symbol writes, and each forward write, is tagged as random, as Thunder's nvFuser
executor tags its attention operators: the cut then keeps their outputs in the forward, saved.
"""

from __future__ import annotations

from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from te_v2_executor.passes._trace import replaced
from te_v2_executor.passes._writes import Writes, reads_values, written_tensor
from te_v2_executor.symbols import in_backward

# NOTE: the tag Thunder's rematerialization (``find_cut``) keeps on the forward side; it has no
# tag that says "reads a storage written later", and RANDOM_OP's meaning, a value that cannot be
# computed again, is what such a read is.
KEPT = prims.OpTags.RANDOM_OP


def _kept(bsym: BoundSymbol) -> BoundSymbol:
    """``bsym`` and its subsymbols tagged ``KEPT`` (a fuser may take the subsymbols apart)."""
    return bsym.from_bsym(tags=bsym.tags | {KEPT}, subsymbols=[_kept(s) for s in bsym.subsymbols])


def guard_recomputation(trace: TraceCtx) -> TraceCtx:
    """Tag every forward write, and every forward read of a storage that a later symbol
    overwrites, so that no fuser recomputes them in the backward."""
    writes, end = Writes(trace), len(trace.bound_symbols)
    swapped = {}
    for at, bsym in enumerate(trace.bound_symbols):
        if in_backward(bsym):
            continue
        overwritten = reads_values(bsym) and any(
            not writes.unchanged(p, at, end) for p in bsym.flat_proxy_args if isinstance(p, TensorProxy)
        )
        if overwritten or written_tensor(bsym) is not None:
            swapped[id(bsym)] = _kept(bsym)
    return replaced(trace, swapped)
