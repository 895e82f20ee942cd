"""Pass ``widenings``: the backward recomputes an exact widening it reads (and the views of it it
reads, and their log-softmax), so that the forward saves the narrow tensor instead of its wide
copy.

A Hugging Face model widens several bfloat16 activations to float32 in the forward: RMSNorm's
input, the logits its loss reads and, under peft (whose adapters are float32 by default), the
input of every LoRA adapter. The backward reads the float32 copies, or views of them, so
Thunder's split saves them between forward and backward at twice the bytes of the bfloat16
tensors they were cast from. The cast is exact and a view copies nothing, so computing them
again in the backward gives the same values; the fusion executor folds them into the backward
region that reads them. Where only te_v2's GEMMs read a copy (a LoRA adapter's wgrad), no fuser
takes the cast, so it is te_v2's own, made to wait for a tensor of the backward its first reader
reads: a lone cast of a saved tensor is what a fuser's reordering (Thunder's dataflow fusion,
thunderfx's choice) hoists to the start of the backward, its wide copy alive through all of it.
The cross-entropy's backward reads the float32 log-softmax of the
logits, over the whole vocabulary: recomputed from the bfloat16 logits, it costs one more pass
over them in the backward and saves half the bytes, with values that may differ by a few float32
ulps where the fuser sums the exponentials in another order.
"""

from __future__ import annotations

from typing import Any

from thunder.core import dtypes, utils
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol, BoundSymbolTag
from thunder.core.trace import TraceCtx, from_trace, tracectx

from te_v2_executor.passes._trace import exact_widening, made_in_backward, spliced
from te_v2_executor.passes._writes import Writes
from te_v2_executor.symbols import WIDEN, in_backward, is_te_v2

# Ops of one tensor input recomputed after the widening they read, by name (which Thunder's torch
# and torch-executor versions share, and the prims of the views): views of it, and the
# log-softmax a cross-entropy saves.
_RECOMPUTED = {
    "expand",
    "broadcast_in_dim",
    "reshape",
    "view",
    "unsqueeze",
    "squeeze",
    "transpose",
    "permute",
    "log_softmax",
}


def _chain(p: TensorProxy, producers: Any) -> list[BoundSymbol]:
    """The forward ops that make ``p`` from a narrower tensor: an exact widening, then views of its
    output or their log-softmax; empty when ``p`` is made otherwise."""
    chain: list[BoundSymbol] = []
    while (producer := producers.get(p, None)) is not None and not in_backward(producer):
        chain.insert(0, producer)
        if exact_widening(producer):
            return chain
        tensors = [a for a in producer.flat_proxy_args if isinstance(a, TensorProxy)]
        if producer.sym.name not in _RECOMPUTED or len(tensors) != 1:
            return []
        p = tensors[0]
    return []


class _Recomputation:
    """The backward copies of widening chains, made once per forward tensor, and where they go."""

    def __init__(self, trace: TraceCtx, new_trace: TraceCtx) -> None:
        self.producers = utils.producers(trace)
        self.writes = Writes(trace)
        self.returned = {
            p.name for p in tree_flatten(trace.bound_symbols[-1].args[0])[0] if isinstance(p, TensorProxy)
        }
        self.new_trace = new_trace
        self.copy_of: dict[str, TensorProxy] = {}  # forward proxy name -> its backward copy
        self.inserted: dict[int, list[BoundSymbol]] = {}  # position -> copies placed before it

    def _allowed(self, chain: list[BoundSymbol], readers: list[BoundSymbol]) -> bool:
        """Whether ``readers`` may read copies of ``chain`` made where the first of them stands:
        the narrow input holds the same values there, nothing writes the chain's tensors, and the
        forward returns none of them (a returned tensor is kept anyway)."""
        cast = chain[0]
        return (
            all(b.output.name not in self.returned for b in chain)
            and not any(self.writes.ever_written(b.output) for b in chain)
            and self.writes.reaches(cast.args[0], self.writes.position(cast), readers)
        )

    def copy(self, p: TensorProxy, readers: list[BoundSymbol]) -> TensorProxy | None:
        """The backward copy of ``p`` for ``readers``, None where ``p`` is no widening chain's
        result or may not be recomputed; a chain's ops are copied once, before the first reader
        that asks for them. Where te_v2's symbols alone read it, which no fuser fuses, the cast is
        ``te_v2_widen``, ordered after a tensor the first reader reads from the backward."""
        chain = _chain(p, self.producers)
        if not chain or not self._allowed(chain, readers):
            return None
        first = min(readers, key=self.writes.position)
        at = self.writes.position(first)
        after = made_in_backward(first, self.producers) if all(map(is_te_v2, readers)) else None
        swap: dict = {}
        for bsym in chain:
            if bsym.output.name not in self.copy_of:
                with tracectx(self.new_trace):
                    fresh = TensorProxy(like=bsym.output)
                if bsym is chain[0] and after is not None:
                    dtype = dtypes.to_torch_dtype(bsym.output.dtype)
                    recomputed = WIDEN.bind(bsym.args[0], after, dtype=dtype, output=fresh)
                else:
                    recomputed = bsym.from_bsym_swap_proxies({**swap, variableify(bsym.output): fresh})
                recomputed.tags.add(BoundSymbolTag.BACKWARD)
                self.inserted.setdefault(at, []).append(recomputed)
                self.copy_of[bsym.output.name] = fresh
            swap[variableify(bsym.output)] = self.copy_of[bsym.output.name]
        return self.copy_of[p.name]


def recompute_widenings(trace: TraceCtx) -> TraceCtx:
    """Give the backward readers of each exact widening the forward computes, or of a view of it
    or its log-softmax, their own copy of it, placed before the first of them and tagged as
    backward."""
    consumers = utils.consumers(trace)
    new_trace = from_trace(trace)
    work = _Recomputation(trace, new_trace)
    swaps: dict[int, dict] = {}  # id of a backward reader -> its swap map
    for bsym in trace.bound_symbols:
        if not in_backward(bsym):
            continue
        for p in bsym.flat_proxy_args:
            if not isinstance(p, TensorProxy) or variableify(p) in swaps.get(id(bsym), {}):
                continue
            readers = [r for r in consumers.get(p, []) if in_backward(r)]
            copy = work.copy(p, readers)
            if copy is not None:
                swaps.setdefault(id(bsym), {})[variableify(p)] = copy
    if not work.inserted:
        return trace
    swapped = {
        id(b): b.from_bsym_swap_proxies(swaps[id(b)], skip_output=True)
        for b in trace.bound_symbols
        if id(b) in swaps
    }
    new_trace.bound_symbols = spliced(trace, swapped, inserted=work.inserted)
    return new_trace
