"""Pass ``scales``: a product's scaling by a constant (a LoRA adapter's ``scaling``) folded into
the unquantized GEMMs around it, as cuBLAS's alpha."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from thunder.core import utils
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from te_v2_executor.passes._trace import (
    Fold,
    dtype,
    fold,
    is_cast,
    plain_product,
    read_only_by,
    replaced,
    widened,
)
from te_v2_executor.passes._writes import Writes
from te_v2_executor.symbols import UNQUANTIZED_DGRAD, UNQUANTIZED_FWD, UNQUANTIZED_WGRAD, arg, with_args

# te_v2 GEMMs that can scale their product by a constant (``scale``).
_SCALABLE = (UNQUANTIZED_FWD, UNQUANTIZED_DGRAD, UNQUANTIZED_WGRAD)


def _is_constant_mul(bsym: BoundSymbol | None) -> bool:
    return (
        bsym is not None
        and bsym.sym.name == "mul"
        and len(bsym.args) == 2
        and sum(isinstance(a, TensorProxy) for a in bsym.args) == 1
        and any(isinstance(a, (int, float)) and not isinstance(a, bool) for a in bsym.args)
    )


def _scaling(
    bsym: BoundSymbol, producers: Any, consumers: Any
) -> tuple[Any, float, list[BoundSymbol]] | None:
    """When ``bsym`` ends ``t * s`` of a tensor t of its output's dtype and a constant s: t, s and
    the chain's ops before ``bsym``. The multiply is in t's dtype, or (Thunder's way for bfloat16)
    in float32 between t's exact widening and the cast back."""
    chain: list[BoundSymbol] = []
    mul = bsym
    if is_cast(bsym):
        mul = producers.get(bsym.args[0], None)
        if not (_is_constant_mul(mul) and read_only_by(bsym.args[0], bsym, consumers)):
            return None
        chain.append(mul)
    elif not _is_constant_mul(bsym):
        return None
    (t,) = (a for a in mul.args if isinstance(a, TensorProxy))
    (s,) = (a for a in mul.args if not isinstance(a, TensorProxy))
    if chain:
        cast = widened(t, mul, producers, consumers)
        if cast is None:
            return None
        chain.append(cast)
        t = cast.args[0]
    if dtype(t) != dtype(bsym.output) or t.shape != bsym.output.shape:
        return None
    return t, float(s), chain


def _scale_in_producer(bsym: BoundSymbol, producers: Any, consumers: Any) -> Iterator[Fold]:
    """(the unquantized GEMM and the scaling's other ops, the GEMM scaling its own product) when
    ``bsym`` ends the scaling of such a GEMM's product that nothing else reads."""
    found = _scaling(bsym, producers, consumers)
    if found is None:
        return
    t, s, chain = found
    gemm = producers.get(t, None)
    if gemm is None or gemm.sym not in _SCALABLE or arg(gemm, "scale") != 1.0:
        return
    if not plain_product(gemm):
        return  # the sum or the bias would be scaled too
    if not read_only_by(t, chain[-1] if chain else bsym, consumers):
        return
    yield (gemm, *chain), with_args(gemm, scale=s, output=bsym.output)


def _reads_as_dy_only(reader: BoundSymbol, p: Any) -> bool:
    """Whether ``reader`` is an unscaled unquantized dgrad or wgrad reading ``p`` as its dy alone."""
    return (
        reader.sym in (UNQUANTIZED_DGRAD, UNQUANTIZED_WGRAD)
        and arg(reader, "dy") is p
        and all(a is not p for a in reader.args[1:])
        and arg(reader, "scale") == 1.0
    )


def _scale_in_consumers(trace: TraceCtx) -> TraceCtx:
    """Where every reader of ``t * s`` is an unquantized dgrad or wgrad reading it as dy, have
    them read t and scale their products by s instead."""
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    writes = Writes(trace)
    swapped: dict[int, BoundSymbol] = {}
    dropped: set[int] = set()
    for bsym in trace.bound_symbols:
        found = _scaling(bsym, producers, consumers)
        readers = consumers.get(bsym.output, []) if found is not None else []
        if not readers or not all(_reads_as_dy_only(r, bsym.output) for r in readers):
            continue
        t, s, chain = found
        read_at = writes.position(chain[-1] if chain else bsym)
        if writes.ever_written(bsym.output) or not writes.reaches(t, read_at, readers):
            continue
        for r in readers:
            swapped[id(r)] = with_args(r, dy=t, scale=s)
        dropped.update(map(id, (bsym, *chain)))
    return replaced(trace, swapped, dropped)


def fold_scales(trace: TraceCtx) -> TraceCtx:
    """Fold a product's scaling by a constant (a LoRA adapter's ``scaling``) into the unquantized
    GEMMs around it, as cuBLAS's alpha: into the GEMM that produced it, when nothing else reads its
    product, else into the dgrad and wgrad that read it (the gradient flowing into the adapter).
    One rounding instead of two, and no elementwise kernel."""
    return _scale_in_consumers(fold(trace, _scale_in_producer))
