"""Pass ``activation_handback``: each activation no fold took (te_v2's GELU and SiLU, forward or
backward) handed back to the fusion executors as torch-level ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import thunder.torch as ltorch
import torch
from thunder.core import utils
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, from_trace, tracectx
from thunder.extend import FusionExecutor

from te_v2_executor.passes._trace import dtype, with_bound_symbols
from te_v2_executor.symbols import GELU, GELU_BACKWARD, SILU, SILU_BACKWARD

_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def _in_compute_dtype(
    grad: TensorProxy, a: TensorProxy, backward: Callable[[TensorProxy, TensorProxy], TensorProxy]
) -> TensorProxy:
    """``backward(grad, a)`` computed as PyTorch's backward kernels do, in the wider of float32
    and ``a``'s dtype (float32 for the 16-bit dtypes, float64 for float64), rounded once to
    ``a``'s dtype."""
    a_dtype = dtype(a)
    compute = torch.promote_types(torch.float32, a_dtype)
    x = ltorch.to(a, compute)
    return ltorch.to(backward(ltorch.to(grad, compute), x), a_dtype)


def _silu(a: TensorProxy) -> TensorProxy:
    """PyTorch's SiLU, x / (1 + exp(-x)) in float32 (or float64), rounded once; Thunder's own
    rounds the sigmoid to a bfloat16 input's dtype before multiplying."""
    a_dtype = dtype(a)
    x = ltorch.to(a, torch.promote_types(torch.float32, a_dtype))
    return ltorch.to(ltorch.true_divide(x, ltorch.add(1.0, ltorch.exp(ltorch.neg(x)))), a_dtype)


def _gelu_backward(g: TensorProxy, x: TensorProxy) -> TensorProxy:
    """PyTorch's: g * (cdf + x * pdf)."""
    cdf = ltorch.mul(0.5, ltorch.add(1.0, ltorch.erf(ltorch.mul(x, _SQRT1_2))))
    pdf = ltorch.mul(ltorch.exp(ltorch.mul(ltorch.mul(-0.5, x), x)), _INV_SQRT_2PI)
    return ltorch.mul(g, ltorch.add(cdf, ltorch.mul(x, pdf)))


def _silu_backward(g: TensorProxy, x: TensorProxy) -> TensorProxy:
    """PyTorch's: g * sigmoid * (1 + x * (1 - sigmoid)), in that order."""
    sigmoid = ltorch.true_divide(1.0, ltorch.add(1.0, ltorch.exp(ltorch.neg(x))))
    return ltorch.mul(ltorch.mul(g, sigmoid), ltorch.add(1.0, ltorch.mul(x, ltorch.sub(1.0, sigmoid))))


# te_v2's activation symbol -> the torch-level ops that compute it, from its bound symbol's args
_AS_TORCH_OPS: dict[Any, Callable[..., TensorProxy]] = {
    GELU: ltorch.gelu,
    GELU_BACKWARD: lambda grad, a: _in_compute_dtype(grad, a, _gelu_backward),
    SILU: _silu,
    SILU_BACKWARD: lambda grad, a: _in_compute_dtype(grad, a, _silu_backward),
}


def _fusible_neighbour(bsym: Any, producers: Any, consumers: Any, fusers: list[FusionExecutor]) -> bool:
    """Whether one of ``fusers`` could fuse an op that produces an input of ``bsym`` or reads
    its output."""
    neighbours = [producers[a] for a in bsym.flat_proxy_args if a in producers]
    neighbours += consumers.get(bsym.output, [])
    return any(f.can_fuse(n) for f in fusers for n in neighbours)


def unfolded_activations_as_torch_ops(trace: TraceCtx, fusers: list[FusionExecutor]) -> TraceCtx:
    """Hand each activation no fold took back to the fusion executors, as torch-level ops they can
    fuse with their neighbours (PyTorch's own kernel, run on its own, cannot). One between te_v2
    symbols only stays PyTorch's kernel: a fusion region holding it alone would run the same one
    kernel, at the cost of a region call."""
    if not fusers:
        return trace
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    bsyms = []
    for bsym in trace.bound_symbols:
        if bsym.sym in _AS_TORCH_OPS and _fusible_neighbour(bsym, producers, consumers, fusers):
            bsyms.extend(activation_as_torch_ops(bsym, trace))
        else:
            bsyms.append(bsym)
    return with_bound_symbols(trace, bsyms)


def activation_as_torch_ops(bsym: BoundSymbol, trace: TraceCtx) -> list[BoundSymbol]:
    """A te_v2 activation's bound symbol (GELU, SiLU or a backward) as Thunder torch-level ops
    with the same output proxy and the same tags, for a fusion executor to fuse with its
    neighbours.

    The tags say where the ops belong: Thunder's dataflow fusion (thunderfx's) keeps what is
    tagged backward out of the forward's regions, and untagged ops of a GELU's backward were
    fused into a forward region, which then read a gradient the forward does not have (an
    UnboundLocalError) or computed part of the backward in the forward and saved it."""
    scratch = from_trace(trace)
    with tracectx(scratch):
        out = _AS_TORCH_OPS[bsym.sym](*bsym.args)
    swap = {variableify(out): bsym.output}
    ops = [b.from_bsym_swap_proxies(swap) for b in scratch.bound_symbols]
    for op in ops:
        op.tags |= bsym.tags
    return ops
