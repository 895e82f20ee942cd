"""Pass ``recast_batches``: weight recasts that follow one another in the backward are made by one
cast of all their weights (``te_v2_recast_weights``), up to ``BATCH_BYTES`` of FP8 copies.

Where the host bounds the step (a 16-layer model at 1B dims), each call into TE costs host time
the GPU waits for, and the backward makes a recast per dgrad of a parameter (``weight_recasts``):
seven a Llama layer. One call to TE's multi-tensor cast makes them all, in one kernel under delayed
scaling, with bitwise the copies each recast would have made. A batch is made where its first
recast was and waits for what that one waited for, so the copies of the later ones live from
there to their dgrads: at most ``BATCH_BYTES`` more than one at a time (and, for the moment of
the call, the row-wise halves TE's cast writes beside them on Hopper, as large again). Runs
follow the trace, not the layers: one continues across a layer boundary while it fits.

Only delayed-scaling recasts are batched (their scales come from the forward sync's snapshot,
``replay``); those of one batch share recipe, backend, weight dtype and device, each casts for a
state of its own, and no write into a weight lies between its recast's place and the batch's.
"""

from __future__ import annotations

import math
from typing import Any

from thunder.core import utils
from thunder.core.symbol import BoundSymbol, BoundSymbolTag
from thunder.core.trace import TraceCtx

from te_v2_executor.passes._trace import replaced
from te_v2_executor.passes._writes import Writes
from te_v2_executor.symbols import RECAST_WEIGHTS, arg, is_recast

# The FP8 copies (a byte per weight) one batch makes: a Llama-3.2-1B layer's seven weights.
BATCH_BYTES = 64 << 20


def _key(recast: BoundSymbol) -> tuple[Any, ...]:
    """What the recasts of one batch share: recipe, backend, snapshot, dtype and device of the
    weight."""
    w, state = arg(recast, "w"), recast.kwargs["state"]
    return (state.recipe, state.backend, arg(recast, "replay").name, w.dtype, w.device)


def _batchable(recast: BoundSymbol, consumers: Any) -> bool:
    """A delayed-scaling recast of a non-empty weight whose readiness marker nobody reads."""
    w = arg(recast, "w")
    return (
        arg(recast, "replay") is not None
        and recast.kwargs["state"].recipe.stateful
        and math.prod(w.shape) > 0
        and not consumers.get(recast.output[3], [])
    )


def _batches(trace: TraceCtx) -> list[list[BoundSymbol]]:
    """The runs of batchable recasts, in trace order, each within ``BATCH_BYTES`` and one key,
    each recast's weight unchanged between the run's first recast and its own, and each state
    once (a state rescales one replay scaling per cast: two of its casts in one call would both
    take the second's scale)."""
    consumers, writes = utils.consumers(trace), Writes(trace)
    runs: list[list[BoundSymbol]] = []
    size = 0
    for bsym in trace.bound_symbols:
        if not is_recast(bsym) or not _batchable(bsym, consumers):
            continue
        w, nbytes = arg(bsym, "w"), math.prod(arg(bsym, "w").shape)
        run = runs[-1] if runs else None
        if (
            run is None
            or size + nbytes > BATCH_BYTES
            or _key(run[0]) != _key(bsym)
            or not writes.unchanged(w, writes.position(run[0]), writes.position(bsym))
            or any(r.kwargs["state"] is bsym.kwargs["state"] for r in run)
        ):
            runs.append([bsym])
            size = nbytes
        else:
            run.append(bsym)
            size += nbytes
    return [run for run in runs if len(run) > 1]


def _batch(run: list[BoundSymbol]) -> BoundSymbol:
    """One cast of the weights of ``run``, made with their states and snapshot rows, whose outputs
    are the recasts' own copies (so their dgrads read them unchanged)."""
    first = run[0]
    batch = RECAST_WEIGHTS.bind(
        arg(first, "replay"),
        arg(first, "after"),
        *(arg(r, "w") for r in run),
        states=tuple(r.kwargs["state"] for r in run),
        rows=tuple(arg(r, "replay_row") for r in run),
        output=tuple(r.output[2] for r in run),
    )
    batch.tags.add(BoundSymbolTag.BACKWARD)
    return batch


def batch_recasts(trace: TraceCtx) -> TraceCtx:
    """Replace each run of weight recasts (``_batches``) by one ``te_v2_recast_weights`` where its
    first recast was."""
    swapped: dict[int, BoundSymbol] = {}
    dropped: set[int] = set()
    for run in _batches(trace):
        swapped[id(run[0])] = _batch(run)
        dropped.update(id(r) for r in run[1:])
    return replaced(trace, swapped, dropped)
