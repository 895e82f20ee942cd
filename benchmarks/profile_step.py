"""Where a step's time goes: host (Python) time against GPU time, and the hottest Python functions.

    python -m benchmarks.profile_step [--out results] [--tokens 2048] [--scenario lora|full]

For the LoRA and full-fine-tune MLP configurations, per variant: the median step time (CUDA
events), the host time to issue one step (wall time of the call, before synchronizing), the GPU
busy time (sum of kernel durations, torch.profiler), and, written to
``profile_<scenario>_<variant>.txt``, the step's kernels by GPU time and a cProfile table of its
Python functions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from benchmarks import shapes
from benchmarks.measure import make_step, step_times_ms, without_te_gpu
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


def kernel_times(step) -> list[tuple[str, int, float]]:
    """(kernel name, launches, total ms) of one step, longest first (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    found = [
        (e.key, e.count, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0
    ]
    return sorted(found, key=lambda k: -k[2])


def kernel_table(kernels: list[tuple[str, int, float]]) -> str:
    lines = ["| kernel | launches | ms |", "| --- | --- | --- |"]
    lines += [f"| {name[:100]} | {count} | {ms:.3f} |" for name, count, ms in kernels]
    return "\n".join(lines)


def python_profile(step, path: Path, kernels: list[tuple[str, int, float]]) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    path.write_text(f"GPU kernels of one step\n\n{kernel_table(kernels)}\n\n{text.getvalue()}")


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
            python_profile(step, args.out / f"profile_{scenario}_{slug}.txt", kernels)
            del model, fn, step
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
