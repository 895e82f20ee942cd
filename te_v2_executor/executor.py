"""The te_v2 executor object users pass to ``thunder.jit``.

A ``FusionExecutor`` that fuses nothing: Thunder calls each fusion executor's ``fusion_pass`` on
the joint forward+backward trace before it splits it, which is the one place the whole backward
can be seen before any fusion. Listed ahead of nvFuser or torch.compile, te_v2's pass runs first.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

from thunder.core import utils
from thunder.core.compile_data import get_compile_data
from thunder.core.proxies import variableify
from thunder.core.trace import TraceCtx, TraceProvenance
from thunder.core.transform_common import replace_redundant_inputs
from thunder.executors import torchex
from thunder.extend import FusionExecutor

from te_v2_executor import analysis, explain
from te_v2_executor.backends import Backend
from te_v2_executor.config import ClaimPolicy, TEv2Config
from te_v2_executor.lowering import LINEAR_IDS, LinearLowering, bind_states, gelu_as_torch_ops, operands
from te_v2_executor.recipes import RecipeSpec
from te_v2_executor.state import registry_for
from te_v2_executor.symbols import GELU, GELU_BACKWARD
from te_v2_executor.writes import Writes, check_no_new_stale_reads


class TEv2FallbackWarning(UserWarning):
    """A linear te_v2 cannot run stays on Thunder's default path."""


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, TEv2FallbackWarning, stacklevel=2)


def _is_unclaimed_linear(bsym: Any) -> bool:
    return bsym.sym.id in LINEAR_IDS or bsym.sym is torchex.linear


# Dtype conversions and views, by name (Thunder's torch, prims and torch-executor versions):
# deterministic, so two of them with the same inputs compute the same tensor.
_MERGEABLE = {"convert_element_type", "to", "reshape", "permute", "transpose"}


def _merge_duplicate_casts_and_views(trace: TraceCtx) -> TraceCtx:
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
    return analysis.with_bound_symbols(trace, list(replace_redundant_inputs(redundant, kept)))


def _same_value(earlier: Any, later: Any, writes: Writes, consumers: Any) -> bool:
    """Whether ``earlier``'s output can stand for ``later``'s, an identical op's, everywhere."""
    at, moved_from = writes.position(earlier), writes.position(later)
    return (
        not writes.ever_written(later.output)
        and all(writes.unchanged(a, at, moved_from) for a in earlier.flat_proxy_args)
        and writes.reaches(earlier.output, at, consumers.get(later.output, []))
    )


def _fusible_neighbour(bsym: Any, producers: Any, consumers: Any, fusers: list[FusionExecutor]) -> bool:
    """Whether one of ``fusers`` could fuse an op that produces an input of ``bsym`` or reads
    its output."""
    neighbours = [producers[a] for a in bsym.flat_proxy_args if a in producers]
    neighbours += consumers.get(bsym.output, [])
    return any(f.can_fuse(n) for f in fusers for n in neighbours)


def _unfolded_gelus_as_torch_ops(trace: TraceCtx, fusers: list[FusionExecutor]) -> TraceCtx:
    """Hand each GELU the analysis did not fold back to the fusion executors, as torch-level ops
    they can fuse with their neighbours (PyTorch's own kernel, run on its own, cannot). A GELU
    between te_v2 symbols only stays PyTorch's kernel: a fusion region holding it alone would run
    the same one kernel, at the cost of a region call."""
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    bsyms = []
    for bsym in trace.bound_symbols:
        if bsym.sym in (GELU, GELU_BACKWARD) and _fusible_neighbour(bsym, producers, consumers, fusers):
            bsyms.extend(gelu_as_torch_ops(bsym, trace))
        else:
            bsyms.append(bsym)
    return analysis.with_bound_symbols(trace, bsyms)


class TEv2Executor(FusionExecutor):
    """Claims Thunder's linears and lowers them to FP8 GEMMs, running only the gradients the
    backward consumes. Use it first: ``thunder.jit(model, executors=[te_v2, ...])``."""

    def __init__(self, config: TEv2Config | None = None, *, name: str = "te_v2") -> None:
        super().__init__(name)
        self.config = config or TEv2Config()
        self.lowering = LinearLowering(self, self.config)
        self.lowering.register()

    def get_fuel(self, amount: int = 1, /) -> bool:
        return True

    def set_fuel(self, value: Any) -> None:
        """te_v2 makes no fusions, so there is no fuel to limit."""

    def _later_fusers(self, compile_data: Any) -> list[FusionExecutor]:
        """The fusion executors (nvFuser, torch.compile) listed after te_v2."""
        if compile_data is None:
            return []
        listed = list(compile_data.executors_list)
        later = listed[listed.index(self) + 1 :] if self in listed else []
        return [ex for ex in later if isinstance(ex, FusionExecutor)]

    def fusion_pass(self, trace: TraceCtx) -> TraceCtx:
        """Analyse the joint trace: make a backward that reads a tensor after an in-place write
        into it raise, trim forwards and dy quantizations to what the backward consumes, insert the
        state flushes, drop exact cast round trips, fold constant factors, sums and GELUs into
        the te_v2 symbols where no write crosses a moved read, warn once per fallback te_v2 could
        not avoid (the claim policy's choices are only reported), and record the report."""
        compile_data = get_compile_data()
        trace = bind_states(trace, registry_for(compile_data))
        fallbacks = []
        for bsym in trace.bound_symbols:
            if _is_unclaimed_linear(bsym):
                rule, by_policy = self.lowering.rule_broken(*bsym.args, **bsym.kwargs)
                rule = rule or "another executor claimed it"
                fallbacks.append((bsym, rule))
                if not by_policy:
                    desc = operands(*bsym.args, **bsym.kwargs).describe()
                    _warn_once(f"te_v2: linear {desc} runs on Thunder's default path: {rule}")
        new_trace = analysis.rewrite_for_consumption(analysis.refuse_stale_reads(trace))
        grad_enabled = compile_data.is_grad_enabled if compile_data is not None else True
        new_trace = analysis.insert_syncs(new_trace, grad_enabled=grad_enabled)
        new_trace = analysis.drop_exact_round_trips(_merge_duplicate_casts_and_views(new_trace))
        new_trace = analysis.accumulate_sums(analysis.fold_scales(new_trace))
        new_trace = analysis.fuse_gelus(new_trace)
        if fusers := self._later_fusers(compile_data):
            new_trace = _unfolded_gelus_as_torch_ops(new_trace, fusers)
        check_no_new_stale_reads(trace, new_trace)
        new_trace.set_provenance(TraceProvenance("te_v2 backward-consumption analysis"))
        registry_for(compile_data).record(
            explain.te_v2_signature(new_trace.bound_symbols),
            explain.report_from_trace(new_trace, fallbacks, self.config.claim),
        )
        return new_trace


te_v2 = TEv2Executor()

_names = itertools.count(1)


def make_te_v2(
    *,
    backend: Backend | str = Backend.TE,
    recipe: RecipeSpec | None = None,
    claim: ClaimPolicy | None = None,
) -> TEv2Executor:
    """A te_v2 executor with its own settings (see ``TEv2Config``).

    ``backend="reference"`` runs the te_v2 symbols in plain torch on any device (CPU included);
    ``recipe`` pins a recipe instead of following ``te.autocast``.
    """
    config = TEv2Config(backend=Backend(backend), recipe=recipe, claim=claim or ClaimPolicy())
    return TEv2Executor(config, name=f"te_v2_{config.backend.value}_{next(_names)}")
