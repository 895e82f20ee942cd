"""Which recasts lower a trace's peak memory: the bytes its tensors hold at each of its symbols.

A recast (``weight_recasts``, ``input_recasts``) makes an FP8 copy again in the backward so that
the forward saves none: the copy no longer holds memory from the forward to its first reader.
That lowers the step's peak only where the peak lies in that span. In a full fine-tune of few
tokens the peak is at the end of the backward, where the weight gradients are all made and the
saved copies already freed; there a recast buys no memory and costs a call into TE (host time,
which bounds such a step). So each pass keeps only the recasts the lowest peak needs.

The estimate walks the joint trace: each storage the trace makes (views counted with their base)
holds its bytes from the symbol that makes it to its last reader, or to the end where the trace
returns it; inputs and parameters are alive anyway and not counted. It is an estimate: of one
trace (under ``thunderfx`` a region does not see the memory of the others), of the trace each
pass sees (``weight_recasts`` decides before the folds and ``input_recasts``, which move the peak
a little), without what a recast itself holds while it runs, and with a view that copies counted
with its base. Where a size is not a number (``cache="symbolic values"``) there is none, and
every recast is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx

from te_v2_executor.passes._trace import known_numel
from te_v2_executor.passes._writes import Writes


class Saving(NamedTuple):
    """A saved ``tensor`` a recast stops holding from position ``start`` to ``end`` (not
    included)."""

    tensor: TensorProxy
    start: int
    end: int


def _nbytes(p: TensorProxy) -> int | None:
    """The bytes of ``p``, or None where its size is not a number at trace time."""
    numel = known_numel(p)
    return None if numel is None else numel * p.dtype.bytes


def live_bytes(trace: TraceCtx, writes: Writes) -> list[int] | None:
    """The bytes the storages ``trace`` makes hold at each of its symbols; None where a size is
    not a number."""
    bsyms = trace.bound_symbols
    made: dict[str, tuple[int, int]] = {}  # storage -> (position made, bytes of its first tensor)
    last: dict[str, int] = {}
    for i, bsym in enumerate(bsyms):
        tensors = [t for t in (*bsym.flat_proxy_outs, *bsym.flat_proxy_args) if isinstance(t, TensorProxy)]
        for t in tensors:
            if not writes.made_here(t):
                continue
            root = writes.root(t)
            last[root] = i
            if root not in made:
                if (size := _nbytes(t)) is None:
                    return None
                made[root] = (i, size)
    delta = [0] * (len(bsyms) + 1)
    for root, (start, size) in made.items():
        delta[start] += size
        delta[last[root] + 1] -= size
    profile, total = [], 0
    for d in delta[:-1]:
        total += d
        profile.append(total)
    return profile


def peak_needs(
    trace: TraceCtx, writes: Writes, savings: Sequence[Saving], *, every: bool = False
) -> list[bool]:
    """Which of ``savings`` the lowest peak of ``trace`` needs, all of them with ``every`` (under
    CUDA graphs, whose forward graph holds what it saves between steps) or where the sizes are not
    known: with every saving made, each in turn is given up where its bytes put back over its span
    leave the peak as low."""
    if not savings:
        return []
    profile = None if every else live_bytes(trace, writes)
    if profile is None:
        return [True] * len(savings)
    sizes = [_nbytes(s.tensor) for s in savings]
    for s, size in zip(savings, sizes, strict=True):
        for i in range(s.start, s.end):
            profile[i] -= size
    peak = max(profile, default=0)
    needed = []
    for s, size in zip(savings, sizes, strict=True):
        span = range(s.start, s.end)
        needs = any(profile[i] + size > peak for i in span)
        if not needs:
            for i in span:
                profile[i] += size
        needed.append(needs)
    return needed
