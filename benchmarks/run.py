"""``make bench``: every variant side by side, in one process and one run, on one GPU.

    python -m benchmarks.run [--suite main|sweeps|ddp|hf|all] [--out results]
                             [--scenarios full lora ...] [--variants "te_v2 + nvFuser" ...]

Prints a markdown table, and writes ``bench.json`` and PNG plots into ``--out``. Needs a CUDA GPU
with TransformerEngine; exits with status 2 without one. The ddp suite (in ``all``) runs
``benchmarks.ddp`` on 2 GPUs through torchrun, and is skipped with a message on fewer. The hf
suite (in ``all``) runs ``benchmarks.hf``, Hugging Face Llama models, each variant in a process of
its own, into ``--out``/hf.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks import ddp, hf, shapes
from benchmarks.measure import forget_variant, make_step, measure, warm_up_process, without_te_gpu
from benchmarks.models import SCENARIOS, needed_flops
from benchmarks.variants import Variant, build, reference_model, variants
from te_v2_executor import TEv2FallbackWarning

SWEEP_VARIANTS = (
    "te.Linear eager",
    "builtin TE + torch.compile",
    "te_v2 + torch.compile",
    "te_v2 + torch.compile + CUDA graphs",
)


def configurations(suite: str) -> list[dict[str, Any]]:
    """(suite, scenario, block kind, tokens, depth) of every measured configuration."""
    configs = []
    if suite in ("main", "all"):
        for scenario in SCENARIOS:
            for kind in shapes.BLOCKS:
                configs.append(
                    dict(
                        suite="main",
                        scenario=scenario,
                        kind=kind,
                        tokens=shapes.MAIN_TOKENS[0],
                        depth=shapes.MAIN_BLOCKS,
                    )
                )
        for scenario in ("full", "lora"):
            configs.append(
                dict(
                    suite="main",
                    scenario=scenario,
                    kind="mlp",
                    tokens=shapes.MAIN_TOKENS[1],
                    depth=shapes.MAIN_BLOCKS,
                )
            )
    if suite in ("sweeps", "all"):
        for scenario in ("full", "lora"):
            for tokens in shapes.TOKEN_SWEEP:
                configs.append(
                    dict(
                        suite="tokens", scenario=scenario, kind="mlp", tokens=tokens, depth=shapes.MAIN_BLOCKS
                    )
                )
        for depth in shapes.DEPTH_SWEEP:
            configs.append(
                dict(suite="depth", scenario="lora", kind="mlp", tokens=shapes.MAIN_TOKENS[0], depth=depth)
            )
    return configs


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        return None


def run_one(config: dict[str, Any], variant: Variant, *, warmup: int, steps: int) -> dict[str, Any]:
    training = config["scenario"] != "inference"
    reference = reference_model(config["kind"], config["depth"], config["scenario"])
    row = {
        **config,
        "variant": variant.name,
        "config": f"{config['scenario']} {config['kind']} {config['tokens']}",
    }
    try:
        model, fn = build(variant, reference, config["kind"], config["depth"], config["scenario"])
        del reference
        x = torch.randn(config["tokens"], shapes.HIDDEN, device="cuda", dtype=torch.bfloat16)
        flops = needed_flops(model, config["tokens"], training)
        step = make_step(fn, model, x, fp8=variant.fp8, training=training)
        row.update(measure(step, model, flops=flops, warmup=warmup, steps=steps))
        row["fp8_peak_share"] = row["tflops"] / shapes.H200_DENSE_FP8_TFLOPS
    except Exception as e:  # one failing variant must not lose the rest of the run
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        forget_variant()
    return row


def table(results: list[dict[str, Any]]) -> str:
    """Markdown table; "x TE" is the step time over te.Linear eager's in the same configuration."""
    eager = {
        (r["suite"], r["config"], r["depth"]): r.get("step_ms")
        for r in results
        if r["variant"] == "te.Linear eager"
    }
    lines = [
        "| suite | config | blocks | variant | step ms | x TE | peak MiB above model | GEMMs/step | kernels/step | TFLOP/s | % FP8 peak |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r:
            lines.append(
                f"| {r['suite']} | {r['config']} | {r['depth']} | {r['variant']} | failed: {r['error'][:60]} | | | | | | |"
            )
            continue
        base = eager.get((r["suite"], r["config"], r["depth"]))
        ratio = f"{r['step_ms'] / base:.2f}" if base else ""
        lines.append(
            f"| {r['suite']} | {r['config']} | {r['depth']} | {r['variant']} | {r['step_ms']:.2f} | {ratio} | "
            f"{r['peak_mib_above_model']:.0f} | {r['gemm_kernels']} | {r['kernels']} | {r['tflops']:.0f} | {100 * r['fp8_peak_share']:.1f} |"
        )
    return "\n".join(lines)


def _write_json(out: Path, device: str, results: list[dict[str, Any]]) -> None:
    (out / "bench.json").write_text(json.dumps({"device": device, "results": results}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="te_v2 benchmark")
    parser.add_argument("--suite", choices=("main", "sweeps", "ddp", "hf", "all"), default="all")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--scenarios", nargs="+", choices=SCENARIOS, help="only these scenarios (main, sweeps)"
    )
    parser.add_argument("--variants", nargs="+", help="only the variants of these names (main, sweeps)")
    parser.add_argument("--ddp-timeout", type=float, default=1200, help="seconds the ddp suite may take")
    args = parser.parse_args(argv)
    if without_te_gpu("make bench"):
        return 2
    warnings.simplefilter("ignore", TEv2FallbackWarning)
    warm_up_process()
    jobs = [(c, v) for c in configurations(args.suite) for v in variants(lora=c["scenario"] == "lora")]
    jobs = [(c, v) for c, v in jobs if c["suite"] == "main" or v.name in SWEEP_VARIANTS]
    jobs = [
        (c, v)
        for c, v in jobs
        if c["scenario"] in (args.scenarios or SCENARIOS) and (not args.variants or v.name in args.variants)
    ]
    bar = _progress(len(jobs))
    results = []
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    for config, variant in jobs:
        if bar is not None:
            bar.set_description(
                f"{config['suite']} {config['scenario']} {config['kind']} {config['tokens']}x{config['depth']} {variant.name}"
            )
        results.append(run_one(config, variant, warmup=args.warmup, steps=args.steps))
        _write_json(args.out, device, results)  # rows measured so far survive an interrupted run
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    if args.suite in ("ddp", "all"):
        gpus = torch.cuda.device_count()
        if gpus >= ddp.WORLD_SIZE:
            gc.collect()
            torch.cuda.empty_cache()
            results += ddp.launch(args.out, warmup=args.warmup, steps=args.steps, timeout_s=args.ddp_timeout)
        else:
            print(
                f"ddp suite skipped: it needs {ddp.WORLD_SIZE} GPUs, this machine has {gpus}.",
                file=sys.stderr,
            )
    if args.suite in ("hf", "all"):
        hf_args = ["--out", str(args.out / "hf"), "--warmup", str(args.warmup), "--steps", str(args.steps)]
        status = hf.main(hf_args)
        if not results:
            return status
    if not results:
        print("nothing was measured.", file=sys.stderr)
        return 2
    _write_json(args.out, device, results)
    print(f"# te_v2 benchmark on {device} (DelayedScaling, bf16, median of {args.steps} steps)\n")
    print(table(results))
    if collectives := ddp.collectives_table(results):
        print(
            "\nDDP rows: step time, TFLOP/s and % FP8 peak are per GPU and per rank's "
            f"{shapes.MAIN_TOKENS[0]} tokens; NCCL kernels per step on rank 0:\n"
        )
        print(collectives)
    from benchmarks.plots import write_plots

    for path in write_plots(results, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
