"""The te_v2 executor object users pass to ``thunder.jit``.

A ``FusionExecutor`` that fuses nothing: Thunder calls each fusion executor's ``fusion_pass`` on
the joint forward+backward trace before it splits it, which is the one place the whole backward
can be seen before any fusion. Listed ahead of nvFuser or torch.compile, te_v2's pass runs first:
it warns once per linear te_v2 could not claim, runs ``passes.PIPELINE`` and records the report.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable
from typing import Any

import thunder
import thunder.torch as ltorch
import torch
from thunder.core.compile_data import get_compile_data, get_compile_option
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx
from thunder.extend import Executor, FusionExecutor
from thunder.transforms.cudagraph import CUDAGraphTransform

from te_v2_executor import passes, report
from te_v2_executor.backends import Backend
from te_v2_executor.checks import Decision
from te_v2_executor.compiled import module_input_names
from te_v2_executor.config import ClaimPolicy, TEv2Config
from te_v2_executor.fusers import after, broken_default_attention, fast_after_te_v2, missing_fuser
from te_v2_executor.lowering import LinearLowering
from te_v2_executor.passes.stale_reads import EAGER_FALLBACK_OPTION
from te_v2_executor.recipes import RecipeSpec
from te_v2_executor.state import registry_for
from te_v2_executor.symbols import UNQUANTIZED_FWD, arg, in_backward, is_thunder_linear


class TEv2FallbackWarning(UserWarning):
    """A linear te_v2 cannot run stays on Thunder's default path."""


class TEv2PerformanceWarning(UserWarning):
    """te_v2 runs, but in a setup that leaves speed on the table (the warning names the fix)."""


_warned: set[str] = set()


def _warn_once(message: str, category: type[Warning] = TEv2FallbackWarning) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, category, stacklevel=2)


class TEv2Executor(FusionExecutor):
    """Claims Thunder's linears and lowers them to FP8 GEMMs, running only the gradients the
    backward consumes. List it first, as ``thunder.jit(model, executors=executors())`` does."""

    def __init__(self, config: TEv2Config | None = None, *, name: str = "te_v2") -> None:
        super().__init__(name)
        self.config = config or TEv2Config()
        passes.check_skippable(self.config.skip_passes)
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
        return [ex for ex in after(list(compile_data.executors_list), self) if isinstance(ex, FusionExecutor)]

    def _warn_without_fuser(self, listed: list[Executor]) -> None:
        """Warn once when no executor after te_v2 in ``listed`` fuses elementwise ops."""
        if message := missing_fuser(listed, self):
            _warn_once(message, TEv2PerformanceWarning)

    def _not_in_fp8(self, trace: TraceCtx) -> list[tuple[BoundSymbol, Decision]]:
        """Each forward linear of ``trace`` te_v2 does not run in FP8, with its decision: those
        left to Thunder, and those te_v2 runs unquantized by its claim policy."""
        decided = []
        for bsym in trace.bound_symbols:
            if is_thunder_linear(bsym):
                decided.append((bsym, self.lowering.decide(*bsym.args, **bsym.kwargs)))
            elif bsym.sym is UNQUANTIZED_FWD and not in_backward(bsym):
                x, w, bias = (arg(bsym, name) for name in ("x", "w", "bias"))
                decided.append((bsym, self.lowering.decide(x, w, bias)))
        return decided

    def fusion_pass(self, trace: TraceCtx) -> TraceCtx:
        """Warn once when nothing after te_v2 fuses elementwise ops, once per fallback te_v2 could
        not avoid (the claim policy's choices are only reported) and once per linear Thunder kept
        from te_v2 inside a checkpointed function (``_kept_in_checkpoints``), run the passes
        (``passes.PIPELINE``) on the joint trace, and record the report of the trace they return."""
        compile_data = get_compile_data()
        if self.config.backend is Backend.TE and compile_data is not None:
            self._warn_without_fuser(list(compile_data.executors_list))
        decided = self._not_in_fp8(trace)
        for bsym, decision in decided:
            if is_thunder_linear(bsym) and not decision.by_policy:
                desc = decision.operands.describe()
                _warn_once(
                    f"te_v2: linear {desc} runs on Thunder's default path: {report.fallback_rule(decision)}"
                )
        for linear in _kept_in_checkpoints(trace):
            if (decision := self.lowering.decide(*linear.args, **linear.kwargs)).fp8:
                _warn_once(
                    f"te_v2: linear {decision.operands.describe()} runs unquantized, in the model's "
                    "dtype: it is inside a checkpointed function nothing needs a gradient of, which "
                    "Thunder keeps whole, out of te_v2's reach; compile with te_v2_executor.thunderfx, "
                    "which calls such functions inline, or leave torch.utils.checkpoint out where no "
                    "gradient is wanted"
                )
        inputs = module_input_names()
        context = passes.Context(
            registry=registry_for(compile_data),
            grad_enabled=compile_data.is_grad_enabled if compile_data is not None else True,
            fusers=self._later_fusers(compile_data),
            graphed=any(
                isinstance(t, CUDAGraphTransform) for t in getattr(compile_data, "transforms", None) or ()
            ),
            inputs=inputs,
            eager_fallback=bool(
                get_compile_option(EAGER_FALLBACK_OPTION, "te_v2: a refused region runs eagerly")
            ),
            dynamo_region=isinstance(getattr(compile_data, "fn", None), torch.fx.GraphModule),
            aliased_inputs=_aliased_inputs(),
        )
        new_trace = passes.run(trace, context, skip=self.config.skip_passes)
        report.record(compile_data, new_trace, report.report_from_trace(new_trace, decided, inputs))
        return new_trace


def _kept_in_checkpoints(trace: TraceCtx) -> list[BoundSymbol]:
    """The linears inside the checkpointed functions of ``trace`` that no backward decomposed
    (``gradless_checkpoints``): the fuser after te_v2 runs each such call whole."""
    pending = [b for b in trace.bound_symbols if b.sym.id == ltorch.checkpoint.id]
    linears = []
    while pending:
        bsym = pending.pop()
        linears += [b for b in bsym.subsymbols if is_thunder_linear(b)]
        pending += [b for b in bsym.subsymbols if not is_thunder_linear(b)]
    return linears


def _aliased_inputs() -> list[list[int]]:
    """The groups of positions among the compiled function's flattened arguments that share
    storage in the call being compiled, as Thunder's cache records them ("0,2-1,3")."""
    try:
        recorded = thunder._get_cache_info().get("alias_tensor_indices", "")
    except LookupError:  # not inside a thunder.jit call
        return []
    return [[int(i) for i in group.split(",")] for group in recorded.split("-") if group]


te_v2 = TEv2Executor()

_names = itertools.count(1)


def make_te_v2(
    *,
    backend: Backend | str = Backend.TE,
    recipe: RecipeSpec | None = None,
    claim: ClaimPolicy | None = None,
    skip_passes: Iterable[str] = (),
) -> TEv2Executor:
    """A te_v2 executor with its own settings (see ``TEv2Config``).

    ``backend="reference"`` runs the te_v2 symbols in plain torch on any device (CPU included);
    ``recipe`` pins a recipe instead of following ``te.autocast``; ``skip_passes`` names optional
    passes (``te_v2_executor.passes.OPTIONAL``) not to run.
    """
    config = TEv2Config(
        backend=Backend(backend),
        recipe=recipe,
        claim=claim or ClaimPolicy(),
        skip_passes=frozenset(skip_passes),
    )
    return TEv2Executor(config, name=f"te_v2_{config.backend.value}_{next(_names)}")


def executors(te_v2_executor: TEv2Executor | None = None) -> list[Executor]:
    """The executor list te_v2 runs fastest in: ``te_v2_executor`` (``te_v2`` when None), then
    cuDNN's attention kernels (``attention.py``; Thunder's SDPA executor for what they do not
    run) and Thunder's torch.compile executor for the ops between te_v2's GEMMs
    (``fusers.fast_after_te_v2``; docs/performance.md, "Real models"). Pass it as ``executors=``
    to ``thunder.jit`` or ``thunderfx``.

    Where Thunder's cuDNN attention executor cannot run, it also removes it from Thunder's default
    executors, with a one-time warning saying why (``fusers.broken_default_attention``): thunderfx
    checks each node with the defaults, and would send every attention out of Thunder."""
    if message := broken_default_attention():
        _warn_once(message, TEv2PerformanceWarning)
    return [te_v2_executor or te_v2, *fast_after_te_v2()]
