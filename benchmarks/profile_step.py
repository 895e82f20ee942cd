"""Where a step's time goes: host (Python) time against GPU time, and the hottest Python functions.

    python -m benchmarks.profile_step [--out results] [--tokens 2048] [--scenario lora|full]

For the LoRA and full-fine-tune MLP configurations, per variant: the median step time (CUDA
events), the host time to issue one step (wall time of the call, before synchronizing), the GPU
busy time (sum of kernel durations, torch.profiler), and, written to
``profile_<scenario>_<variant>.txt``, the step's kernels by GPU time, the host time of each call
its Thunder traces make (te_v2 symbols, torch.compile regions), and a cProfile table of its Python
functions.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gzip
import inspect
import io
import json
import math
import pstats
import re
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import thunder
import torch

from benchmarks import shapes
from benchmarks.measure import (
    ATTENTION_KERNEL,
    GEMM_KERNEL,
    forget_variant,
    make_step,
    step_times_ms,
    without_te_gpu,
)
from benchmarks.variants import build, reference_model, variants
from te_v2_executor import TEv2FallbackWarning

PROFILED = (
    "te.Linear eager",
    "builtin TE + torch.compile",
    "te_v2 + torch.compile",
    "te_v2 + torch.compile + CUDA graphs",
)


def host_ms(step, *, steps: int = 10) -> float:
    """Median wall time to issue one step, each started on an idle GPU."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


@contextlib.contextmanager
def timed_trace_calls(jitted) -> Iterator[collections.Counter]:
    """Seconds spent in each callable that ``jitted``'s forward and backward traces call, by name,
    while the block runs. The generated trace functions look their callees up in their globals,
    which are wrapped with timers meanwhile (a Python call each, against tens of microseconds a
    callee)."""
    spent: collections.Counter = collections.Counter()
    patched = []

    def timer(fn, name):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return timed

    for entry in thunder.compile_stats(jitted).interpreter_cache:
        for fn in (entry.computation_fn, entry.backward_fn):
            names = inspect.unwrap(fn).__globals__ if fn is not None else {}
            for name, value in list(names.items()):
                if callable(value) and not name.startswith("__") and not isinstance(value, type):
                    patched.append((names, name, value))
                    names[name] = timer(value, name)
    try:
        yield spent
    finally:
        for names, name, value in patched:
            names[name] = value


def trace_call_table(jitted, step, *, steps: int = 10) -> str:
    """Host microseconds per step in each call of the Thunder traces, largest first."""
    with timed_trace_calls(jitted) as spent:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    lines = ["| trace call | host us per step |", "| --- | --- |"]
    lines += [f"| {name} | {s / steps * 1e6:.0f} |" for name, s in spent.most_common()]
    return "\n".join(lines)


def kernel_times(step) -> list[tuple[str, int, float]]:
    """(kernel name, launches, total ms) of one step, longest first (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    found = [
        (e.key, e.count, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0
    ]
    return sorted(found, key=lambda k: -k[2])


def timeline(step, path: Path) -> dict[str, float]:
    """Profile one step's host and GPU activity into a gzipped Chrome trace at ``path``; return
    the GPU's idle time between the step's first and last kernel, split at the first kernel the
    backward launches (a launch after autograd's engine first evaluates a node), and how many
    Thunder and TorchInductor regions the forward calls (their autograd functions)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    with gzip.open(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    backward = min((e["ts"] for e in ops if "evaluate_function" in e["name"]), default=math.inf)
    launched = {e["args"]["correlation"]: e["ts"] for e in events if e.get("cat") == "cuda_runtime"}
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], launched.get(e["args"].get("correlation"), 0) >= backward)
        for e in events
        if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")
    )
    idle = {False: 0.0, True: 0.0}
    reach = kernels[0][1] if kernels else 0.0
    for start, end, in_backward in kernels[1:]:
        idle[in_backward] += max(0.0, start - reach)
        reach = max(reach, end)
    forward_calls = collections.Counter(e["name"] for e in ops if e["ts"] < backward)
    return {
        "gpu_idle_forward_ms": idle[False] / 1e3,
        "gpu_idle_backward_ms": idle[True] / 1e3,
        "thunder_regions": forward_calls["ThunderFunction"],
        "inductor_regions": forward_calls["CompiledFunction"],
    }


def kernel_table(kernels: list[tuple[str, int, float]]) -> str:
    lines = ["| kernel | launches | ms |", "| --- | --- | --- |"]
    lines += [f"| {name[:100]} | {count} | {ms:.3f} |" for name, count, ms in kernels]
    return "\n".join(lines)


# The kinds of kernel a training step runs, tried in order on each kernel's name.
KERNEL_KINDS = (
    ("attention", ATTENTION_KERNEL),
    ("GEMM", GEMM_KERNEL),
    ("Triton (Inductor, te_v2's folds)", re.compile(r"^triton", re.IGNORECASE)),
    (
        "TE casts and amax updates",
        re.compile(r"transformer_engine|cast|transpose|amax|quantize", re.IGNORECASE),
    ),
    ("reductions", re.compile(r"reduce|softmax|norm", re.IGNORECASE)),
    ("elementwise and copies", re.compile(r"elementwise|copy|fill|memset|memcpy", re.IGNORECASE)),
)


def kernel_kinds(kernels: list[tuple[str, int, float]]) -> str:
    """A markdown table of one step's GPU time and launches per kind of kernel (``KERNEL_KINDS``,
    "other" for the rest), with the total."""
    totals: dict[str, list[float]] = {name: [0, 0.0] for name, _ in KERNEL_KINDS}
    totals["other"] = [0, 0.0]
    for name, count, ms in kernels:
        kind = next((k for k, pattern in KERNEL_KINDS if pattern.search(name)), "other")
        totals[kind][0] += count
        totals[kind][1] += ms
    lines = ["| kind | launches | GPU ms |", "| --- | --- | --- |"]
    lines += [f"| {kind} | {count:.0f} | {ms:.3f} |" for kind, (count, ms) in totals.items()]
    launches, busy = sum(c for c, _ in totals.values()), sum(m for _, m in totals.values())
    return "\n".join([*lines, f"| all | {launches:.0f} | {busy:.3f} |"])


def python_profile(step, path: Path, sections: dict[str, str]) -> None:
    """Write ``sections`` (title: markdown) to ``path``, then a cProfile table of one step's Python
    functions, by own time and by cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    path.write_text("".join(f"{title}\n\n{body}\n\n" for title, body in sections.items()) + text.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--tokens", type=int, default=shapes.MAIN_TOKENS[1])
    parser.add_argument("--scenario", choices=("lora", "full"), action="append", help="default: both")
    args = parser.parse_args(argv)
    if without_te_gpu("profiling"):
        return 2
    warnings.simplefilter("ignore", TEv2FallbackWarning)
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        "| scenario | variant | step ms | host ms to issue | GPU busy ms |\n| --- | --- | --- | --- | --- |"
    )
    for scenario in args.scenario or ("lora", "full"):
        for variant in variants(lora=scenario == "lora"):
            if variant.name not in PROFILED:
                continue
            reference = reference_model("mlp", shapes.MAIN_BLOCKS, scenario)
            model, fn = build(variant, reference, "mlp", shapes.MAIN_BLOCKS, scenario)
            x = torch.randn(args.tokens, shapes.HIDDEN, device="cuda", dtype=torch.bfloat16)
            step = make_step(fn, model, x, fp8=variant.fp8, training=True)
            step_ms = statistics.median(step_times_ms(step, warmup=5, steps=20))
            kernels = kernel_times(step)
            host, busy = host_ms(step), sum(ms for _, _, ms in kernels)
            print(
                f"| {scenario} {args.tokens} | {variant.name} | {step_ms:.2f} | {host:.2f} | {busy:.2f} |",
                flush=True,
            )
            slug = variant.name.replace(" ", "_").replace(".", "").replace("+", "")
            calls = "" if fn is model else trace_call_table(fn, step)
            sections = {
                "GPU kernels of one step": kernel_table(kernels),
                "Host time of the Thunder traces' calls": calls,
            }
            python_profile(step, args.out / f"profile_{scenario}_{slug}.txt", sections)
            del model, fn, step
            forget_variant()
    return 0


if __name__ == "__main__":
    sys.exit(main())
