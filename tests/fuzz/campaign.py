"""A fuzzing campaign: programs of one seed, one after another, until a time or count budget is
spent; each failure shrunk, attributed (te_v2's or Thunder's) and kept once per shape."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.fuzz.oracle import Verdict, check
from tests.fuzz.programs import FUSINGS, Fusing, Program, Weights, generate
from tests.fuzz.shrink import shrink


@dataclass
class Failure:
    """One failing program, as found and as shrunk."""

    index: int
    elapsed_s: float  # since the campaign started, when it was found
    original: Program
    program: Program
    verdict: Verdict
    duplicate_of: int | None = None  # index of an earlier failure of the same shrunk shape

    @property
    def signature(self) -> tuple[str, ...]:
        return (self.verdict.status, self.verdict.kind, *self.program.kinds())

    def script(self) -> str:
        """The shrunk program as a standalone script, what differed in its docstring."""
        lines = [
            f"{self.verdict.kind}: found as program {self.index} ({len(self.original.ops)} ops) after "
            f"{self.elapsed_s:.0f} s, shrunk to {len(self.program.ops)} ops; "
            f"ClaimPolicy(min_features={self.program.min_features}), current scaling.",
            *(f"- {p}" for p in self.verdict.problems[:8]),
            *([f"- ... {len(self.verdict.problems) - 8} more"] if len(self.verdict.problems) > 8 else []),
            self.verdict.note + ".",
        ]
        emulation = self.verdict.fp8 and "emulation" in self.verdict.kind
        return self.program.script("\n".join(lines), emulation=emulation)


@dataclass
class Summary:
    """What a campaign ran and found."""

    seed: int
    programs: int = 0
    elapsed_s: float = 0.0
    statuses: Counter = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)  # te_v2's
    thunder: list[Failure] = field(default_factory=list)  # Thunder's without te_v2 too
    silent: list[tuple[int, str]] = field(default_factory=list)  # eager raised, te_v2 did not

    def report(self) -> str:
        lines = [
            f"seed {self.seed}: {self.programs} programs in {self.elapsed_s:.0f} s: "
            + ", ".join(f"{n} {s}" for s, n in sorted(self.statuses.items())),
        ]
        for title, found in (
            ("te_v2 failures", self.failures),
            ("Thunder's own (without te_v2 too)", self.thunder),
        ):
            distinct = [f for f in found if f.duplicate_of is None]
            lines.append(f"{len(found)} {title}, {len(distinct)} distinct after shrinking")
            for f in distinct:
                again = [g.index for g in found if g.duplicate_of == f.index]
                lines.append(
                    f"  program {f.index} at {f.elapsed_s:.0f} s: {f.verdict.kind}: {' '.join(f.program.kinds())}"
                    + (f" (again: programs {again})" if again else "")
                )
        if self.silent:
            lines.append(f"{len(self.silent)} programs eager rejects but te_v2 runs without an error:")
            lines += [f"  program {i}: eager: {why[:160]}" for i, why in self.silent[:10]]
            if len(self.silent) > 10:
                lines.append(f"  ... programs {[i for i, _ in self.silent[10:]]}")
        return "\n".join(lines)


def run(
    seed: int,
    *,
    seconds: float | None = None,
    count: int | None = None,
    start: int = 0,
    shrink_budget_s: float = 90.0,
    delayed_every: int = 8,
    graphs: bool = False,
    stop_at_first: bool = False,
    shrink_thunder: bool = True,
    weights: Weights | None = None,
    fusing: Fusing = FUSINGS["none"],
    on_failure: Callable[[Failure], None] | None = None,
    on_program: Callable[[int, Program, Verdict], None] | None = None,
) -> Summary:
    """Check programs ``start``, ``start + 1``, ... of ``seed`` until ``seconds`` have passed
    (shrinking included; no new program starts after) or ``count`` programs ran; every
    ``delayed_every``-th also with delayed scaling (0: none); with ``graphs``, each also under
    CUDA graphs (``oracle.check``). ``stop_at_first``: stop at te_v2's
    first failure; ``shrink_thunder`` False leaves Thunder's own failures as found; ``fusing``:
    how the compiled runs fuse."""
    summary = Summary(seed)
    t0 = time.monotonic()
    seen: dict[tuple[str, ...], int] = {}  # failure signature: index of its first program
    index = start
    while (seconds is None or time.monotonic() - t0 < seconds) and (
        count is None or summary.programs < count
    ):
        program = dataclasses.replace(generate(seed, index, weights), fusing=fusing)
        judge = functools.partial(
            check, delayed=delayed_every > 0 and index % delayed_every == 0, graphs=graphs
        )
        verdict = judge(program)
        summary.programs += 1
        summary.statuses[verdict.status] += 1
        if on_program is not None:
            on_program(index, program, verdict)
        if verdict.status == "eager_raised_te_v2_silent":
            summary.silent.append((index, verdict.eager_error))
        if verdict.status in ("fail", "thunder"):
            found_at = time.monotonic() - t0
            # Thunder's own failures are shrunk once per kind: they are reported, not te_v2's.
            first_of_kind = verdict.failed or (shrink_thunder and (verdict.status, verdict.kind) not in seen)
            budget = shrink_budget_s if verdict.failed else shrink_budget_s / 3
            small, small_verdict = (
                shrink(program, verdict, budget_s=budget, judge=judge)
                if first_of_kind
                else (program, verdict)
            )
            failure = Failure(index, found_at, program, small, small_verdict)
            key = failure.signature if verdict.failed else (verdict.status, verdict.kind)
            failure.duplicate_of = seen.setdefault(key, index)
            if failure.duplicate_of == index:
                failure.duplicate_of = None
            (summary.failures if verdict.failed else summary.thunder).append(failure)
            if on_failure is not None:
                on_failure(failure)
            if stop_at_first and verdict.failed:
                break
        index += 1
    summary.elapsed_s = time.monotonic() - t0
    return summary
