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

Only exact recomputation is made: x, or each operand of a folded activation, must be a tensor a
backward symbol reads anyway, a parameter, or views and copies of one (``_VIEWS``), unwritten
from the forward to the wgrad. Where x is instead the product of two such tensors, which only
this forward reads (an RMSNorm's output: its weight times the normalized input, both of which the
norm's backward reads), the forward multiplies them itself (``times``), as PyTorch's ``*`` does,
and so does the recast: left to a fuser, the product may be computed from values it keeps in
float32 without the rounding the saved tensor took (Inductor drops such round trips), which the
backward could not reproduce. Under CUDA graphs, which would run each recast outside them, every
copy stays saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import thunder.torch as ltorch
from thunder.core import prims, utils
from thunder.core.proxies import AnyProxy, TensorProxy, variableify
from thunder.core.symbol import BoundSymbol, BoundSymbolTag
from thunder.core.trace import TraceCtx, tracectx
from thunder.core.transform_common import dce

from te_v2_executor.passes._trace import made_in_backward, product, replaced
from te_v2_executor.passes._writes import Writes, names_as_run, reads_values
from te_v2_executor.passes.recasts import is_parameter
from te_v2_executor.passes.syncs import replaying
from te_v2_executor.symbols import LINEAR_FWD, QUANTIZE_INPUT, arg, in_backward, with_args

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


def _kept_in_backward(trace: TraceCtx) -> set[str]:
    """The names of the tensors a backward symbol reads the values of."""
    return {
        p.name
        for b in trace.bound_symbols
        if in_backward(b) and reads_values(b)
        for p in b.flat_proxy_args
        if isinstance(p, TensorProxy)
    }


def _views_of_kept(p: TensorProxy, kept: set[str], producers: Any) -> list[BoundSymbol] | None:
    """The forward views that make ``p`` from a tensor the backward keeps anyway, first one first
    (empty where ``p`` is kept itself); None where ``p`` is made otherwise."""
    chain: list[BoundSymbol] = []
    while p.name not in kept and not is_parameter(p, producers):
        producer = producers.get(p, None)
        tensors = [a for a in getattr(producer, "flat_proxy_args", ()) if isinstance(a, TensorProxy)]
        if (
            producer is None
            or in_backward(producer)
            or producer.sym.name not in _VIEWS
            or len(tensors) != 1
            or len(chain) == _MAX_VIEWS
        ):
            return None
        chain.insert(0, producer)
        p = tensors[0]
    return chain


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
    multiplies itself), each through its ``chains`` of views copied, placed before
    ``first_reader``, the first wgrad that reads the saved copy; ``shape_readers``: the other
    forwards that read x, only for its shape (they read the shared cast)."""

    forward: BoundSymbol
    sources: list[TensorProxy]
    chains: list[list[BoundSymbol]]
    first_reader: BoundSymbol
    times: bool = False
    shape_readers: list[BoundSymbol] = field(default_factory=list)

    def readers_of_the_first_operand(self) -> dict[int, BoundSymbol]:
        """The forwards that read x only for its shape, reading the product's first operand, of
        x's shape and dtype, instead (by id), so that nothing reads x any more."""
        return {id(r): with_args(r, x=self.sources[0]) for r in self.shape_readers}

    def bound_symbols(
        self, trace: TraceCtx, producers: Any, replay: Any, rows: dict[int, int]
    ) -> list[BoundSymbol]:
        """The copies of the views, then the cast, all tagged as backward."""
        made, copies = [], {}
        for chain in self.chains:
            for view in chain:
                with tracectx(trace):
                    fresh = TensorProxy(like=view.output)
                swap = {variableify(view.output): fresh, **copies}
                made.append(view.from_bsym_swap_proxies(swap))
                copies[variableify(view.output)] = fresh
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
            after=made_in_backward(self.first_reader, producers),
            **operand,
            **replayed,
            output=(None, copy, None, marker),
        )
        for b in (*made, cast):
            b.tags.add(BoundSymbolTag.BACKWARD)
        return [*made, cast]

    def forward_without_copy(self) -> BoundSymbol:
        """The forward, casting its input row-wise only (multiplying it first, with ``times``)."""
        forward = self.forward
        if forward.sym is QUANTIZE_INPUT:
            x_q, _ = forward.output
            kwargs = {**forward.kwargs, "columnwise": False}
            if self.times:
                return forward.from_bsym(
                    args=(self.sources[0],), kwargs={**kwargs, "times": self.sources[1]}, output=(x_q, None)
                )
            return forward.from_bsym(kwargs=kwargs, output=(x_q, None))
        y, _, w_saved, amax_ready = forward.output
        product = dict(x=self.sources[0], times=self.sources[1]) if self.times else {}
        return with_args(forward, save_input=False, **product, output=(y, None, w_saved, amax_ready))


def _reads_only_the_shape(bsym: BoundSymbol) -> bool:
    """A forward that reads x for its shape only, its FP8 copy from a shared cast."""
    return bsym.sym is LINEAR_FWD and arg(bsym, "x_q") is not None


def _takes_a_product(bsym: BoundSymbol) -> bool:
    """Whether forward ``bsym`` may multiply its input itself: a plain cast of x."""
    return bsym.sym is QUANTIZE_INPUT or not (arg(bsym, "gelu") or arg(bsym, "up") is not None)


def _recast(bsym: BoundSymbol, first: BoundSymbol, trace: Any) -> _Recast | None:
    """The recast of forward ``bsym``'s input for its wgrads, ``first`` the first of them; None where
    it cannot be made exactly. ``trace``: (producers, consumers, writes, kept) of the trace."""
    producers, consumers, writes, kept = trace
    sources = _sources(bsym)
    chains = [_views_of_kept(s, kept, producers) for s in sources]
    times = False
    shape_readers = [r for r in consumers.get(sources[0], []) if r is not bsym]
    if chains == [None] and _takes_a_product(bsym) and all(map(_reads_only_the_shape, shape_readers)):
        found = product(sources[0], producers)
        if found is not None:
            a, b, ops = found
            sources, chains, times = (
                [a, b],
                [_views_of_kept(a, kept, producers), _views_of_kept(b, kept, producers)],
                True,
            )
            product_at = min(map(writes.position, ops))  # where the product read a and b
            if not all(writes.unchanged(p, product_at, writes.position(bsym)) for p in (a, b)):
                return None
    if any(c is None for c in chains):
        return None
    read = [*sources, *(p for c in chains for v in c for p in v.flat_proxy_args)]
    span = (writes.position(bsym), writes.position(first))
    if not all(writes.unchanged(p, *span) for p in read if isinstance(p, TensorProxy)):
        return None
    return _Recast(bsym, sources, chains, first, times, shape_readers if times else [])


def _recastable(trace: TraceCtx, graphed: bool) -> list[_Recast]:
    """The forwards whose saved input copy the backward can make again exactly (see the module
    docstring)."""
    if graphed:
        return []
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    facts = (producers, consumers, Writes(trace), _kept_in_backward(trace))
    found = []
    for bsym in trace.bound_symbols:
        x_saved = None if in_backward(bsym) else _saved_input(bsym)
        readers = consumers.get(x_saved, []) if x_saved is not None else []
        if readers and all(map(in_backward, readers)):
            first = min(readers, key=facts[2].position)
            if (recast := _recast(bsym, first, facts)) is not None:
                found.append(recast)
    return found


def recast_inputs(trace: TraceCtx, *, graphed: bool = False) -> TraceCtx:
    """Have the wgrads of each forward whose input the backward keeps anyway read a copy cast in
    the backward rather than one the forward saved (see the module docstring for which)."""
    recasts = _recastable(trace, graphed)
    if not recasts:
        return trace
    trace, replay, rows = replaying(trace, [r.forward.kwargs["state"] for r in recasts])
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    position = {id(b): i for i, b in enumerate(trace.bound_symbols)}
    swapped: dict[int, BoundSymbol] = {}
    inserted: dict[int, list[BoundSymbol]] = {}
    for r in recasts:
        made = r.bound_symbols(trace, producers, replay, rows)
        inserted.setdefault(position[id(r.first_reader)], []).extend(made)
        swapped[id(r.forward)] = r.forward_without_copy()
        swapped.update(r.readers_of_the_first_operand())
        x_saved = _saved_input(r.forward)
        swap = {variableify(x_saved): made[-1].output[1]}
        for reader in consumers[x_saved]:  # the wgrads
            swapped[id(reader)] = reader.from_bsym_swap_proxies(swap, skip_output=True)
    return dce(replaced(trace, swapped, inserted=inserted))  # a folded product's ops
