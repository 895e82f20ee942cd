"""Pass ``narrowings``: an unquantized GEMM reads the bfloat16 tensor that an exact widening to
float32 was cast from, instead of the float32 copy, where its other operand is a smaller float32
tensor.

peft keeps LoRA adapters in float32 and casts each adapter's bfloat16 input to float32; the
gradient flowing into an adapter is the float32 widening of the bfloat16 gradient of the layer's
output. So every adapter GEMM that reads an activation-sized operand reads a float32 copy of a
bfloat16 tensor: ``x @ A^T`` and ``dh^T @ x`` read x's copy, ``dy @ B`` and ``dy^T @ h`` read dy's.
Making the copy writes twice the bytes of the tensor, and the GEMM reads it on CUDA cores, as
cuBLAS runs every float32 GEMM. Reading the bfloat16 tensor, the GEMM computes the same float32
product (``backends/unquantized.py``: the small float32 operand split into three bfloat16 pieces,
one tensor-core GEMM), and the cast, once no other op reads it, is gone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx
from thunder.core.transform_common import dce

from te_v2_executor.passes._trace import Fold, dtype, fold, is_cast
from te_v2_executor.symbols import UNQUANTIZED_DGRAD, UNQUANTIZED_FWD, UNQUANTIZED_WGRAD, arg, with_args

# Each unquantized GEMM's (operand, other operand) pairs, by the meta's parameter names.
_OPERANDS = {
    UNQUANTIZED_FWD: (("x", "w"),),
    UNQUANTIZED_DGRAD: (("dy", "w"),),
    UNQUANTIZED_WGRAD: (("dy", "x"), ("x", "dy")),
}


def _bfloat16_widening(bsym: BoundSymbol | None) -> bool:
    return is_cast(bsym) and (dtype(bsym.args[0]), dtype(bsym.output)) == (torch.bfloat16, torch.float32)


def _narrowed(bsym: BoundSymbol, producers: Any, consumers: Any) -> Iterator[Fold]:
    """(nothing absorbed, ``bsym`` reading the bfloat16 source of one operand, the widening it
    read) when that operand is the widening's output and the other operand is a float32 tensor of
    fewer elements (an adapter's weight, or its rank-wide activation or gradient)."""
    if bsym.sym not in _OPERANDS or (bsym.sym is UNQUANTIZED_FWD and arg(bsym, "bias") is not None):
        return
    for name, other_name in _OPERANDS[bsym.sym]:
        wide, other = arg(bsym, name), arg(bsym, other_name)
        cast = producers.get(wide, None)
        if not _bfloat16_widening(cast) or dtype(other) != torch.float32:
            continue
        if math.prod(other.shape) < math.prod(wide.shape):
            yield (), with_args(bsym, **{name: cast.args[0]}), (cast,)
            return


def narrow_operands(trace: TraceCtx) -> TraceCtx:
    """Have each unquantized GEMM whose large operand is a bfloat16 tensor's float32 widening read
    the bfloat16 tensor, and drop the widenings nothing else reads."""
    narrowed = fold(trace, _narrowed)
    return narrowed if narrowed is trace else dce(narrowed)
