"""The per-linear report: which gradients run and which FP8 copies the forward saves; the
reports each compiled function keeps, and ``explain``, which finds the one of its last run.

Built from the trace the passes return (the joint forward+backward trace before fusion), so it
states what will execute, not what was intended.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import thunder
from thunder.core import utils
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from te_v2_executor.checks import Decision, operands
from te_v2_executor.compiled import PerFunction, compiled_functions
from te_v2_executor.passes import source_name
from te_v2_executor.state import LinearQuantState
from te_v2_executor.symbols import (
    LINEAR_DGRAD,
    LINEAR_FWD,
    LINEAR_SYMBOLS,
    QUANTIZE_GRAD_OUTPUT,
    QUANTIZE_INPUT,
    RECAST_WEIGHTS,
    UNQUANTIZED_DGRAD,
    UNQUANTIZED_FWD,
    UNQUANTIZED_SYMBOLS,
    arg,
    in_backward,
    is_input_recast,
    is_recast,
    is_recompute,
    is_thunder_linear,
)


@dataclass(frozen=True)
class LinearReport:
    """One linear call site of a compiled function."""

    name: str  # the weight, as the trace names its source parameter
    operation: str  # shapes, dtype and device
    recipe: str  # "delayed", "current", "block", ..., "unquantized", or "" when not claimed
    fallback: str = ""  # the rule that kept it on Thunder's default path, "" when te_v2 runs it
    unquantized: str = ""  # the claim-policy rule te_v2 runs it without FP8 by, "" if in FP8
    saves_input_t: bool = False  # forward keeps the column-wise FP8 copy of x (for wgrad)
    shares_input: bool = False  # reads x as another linear's forward cast it (passes/shared_inputs.py)
    saves_weight_t: bool = False  # forward keeps the column-wise FP8 copy of W (for dgrad)
    recasts_weight_t: bool = False  # the backward casts W again for dgrad instead (passes/recasts.py)
    recasts_input_t: bool = False  # the backward casts x again for wgrad instead (passes/input_recasts.py)
    dgrad: bool = False
    wgrad: bool = False
    bgrad: bool = False  # an FP8 linear's; an unquantized one's bias grad is Thunder's own sum
    recomputed: bool = False  # recomputed in the backward (activation checkpointing)
    state: LinearQuantState | None = field(default=None, repr=False, compare=False)  # its quantization state

    @property
    def claimed(self) -> bool:
        return not self.fallback


_HEADER = (
    "linear",
    "recipe",
    "dgrad",
    "wgrad",
    "bgrad",
    "shares x",
    "saves x^T",
    "saves W^T",
    "recasts W^T",
    "recasts x^T",
    "recomputed",
)


@dataclass(frozen=True)
class Report:
    """All linears of one trace: those te_v2 runs in trace order, then the fallbacks."""

    linears: tuple[LinearReport, ...]

    def __str__(self) -> str:
        def mark(flag: bool) -> str:
            return "yes" if flag else "-"

        rows = [_HEADER]
        notes = []
        for r in self.linears:
            if r.claimed:
                rows.append(
                    (
                        r.name,
                        r.recipe,
                        *(
                            mark(f)
                            for f in (
                                r.dgrad,
                                r.wgrad,
                                r.bgrad,
                                r.shares_input,
                                r.saves_input_t,
                                r.saves_weight_t,
                                r.recasts_weight_t,
                                r.recasts_input_t,
                                r.recomputed,
                            )
                        ),
                    )
                )
                if r.unquantized:
                    notes.append(f"  {r.name}: {r.operation} runs unquantized: {r.unquantized}")
            else:
                rows.append((r.name, "fallback", *("n/a",) * (len(_HEADER) - 2)))
                notes.append(f"  {r.name}: {r.operation} runs on Thunder's default path: {r.fallback}")
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines + notes)


def _site_key(bsym: Any) -> Any:
    """What ties the symbols of one claimed linear together: its state, or its site's name."""
    return id(bsym.kwargs["state"]) if bsym.sym in LINEAR_SYMBOLS else bsym.kwargs["site"]


def _claimed_linears(trace: TraceCtx) -> dict[Any, dict[str, Any]]:
    sites: dict[Any, dict[str, Any]] = {}
    casts = {}  # a shared cast's row-wise copy -> the cast (passes/shared_inputs.py)
    for bsym in trace.bound_symbols:
        if bsym.sym is QUANTIZE_INPUT:
            casts[bsym.output[0].name] = bsym
            continue
        if bsym.sym is RECAST_WEIGHTS:
            for state in bsym.kwargs["states"]:
                sites.setdefault(id(state), {"state": state})["recasts_weight_t"] = True
            continue
        if bsym.sym in UNQUANTIZED_SYMBOLS:
            site = sites.setdefault(_site_key(bsym), {})
            if bsym.sym is UNQUANTIZED_FWD and in_backward(bsym):
                site["recomputed"] = True
            elif bsym.sym is UNQUANTIZED_FWD:
                site.update(x=arg(bsym, "x"), w=arg(bsym, "w"))
            else:
                site["dgrad" if bsym.sym is UNQUANTIZED_DGRAD else "wgrad"] = True
            continue
        if bsym.sym not in LINEAR_SYMBOLS:
            continue
        state = bsym.kwargs["state"]
        site = sites.setdefault(id(state), {"state": state})
        if bsym.sym is LINEAR_FWD:
            if is_recast(bsym):
                site["recasts_weight_t"] = True
            elif is_input_recast(bsym):
                site["recasts_input_t"] = True
            elif is_recompute(bsym):
                site["recomputed"] = True
            else:
                cast = casts.get(getattr(arg(bsym, "x_q"), "name", None))
                owns = cast is not None and cast.kwargs["state"] is state
                site.update(
                    x=arg(bsym, "x"),
                    w=arg(bsym, "w"),
                    shares_input=cast is not None and not owns,
                    saves_input_t=bsym.kwargs["save_input"] or (owns and cast.kwargs["columnwise"]),
                    saves_weight_t=bsym.kwargs["save_weight"],
                )
        elif bsym.sym is QUANTIZE_GRAD_OUTPUT:
            site["bgrad"] = bsym.kwargs["bgrad"]
        else:
            site["dgrad" if bsym.sym is LINEAR_DGRAD else "wgrad"] = True
    return sites


def fallback_rule(decision: Decision) -> str:
    """Why a linear te_v2 did not claim runs on Thunder's default path."""
    return decision.rule or "another executor claimed it"


def report_from_trace(
    trace: TraceCtx, decided: list[tuple[BoundSymbol, Decision]], inputs: Mapping[str, str]
) -> Report:
    """The report of a trace the passes returned; ``decided`` pairs each forward linear of the
    trace they were given that does not run in FP8 (left to Thunder, or run unquantized by te_v2)
    with its decision; ``inputs`` names the module's parameters and buffers (``source_name``)."""
    policy_rules = {b.kwargs["site"]: d.rule for b, d in decided if b.sym is UNQUANTIZED_FWD}
    producers = utils.producers(trace)
    rows = []
    for key, site in _claimed_linears(trace).items():
        x, w = site.pop("x"), site.pop("w")
        state = site.get("state")
        rows.append(
            LinearReport(
                name=source_name(producers, w, inputs),
                operation=operands(x, w, None).describe(),
                recipe="unquantized" if state is None else state.recipe.scaling.value,
                unquantized="" if state is not None else policy_rules[key],
                **site,
            )
        )
    for bsym, decision in decided:
        if is_thunder_linear(bsym):
            rows.append(
                LinearReport(
                    name=source_name(producers, bsym.args[1], inputs),
                    operation=decision.operands.describe(),
                    recipe="",
                    fallback=fallback_rule(decision),
                )
            )
    return Report(tuple(rows))


def te_v2_signature(bound_symbols: list[Any]) -> frozenset:
    """What te_v2 runs in a trace, the same for the joint trace the passes return and for the
    forward and backward traces Thunder splits it into: each te_v2 GEMM-side symbol, by linear
    and flags."""
    return frozenset(
        (
            _site_key(b),
            b.sym.name,
            tuple(sorted((k, v) for k, v in b.kwargs.items() if isinstance(v, bool))),
        )
        for b in bound_symbols
        if b.sym in LINEAR_SYMBOLS or b.sym in UNQUANTIZED_SYMBOLS
    )


def _last_run_signature(fn: Any) -> frozenset | None:
    """The signature of the traces ``fn`` ran last: a cache hit reruns an older trace, which
    Thunder records only by making its computation traces the last ones."""
    stats = thunder.compile_stats(fn)
    if stats is None:
        return None
    for entry in stats.interpreter_cache:
        if entry.computation_traces is stats.last_traces:
            bsyms = list(entry.computation_traces[-1].bound_symbols)
            if entry.backward_traces:
                bsyms += entry.backward_traces[-1].bound_symbols
            return te_v2_signature(bsyms)
    return None


class _Reports:
    """The reports of one compiled function's traces, keyed by what te_v2 runs in each (so that
    a cache hit on an older trace finds that trace's report), and the latest."""

    def __init__(self) -> None:
        self.by_signature: dict[frozenset, Report] = {}
        self.latest: Report | None = None


_reports = PerFunction(_Reports)


def record(compile_data: Any, trace: TraceCtx, report: Report) -> None:
    """Keep ``report``, of ``trace``, for ``explain`` of the function ``compile_data`` compiles."""
    store = _reports(compile_data)
    store.by_signature[te_v2_signature(trace.bound_symbols)] = store.latest = report


def _report_of_last_run(fn: Any) -> Report | None:
    store = _reports(thunder.compile_data(fn))
    return store.by_signature.get(_last_run_signature(fn), store.latest)


def explain(fn: Any) -> Report:
    """The report of the trace a ``thunder.jit`` callable ran last (after a cache hit, that older
    trace's); for a ``thunderfx`` object, the rows of all its regions together (weights named as
    Dynamo names them)."""
    reports = [_report_of_last_run(f) for f in compiled_functions(fn)]
    reports = [r for r in reports if r is not None]
    if not reports:
        raise ValueError("te_v2: no trace analysed yet for this function; call it once first")
    return Report(tuple(row for r in reports for row in r.linears))
