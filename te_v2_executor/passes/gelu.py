"""Passes ``gelus`` and ``gelu_handback``: an exact GELU folded into the FP8 quantization next to
it, and each GELU left unfolded handed back to the fusion executors as torch-level ops."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import thunder.torch as ltorch
import torch
from thunder.core import utils
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, from_trace, tracectx
from thunder.extend import FusionExecutor

from te_v2_executor.passes._trace import Fold, dtype, fold, read_only_by, with_bound_symbols
from te_v2_executor.symbols import GELU, GELU_BACKWARD, LINEAR_FWD, QUANTIZE_GRAD_OUTPUT, arg, with_args

_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


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


def _fusible_neighbour(bsym: Any, producers: Any, consumers: Any, fusers: list[FusionExecutor]) -> bool:
    """Whether one of ``fusers`` could fuse an op that produces an input of ``bsym`` or reads
    its output."""
    neighbours = [producers[a] for a in bsym.flat_proxy_args if a in producers]
    neighbours += consumers.get(bsym.output, [])
    return any(f.can_fuse(n) for f in fusers for n in neighbours)


def unfolded_gelus_as_torch_ops(trace: TraceCtx, fusers: list[FusionExecutor]) -> TraceCtx:
    """Hand each GELU the ``gelus`` pass did not fold back to the fusion executors, as torch-level ops
    they can fuse with their neighbours (PyTorch's own kernel, run on its own, cannot). A GELU
    between te_v2 symbols only stays PyTorch's kernel: a fusion region holding it alone would run
    the same one kernel, at the cost of a region call."""
    if not fusers:
        return trace
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    bsyms = []
    for bsym in trace.bound_symbols:
        if bsym.sym in (GELU, GELU_BACKWARD) and _fusible_neighbour(bsym, producers, consumers, fusers):
            bsyms.extend(gelu_as_torch_ops(bsym, trace))
        else:
            bsyms.append(bsym)
    return with_bound_symbols(trace, bsyms)


def _gelu_backward_ops(grad: TensorProxy, a: TensorProxy) -> TensorProxy:
    """PyTorch's exact GELU backward, computed as PyTorch does in the wider of float32 and
    ``a``'s dtype (float32 for the 16-bit dtypes, float64 for float64), rounded once to ``a``'s
    dtype."""
    a_dtype = dtype(a)
    compute = torch.promote_types(torch.float32, a_dtype)
    x = ltorch.to(a, compute)
    cdf = ltorch.mul(0.5, ltorch.add(1.0, ltorch.erf(ltorch.mul(x, _SQRT1_2))))
    pdf = ltorch.mul(ltorch.exp(ltorch.mul(ltorch.mul(-0.5, x), x)), _INV_SQRT_2PI)
    dx = ltorch.mul(ltorch.to(grad, compute), ltorch.add(cdf, ltorch.mul(x, pdf)))
    return ltorch.to(dx, a_dtype)


def gelu_as_torch_ops(bsym: BoundSymbol, trace: TraceCtx) -> list[BoundSymbol]:
    """A ``te_v2_gelu`` or ``te_v2_gelu_backward`` bound symbol as Thunder torch-level ops with the
    same output proxy and the same tags, for a fusion executor to fuse with its neighbours.

    The tags say where the ops belong: Thunder's dataflow fusion (thunderfx's) keeps what is
    tagged backward out of the forward's regions, and untagged ops of a GELU's backward were
    fused into a forward region, which then read a gradient the forward does not have (an
    UnboundLocalError) or computed part of the backward in the forward and saved it."""
    scratch = from_trace(trace)
    with tracectx(scratch):
        out = ltorch.gelu(*bsym.args) if bsym.sym is GELU else _gelu_backward_ops(*bsym.args)
    swap = {variableify(out): bsym.output}
    ops = [b.from_bsym_swap_proxies(swap) for b in scratch.bound_symbols]
    for op in ops:
        op.tags |= bsym.tags
    return ops
