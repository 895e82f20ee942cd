"""The measurement behind the default claim policy: LoRA adapters of each rank in FP8 or BF16.

    python -m benchmarks.claim_policy [--out results]

Two Llama-3-8B MLP blocks with a frozen FP8 base and LoRA adapters of rank r, te_v2 with
Thunder's torch.compile executor; the adapters either claimed by te_v2 (FP8) or left to Thunder
(BF16). Prints a markdown table and writes ``claim_policy.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

import thunder
import torch

from benchmarks import shapes
from benchmarks.measure import make_step, step_times_ms, without_te_gpu
from benchmarks.models import Blocks, linear_factories
from te_v2_executor import ClaimPolicy, TEv2FallbackWarning, make_te_v2

RANKS = (16, 64, 256, 1024)


def adapter_step_ms(rank: int, tokens: int, *, fp8_adapters: bool, warmup: int, steps: int) -> float:
    from thunder.executors.torch_compile import torch_compile_ex

    torch.manual_seed(0)
    model = Blocks("mlp", shapes.MAIN_BLOCKS, "lora", linear_factories()["torch"], rank=rank)
    policy = ClaimPolicy(min_features=0 if fp8_adapters else rank + 1)
    jitted = thunder.jit(model, executors=[make_te_v2(claim=policy), torch_compile_ex])
    x = torch.randn(tokens, shapes.HIDDEN, device="cuda", dtype=torch.bfloat16)
    step = make_step(jitted, model, x, fp8=True, training=True)
    return statistics.median(step_times_ms(step, warmup=warmup, steps=steps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if without_te_gpu("the claim-policy measurement"):
        return 2
    warnings.simplefilter("ignore", TEv2FallbackWarning)
    rows = []
    print(
        "| tokens | LoRA rank | adapters FP8 ms | adapters BF16 ms | FP8 / BF16 |\n| --- | --- | --- | --- | --- |"
    )
    for tokens in shapes.MAIN_TOKENS:
        for rank in RANKS:
            fp8, bf16 = (
                adapter_step_ms(rank, tokens, fp8_adapters=f, warmup=args.warmup, steps=args.steps)
                for f in (True, False)
            )
            rows.append({"tokens": tokens, "rank": rank, "fp8_adapters_ms": fp8, "bf16_adapters_ms": bf16})
            print(f"| {tokens} | {rank} | {fp8:.2f} | {bf16:.2f} | {fp8 / bf16:.2f} |", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "claim_policy.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
