"""Passes ``merge_casts`` and ``round_trips``: one of identical dtype conversions and views, and
none of an exact round trip through a wider dtype."""

from __future__ import annotations

from typing import Any

from thunder.core import utils
from thunder.core.proxies import variableify
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceCtx
from thunder.core.transform_common import dce, replace_redundant_inputs

from te_v2_executor.passes._trace import dtype, exact_widening, is_cast, with_bound_symbols
from te_v2_executor.passes._writes import Writes

# Dtype conversions and views, by name (Thunder's torch, prims and torch-executor versions):
# deterministic, so two of them with the same inputs compute the same tensor.
_MERGEABLE = {"convert_element_type", "to", "reshape", "permute", "transpose"}


def merge_duplicate_casts_and_views(trace: TraceCtx) -> TraceCtx:
    """Keep one of identical dtype conversions (and views). A bf16 add's backward converts the
    same fp32 gradient to bf16 once per input, and a fusion executor that does not merge them
    (torch.compile) writes one full activation gradient per copy: the largest live buffer of a
    LoRA backward.

    Only these ops: Thunder's general CSE would also merge random draws and fresh buffers that are
    later written in place. Nor are two merged where a write could tell them apart: into the later
    one, into the inputs between the two, or into the earlier one before a reader of the later.
    """
    consumers = utils.consumers(trace)
    writes = Writes(trace)
    redundant: dict = {}
    first: dict = {}
    kept = []
    for bsym in trace.bound_symbols:
        if bsym.sym.name in _MERGEABLE:
            swapped = bsym.from_bsym_swap_proxies(redundant, skip_inputs=False, skip_output=True)
            earlier = first.setdefault((swapped.rhs, id(bsym.sym.executor)), bsym)
            if earlier is not bsym and _same_value(earlier, bsym, writes, consumers):
                redundant[variableify(bsym.output)] = earlier.output
                continue
        kept.append(bsym)
    if not redundant:
        return trace
    return with_bound_symbols(trace, list(replace_redundant_inputs(redundant, kept)))


def _same_value(earlier: Any, later: Any, writes: Writes, consumers: Any) -> bool:
    """Whether ``earlier``'s output can stand for ``later``'s, an identical op's, everywhere."""
    at, moved_from = writes.position(earlier), writes.position(later)
    return (
        not writes.ever_written(later.output)
        and all(writes.unchanged(a, at, moved_from) for a in earlier.flat_proxy_args)
        and writes.reaches(earlier.output, at, consumers.get(later.output, []))
    )


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
        inner = producers.get(bsym.args[0], None) if is_cast(bsym) else None
        if exact_widening(inner):
            a, out = inner.args[0], bsym.output
            if (
                id(out) not in returned
                and dtype(a) == dtype(out)
                and not writes.ever_written(out)
                and writes.reaches(a, writes.position(inner), consumers.get(out, []))
            ):
                redundant[variableify(out)] = a
                continue
        kept.append(bsym)
    if not redundant:
        return trace
    return dce(with_bound_symbols(trace, list(replace_redundant_inputs(redundant, kept))))
