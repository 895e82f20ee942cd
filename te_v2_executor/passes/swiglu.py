"""Pass ``swiglus``: a SwiGLU, ``silu(gate) * up``, folded into the FP8 quantization of the
linear that reads it, and its backward into the quantizations of the gate's and up's gradients.

Three folds, each an identity of the ops it replaces, whatever model made them:

- ``te_v2_linear_fwd(silu(g) * u)`` becomes ``te_v2_linear_fwd(g, up=u)``;
- ``te_v2_quantize_grad_output(silu(g) * t)`` becomes ``te_v2_quantize_grad_output(t,
  swiglu_gate=g)``: up's gradient, t the output's;
- ``te_v2_quantize_grad_output(silu_backward(t * u, g))`` becomes
  ``te_v2_quantize_grad_output(t, swiglu_gate=g, swiglu_up=u)``: the gate's gradient.

The backward folds go first: they remove the backward's reads of ``silu(g)`` and of the float32
copies of the operands, so that the forward fold can then take the whole chain, and neither the
SiLU's output nor the product is written, or saved for the backward, in BF16. A product is the
multiply of two tensors of its dtype, or (Thunder's way for bfloat16) in float32 between their
exact widenings and the cast back; both compute what PyTorch's ``a * b`` does. Each fold is made
only where the folded tensor has no other reader, and moves reads only past no write.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx
from thunder.core.transform_common import dce

from te_v2_executor.passes._trace import Fold, dtype, fold, product, read_only_by
from te_v2_executor.symbols import (
    LINEAR_FWD,
    QUANTIZE_GRAD_OUTPUT,
    SILU,
    SILU_BACKWARD,
    arg,
    in_backward,
    with_args,
)


def _silu_times(p: Any, producers: Any) -> tuple[TensorProxy, TensorProxy, list[BoundSymbol]] | None:
    """When ``p`` is ``silu(g) * t``: g, t and the ops of the product and the SiLU."""
    found = product(p, producers)
    if found is None:
        return None
    *operands, chain = found
    for s, t in (operands, operands[::-1]):
        silu = producers.get(s, None)
        if silu is not None and silu.sym is SILU:
            return silu.args[0], t, [*chain, silu]
    return None


def _made_in_forward(p: TensorProxy, producers: Any) -> bool:
    producer = producers.get(p, None)
    return producer is None or not in_backward(producer)


def _fold(chain: list[BoundSymbol], reader: BoundSymbol, replacement: BoundSymbol, consumers: Any) -> Fold:
    """The fold of ``chain`` (its ops ordered from the one ``reader`` reads back) into
    ``replacement``: it absorbs the ops nothing outside the chain reads, and takes over the reads
    of the others, which stay for their other readers, the replacement among them (a SiLU times
    itself reads the SiLU's output as up)."""
    read = {p.name for p in replacement.flat_proxy_args if isinstance(p, TensorProxy)}
    inside = {id(reader)}
    absorbed = []
    for bsym in chain:
        readers = [r for out in bsym.flat_proxy_outs for r in consumers.get(out, [])]
        if all(id(r) in inside for r in readers) and not any(o.name in read for o in bsym.flat_proxy_outs):
            absorbed.append(bsym)
            inside.add(id(bsym))
    return tuple(absorbed), replacement, tuple(b for b in chain if id(b) not in inside)


def _grad_folded(bsym: BoundSymbol, producers: Any, consumers: Any) -> Iterator[Fold]:
    """(the ops it absorbs, ``bsym`` quantizing t with the SwiGLU's operands) when ``bsym`` is a
    dy quantization of up's or the gate's gradient of a SwiGLU that it alone reads."""
    if bsym.sym is not QUANTIZE_GRAD_OUTPUT or any(
        arg(bsym, name) is not None for name in ("gelu_input", "swiglu_gate", "swiglu_up")
    ):
        return
    dy = arg(bsym, "dy")
    if not read_only_by(dy, bsym, consumers):
        return
    if (found := _silu_times(dy, producers)) is not None:  # up's gradient
        g, t, chain = found
        yield _fold(chain, bsym, with_args(bsym, dy=t, swiglu_gate=g), consumers)
        return
    silu_backward = producers.get(dy, None)
    if silu_backward is None or silu_backward.sym is not SILU_BACKWARD:
        return
    ds, g = silu_backward.args
    if (found := product(ds, producers)) is None or dtype(g) != dtype(dy) or g.shape != dy.shape:
        return
    t, u, chain = found
    if _made_in_forward(t, producers) and not _made_in_forward(u, producers):
        t, u = u, t  # the product is the same; dy is the one the backward makes, as named
    replacement = with_args(bsym, dy=t, swiglu_gate=g, swiglu_up=u)
    yield _fold([silu_backward, *chain], bsym, replacement, consumers)


def _forward_folded(bsym: BoundSymbol, producers: Any, consumers: Any) -> Iterator[Fold]:
    """(the ops it absorbs, ``bsym`` reading the gate and up) when ``bsym`` is a te_v2 forward
    whose input is a SwiGLU it alone reads."""
    if bsym.sym is not LINEAR_FWD or arg(bsym, "gelu") or arg(bsym, "up") is not None:
        return
    x = arg(bsym, "x")
    if arg(bsym, "x_q") is not None or x is None or not read_only_by(x, bsym, consumers):
        return
    if (found := _silu_times(x, producers)) is not None:
        g, u, chain = found
        yield _fold(chain, bsym, with_args(bsym, x=g, up=u), consumers)


def _folded(trace: TraceCtx, folds: Any) -> TraceCtx:
    """``fold(trace, folds)``, less what the folds left dead: an op an absorbed one shared with
    another fold, such as dy's widening that both SwiGLU gradients read."""
    folded = fold(trace, folds)
    return folded if folded is trace else dce(folded)


def fuse_swiglus(trace: TraceCtx) -> TraceCtx:
    """Fold each SwiGLU's backward into the quantizations of its operands' gradients, then each
    SwiGLU into the quantization of the te_v2 forward that reads it (see the module docstring)."""
    return _folded(_folded(trace, _grad_folded), _forward_folded)
