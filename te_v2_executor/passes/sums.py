"""Pass ``sums``: the sum of a te_v2 GEMM's product and a tensor nothing else reads, folded into
the GEMM, which accumulates into that tensor's buffer (cuBLAS beta = 1)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from te_v2_executor.passes._trace import Fold, dtype, fold, is_cast, plain_product, read_only_by, widened
from te_v2_executor.symbols import ACCUMULATE_ARG, LINEAR_FWD, with_args

# By name, which Thunder's torch, prims and executor-claimed versions of an op share: ops whose
# output is a tensor of its own, and ops whose output may be a view of their first input.
_ALLOCATING = {"add", "matmul", "linear"}
_VIEWING = {"reshape", "shallow_copy"}


def _allocates(producer: BoundSymbol, p: Any) -> bool:
    """Whether ``p`` is a fresh tensor ``producer`` allocated (not a view, not a saved copy)."""
    if producer.sym is LINEAR_FWD:
        return p is producer.output[0]
    return producer.sym in ACCUMULATE_ARG or producer.sym.name in _ALLOCATING


def _writable_in_place(p: Any, reader: BoundSymbol, producers: Any, consumers: Any) -> bool:
    """Whether ``reader`` may overwrite ``p``: every tensor on the chain of views from ``p`` back
    to the op that allocated it is read by the next link alone, and that op allocates its output."""
    while read_only_by(p, reader, consumers) and (producer := producers.get(p, None)) is not None:
        if _allocates(producer, p):
            return True
        if producer.sym.name not in _VIEWING:
            return False
        reader, p = producer, producer.args[0]
    return False


def _is_plain_add(bsym: BoundSymbol | None) -> bool:
    return (
        bsym is not None
        and bsym.sym.name == "add"
        and len(bsym.args) == 2
        and bsym.kwargs.get("alpha", 1) == 1
        and all(isinstance(a, TensorProxy) for a in bsym.args)
    )


def _summands(
    bsym: BoundSymbol, producers: Any, consumers: Any
) -> tuple[list[tuple[Any, BoundSymbol]], list[BoundSymbol]] | None:
    """When ``bsym`` ends a sum ``a + b`` of two tensors of its output's shape and dtype: the
    (operand, the op in the sum that reads it) pairs, and the sum's ops before ``bsym``.

    The sum is an add of them, or the cast back of an add of their exact widenings (Thunder adds
    bfloat16 tensors in float32): a GEMM that accumulates in float32 into the other operand
    computes it with one rounding, where the widened add rounds its operands first.
    """
    if _is_plain_add(bsym):
        pairs, ops = [(a, bsym) for a in bsym.args], []
    elif is_cast(bsym) and _is_plain_add(add := producers.get(bsym.args[0], None)):
        casts = [widened(a, add, producers, consumers) for a in add.args]
        if not read_only_by(bsym.args[0], bsym, consumers) or any(c is None for c in casts):
            return None
        pairs, ops = [(c.args[0], c) for c in casts], [add, *casts]
    else:
        return None
    out = bsym.output
    if not all(a.shape == out.shape and dtype(a) == dtype(out) for a, _ in pairs):
        return None
    return pairs, ops


def _accumulating_gemm(bsym: BoundSymbol, producers: Any, consumers: Any) -> Iterator[Fold]:
    """(the GEMM and the sum's other ops, the GEMM accumulating into the other summand), for each
    of the sum's operands that is a te_v2 GEMM's product, when ``bsym`` ends a sum of it and a
    tensor the sum may overwrite."""
    found = _summands(bsym, producers, consumers)
    if found is None:
        return
    pairs, ops = found
    for (product, reader), (other, other_reader) in (pairs, pairs[::-1]):
        gemm = producers.get(product, None)
        if gemm is None or gemm.sym not in ACCUMULATE_ARG or other is product:
            continue
        if not plain_product(gemm):
            continue  # accumulating already, or a bias that would be added twice
        if read_only_by(product, reader, consumers) and _writable_in_place(
            other, other_reader, producers, consumers
        ):
            yield (gemm, *ops), with_args(gemm, accumulate_into=other, output=bsym.output)


def accumulate_sums(trace: TraceCtx) -> TraceCtx:
    """Replace ``gemm(...) + g`` by a GEMM that adds its product into g's buffer (cuBLAS beta = 1,
    as TE's fused backward linear + add), when nothing else reads g or a view of it: an FP8 dgrad
    or an unquantized linear's forward or dgrad, summed with another gradient of the same input
    or with another linear's output (a LoRA adapter's and its base's).

    The sum then needs no third activation-sized buffer nor an elementwise kernel: for a frozen
    linear with a LoRA adapter, the backward's largest live buffer.
    """
    return fold(trace, _accumulating_gemm)
