"""Measuring one variant on one configuration: step time, peak memory, kernels, TFLOP/s."""

from __future__ import annotations

import contextlib
import gc
import re
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from te_v2_executor import backends

GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass", re.IGNORECASE)
# Fused attention kernels, some of them CUTLASS ones (PyTorch's memory-efficient "fmha_cutlass").
ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|sdpa", re.IGNORECASE)


def without_te_gpu(what: str) -> bool:
    """Whether this machine lacks a CUDA GPU with TransformerEngine; if so, says so for ``what``
    on stderr (the benchmarks then exit with status 2)."""
    if torch.cuda.is_available() and backends.te_available():
        return False
    reason = "no CUDA device" if not torch.cuda.is_available() else backends.te_import_error()
    print(
        f"{what} needs a CUDA GPU with TransformerEngine ({reason}); nothing was measured.", file=sys.stderr
    )
    return True


def make_step(
    fn: Callable,
    model: torch.nn.Module,
    x: torch.Tensor,
    *,
    fp8: bool,
    training: bool,
    amax_group: Any = None,
) -> Callable[[], None]:
    """One step: forward under te.autocast (DelayedScaling) if ``fp8``, backward of sum() if
    ``training``; gradients are dropped first so every variant allocates them alike.
    ``amax_group``: te.autocast's amax reduction group (None: its default).

    Each step runs with a TransformerEngine global FP8 state of its own. Every ``te.Linear``
    registers its amax history in that state for good, and each ``te.autocast`` exit updates all
    registered histories: with one shared state, a te_v2 step timed alongside a te.Linear model
    (``benchmarks.interleaved``) would pay that model's amax update too."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling
    from transformer_engine.pytorch.quantization import FP8GlobalState, FP8GlobalStateManager

    recipe = DelayedScaling()
    te_state = FP8GlobalState()

    def step() -> None:
        FP8GlobalStateManager.quantization_state = te_state
        model.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:
            if not training:
                stack.enter_context(torch.no_grad())
            with te.autocast(enabled=fp8, recipe=recipe, amax_reduction_group=amax_group):
                y = fn(x)
        if training:
            y.sum().backward()

    return step


def forget_variant() -> None:
    """Free what a measured variant left behind, so the next one does not pay for it: unreachable
    objects, cached GPU blocks, and the TransformerEngine global FP8 state its last step left
    installed (it holds that model's amax histories)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    gc.collect()
    FP8GlobalStateManager.reset()
    torch.cuda.empty_cache()


def warm_up_process() -> None:
    """Allocate what a process allocates once (TE's and cuBLAS's GEMM workspaces) before any
    variant is measured, so that no variant's peak memory carries it for the others."""
    import transformer_engine.pytorch as te

    model = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    make_step(model, model, x, fp8=True, training=True)()
    (x @ x).sum().backward()
    torch.cuda.synchronize()


def step_times_ms(step: Callable[[], None], *, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def peak_memory_above(step: Callable[[], None], model: torch.nn.Module, baseline: int) -> int:
    """Bytes a step holds at its peak beyond ``baseline``, what was live before the variant first
    ran (the model, its input): what a variant keeps between steps (CUDA graph pools, workspaces)
    counts, as it occupies the GPU all the same.

    That is the peak the allocator counts as allocated, plus what the private pools of CUDA
    graphs hold that no tensor does (``idle_in_graph_pools``): a replay writes its temporaries
    there without allocating them."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline + idle_in_graph_pools(torch.cuda.memory_snapshot())


def idle_in_graph_pools(segments: list[dict[str, Any]]) -> int:
    """Bytes of the memory ``segments`` (``torch.cuda.memory_snapshot()``) that belong to a
    private pool, as a CUDA graph's memory does, and that no tensor holds.

    A capture allocates the graph's temporaries from its pool and frees them when it ends, so
    ``torch.cuda.max_memory_allocated`` no longer counts them; each replay writes them all the
    same, and no allocation outside the pool can take that memory while the graph lives. Outside
    private pools, free memory is the caching allocator's to lend and is not counted."""
    return sum(
        s["total_size"] - s["allocated_size"] for s in segments if tuple(s["segment_pool_id"]) != (0, 0)
    )


def kernel_names(step: Callable[[], None]) -> list[str]:
    """The names of the kernels one step launches, from torch.profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def gemms(names: list[str]) -> list[str]:
    """The kernels of ``names`` that are GEMMs (cuBLAS, cuBLASLt's nvjet, CUTLASS), fused
    attention kernels left out."""
    return [n for n in names if GEMM_KERNEL.search(n) and not ATTENTION_KERNEL.search(n)]


def gemm_count(names: list[str]) -> int:
    """How many of the kernels ``names`` are GEMMs (``gemms``)."""
    return len(gemms(names))


def measure(
    step: Callable[[], None],
    model: torch.nn.Module,
    *,
    flops: float,
    warmup: int,
    steps: int,
    baseline: int | None = None,
) -> dict[str, Any]:
    """Step time, peak memory above ``baseline`` (by default what is allocated now) and kernels;
    a caller that ran the first step already passes what was allocated before it."""
    if baseline is None:
        baseline = torch.cuda.memory_allocated()
    times = sorted(step_times_ms(step, warmup=warmup, steps=steps))
    median = statistics.median(times)
    names = kernel_names(step)
    return {
        "step_ms": median,
        "step_ms_p10_p90": [times[len(times) // 10], times[-1 - len(times) // 10]],
        "peak_mib_above_model": peak_memory_above(step, model, baseline) / 2**20,
        "graph_pools_idle_mib": idle_in_graph_pools(torch.cuda.memory_snapshot()) / 2**20,
        "gemm_kernels": gemm_count(names),
        "kernels": len(names),
        "tflops": flops / (median * 1e-3) / 1e12,
    }
