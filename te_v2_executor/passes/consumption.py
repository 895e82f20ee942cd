"""Pass ``consumption``: every te_v2 forward and dy quantization produces only what is consumed.

Its signal is consumption, never ``requires_grad``: after Thunder's dead-code elimination, a
dgrad, wgrad or bias grad exists in the joint trace only if a returned gradient needs it, through
any chain of casts, views, checkpoints or collectives.
"""

from __future__ import annotations

from typing import Any

from thunder.core import utils
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from te_v2_executor.passes._trace import with_bound_symbols
from te_v2_executor.symbols import LINEAR_DGRAD, LINEAR_FWD, LINEAR_WGRAD, QUANTIZE_GRAD_OUTPUT, with_args


def rewrite_for_consumption(trace: TraceCtx) -> TraceCtx:
    """Make every te_v2 forward and dy quantization produce only what is consumed.

    Each ``te_v2_linear_fwd`` builds the column-wise FP8 copy of x only when a wgrad reads it, of
    W only when a dgrad reads it, and its output only when something reads it (a recomputed
    forward under activation checkpointing may be needed for its copies alone); each
    ``te_v2_quantize_grad_output`` builds the usages its surviving GEMMs read, and the bias grad
    only when it is consumed.
    """
    consumers = utils.consumers(trace)

    def readers(p: Any) -> list[BoundSymbol]:
        return consumers.get(p, []) if isinstance(p, TensorProxy) else []

    new_bsyms = []
    for bsym in trace.bound_symbols:
        if bsym.sym is LINEAR_FWD:
            y, x_saved, w_saved, amax_ready = bsym.output
            keep_y, keep_x, keep_w = bool(readers(y)), bool(readers(x_saved)), bool(readers(w_saved))
            bsym = with_args(
                bsym,
                compute_output=keep_y,
                save_input=keep_x,
                save_weight=keep_w,
                output=(
                    y if keep_y else None,
                    x_saved if keep_x else None,
                    w_saved if keep_w else None,
                    amax_ready,
                ),
            )
        elif bsym.sym is QUANTIZE_GRAD_OUTPUT:
            dy_q, dbias = bsym.output
            gemms = {r.sym for r in readers(dy_q)}
            rowwise, columnwise, bgrad = LINEAR_DGRAD in gemms, LINEAR_WGRAD in gemms, bool(readers(dbias))
            bsym = with_args(
                bsym,
                rowwise=rowwise,
                columnwise=columnwise,
                bgrad=bgrad,
                output=(dy_q if rowwise or columnwise else None, dbias if bgrad else None),
            )
        new_bsyms.append(bsym)
    return with_bound_symbols(trace, new_bsyms)
