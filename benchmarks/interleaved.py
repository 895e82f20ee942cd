"""Two variants of one configuration timed in alternating blocks.

    python -m benchmarks.interleaved [--scenario full] [--tokens 8192] [--rounds 8]

``make bench`` measures the variants of a configuration one after the other. Over a run the GPU
warms up and its clocks drop, so a variant measured later runs the same GEMM kernels a few percent
slower (docs/performance.md). Here both variants are built first and then timed in alternating
blocks (A B, B A, ...), so that drift and host noise fall on both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings

import torch

from benchmarks import shapes
from benchmarks.measure import make_step, step_times_ms, without_te_gpu
from benchmarks.variants import ablations, build, reference_model, variants
from te_v2_executor import TEv2FallbackWarning


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("full", "lora"), default="full")
    parser.add_argument("--tokens", type=int, default=shapes.MAIN_TOKENS[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--variant", action="append", help="default: te.Linear eager, te_v2 + torch.compile")
    args = parser.parse_args(argv)
    if without_te_gpu("benchmarks.interleaved"):
        return 2
    warnings.simplefilter("ignore", TEv2FallbackWarning)
    chosen = args.variant or ["te.Linear eager", "te_v2 + torch.compile"]
    offered = {v.name: v for v in [*variants(lora=args.scenario == "lora"), *ablations()]}
    reference = reference_model("mlp", shapes.MAIN_BLOCKS, args.scenario)
    x = torch.randn(args.tokens, shapes.HIDDEN, device="cuda", dtype=torch.bfloat16)
    steps = {}
    for name in chosen:
        model, fn = build(offered[name], reference, "mlp", shapes.MAIN_BLOCKS, args.scenario)
        steps[name] = make_step(fn, model, x, fp8=offered[name].fp8, training=True)
    times: dict[str, list[float]] = {name: [] for name in chosen}
    for r in range(args.rounds):
        for name in chosen if r % 2 == 0 else chosen[::-1]:
            times[name] += step_times_ms(steps[name], warmup=2, steps=args.steps)
    first = statistics.median(times[chosen[0]])
    print(f"| {args.scenario} mlp {args.tokens} | median ms | x {chosen[0]} |\n| --- | --- | --- |")
    for name in chosen:
        median = statistics.median(times[name])
        print(f"| {name} | {median:.2f} | {median / first:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
