"""Shrink a failing program: drop ops and outputs, and simplify inputs and linears, while it
fails the same way (same status and kind)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from tests.fuzz.oracle import Verdict, check
from tests.fuzz.programs import Program


def _simpler(p: Program) -> Iterator[Callable[[Program], Program | None]]:
    """Edits to try on the current program, each a function of it (None: not applicable)."""
    yield lambda q: q.without_dead_ops()
    size = len(p.ops) // 2
    while size >= 1:  # chunks of ops, halves first, the last ops first
        for start in range(len(p.ops) - size, -1, -size):
            yield lambda q, r=range(start, start + size): q.without_ops(r) if r.stop <= len(q.ops) else None
        size //= 2
    for o in reversed(p.outputs):
        yield (
            lambda q, o=o: (
                dataclasses.replace(q, outputs=tuple(x for x in q.outputs if x != o)).used()
                if o in q.outputs and len(q.outputs) > 1
                else None
            )
        )
    for x in p.inputs:
        yield lambda q, name=x.name: dataclasses.replace(
            q,
            inputs=tuple(
                dataclasses.replace(i, requires_grad=False) if i.name == name else i for i in q.inputs
            ),
        )
    for lin in p.linears:
        for field, value in (("bias", False), ("frozen", True)):
            yield lambda q, name=lin.name, f=field, v=value: dataclasses.replace(
                q,
                linears=tuple(
                    dataclasses.replace(li, **{f: v}) if li.name == name else li for li in q.linears
                ),
            )


def shrink(
    program: Program,
    verdict: Verdict,
    *,
    budget_s: float,
    judge: Callable[[Program], Verdict] = check,
) -> tuple[Program, Verdict]:
    """The smallest program found within ``budget_s`` that fails as ``program`` does, and its
    verdict: passes of the edits of ``_simpler``, each kept when the failure remains, until a
    pass changes nothing."""
    deadline = time.monotonic() + budget_s
    best, best_verdict = program, verdict
    tried = {program.source()}
    changed = True
    while changed:
        changed = False
        for edit in _simpler(best):
            if time.monotonic() >= deadline:
                return best, best_verdict
            candidate = edit(best)
            if candidate is None or (src := candidate.source()) in tried:
                continue
            tried.add(src)
            v = judge(candidate)
            if v.status == verdict.status and v.kind == verdict.kind:
                best, best_verdict, changed = candidate, v, True
    return best, best_verdict
