"""Pass ``input_recasts``: the backward casts a linear's input to FP8 again for its wgrad, where
the backward keeps that input anyway, so that the forward saves no FP8 copy of it.

A wgrad reads the column-wise FP8 copy of x, a byte per element saved from forward to backward.
Often the backward keeps the BF16 tensors x is made of for another reader: the attention's
output, which its backward reads, is o_proj's input through a transpose and a reshape; the gate
and up projections' outputs, which SwiGLU's backward reads, are down_proj's input through the
SwiGLU fold. Saving the copy then holds a byte per element on top of what is kept anyway
(torchao's float8 casts again in the backward instead). Here the backward gets a cast of x alone
(``te_v2_linear_fwd`` with no output and no weight, only the input's copy), placed before the
first wgrad and after the gradient it reads, made from what the backward keeps through copies of
the forward's views; the forward sync hands it the scale the forward cast with (``replay``), so
its copy is bitwise the one the forward would have saved, and the forward casts row-wise only.

Only recomputation that costs no memory is made: x, or each operand of a folded activation,
must come through views and copies (``_VIEWS``), unwritten from the forward to the wgrad, from a
tensor the forward saves anyway (a backward symbol reads it, and no fuser can take the symbol that
makes it, whose rematerialization may compute its own tensors again in the backward rather than
save them) that nothing outside the trace can write, or from a small trace input, which the
forward snapshots (``.data`` writes between forward and backward would reach the recast, where
eager's wgrad reads the tensor it saved). With a fuser after te_v2, x may instead be made by its
elementwise ops from tensors the backward keeps anyway (``_recomputed``: a norm's output, from
the norm's input and scale), which the copied ops compute again in a region of that fuser; the
cast is then of what eager would compute from those tensors, which the fuser's forward region may
not round alike (Inductor keeps a residual sum in float32 where eager rounds it to bfloat16), so
x^T may differ from the forward's x in a last bit before the cast. Where x is instead the product
of two tensors saved anyway, which only this forward reads, the forward multiplies them itself
(``times``), as PyTorch's ``*`` does, and so does the recast: left to a fuser, the product may be
computed from values it keeps in float32 without the rounding the saved tensor took (Inductor
drops such round trips). A recast is made only where it lowers the step's peak memory
(``_peak.py``), as ``weight_recasts`` does; under CUDA graphs, whose forward graph holds what it
saves between steps, every one that can be is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from typing import Any

import thunder.torch as ltorch
from thunder.core import prims, utils
from thunder.core.proxies import AnyProxy, TensorProxy, variableify
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol, BoundSymbolTag, has_tags
from thunder.core.trace import TraceCtx, tracectx
from thunder.core.transform_common import dce
from thunder.extend import FusionExecutor

from te_v2_executor.passes._peak import Saving, peak_needs
from te_v2_executor.passes._trace import known_numel, made_in_backward, ordered_read, product, replaced
from te_v2_executor.passes._writes import Writes, names_as_run, reads_values
from te_v2_executor.passes.syncs import replaying
from te_v2_executor.symbols import LINEAR_FWD, QUANTIZE_INPUT, SNAPSHOT, arg, in_backward, with_args

# Ops that make an exact copy or view of their one tensor input, by name: Thunder's torch and prims
# versions, and the torch executor's that run them.
_VIEW_OPS = (
    "reshape",
    "view",
    "transpose",
    "permute",
    "contiguous",
    "expand",
    "broadcast_in_dim",
    "unsqueeze",
    "squeeze",
    "flatten",
    "shallow_copy",
)
_VIEWS = frozenset(
    names_as_run(s for module in (prims, ltorch) for n in _VIEW_OPS if (s := getattr(module, n, None)))
    | set(_VIEW_OPS)
)
_MAX_VIEWS = 8

# Elementwise ops whose result the backward may compute again from the same operands, by name, as
# for the views; a recomputation takes at most this many ops, views included.
_ELEMENTWISE_OPS = ("convert_element_type", "mul", "add", "sub", "neg")
_RECOMPUTABLE = _VIEWS | frozenset(
    names_as_run(s for module in (prims, ltorch) for n in _ELEMENTWISE_OPS if (s := getattr(module, n, None)))
    | set(_ELEMENTWISE_OPS)
)
_MAX_RECOMPUTED = 12
# The ops Thunder's rematerialization never moves from the forward's region to the backward's.
_NOT_MOVED = {prims.OpTags.REDUCTION_OP, prims.OpTags.RANDOM_OP, prims.OpTags.MATMUL_OP}


def _kept_in_backward(trace: TraceCtx) -> set[str]:
    """The names of the tensors a backward symbol reads the values of."""
    return {
        p.name
        for b in trace.bound_symbols
        if in_backward(b) and reads_values(b)
        for p in b.flat_proxy_args
        if isinstance(p, TensorProxy)
    }


@dataclass(frozen=True)
class _Facts:
    """What the pass knows of the trace: producers, consumers, writes, the tensors the backward
    keeps (by name) and the forward's outputs."""

    producers: Any
    consumers: Any
    writes: Writes
    kept: set[str]
    outputs: list[TensorProxy]
    fusers: list[FusionExecutor]

    def saved_anyway(self, p: TensorProxy) -> bool:
        """Whether the forward saves ``p`` for the backward whatever this pass does: a backward
        symbol reads it, and no fuser can take the symbol that makes it, so no fuser's
        rematerialization computes it again in the backward instead (as Thunder's does a norm's
        normalized input, from the norm's input and scale)."""
        return p.name in self.kept and not self.fusible(self.producers.get(p, None))

    def fusible(self, bsym: BoundSymbol | None) -> bool:
        """Whether a fuser listed after te_v2 can take ``bsym``."""
        return any(f.can_fuse(bsym) for f in self.fusers)

    def reachable_from_outside(self, p: TensorProxy) -> bool:
        """Whether code outside the trace can write into ``p``'s storage between forward and
        backward (through ``.data``, which no version counter sees): an input's, or an output's."""
        return not self.writes.made_here(p) or any(self.writes.same_storage(p, o) for o in self.outputs)


def _views_of_kept(p: TensorProxy, facts: _Facts) -> tuple[list[BoundSymbol], list[TensorProxy]] | None:
    """The forward views that make ``p`` (first one first) from its leaf: a tensor the backward
    keeps anyway that nothing outside the trace can write, or a trace input (which the pass then
    snapshots); None where ``p`` is made otherwise."""
    chain: list[BoundSymbol] = []
    while True:
        producer = facts.producers.get(p, None)
        if _unpacked(producer):
            return chain, [p]
        if facts.saved_anyway(p) and not facts.reachable_from_outside(p):
            return chain, [p]
        tensors = _operands(producer)
        if (
            in_backward(producer)
            or producer.sym.name not in _VIEWS
            or len(tensors) != 1
            or len(chain) == _MAX_VIEWS
        ):
            return None
        chain.insert(0, producer)
        p = tensors[0]


def _recomputed(root: TensorProxy, facts: _Facts) -> tuple[list[BoundSymbol], list[TensorProxy]] | None:
    """The forward's elementwise ops and views that make ``root`` (in trace order), every one a
    fuser can take, and the leaves they start from; None where ``root`` is made otherwise, or
    with no fuser after te_v2.

    Copied into the backward, the ops make a fuser's region there, which reads its leaves through
    ``te_v2_ordered``: read directly from the forward's region, Thunder's rematerialization would
    move the ops into the forward and save their result, as its min-cut weighs a tensor by its
    dtype's bytes alone, a bfloat16 result below a bfloat16 input and a float32 scale. So the
    leaves are what the forward saves, and must be what it saves anyway: the ops go back as far as
    they can, to trace inputs (which the pass then snapshots), tensors the forward saves anyway
    (``saved_anyway``), and, where they cannot go further, tensors a backward symbol reads that
    the fuser cannot compute again from what it has (``at_hand``): a norm's input, the residual
    sum of a linear's output, and its scale, which a reduction makes; not the normalized input,
    which the norm's weight gradient reads and Thunder computes again from those two."""
    if not facts.fusers:
        return None
    walked: dict[str, tuple[dict[int, BoundSymbol], dict[str, TensorProxy]] | None] = {}
    computable: dict[str, bool] = {}

    def walk(p: TensorProxy) -> tuple[dict[int, BoundSymbol], dict[str, TensorProxy]] | None:
        if p.name not in walked:
            walked[p.name] = made(p)
        return walked[p.name]

    def made(p: TensorProxy) -> tuple[dict[int, BoundSymbol], dict[str, TensorProxy]] | None:
        producer = facts.producers.get(p, None)
        inside = not facts.reachable_from_outside(p)
        if p is not root and (_unpacked(producer) or (facts.saved_anyway(p) and inside)):
            return {}, {p.name: p}
        if (
            producer is not None
            and not in_backward(producer)
            and producer.sym.name in _RECOMPUTABLE
            and isinstance(producer.output, TensorProxy)
            and facts.fusible(producer)
        ):
            found = [walk(a) for a in _operands(producer)]
            if all(f is not None for f in found):
                ops, leaves = {id(producer): producer}, {}
                for more_ops, more_leaves in found:
                    ops.update(more_ops)
                    leaves.update(more_leaves)
                return ops, leaves
        if p is not root and p.name in facts.kept and inside and not all(map(at_hand, _operands(producer))):
            return {}, {p.name: p}
        return None

    def at_hand(p: TensorProxy) -> bool:
        """Whether the backward has ``p``, or Thunder's rematerialization could compute it again
        there, without the forward saving more: a trace input, a tensor a backward symbol reads,
        or what a fuser's op that rematerialization may move (no reduction, random op or matmul)
        makes of them."""
        if p.name not in computable:
            producer = facts.producers.get(p, None)
            computable[p.name] = (
                _unpacked(producer)
                or p.name in facts.kept
                or (
                    not has_tags(producer, _NOT_MOVED)
                    and facts.fusible(producer)
                    and all(map(at_hand, _operands(producer)))
                )
            )
        return computable[p.name]

    found = walk(root)
    if found is None or len(found[0]) > _MAX_RECOMPUTED:
        return None
    ops, leaves = found
    return sorted(ops.values(), key=facts.writes.position), list(leaves.values())


def _operands(bsym: BoundSymbol) -> list[TensorProxy]:
    """The tensors ``bsym`` reads."""
    return [a for a in bsym.flat_proxy_args if isinstance(a, TensorProxy)]


def _unpacked(producer: BoundSymbol | None) -> bool:
    """Whether ``producer`` makes a trace input: none does, or the unpack that gives it."""
    return producer is None or producer.sym.id is prims.PrimIDs.UNPACK_TRIVIAL


def _sources(bsym: BoundSymbol) -> list[TensorProxy]:
    """What the FP8 input of forward ``bsym`` is computed from: x, and a folded SwiGLU's up."""
    if bsym.sym is QUANTIZE_INPUT:
        return [bsym.args[0]]
    return [a for a in (arg(bsym, "x"), arg(bsym, "up")) if a is not None]


def _saved_input(bsym: BoundSymbol) -> TensorProxy | None:
    """The column-wise copy of its input forward ``bsym`` saves, None where it saves none."""
    if bsym.sym is QUANTIZE_INPUT:
        return bsym.output[1]
    if bsym.sym is LINEAR_FWD and arg(bsym, "x_q") is None and arg(bsym, "replay") is None:
        return bsym.output[1]
    return None


@dataclass
class _Recast:
    """The backward's cast of one forward's input, made from ``sources`` (x and a folded SwiGLU's
    up; or, with ``times``, the two operands of the product x is, which the forward then
    multiplies itself), each through its ``ops`` (views, or a fuser's elementwise ops) copied,
    placed before ``first_reader``, the first wgrad that reads the saved copy; ``shape_readers``:
    the other forwards that read x, only for its shape (they read the shared cast); ``outside``:
    the trace inputs the ops start from (a norm's weight), which code outside the trace could write
    before the backward through ``.data``, so the forward snapshots them; ``pinned``: the other
    leaves of a fuser's ops, which they read through ``te_v2_ordered``."""

    forward: BoundSymbol
    sources: list[TensorProxy]
    ops: list[list[BoundSymbol]]
    first_reader: BoundSymbol
    times: bool = False
    shape_readers: list[BoundSymbol] = field(default_factory=list)
    outside: list[TensorProxy] = field(default_factory=list)
    pinned: list[TensorProxy] = field(default_factory=list)
    snapshot: BoundSymbol | None = None

    def take_snapshot(self, trace: TraceCtx) -> list[BoundSymbol]:
        """The forward's snapshot of the trace inputs in ``outside``, to run before it (none when
        there are none)."""
        if self.outside:
            with tracectx(trace):
                copies = SNAPSHOT.meta(*self.outside)
            self.snapshot = SNAPSHOT.bind(*self.outside, output=copies)
        return [self.snapshot] if self.snapshot is not None else []

    def readers_of_the_first_operand(self) -> dict[int, BoundSymbol]:
        """The forwards that read x only for its shape, reading the product's first operand, of
        x's shape and dtype, instead (by id), so that nothing reads x any more."""
        return {id(r): with_args(r, x=self.sources[0]) for r in self.shape_readers}

    def bound_symbols(
        self, trace: TraceCtx, producers: Any, replay: Any, rows: dict[int, int]
    ) -> list[BoundSymbol]:
        """The copies of the ops, then the cast, all tagged as backward."""
        made = []
        taken = zip(self.snapshot.args, self.snapshot.output, strict=True) if self.snapshot else ()
        copies = {variableify(leaf): copy for leaf, copy in taken}
        after = made_in_backward(self.first_reader, producers)
        for leaf in self.pinned:
            wait, copies[variableify(leaf)] = ordered_read(trace, leaf, [after] if after is not None else [])
            made.append(wait)
        for ops in self.ops:
            for op in ops:
                with tracectx(trace):
                    fresh = TensorProxy(like=op.output)
                swap = {variableify(op.output): fresh, **copies}
                made.append(op.from_bsym_swap_proxies(swap))
                copies[variableify(op.output)] = fresh
        x, *other = [copies.get(variableify(s), s) for s in self.sources]
        state = self.forward.kwargs["state"]
        with tracectx(trace):
            copy = TensorProxy(like=_saved_input(self.forward))
            marker = AnyProxy(None, prefix="amax_ready")
        replayed = dict(replay=replay, replay_row=rows[id(state)]) if id(state) in rows else {}
        operand = dict(times=other[0]) if self.times else dict(up=other[0] if other else None)
        cast = LINEAR_FWD.bind(
            x,
            None,
            None,
            state=state,
            compute_output=False,
            save_input=True,
            save_weight=False,
            gelu=self.forward.sym is LINEAR_FWD and arg(self.forward, "gelu"),
            after=after,
            **operand,
            **replayed,
            output=(None, copy, None, marker),
        )
        for b in (*made, cast):
            b.tags.add(BoundSymbolTag.BACKWARD)
        return [*made, cast]

    def forward_without_copy(self) -> BoundSymbol:
        """The forward, casting its input row-wise only (multiplying it first, with ``times``),
        after the snapshot."""
        forward = self.forward
        changes = dict(x=self.sources[0], times=self.sources[1]) if self.times else {}
        if self.snapshot is not None:
            changes["after"] = self.snapshot.output[0]
        if forward.sym is QUANTIZE_INPUT:
            x_q, _ = forward.output
            x = changes.pop("x", forward.args[0])
            kwargs = {**forward.kwargs, **changes, "columnwise": False}
            return forward.from_bsym(args=(x,), kwargs=kwargs, output=(x_q, None))
        y, _, w_saved, amax_ready = forward.output
        return with_args(forward, save_input=False, **changes, output=(y, None, w_saved, amax_ready))


def _reads_only_the_shape(bsym: BoundSymbol) -> bool:
    """A forward that reads x for its shape only, its FP8 copy from a shared cast."""
    return bsym.sym is LINEAR_FWD and arg(bsym, "x_q") is not None


def _takes_a_product(bsym: BoundSymbol) -> bool:
    """Whether forward ``bsym`` may multiply its input itself: a plain cast of x."""
    return bsym.sym is QUANTIZE_INPUT or not (arg(bsym, "gelu") or arg(bsym, "up") is not None)


# A trace input a recast starts from is snapshotted in the forward: only one of at most this share
# of x's elements (a norm's weight, broadcast), so that the snapshot costs far less than the copy.
_SNAPSHOT_SHARE = 8


def _recast(bsym: BoundSymbol, first: BoundSymbol, facts: _Facts) -> _Recast | None:
    """The recast of forward ``bsym``'s input for its wgrads, ``first`` the first of them; None
    where it cannot be made exactly."""
    writes = facts.writes
    sources = _sources(bsym)
    x = sources[0]
    found, computed = [], []
    for s in sources:
        made = _views_of_kept(s, facts)
        if made is None and (made := _recomputed(s, facts)) is not None:
            computed += made[1]
        found.append(made)
    times = False
    shape_readers = [r for r in facts.consumers.get(x, []) if r is not bsym]
    if found == [None] and _takes_a_product(bsym) and all(map(_reads_only_the_shape, shape_readers)):
        product_of = product(x, facts.producers)
        if product_of is not None:
            a, b, ops = product_of
            sources, found, times = [a, b], [_views_of_kept(a, facts), _views_of_kept(b, facts)], True
            product_at = min(map(writes.position, ops))  # where the product read a and b
            if not all(writes.unchanged(p, product_at, writes.position(bsym)) for p in (a, b)):
                return None
    if any(f is None for f in found):
        return None
    ops = [made for made, _ in found]
    leaves = [leaf for _, made_from in found for leaf in made_from]
    outside = [leaf for leaf in leaves if facts.reachable_from_outside(leaf)]
    sizes = [known_numel(p) for p in (x, *outside)]
    if None in sizes or any(_SNAPSHOT_SHARE * n > sizes[0] for n in sizes[1:]):
        return None
    # What the ops read must be what the forward's read (from the first of them), and, but for the
    # snapshotted inputs, what the backward reads (to the first wgrad).
    start = min(map(writes.position, [bsym, *(op for made in ops for op in made)]))
    snapshotted = {o.name for o in outside}
    for p in [*leaves, *(p for made in ops for op in made for p in op.flat_proxy_args)]:
        end = bsym if p.name in snapshotted else first
        if not writes.unchanged(p, start, writes.position(end)):
            return None
    # a fuser's ops read their leaves through te_v2_ordered (see _recomputed)
    pinned = [leaf for leaf in computed if leaf.name not in snapshotted]
    return _Recast(bsym, sources, ops, first, times, shape_readers if times else [], outside, pinned)


def _recastable(trace: TraceCtx, every: bool, fusers: list[FusionExecutor]) -> list[_Recast]:
    """The forwards whose saved input copy the backward can make again exactly (see the module
    docstring): with ``every``, all of them, else those the lowest peak needs."""
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    returned = trace.bound_symbols[-1].args[0]
    outputs = [
        o
        for o in tree_flatten(returned.get("fw_flat_out", returned["output"]))[0]
        if isinstance(o, TensorProxy)
    ]
    facts = _Facts(producers, consumers, Writes(trace), _kept_in_backward(trace), outputs, fusers)
    found = []
    for bsym in trace.bound_symbols:
        x_saved = None if in_backward(bsym) else _saved_input(bsym)
        readers = consumers.get(x_saved, []) if x_saved is not None else []
        if readers and all(map(in_backward, readers)):
            first = min(readers, key=facts.writes.position)
            if (recast := _recast(bsym, first, facts)) is not None:
                found.append(recast)
    position = facts.writes.position
    savings = [Saving(_saved_input(r.forward), position(r.forward), position(r.first_reader)) for r in found]
    return list(compress(found, peak_needs(trace, facts.writes, savings, every=every)))


def recast_inputs(trace: TraceCtx, fusers: list[FusionExecutor], *, every: bool = False) -> TraceCtx:
    """Have the wgrads of each forward whose input the backward keeps anyway read a copy cast in
    the backward rather than one the forward saved (see the module docstring for which; with
    ``every``, each one that can, peak or not); ``fusers``: the fusion executors after te_v2,
    whose rematerialization decides what else the forward saves."""
    recasts = _recastable(trace, every, fusers)
    if not recasts:
        return trace
    trace, replay, rows = replaying(trace, [r.forward.kwargs["state"] for r in recasts])
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    position = {id(b): i for i, b in enumerate(trace.bound_symbols)}
    swapped: dict[int, BoundSymbol] = {}
    inserted: dict[int, list[BoundSymbol]] = {}
    for r in recasts:
        inserted.setdefault(position[id(r.forward)], []).extend(r.take_snapshot(trace))
        made = r.bound_symbols(trace, producers, replay, rows)
        inserted.setdefault(position[id(r.first_reader)], []).extend(made)
        swapped[id(r.forward)] = r.forward_without_copy()
        swapped.update(r.readers_of_the_first_operand())
        x_saved = _saved_input(r.forward)
        swap = {variableify(x_saved): made[-1].output[1]}
        for reader in consumers[x_saved]:  # the wgrads
            swapped[id(reader)] = reader.from_bsym_swap_proxies(swap, skip_output=True)
    return dce(replaced(trace, swapped, inserted=inserted))  # a folded product's ops
