"""Pass ``states``: give every linear of a whole trace its quantization state from the function's
registry, by ``StateKey``, in place of the provisional one the lowering gave it."""

from __future__ import annotations

import collections
from collections.abc import Mapping

from thunder.core import utils
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from te_v2_executor.passes._trace import source_input, source_name, with_bound_symbols
from te_v2_executor.state import LinearQuantState, StateKey, StateRegistry
from te_v2_executor.symbols import LINEAR_FWD, is_forward_linear, with_args


def bind_states(trace: TraceCtx, registry: StateRegistry, inputs: Mapping[str, str]) -> TraceCtx:
    """Give every te_v2 symbol of a joint or inference trace its linear's state from
    ``registry``, by ``StateKey``, in place of the provisional one the transforms gave it; then
    load what was loaded before the first trace (``load_quantization_state_dict``). ``inputs``
    names the module's parameters and buffers by their proxies' names (``source_name``).

    The symbols of one linear (its forward, a checkpoint recompute, the dy quantization and the
    GEMMs) share the provisional state, so they get one state. A linear's ordinal counts the
    forwards before it whose weight has the same source, whoever runs them, so that a trace where
    another use of the weight falls back (a batch shape TE cannot run) numbers the same.
    """
    producers = utils.producers(trace)
    ordinals: collections.Counter[str] = collections.Counter()
    bound: dict[int, LinearQuantState] = {}
    for bsym in filter(is_forward_linear, trace.bound_symbols):
        root = source_input(producers, bsym.args[1])
        name, source = root.name, source_name(producers, root, inputs)
        ordinal, ordinals[source] = ordinals[source], ordinals[source] + 1
        if bsym.sym is LINEAR_FWD:
            state = bsym.kwargs["state"]
            key = StateKey(source, ordinal, state.recipe, state.backend)
            bound[id(state)] = registry.state(key, name)
    registry.take_held()
    if not bound:
        return trace
    return with_bound_symbols(trace, [_rebound(b, bound) for b in trace.bound_symbols])


def _rebound(bsym: BoundSymbol, bound: dict[int, LinearQuantState]) -> BoundSymbol:
    """``bsym`` with its bound state, if it is a te_v2 symbol of a linear."""
    state = bsym.kwargs.get("state")
    if not isinstance(state, LinearQuantState):
        return bsym
    return with_args(bsym, state=bound[id(state)])
