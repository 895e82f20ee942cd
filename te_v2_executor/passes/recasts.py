"""Pass ``weight_recasts``: the backward casts a parameter to FP8 again for its dgrad, so that the
forward saves no FP8 copy of it.

A dgrad reads the column-wise FP8 copy of W. Saved by the forward, it holds a byte per weight
from forward to backward, for every linear whose input needs a gradient (under LoRA and in full
fine-tuning, every projection but the first layer's), next to the parameter itself, which is
alive anyway; torchao's float8 casts the weight again in the backward instead. Here the backward
gets a cast of the weight alone (``te_v2_linear_fwd`` with no input and no output, only the
weight's copy) tagged as backward, like an activation checkpoint's recomputed forward: the
forward sync hands it the scale the forward quantized with, so that its copy is bitwise the one
the forward would have saved.

Only weights the trace reads as they were passed in, parameters and buffers (Thunder tags their
proxies ``STATIC_MEMORY_LOCATION``), are recast: the caller keeps them alive, while another
tensor would be kept alive for the backward at least twice the bytes of its FP8 copy. A weight
read through a cast (float32 parameters under ``torch.autocast``) or a slice keeps its saved
copy. So does every weight where the trace writes into any of its inputs after the forward:
inputs may share storage without Thunder knowing (a buffer that is a view of a weight), so a
write into one may change another, and Thunder's split may move a write of the backward into
the forward. A parameter written in place outside the trace between forward and backward makes
PyTorch's check of saved tensors raise, as in eager mode; one written through ``.data``, which
that check cannot see, is read with its new values, as eager autograd reads it.

A recast costs a call into TE in the backward, so one is made only where it lowers the step's
peak memory (``_peak.py``): in a full fine-tune of few tokens the peak is the end of the backward,
after every saved copy is freed, and no recast is made. Under CUDA graphs every one that can be
is made: the forward graph holds what it saves from one step to the next.
"""

from __future__ import annotations

from typing import Any

from thunder.core import prims, utils
from thunder.core.proxies import AnyProxy, ProxyTag, TensorProxy, variableify
from thunder.core.symbol import BoundSymbol, BoundSymbolTag
from thunder.core.trace import TraceCtx, tracectx

from te_v2_executor.passes._peak import Saving, peak_needs
from te_v2_executor.passes._trace import made_in_backward, replaced
from te_v2_executor.passes._writes import Writes
from te_v2_executor.symbols import LINEAR_FWD, arg, in_backward, with_args


def _is_parameter(w: TensorProxy, producers: Any) -> bool:
    """Whether ``w`` is a parameter or buffer the trace unpacks from its inputs."""
    producer = producers.get(w, None)
    made_here = producer is not None and producer.sym.id is not prims.PrimIDs.UNPACK_TRIVIAL
    return not made_here and ProxyTag.STATIC_MEMORY_LOCATION in w.tags


def _recast(fwd: BoundSymbol, trace: TraceCtx, after: TensorProxy | None) -> BoundSymbol:
    """The backward's cast of ``fwd``'s weight alone: its column-wise FP8 copy, in a new proxy,
    ordered after ``after`` (the gradient its first dgrad reads), so that no reordering of the
    backward casts it long before that dgrad."""
    w_saved = fwd.output[2]
    with tracectx(trace):
        copy, marker = TensorProxy(like=w_saved), AnyProxy(None, prefix="amax_ready")
    recast = with_args(
        fwd,
        x=None,
        bias=None,
        compute_output=False,
        save_input=False,
        save_weight=True,
        gelu=False,
        up=None,
        after=after,
        output=(None, None, copy, marker),
    )
    recast.tags.add(BoundSymbolTag.BACKWARD)
    return recast


def recast_weights(trace: TraceCtx, *, every: bool = False) -> TraceCtx:
    """Have each dgrad of a parameter's linear read a copy cast in the backward, before the first
    of its readers and after that reader's gradient, rather than one the forward saved (see the
    module docstring for which; with ``every``, each one that can, peak or not)."""
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    writes = Writes(trace)
    unpacked = (b.output for b in trace.bound_symbols if b.sym.id is prims.PrimIDs.UNPACK_TRIVIAL)
    last_input_write = writes.last_write(p for p in unpacked if isinstance(p, TensorProxy))
    candidates = []
    for at, bsym in enumerate(trace.bound_symbols):
        if bsym.sym is not LINEAR_FWD or in_backward(bsym) or bsym.output[2] is None:
            continue
        w, w_saved = arg(bsym, "w"), bsym.output[2]
        readers = consumers.get(w_saved, [])
        if (
            not _is_parameter(w, producers)
            or not readers
            or not all(map(in_backward, readers))
            or at < last_input_write
        ):
            continue
        candidates.append((bsym, readers, min(readers, key=writes.position)))
    savings = [Saving(b.output[2], writes.position(b), writes.position(first)) for b, _, first in candidates]
    swapped: dict[int, BoundSymbol] = {}  # id of a bound symbol -> its replacement
    inserted: dict[int, list[BoundSymbol]] = {}  # position -> recasts placed before it
    for (bsym, readers, first_reader), needed in zip(
        candidates, peak_needs(trace, writes, savings, every=every), strict=True
    ):
        if not needed:
            continue
        recast = _recast(bsym, trace, made_in_backward(first_reader, producers))
        inserted.setdefault(writes.position(first_reader), []).append(recast)
        y, x_saved, w_saved, amax_ready = bsym.output
        swapped[id(bsym)] = with_args(bsym, save_weight=False, output=(y, x_saved, None, amax_ready))
        swap = {variableify(w_saved): recast.output[2]}
        for reader in readers:  # dgrads, each reading one weight copy
            swapped[id(reader)] = reader.from_bsym_swap_proxies(swap, skip_output=True)
    return replaced(trace, swapped, inserted=inserted)
