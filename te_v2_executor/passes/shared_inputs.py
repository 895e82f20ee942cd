"""Pass ``shared_inputs``: one FP8 cast of an input that several te_v2 forwards read.

A Hugging Face attention block reads its normalized hidden states with q_proj, k_proj and v_proj,
and a SwiGLU MLP with gate_proj and up_proj. Each te_v2 forward casts its own input, so one tensor
is cast three (two) times, and where the wgrads run, three (two) identical column-wise copies of
it are saved for the backward. Here a ``te_v2_quantize_input`` with the first forward's state
casts it once, before that forward: every forward of the group reads its row-wise copy, every
wgrad the one column-wise copy (built when any of them reads it).

The cast is bitwise the one each forward would have made: the forwards read the same tensor with
the same recipe, and under delayed scaling their input scales agree, because each one's input
history keeps recording what its own cast would have: the shared cast adds its amax into the
input history of every linear of the group (``sharers``), in every trace that shares, with or
without a forward sync (a ``torch.no_grad()`` call records too). Where the scales disagree (a
state dict that gave the linears different histories or scales, or another trace of the
function that casts different tensors for them, as one with an in-place write between their
reads does), the group casts with the first linear's scale, made from the history of that same
tensor: as exact an FP8 copy of it, not bitwise the one the other linears' scales would give.

Grouped are the forwards of the joint trace's forward (not checkpoint recomputes or recasts)
that compute an output from the same proxy, of one recipe and backend, with no GELU folded into
their cast and no write into the input's storage between the first and each of the others. A
linear the backward recomputes (activation checkpointing) casts on its own: its recompute
replays its own forward scale, which must be the one its forward cast with.
"""

from __future__ import annotations

from thunder.core import utils
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, tracectx

from te_v2_executor.passes._trace import replaced
from te_v2_executor.passes._writes import Writes
from te_v2_executor.symbols import (
    LINEAR_FWD,
    QUANTIZE_INPUT,
    arg,
    in_backward,
    is_recast,
    is_recompute,
    with_args,
)


def _shareable(bsym: BoundSymbol, recomputed: set[int]) -> bool:
    """A forward that casts its own input to compute its output, of a linear not recomputed in
    the backward (``recomputed``: the ids of those linears' states)."""
    return (
        bsym.sym is LINEAR_FWD
        and not in_backward(bsym)
        and id(bsym.kwargs["state"]) not in recomputed
        and bsym.kwargs["compute_output"]
        and isinstance(arg(bsym, "x"), TensorProxy)
        and arg(bsym, "x_q") is None
        and arg(bsym, "replay") is None
        and not arg(bsym, "gelu")
    )


def _renamed_from(trace: TraceCtx) -> dict[str, str]:
    """The proxy each of Thunder's renamings of a tensor (``update_aliases``, which follows the
    ops of a function with in-place writes) renames, by name, back to the first one."""
    first: dict[str, str] = {}
    for bsym in trace.bound_symbols:
        if bsym.sym.name == "update_aliases":
            for out, renamed in zip(bsym.flat_outs, bsym.args[0], strict=True):
                if isinstance(out, TensorProxy):
                    first[out.name] = first.get(renamed.name, renamed.name)
    return first


def _groups(trace: TraceCtx, writes: Writes) -> list[list[BoundSymbol]]:
    """The forwards that may share one cast, each group in trace order: same input tensor (one
    proxy, or its renamings), recipe and backend, the input unwritten from the group's first
    forward to each of the others."""
    renamed_from = _renamed_from(trace)
    recomputed = {id(b.kwargs["state"]) for b in trace.bound_symbols if is_recompute(b) and not is_recast(b)}
    open_groups: dict[tuple, list[BoundSymbol]] = {}
    groups = []
    for bsym in (b for b in trace.bound_symbols if _shareable(b, recomputed)):
        state = bsym.kwargs["state"]
        x = arg(bsym, "x")
        key = (renamed_from.get(x.name, x.name), state.recipe, state.backend)
        group = open_groups.get(key)
        if group is None or not writes.unchanged(x, writes.position(group[0]), writes.position(bsym)):
            group = open_groups[key] = []
            groups.append(group)
        group.append(bsym)
    return [g for g in groups if len(g) > 1]


def _shared_cast(group: list[BoundSymbol], trace: TraceCtx) -> tuple[BoundSymbol, dict, list]:
    """The cast of ``group``'s input, its forwards reading it (by id), and (saved copy, shared
    copy) for each of their column-wise copies the shared one replaces."""
    first = group[0]
    x, state = arg(first, "x"), first.kwargs["state"]
    columnwise = any(b.kwargs["save_input"] for b in group)
    options = dict(state=state, sharers=tuple(b.kwargs["state"] for b in group[1:]), columnwise=columnwise)
    with tracectx(trace):
        x_q, x_saved = QUANTIZE_INPUT.meta(x, **options)
    cast = QUANTIZE_INPUT.bind(x, **options, output=(x_q, x_saved))
    forwards, replaced_by = {}, []
    for b in group:
        y, own_saved, w_saved, amax_ready = b.output
        forwards[id(b)] = with_args(b, x_q=x_q, save_input=False, output=(y, None, w_saved, amax_ready))
        if own_saved is not None:
            replaced_by.append((own_saved, x_saved))
    return cast, forwards, replaced_by


def share_input_casts(trace: TraceCtx) -> TraceCtx:
    """Cast each input that several te_v2 forwards read once, before the first of them (see the
    module docstring for which)."""
    writes = Writes(trace)
    groups = _groups(trace, writes)
    if not groups:
        return trace
    inserted: dict[int, list[BoundSymbol]] = {}  # position of a group's first forward -> its cast
    swapped: dict[int, BoundSymbol] = {}  # id of a forward or wgrad -> its replacement
    replaced_by: list = []  # (a forward's own saved copy, the shared one)
    for group in groups:
        cast, forwards, group_replaced = _shared_cast(group, trace)
        inserted[writes.position(group[0])] = [cast]
        swapped.update(forwards)
        replaced_by += group_replaced
    consumers = utils.consumers(trace)
    swap = {variableify(p): shared for p, shared in replaced_by}
    for reader in (r for p, _ in replaced_by for r in consumers.get(p, [])):  # the wgrads
        swapped[id(reader)] = reader.from_bsym_swap_proxies(swap, skip_output=True)
    return replaced(trace, swapped, inserted=inserted)
