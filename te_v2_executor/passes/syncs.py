"""Pass ``syncs``: the once-per-pass flushes of delayed-scaling state, ``te_v2_forward_sync`` at
the end of the forward and ``te_v2_backward_sync`` after every gradient is produced."""

from __future__ import annotations

from typing import Any

from thunder.core import prims, utils
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.pytree import tree_flatten, tree_map
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, tracectx

from te_v2_executor.passes._trace import before_return, returned_grads, with_bound_symbols
from te_v2_executor.state import LinearQuantState, SyncGroup
from te_v2_executor.symbols import (
    BACKWARD_SYNC,
    FORWARD_SYNC,
    LINEAR_FWD,
    QUANTIZE_GRAD_OUTPUT,
    is_recompute,
    with_args,
)


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
            return with_args(b, replay=replay, replay_row=rows[id(b.kwargs["state"])])
        return b

    swapped = {
        k: tree_map(lambda o: passed if o is token else o, v)
        for k, v in ret.args[0].items()
        if k in (key, "flat_output")
    }
    new_ret = ret.from_bsym(args=({**ret.args[0], **swapped},))
    body = [redirect(b) for b in bsyms[:-1]]
    return with_bound_symbols(trace, [*body[:position], sync, *body[position:], new_ret])


def insert_syncs(trace: TraceCtx, *, grad_enabled: bool) -> TraceCtx:
    """Insert the delayed-scaling flushes, if the trace has delayed-scaling linears.

    Like ``te.autocast``, forward state is updated only when grad mode is on, and backward state
    after each backward. A joint trace that returns no gradient (Thunder builds one under
    ``torch.no_grad()`` when parameters require grad) is an inference trace.
    """
    ret = trace.bound_symbols[-1]
    joint = "fw_flat_out" in ret.args[0]
    grads = returned_grads(trace)
    forward_states = _delayed_states(trace, LINEAR_FWD)
    backward_states = _delayed_states(trace, QUANTIZE_GRAD_OUTPUT)
    backward = SyncGroup(backward_states, forward=False) if grads and backward_states else None
    if forward_states and (grads or (grad_enabled and not joint)):
        replayed = _delayed_states(trace, LINEAR_FWD, recomputed=True)
        group = SyncGroup(forward_states, forward=True, replayed=replayed, backward=backward)
        trace = _insert_forward_sync(trace, group)
    if backward is not None:
        trace = before_return(trace, BACKWARD_SYNC.bind(*grads, group=backward, output=None))
    return trace


def replaying(
    trace: TraceCtx, states: list[LinearQuantState]
) -> tuple[TraceCtx, TensorProxy | None, dict[int, int]]:
    """``trace`` with its forward sync snapshotting the scales of ``states`` too (forwards whose
    casts a later pass has the backward make again), the snapshot, and each state's row in it, by
    id; the snapshot is None and the rows empty where no forward sync updates them (a stateless
    recipe, an inference trace)."""
    bsyms = list(trace.bound_symbols)
    at = next((i for i, b in enumerate(bsyms) if b.sym is FORWARD_SYNC), None)
    if at is None:
        return trace, None, {}
    sync = bsyms[at]
    group: SyncGroup = sync.kwargs["group"]
    stateful, replayed = {id(s) for s in group.states}, {id(s) for s in group.replayed}
    added = tuple({id(s): s for s in states if id(s) in stateful and id(s) not in replayed}.values())
    if added:
        group = SyncGroup(
            group.states, forward=True, replayed=group.replayed + added, backward=group.backward
        )
        passed, old_replay = sync.output
        with tracectx(trace):
            _, replay = FORWARD_SYNC.meta(*sync.args, group=group)
        bsyms[at] = sync.from_bsym(kwargs={**sync.kwargs, "group": group}, output=(passed, replay))
        if old_replay is not None:  # the recomputed forwards that read it, rows unchanged
            swap = {variableify(old_replay): replay}
            bsyms = [
                b.from_bsym_swap_proxies(swap, skip_output=True)
                if any(a is old_replay for a in b.flat_proxy_args)
                else b
                for b in bsyms
            ]
        trace = with_bound_symbols(trace, bsyms)
    rows = {id(s): i for i, s in enumerate(group.replayed)}
    return trace, bsyms[at].output[1], rows
