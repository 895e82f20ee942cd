"""``make bench``'s DDP suite: te_v2 against ``te.Linear`` eager and Thunder's built-in TE executor
under torch DistributedDataParallel, on Llama-3-8B MLP blocks, full fine-tune and LoRA.

A torchrun worker; ``python -m benchmarks.run --suite ddp`` launches it on 2 GPUs:

    torchrun --standalone --nproc_per_node=2 -m benchmarks.ddp --out results [--warmup 5 --steps 20]

Every variant runs as ``DDP(model)`` (eager) or ``DDP(thunder.jit(model, ...))``: torch DDP around
the ThunderModule, whose ``named_parameters`` are the original module's parameters, so DDP's
reducer hooks fire when Thunder's backward hands their gradients to autograd. Weights are the same
on every rank (seed 0), inputs differ per rank. Steps run under ``te.autocast`` with the world
group as amax reduction group, so ``te.Linear``, the built-in executor and te_v2 all reduce amaxes
across ranks. Rank 0 writes ``ddp.json`` (rows like ``run.py``'s, suite "ddp") into ``--out``
after every variant, so a crash keeps what was measured.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks import shapes
from benchmarks.measure import forget_variant
from benchmarks.models import needed_flops
from benchmarks.variants import Variant, build, reference_model, variants

VARIANTS = ("te.Linear eager", "builtin TE + torch.compile", "te_v2 + torch.compile")
SCENARIOS = ("full", "lora")
WORLD_SIZE = 2
RESULTS = "ddp.json"
INPUT_SEED = 1000  # + rank: every rank trains on its own batch
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


def configurations(world_size: int) -> list[dict[str, Any]]:
    """The measured configurations: MLP blocks at the main token count per rank."""
    return [
        dict(
            suite="ddp",
            scenario=scenario,
            kind="mlp",
            tokens=shapes.MAIN_TOKENS[0],
            depth=shapes.MAIN_BLOCKS,
            world_size=world_size,
        )
        for scenario in SCENARIOS
    ]


def selected(scenario: str) -> list[Variant]:
    """The variants of ``VARIANTS`` that ``variants()`` still offers, in that order."""
    offered = {v.name: v for v in variants(lora=scenario == "lora")}
    return [offered[name] for name in VARIANTS if name in offered]


def wrap(fn: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """torch DDP around an eager model or a ThunderModule. DDP buckets only parameters that require
    grad (a frozen LoRA base gets none); every bucketed parameter gets a gradient every step, and
    the models have no buffers to broadcast."""
    return DistributedDataParallel(
        fn,
        device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=False,
        find_unused_parameters=False,
    )


def rank_input(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(INPUT_SEED + dist.get_rank())
    return torch.randn(rows, cols, device=device, dtype=torch.bfloat16, generator=generator)


def in_step(row: dict[str, Any], action: Callable[[], Any], device: torch.device) -> Any:
    """Run ``action`` on every rank; an exception is recorded in ``row`` instead of raised. Then
    the ranks agree (one all-reduce) whether all succeeded, so a failure on one rank does not leave
    the others waiting in the next collective; returns ``action``'s result, or None on any failure."""
    result = None
    try:
        result = action()
    except Exception as e:  # one failing variant must not lose the rest of the run
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    flag = torch.tensor([0 if "error" in row else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item():
        row.setdefault("error", "failed on another rank")
        return None
    return result


def collectives(names: list[str]) -> dict[str, Any]:
    """NCCL kernels among one step's kernels; all-reduce ones by name (NCCL may also run a
    collective in a generic kernel whose name does not say which: see ``nccl_kernel_names``)."""
    nccl = [n.split("(")[0] for n in names if "nccl" in n.lower()]
    return {
        "nccl_kernels": len(nccl),
        "allreduce_kernels": sum("allreduce" in n.lower().replace("_", "") for n in nccl),
        "nccl_kernel_names": dict(collections.Counter(nccl)),
    }


def _build(config: dict[str, Any], variant: Variant) -> tuple[torch.nn.Module, torch.nn.Module]:
    reference = reference_model(config["kind"], config["depth"], config["scenario"])  # seed 0 on all ranks
    return build(variant, reference, config["kind"], config["depth"], config["scenario"])


def _measure(
    model: torch.nn.Module,
    fn: torch.nn.Module,
    variant: Variant,
    config: dict[str, Any],
    device: torch.device,
    *,
    warmup: int,
    steps: int,
) -> dict[str, Any]:
    from benchmarks.measure import kernel_names, make_step, measure

    ddp = wrap(fn, device)
    x = rank_input(config["tokens"], shapes.HIDDEN, device)
    step = make_step(ddp, ddp, x, fp8=variant.fp8, training=True, amax_group=dist.group.WORLD)
    flops = needed_flops(model, config["tokens"], training=True)  # per rank
    found = measure(step, ddp, flops=flops, warmup=warmup, steps=steps)
    found.update(collectives(kernel_names(step)))
    found["fp8_peak_share"] = found["tflops"] / shapes.H200_DENSE_FP8_TFLOPS
    return found


def run_one(
    config: dict[str, Any], variant: Variant, device: torch.device, *, warmup: int, steps: int
) -> dict[str, Any]:
    """One variant on one configuration, on every rank; the ranks stay in step when it fails."""
    row = {
        **config,
        "variant": variant.name,
        "config": f"{config['scenario']} {config['kind']} {config['tokens']}",
    }
    # building runs no collective, measuring does: agree after each, so that no rank enters DDP's
    # collectives while another has given up on the variant
    built = in_step(row, lambda: _build(config, variant), device)
    if built is not None:
        found = in_step(
            row, lambda: _measure(*built, variant, config, device, warmup=warmup, steps=steps), device
        )
        del built
        if found is not None:
            row.update(found)
            medians = [None] * dist.get_world_size()
            dist.all_gather_object(medians, row["step_ms"])
            row["step_ms_per_rank"] = medians
    forget_variant()
    return row


def worker(out: Path, *, warmup: int, steps: int) -> int:
    from te_v2_executor import TEv2FallbackWarning, backends

    local_rank = int(os.environ["LOCAL_RANK"])
    if not (torch.cuda.is_available() and torch.cuda.device_count() > local_rank):
        print(f"ddp worker: rank {local_rank} has no CUDA device", file=sys.stderr)
        return 2
    if not backends.te_available():
        print(f"ddp worker: TransformerEngine unavailable ({backends.te_import_error()})", file=sys.stderr)
        return 2
    warnings.simplefilter("ignore", TEv2FallbackWarning)
    # Thunder's torch.compile regions are fragments of its traces, not the DDP model: keep Dynamo's
    # DDP graph splitting out of them, so they compile as in the single-GPU suites.
    torch._dynamo.config.optimize_ddp = False
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=device)
    try:
        rank = dist.get_rank()
        rows = []
        for config in configurations(dist.get_world_size()):
            chosen = selected(config["scenario"])
            if rank == 0 and len(chosen) < len(VARIANTS):
                missing = sorted(set(VARIANTS) - {v.name for v in chosen})
                print(f"ddp {config['scenario']}: variants no longer offered: {missing}", file=sys.stderr)
            for variant in chosen:
                row = run_one(config, variant, device, warmup=warmup, steps=steps)
                rows.append(row)
                if rank == 0:
                    out.mkdir(parents=True, exist_ok=True)
                    (out / RESULTS).write_text(json.dumps(rows, indent=1))
                    got = row.get("error") or f"{row['step_ms']:.2f} ms, {row['nccl_kernels']} NCCL kernels"
                    print(f"ddp {row['config']} x{row['world_size']} {variant.name}: {got}", file=sys.stderr)
    finally:
        dist.destroy_process_group()
    return 0


def launch(out: Path, *, warmup: int, steps: int, timeout_s: float) -> list[dict[str, Any]]:
    """Run the worker on ``WORLD_SIZE`` GPUs through torchrun (its output goes to stderr) and
    return the rows it wrote, also after a failure or a timeout."""
    out = out.resolve()
    (out / RESULTS).unlink(missing_ok=True)
    worker_args = ["--out", str(out), "--warmup", str(warmup), "--steps", str(steps)]
    rc = torchrun(WORLD_SIZE, "benchmarks.ddp", worker_args, timeout_s=timeout_s)
    if rc != 0:
        print(f"ddp suite: the torchrun worker ended with {rc}; keeping the rows it wrote", file=sys.stderr)
    path = out / RESULTS
    return json.loads(path.read_text()) if path.exists() else []


def torchrun(
    nproc: int, module: str, args: list[str], *, timeout_s: float, env: dict[str, str] | None = None
) -> int | str:
    """Run ``python -m module args`` on ``nproc`` ranks through torchrun, its output on stderr;
    its exit status, or why it was killed after ``timeout_s``."""
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *(f"--nproc_per_node={nproc}", "-m", module, *args),
    ]
    proc = subprocess.Popen(command, stdout=sys.stderr.fileno(), start_new_session=True, env=env)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun and its workers: the session it leads
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return f"killed after {timeout_s:.0f} s"


def collectives_table(results: list[dict[str, Any]]) -> str:
    """Markdown table of the NCCL kernels per step of the DDP rows (empty without any)."""
    rows = [r for r in results if r["suite"] == "ddp" and "error" not in r]
    if not rows:
        return ""
    lines = [
        "| config | GPUs | variant | NCCL kernels/step | all-reduce kernels/step | step ms on each rank |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ranks = ", ".join(f"{ms:.2f}" for ms in r["step_ms_per_rank"])
        lines.append(
            f"| {r['config']} | {r['world_size']} | {r['variant']} | {r['nccl_kernels']} | {r['allreduce_kernels']} | {ranks} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="te_v2 DDP benchmark worker (run under torchrun)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        print(
            "benchmarks.ddp is a torchrun worker: torchrun --standalone --nproc_per_node=2 -m benchmarks.ddp",
            file=sys.stderr,
        )
        return 2
    return worker(args.out, warmup=args.warmup, steps=args.steps)


if __name__ == "__main__":
    sys.exit(main())
