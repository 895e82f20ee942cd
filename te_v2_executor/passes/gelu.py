"""Pass ``gelus``: an exact GELU folded into the FP8 quantization next to it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from te_v2_executor.passes._trace import Fold, fold, read_only_by
from te_v2_executor.symbols import GELU, GELU_BACKWARD, LINEAR_FWD, QUANTIZE_GRAD_OUTPUT, arg, with_args


def _gelu_folded(bsym: BoundSymbol, producers: Any, consumers: Any) -> Iterator[Fold]:
    """(the GELU, ``bsym`` reading the GELU's input instead) when ``bsym`` is a te_v2 forward or
    dy quantization whose tensor operand an exact GELU (or its backward) produced for it alone."""
    if bsym.sym is LINEAR_FWD:
        gelu_sym, operand = GELU, arg(bsym, "x")
    elif bsym.sym is QUANTIZE_GRAD_OUTPUT:
        gelu_sym, operand = GELU_BACKWARD, arg(bsym, "dy")
    else:
        return
    gelu = producers.get(operand, None)
    if gelu is None or gelu.sym is not gelu_sym or not read_only_by(operand, bsym, consumers):
        return
    if gelu_sym is GELU:
        (a,) = gelu.args
        yield (gelu,), with_args(bsym, x=a, gelu=True)
    else:
        grad, a = gelu.args
        yield (gelu,), with_args(bsym, dy=grad, gelu_input=a)


def fuse_gelus(trace: TraceCtx) -> TraceCtx:
    """Compute each exact GELU read only by a te_v2 forward inside that forward's input
    quantization, and each GELU backward read only by a dy quantization inside it.

    ``te_v2_linear_fwd(gelu(a), ...)`` becomes ``te_v2_linear_fwd(a, ..., gelu=True)`` and
    ``te_v2_quantize_grad_output(gelu_backward(g, a))`` becomes ``te_v2_quantize_grad_output(g, a)``:
    the activation, or its gradient, is never written in BF16 to be read back by the cast. The
    fold moves the read of ``a`` (and ``g``) to the te_v2 symbol, and is not made where a write
    in between would change them.
    """
    return fold(trace, _gelu_folded)
