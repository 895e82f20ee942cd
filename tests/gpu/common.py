"""What the GPU tests share: the skip rule, TE model factories, training steps, kernel counts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import thunder
import torch

from benchmarks.measure import gemm_count, kernel_names
from te_v2_executor import backends, explain
from tests.helpers import CLAIM_ALL

_REASON = "needs a CUDA GPU with TransformerEngine" + (
    "" if not backends.te_import_error() else f" ({backends.te_import_error()})"
)
requires_te_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and backends.te_available()), reason=_REASON),
]

DTYPE = torch.bfloat16
# TransformerEngine's own tolerances for FP8 (tests/pytorch/utils.py: dtype_tols).
FP8_TOLS = {"rtol": 0.125, "atol": 0.0675}


def te_linear(in_f: int, out_f: int, bias: bool, dtype: torch.dtype = DTYPE) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    return te.Linear(in_f, out_f, bias=bias, params_dtype=dtype, device="cuda")


def torch_linear(in_f: int, out_f: int, bias: bool) -> torch.nn.Module:
    return torch.nn.Linear(in_f, out_f, bias=bias, dtype=DTYPE, device="cuda")


def builtin_executors() -> tuple[list, list]:
    """Thunder 0.2.6's own TE executor and the transform it needs."""
    from thunder.executors.transformer_engineex import TransformerEngineTransform, transformer_engine_ex

    return [transformer_engine_ex], [TransformerEngineTransform()]


def delayed_recipe():
    """DelayedScaling with a 16-row amax history, short enough to see each update in it."""
    from transformer_engine.common.recipe import DelayedScaling

    return DelayedScaling(amax_history_len=16)


def train_step(fn: Callable, x: torch.Tensor, recipe) -> torch.Tensor:
    """Forward under ``te.autocast`` with ``recipe`` (plain BF16 when None), then backward of
    sum() after it, as TE expects."""
    import transformer_engine.pytorch as te

    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = fn(x)
    if y.requires_grad:
        y.float().sum().backward()
    return y


def train_step_kernels(fn: Callable, x: torch.Tensor, recipe, *, warmup: int = 2) -> list[str]:
    """Names of the CUDA kernels one ``train_step`` launches (torch.profiler), after warm-up."""
    for _ in range(warmup):
        train_step(fn, x, recipe)
    torch.cuda.synchronize()
    return kernel_names(lambda: train_step(fn, x, recipe))


def train_step_gemms(fn: Callable, x: torch.Tensor, recipe) -> tuple[int, list[str]]:
    """GEMM kernels one forward+backward step launches, and all kernel names."""
    names = train_step_kernels(fn, x, recipe)
    return gemm_count(names), names


@functools.cache
def te_v2_claiming_all(**options) -> Any:
    """A te_v2 that follows te.autocast and claims every linear TE can run (the test models are
    below the default claim policy's threshold); ``options`` as ``make_te_v2`` takes them."""
    from te_v2_executor import make_te_v2

    return make_te_v2(claim=CLAIM_ALL, **options)


def jit_te_v2(model: torch.nn.Module, *fusers) -> Callable:
    """``model`` compiled with te_v2 first, then ``fusers`` (e.g. the torch.compile executor)."""
    return thunder.jit(model, executors=[te_v2_claiming_all(), *fusers])


def te_v2_states(jitted: Callable) -> list:
    """(forward, backward) scaling states of each linear, in forward order."""
    return [(r.state.scaling(forward=True), r.state.scaling(forward=False)) for r in explain(jitted).linears]


def executors_run(traces: list) -> set[str]:
    """The names of the executors whose own symbols ``traces`` call."""
    return {b.sym.executor.name for t in traces for b in t.bound_symbols if getattr(b.sym, "executor", None)}
