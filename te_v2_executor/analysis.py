"""The backward-consumption analysis: a pass over the joint forward+backward trace, before fusion.

Its signal is consumption, never ``requires_grad``: after Thunder's dead-code elimination, a
dgrad, wgrad or bias grad exists in the joint trace only if a returned gradient needs it, through
any chain of casts, views, checkpoints or collectives. From that the pass

* makes a backward that reads a tensor after an in-place write into it raise, as eager's does
  (Thunder's would read the written values);
* rewrites each ``te_v2_linear_fwd`` to build the column-wise FP8 copy of x only when a wgrad
  reads it, of W only when a dgrad reads it, and its output only when something reads it (a
  recomputed forward under activation checkpointing may be needed for its copies alone);
* rewrites each ``te_v2_quantize_grad_output`` to the usages its surviving GEMMs read, and to
  compute the bias grad only when it is consumed;
* inserts the once-per-pass flushes of delayed-scaling state: ``te_v2_forward_sync`` at the end
  of the forward and ``te_v2_backward_sync`` after every gradient is produced;
* drops casts to a wider dtype and back (the gradient of a bfloat16 add), exact identities;
* folds a product's scaling by a constant (a LoRA adapter's ``scaling``) into the unquantized
  GEMMs that produce or read it, as their alpha;
* folds the sum of a te_v2 GEMM's product and a tensor nothing else reads (a base dgrad and its
  adapter's, an adapter's output and its base's) into the GEMM, which accumulates into that
  tensor's buffer;
* folds an exact GELU whose output only a te_v2 forward reads into that forward's quantization,
  and the GELU's backward into the quantization of the gradient it produces.

Every fold moves a read, and is made only where no write into what it reads lies between the
old and the new position (``writes.Writes``). Trace in, trace out; symbols are recognised by
identity.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from thunder.core import dtypes, prims, utils
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.pytree import tree_flatten, tree_map
from thunder.core.symbol import BoundSymbol, BoundSymbolTag
from thunder.core.trace import TraceCtx, from_trace, tracectx
from thunder.core.transform_common import dce, replace_redundant_inputs

from te_v2_executor.state import LinearQuantState, SyncGroup
from te_v2_executor.symbols import (
    ACCUMULATE_ARG,
    BACKWARD_SYNC,
    FORWARD_SYNC,
    GELU,
    GELU_BACKWARD,
    LINEAR_DGRAD,
    LINEAR_FWD,
    LINEAR_WGRAD,
    QUANTIZE_GRAD_OUTPUT,
    REFUSE_BACKWARD,
    UNQUANTIZED_DGRAD,
    UNQUANTIZED_FWD,
    UNQUANTIZED_WGRAD,
)
from te_v2_executor.writes import Writes, describe


def is_recompute(bsym: BoundSymbol) -> bool:
    """A forward copy Thunder placed in the backward to recompute a checkpointed region."""
    return bsym.sym is LINEAR_FWD and BoundSymbolTag.BACKWARD in bsym.tags


def rewrite_for_consumption(trace: TraceCtx) -> TraceCtx:
    """Make every te_v2 forward and dy quantization produce only what is consumed."""
    consumers = utils.consumers(trace)

    def readers(p: Any) -> list[BoundSymbol]:
        return consumers.get(p, []) if isinstance(p, TensorProxy) else []

    new_bsyms = []
    for bsym in trace.bound_symbols:
        if bsym.sym is LINEAR_FWD:
            y, x_saved, w_saved, amax_ready = bsym.output
            keep_y, keep_x, keep_w = bool(readers(y)), bool(readers(x_saved)), bool(readers(w_saved))
            bsym = bsym.from_bsym(
                kwargs={**bsym.kwargs, "compute_output": keep_y, "save_input": keep_x, "save_weight": keep_w},
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
            bsym = bsym.from_bsym(
                kwargs={**bsym.kwargs, "rowwise": rowwise, "columnwise": columnwise, "bgrad": bgrad},
                output=(dy_q if rowwise or columnwise else None, dbias if bgrad else None),
            )
        new_bsyms.append(bsym)
    return with_bound_symbols(trace, new_bsyms)


def _delayed_states(trace: TraceCtx, sym: Any, *, recomputed: bool = False) -> tuple[LinearQuantState, ...]:
    """The delayed-scaling states of the ``sym`` bound symbols of a trace: of the recomputed
    forwards if ``recomputed``, else of the others."""
    states: dict[int, LinearQuantState] = {}
    for bsym in trace.bound_symbols:
        if bsym.sym is sym and is_recompute(bsym) is recomputed and bsym.kwargs["state"].recipe.stateful:
            states.setdefault(id(bsym.kwargs["state"]), bsym.kwargs["state"])
    return tuple(states.values())


def _forward_token(trace: TraceCtx, returned: dict, key: str) -> TensorProxy:
    """The forward output the forward sync passes through: one the trace computes, else an input
    the trace writes into (``out.copy_(linear(x)); return out``), whose written version it
    returns."""
    outputs = [o for o in tree_flatten(returned[key])[0] if isinstance(o, TensorProxy)]
    flat_args = {a.name for a in returned["flat_args"] if isinstance(a, TensorProxy)}
    producers = utils.producers(trace)
    computed = [o for o in outputs if o.name not in flat_args]
    written = [o for o in outputs if o.name in flat_args and o in producers]
    token = next(iter(computed + written), None)
    if token is None:
        raise NotImplementedError(
            "te_v2: delayed scaling flushes its state at the end of the forward by passing one "
            "output tensor through, but this function returns no tensor it computes or writes; "
            "return one (e.g. the linear's output), or use a stateless recipe "
            "(Float8CurrentScaling, Float8BlockScaling)"
        )
    return token


def _insert_forward_sync(trace: TraceCtx, group: SyncGroup) -> TraceCtx:
    """Put the forward sync at the end of the forward.

    Thunder splits a joint trace after fusion and keeps in the forward only what produces a
    forward output. So the sync passes one forward output through (``token``): the return, and the
    cotangent read of that output, are redirected to the passed-through proxy. It also reads the
    ``amax_ready`` marker of every te_v2 forward, so it runs after all of them without keeping
    their outputs alive. Recomputed forwards read the scales it snapshots before updating.
    """
    bsyms = list(trace.bound_symbols)
    ret = bsyms[-1]
    key = "fw_flat_out" if "fw_flat_out" in ret.args[0] else "output"
    token = _forward_token(trace, ret.args[0], key)
    after = [b.output[-1] for b in bsyms if b.sym is LINEAR_FWD and not is_recompute(b)]
    with tracectx(trace):
        passed, replay = FORWARD_SYNC.meta(token, *after, group=group)
    sync = FORWARD_SYNC.bind(token, *after, group=group, output=(passed, replay))
    producers = utils.producers(trace)
    position = 1 + max(bsyms.index(producers[p]) for p in (token, *after))
    rows = {id(s): i for i, s in enumerate(group.replayed)}

    def redirect(b: BoundSymbol) -> BoundSymbol:
        if b.sym is prims.get_grad and b.args[0] is token:
            return b.from_bsym(args=(passed,))
        if is_recompute(b) and id(b.kwargs["state"]) in rows:
            return b.from_bsym(
                kwargs={**b.kwargs, "replay": replay, "replay_row": rows[id(b.kwargs["state"])]}
            )
        return b

    swapped = {
        k: tree_map(lambda o: passed if o is token else o, v)
        for k, v in ret.args[0].items()
        if k in (key, "flat_output")
    }
    new_ret = ret.from_bsym(args=({**ret.args[0], **swapped},))
    body = [redirect(b) for b in bsyms[:-1]]
    return with_bound_symbols(trace, [*body[:position], sync, *body[position:], new_ret])


def with_bound_symbols(trace: TraceCtx, bsyms: list[BoundSymbol]) -> TraceCtx:
    """A copy of ``trace`` (its signature, names and provenance) running ``bsyms`` instead."""
    new_trace = from_trace(trace)
    new_trace.bound_symbols = bsyms
    return new_trace


def _returned_grads(trace: TraceCtx) -> list[TensorProxy]:
    """The gradients a joint trace returns (none for an inference trace)."""
    ret = trace.bound_symbols[-1].args[0]
    return [g for g in ret["output"] if isinstance(g, TensorProxy)] if "fw_flat_out" in ret else []


def _before_return(trace: TraceCtx, bsym: BoundSymbol) -> TraceCtx:
    return with_bound_symbols(trace, [*trace.bound_symbols[:-1], bsym, trace.bound_symbols[-1]])


def refuse_stale_reads(trace: TraceCtx) -> TraceCtx:
    """Make a backward that reads a tensor after an in-place write into it raise, as eager's does.

    Thunder's backward reads what the forward saved by its storage, so a write into it after the
    save changes the gradient, silently. The forward still runs, as eager's does, and a
    ``te_v2_refuse_backward`` that reads the returned gradients (so that Thunder's split puts it
    at the end of the backward, before they are returned) raises the error naming the tensor and
    the write. The forward is Thunder's and is left as it is."""
    writes = Writes(trace)
    stale = next((s for s in writes.stale_reads() if BoundSymbolTag.BACKWARD in s.reader.tags), None)
    grads = _returned_grads(trace)
    if stale is None or not grads:
        return trace
    return _before_return(trace, REFUSE_BACKWARD.bind(*grads, message=describe(writes, stale), output=None))


def insert_syncs(trace: TraceCtx, *, grad_enabled: bool) -> TraceCtx:
    """Insert the delayed-scaling flushes, if the trace has delayed-scaling linears.

    Like ``te.autocast``, forward state is updated only when grad mode is on, and backward state
    after each backward. A joint trace that returns no gradient (Thunder builds one under
    ``torch.no_grad()`` when parameters require grad) is an inference trace.
    """
    ret = trace.bound_symbols[-1]
    joint = "fw_flat_out" in ret.args[0]
    grads = _returned_grads(trace)
    forward_states = _delayed_states(trace, LINEAR_FWD)
    if forward_states and (grads or (grad_enabled and not joint)):
        replayed = _delayed_states(trace, LINEAR_FWD, recomputed=True)
        trace = _insert_forward_sync(trace, SyncGroup(forward_states, forward=True, replayed=replayed))
    backward_states = _delayed_states(trace, QUANTIZE_GRAD_OUTPUT)
    if grads and backward_states:
        trace = _before_return(
            trace, BACKWARD_SYNC.bind(*grads, group=SyncGroup(backward_states, forward=False), output=None)
        )
    return trace


# By name, which Thunder's torch, prims and executor-claimed versions of an op share: ops whose
# output is a tensor of its own, and ops whose output may be a view of their first input.
_ALLOCATING = {"add", "matmul", "linear"}
_VIEWING = {"reshape", "shallow_copy"}

# te_v2 GEMMs that can scale their product by a constant (``scale``).
_SCALABLE = (UNQUANTIZED_FWD, UNQUANTIZED_DGRAD, UNQUANTIZED_WGRAD)

# (operand dtype, wider dtype) pairs whose round trip through the wider one is exact.
_EXACT_WIDENING = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}


# A fold a pass may make: (the bound symbols it absorbs, the one that replaces the last of them).
Fold = tuple[tuple[BoundSymbol, ...], BoundSymbol]


def _read_only_by(p: Any, reader: BoundSymbol, consumers: Any) -> bool:
    readers = consumers.get(p, [])
    return len(readers) == 1 and readers[0] is reader


def _allocates(producer: BoundSymbol, p: Any) -> bool:
    """Whether ``p`` is a fresh tensor ``producer`` allocated (not a view, not a saved copy)."""
    if producer.sym is LINEAR_FWD:
        return p is producer.output[0]
    return producer.sym in ACCUMULATE_ARG or producer.sym.name in _ALLOCATING


def _writable_in_place(p: Any, reader: BoundSymbol, producers: Any, consumers: Any) -> bool:
    """Whether ``reader`` may overwrite ``p``: every tensor on the chain of views from ``p`` back
    to the op that allocated it is read by the next link alone, and that op allocates its output."""
    while _read_only_by(p, reader, consumers) and (producer := producers.get(p, None)) is not None:
        if _allocates(producer, p):
            return True
        if producer.sym.name not in _VIEWING:
            return False
        reader, p = producer, producer.args[0]
    return False


def _dtype(p: Any) -> torch.dtype | None:
    return dtypes.to_torch_dtype(p.dtype) if isinstance(p, TensorProxy) else None


def _is_cast(bsym: BoundSymbol | None) -> bool:
    """A dtype conversion: Thunder's, or the torch executor's ``Tensor.to`` that runs it."""
    if bsym is None or bsym.sym.name not in ("convert_element_type", "to"):
        return False
    a, out = bsym.args[0], bsym.output
    return (
        isinstance(a, TensorProxy)
        and isinstance(out, TensorProxy)
        and (a.shape, a.device) == (out.shape, out.device)
    )


def _exact_widening(bsym: BoundSymbol | None) -> bool:
    """A cast to a wider dtype that holds every value of the narrower one."""
    return _is_cast(bsym) and (_dtype(bsym.args[0]), _dtype(bsym.output)) in _EXACT_WIDENING


def _widened(p: Any, reader: BoundSymbol, producers: Any, consumers: Any) -> BoundSymbol | None:
    """The exact widening that produced ``p``, when ``reader`` alone reads ``p``."""
    cast = producers.get(p, None)
    return cast if _exact_widening(cast) and _read_only_by(p, reader, consumers) else None


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
    elif _is_cast(bsym) and _is_plain_add(add := producers.get(bsym.args[0], None)):
        casts = [_widened(a, add, producers, consumers) for a in add.args]
        if not _read_only_by(bsym.args[0], bsym, consumers) or any(c is None for c in casts):
            return None
        pairs, ops = [(c.args[0], c) for c in casts], [add, *casts]
    else:
        return None
    out = bsym.output
    if not all(a.shape == out.shape and _dtype(a) == _dtype(out) for a, _ in pairs):
        return None
    return pairs, ops


def _plain_product(gemm: BoundSymbol) -> bool:
    """Whether ``gemm`` computes its product alone: it adds it into no buffer and adds no bias,
    so that its output may take a scale, or another summand, without changing either."""
    at = ACCUMULATE_ARG.get(gemm.sym)
    if at is not None and len(gemm.args) > at and gemm.args[at] is not None:
        return False
    return not (gemm.sym is UNQUANTIZED_FWD and gemm.args[2] is not None)


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
        if not _plain_product(gemm):
            continue  # accumulating already, or a bias that would be added twice
        if _read_only_by(product, reader, consumers) and _writable_in_place(
            other, other_reader, producers, consumers
        ):
            at = ACCUMULATE_ARG[gemm.sym]
            args = list(gemm.args) + [None] * (at + 1 - len(gemm.args))
            args[at] = other
            yield (gemm, *ops), gemm.from_bsym(args=tuple(args), output=bsym.output)


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
    if _is_cast(bsym):
        mul = producers.get(bsym.args[0], None)
        if not (_is_constant_mul(mul) and _read_only_by(bsym.args[0], bsym, consumers)):
            return None
        chain.append(mul)
    elif not _is_constant_mul(bsym):
        return None
    (t,) = (a for a in mul.args if isinstance(a, TensorProxy))
    (s,) = (a for a in mul.args if not isinstance(a, TensorProxy))
    if chain:
        cast = _widened(t, mul, producers, consumers)
        if cast is None:
            return None
        chain.append(cast)
        t = cast.args[0]
    if _dtype(t) != _dtype(bsym.output) or t.shape != bsym.output.shape:
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
    if gemm is None or gemm.sym not in _SCALABLE or gemm.kwargs.get("scale", 1.0) != 1.0:
        return
    if not _plain_product(gemm):
        return  # the sum or the bias would be scaled too
    if not _read_only_by(t, chain[-1] if chain else bsym, consumers):
        return
    yield (gemm, *chain), gemm.from_bsym(kwargs={**gemm.kwargs, "scale": s}, output=bsym.output)


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
        if not readers or not all(
            r.sym in (UNQUANTIZED_DGRAD, UNQUANTIZED_WGRAD)
            and r.args[0] is bsym.output
            and all(a is not bsym.output for a in r.args[1:])
            and r.kwargs.get("scale", 1.0) == 1.0
            for r in readers
        ):
            continue
        t, s, chain = found
        read_at = writes.position(chain[-1] if chain else bsym)
        if writes.ever_written(bsym.output) or not writes.reaches(t, read_at, readers):
            continue
        for r in readers:
            swapped[id(r)] = r.from_bsym(args=(t, *r.args[1:]), kwargs={**r.kwargs, "scale": s})
        dropped.update(map(id, (bsym, *chain)))
    return _replaced(trace, swapped, dropped)


def fold_scales(trace: TraceCtx) -> TraceCtx:
    """Fold a product's scaling by a constant (a LoRA adapter's ``scaling``) into the unquantized
    GEMMs around it, as cuBLAS's alpha: into the GEMM that produced it, when nothing else reads its
    product, else into the dgrad and wgrad that read it (the gradient flowing into the adapter).
    One rounding instead of two, and no elementwise kernel. Run before ``accumulate_sums``, whose
    sums the scaled products then feed directly."""
    return _scale_in_consumers(_fold(trace, _scale_in_producer))


def accumulate_sums(trace: TraceCtx) -> TraceCtx:
    """Replace ``gemm(...) + g`` by a GEMM that adds its product into g's buffer (cuBLAS beta = 1,
    as TE's fused backward linear + add), when nothing else reads g or a view of it: an FP8 dgrad
    or an unquantized linear's forward or dgrad, summed with another gradient of the same input
    or with another linear's output (a LoRA adapter's and its base's).

    The sum then needs no third activation-sized buffer nor an elementwise kernel: for a frozen
    linear with a LoRA adapter, the backward's largest live buffer. Run after duplicate casts and
    views are merged, which changes who reads what.
    """
    return _fold(trace, _accumulating_gemm)


def drop_exact_round_trips(trace: TraceCtx) -> TraceCtx:
    """Read ``a`` where the trace casts it to a wider dtype and back (the gradient of a bfloat16
    add, whose backward Thunder writes in float32): an identity that a fusion executor would still
    run as a copy kernel. A round trip whose result the trace returns is kept, so that no output
    is one of the trace's own tensors by another name, and so is one whose result is written in
    place, or whose source is written before the result is read."""
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    writes = Writes(trace)
    returned = {id(o) for o in tree_flatten(trace.output)[0]}
    redundant: dict = {}
    kept = []
    for bsym in trace.bound_symbols:
        inner = producers.get(bsym.args[0], None) if _is_cast(bsym) else None
        if _exact_widening(inner):
            a, out = inner.args[0], bsym.output
            if (
                id(out) not in returned
                and _dtype(a) == _dtype(out)
                and not writes.ever_written(out)
                and writes.reaches(a, writes.position(inner), consumers.get(out, []))
            ):
                redundant[variableify(out)] = a
                continue
        kept.append(bsym)
    if not redundant:
        return trace
    return dce(with_bound_symbols(trace, list(replace_redundant_inputs(redundant, kept))))


def _fold(trace: TraceCtx, fold: Any) -> TraceCtx:
    """Apply ``fold(bsym, producers, consumers)`` to every bound symbol: of the folds it offers,
    (other bound symbols, a replacement), the first whose replacement reads what they read, no
    write in between (``Writes.moved_reads_unchanged``), is made: the replacement takes ``bsym``'s
    place and the others, whose work it now does, are removed."""
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    writes = Writes(trace)
    dropped: set[int] = set()
    swapped: dict[int, BoundSymbol] = {}
    for bsym in trace.bound_symbols:
        at = writes.position(bsym)
        for absorbed, replacement in fold(bsym, producers, consumers):
            if writes.moved_reads_unchanged([*absorbed, bsym], replacement, at):
                swapped[id(bsym)] = replacement
                dropped.update(map(id, absorbed))
                break
    return _replaced(trace, swapped, dropped)


def _replaced(trace: TraceCtx, swapped: dict[int, BoundSymbol], dropped: set[int]) -> TraceCtx:
    """``trace`` with the bound symbols keyed (by id) in ``swapped`` replaced and those in
    ``dropped`` removed; ``trace`` itself when nothing is swapped."""
    if not swapped:
        return trace
    return with_bound_symbols(
        trace, [swapped.get(id(b), b) for b in trace.bound_symbols if id(b) not in dropped]
    )


def _gelu_folded(bsym: BoundSymbol, producers: Any, consumers: Any) -> Iterator[Fold]:
    """(the GELU, ``bsym`` reading the GELU's input instead) when ``bsym`` is a te_v2 forward or
    dy quantization whose tensor operand an exact GELU (or its backward) produced for it alone."""
    if bsym.sym is LINEAR_FWD:
        gelu_sym, flag = GELU, {"gelu": True}
    elif bsym.sym is QUANTIZE_GRAD_OUTPUT:
        gelu_sym, flag = GELU_BACKWARD, {}
    else:
        return
    operand = bsym.args[0]
    gelu = producers.get(operand, None)
    if gelu is None or gelu.sym is not gelu_sym or not _read_only_by(operand, bsym, consumers):
        return
    args = (*gelu.args, *bsym.args[len(gelu.args) :])
    yield (gelu,), bsym.from_bsym(args=args, kwargs={**bsym.kwargs, **flag})


def fuse_gelus(trace: TraceCtx) -> TraceCtx:
    """Compute each exact GELU read only by a te_v2 forward inside that forward's input
    quantization, and each GELU backward read only by a dy quantization inside it.

    ``te_v2_linear_fwd(gelu(a), ...)`` becomes ``te_v2_linear_fwd(a, ..., gelu=True)`` and
    ``te_v2_quantize_grad_output(gelu_backward(g, a))`` becomes ``te_v2_quantize_grad_output(g, a)``:
    the activation, or its gradient, is never written in BF16 to be read back by the cast. The
    fold moves the read of ``a`` (and ``g``) to the te_v2 symbol, and is not made where a write
    in between would change them.
    """
    return _fold(trace, _gelu_folded)
