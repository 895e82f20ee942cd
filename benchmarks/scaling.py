"""``make bench-ddp``'s scaling suite: a Hugging Face Llama sharded by torch FSDP2 on 1, 2 and 4 GPUs.

    python -m benchmarks.scaling [--gpus 1 2 4] [--models 1b] [--scenarios full lora] \\
        [--variants "thunderfx + te_v2" ...] [--out results/scaling]

Each (GPUs, model, scenario, variant) runs in a torchrun launch of its own (``--worker`` on every
rank), as users scale today: ``fully_shard`` on every decoder layer and on the model, as torchtitan
does, then the variant's compiler. Every rank trains on a batch of its own of the model's size
(4 x 2048 tokens for the Llama dims of ``benchmarks.hf``), so the work per GPU is the same at every
count (weak scaling) and the scaling efficiency of a variant at N GPUs is its tokens a second per
GPU there over its own on one GPU. Per-tensor current scaling for every FP8 route (torchao's
tensorwise, TE's ``Float8CurrentScaling``, te_v2's ``current_scaling()``): per-layer FSDP2 makes
te_v2's layers share one Thunder region, and with it delayed-scaling state (docs/usage.md).

Per row: median step time (host clock around a synchronized step, which every collective joins),
tokens a second per GPU, peak memory, and per step, the collectives FSDP2 and the variant issue
(calls and payload bytes, counted at ``torch.distributed``'s functions: an all-gather's gathered
tensor, a reduce-scatter's input, an all-reduce's tensor) and, on GPUs, the time of NCCL's
all-gather, reduce-scatter and all-reduce kernels (torch.profiler). te_v2 runs with its weights
gathered in BF16 and in FP8 (``fp8_all_gather``, one amax all-reduce a gather of a sharded
module, where torchao's variant precomputes every scale after each backward in one).

On the CPU (``--device cpu``, gloo, te_v2's reference backend, a tiny Llama in float32) the
worker runs the te_v2 variants only; ``tests/cpu/test_scaling_bench.py`` checks it there.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import hf
from benchmarks.ddp import in_step, torchrun

GPUS = (1, 2, 4)
SCENARIOS = hf.SCENARIOS
# a Llama small enough for two CPU ranks, for the worker's CPU check
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
MODELS = {**hf.MODELS, "tiny": TINY}
# (batch, sequence) each rank trains on
TOKENS = {**{name: (hf.BATCH, hf.SEQUENCE) for name in hf.MODELS}, "tiny": (2, 32)}
INPUT_SEED = 1000  # + rank: every rank trains on its own batch
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# torch.distributed's functions counted, and the argument that is their payload
COUNTED = {
    "all_gather_into_tensor": "output_tensor",
    "reduce_scatter_tensor": "input",
    "all_reduce": "tensor",
}
# NCCL kernel names by the collective they run
NCCL_KINDS = {"all_gather": "allgather", "reduce_scatter": "reducescatter", "all_reduce": "allreduce"}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face Llama, bare or inside a peft model."""
    return [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` on every decoder layer, then on ``model``, over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device_type = next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Variant:
    """How one variant compiles a model and runs a step of it: ``compile(model)`` shards the model
    and returns the callable a step runs; ``step_context()`` wraps each forward and backward;
    ``after_backward(model)`` runs at the end of each step."""

    def __init__(
        self,
        compile: Callable[[torch.nn.Module], Callable],
        step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        after_backward: Callable[[torch.nn.Module], None] = lambda model: None,
    ) -> None:
        self.compile = compile
        self.step_context = step_context
        self.after_backward = after_backward


def _te_v2(fp8_gather: bool) -> Callable[[torch.nn.Module], Callable]:
    """te_v2 through thunderfx under current scaling, its weights gathered in FP8 where
    ``fp8_gather`` (the reference backend, claiming every linear it can, on the CPU)."""

    def compile(model: torch.nn.Module) -> Callable:
        from te_v2_executor import (
            ClaimPolicy,
            current_scaling,
            executors,
            fp8_all_gather,
            make_te_v2,
            thunderfx,
        )

        if next(model.parameters()).device.type == "cuda":
            te_v2 = make_te_v2(recipe=current_scaling())
            listed = executors(te_v2)
        else:
            te_v2 = make_te_v2(
                backend="reference", recipe=current_scaling(), claim=ClaimPolicy(min_features=16)
            )
            listed = [te_v2]
        if fp8_gather:
            fp8_all_gather(model, te_v2)
        return thunderfx(shard(model), executors=listed)

    return compile


def _te_v2_scope() -> contextlib.AbstractContextManager:
    from te_v2_executor import quantization_update_scope

    return quantization_update_scope()


def _te_linear(model: torch.nn.Module) -> Callable:
    return shard(hf._to_te_linears(model))


def _te_autocast() -> contextlib.AbstractContextManager:
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8CurrentScaling

    return te.autocast(enabled=True, recipe=Float8CurrentScaling())


def _torchao(model: torch.nn.Module) -> Callable:
    return torch.compile(shard(hf.torchao_float8(model, fsdp_float8_all_gather=True)))


def _torchao_scales(model: torch.nn.Module) -> None:
    """torchtitan's step after the optimizer's: every FP8-gathered weight's scale, one all-reduce."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


VARIANTS = {
    "thunderfx + te_v2": Variant(_te_v2(False), _te_v2_scope),
    "thunderfx + te_v2, FP8 all-gather": Variant(_te_v2(True), _te_v2_scope),
    "te.Linear eager": Variant(_te_linear, _te_autocast),
    "torchao float8 + torch.compile, FP8 all-gather": Variant(_torchao, after_backward=_torchao_scales),
}
CPU_VARIANTS = ("thunderfx + te_v2", "thunderfx + te_v2, FP8 all-gather")


@contextlib.contextmanager
def counted_collectives() -> Iterator[dict[str, dict[str, int]]]:
    """Count the calls of ``torch.distributed``'s collectives in ``COUNTED`` and their payload
    bytes while the block runs: {name: {"calls": n, "bytes": b}}."""
    counts = {name: {"calls": 0, "bytes": 0} for name in COUNTED}
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name: str) -> Callable:
        original = originals[name]
        signature = inspect.signature(original)

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name]["calls"] += 1
            counts[name]["bytes"] += signature.bind(*args, **kwargs).arguments[COUNTED[name]].nbytes
            return original(*args, **kwargs)

        return call

    for name in COUNTED:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def nccl_ms(step: Callable[[], None]) -> dict[str, float]:
    """GPU milliseconds of NCCL's all-gather, reduce-scatter and all-reduce kernels in one step."""
    from benchmarks.profile_step import kernel_times

    found = dict.fromkeys(NCCL_KINDS, 0.0)
    for name, _, ms in kernel_times(step):
        key = name.lower().replace("_", "")
        kind = next((k for k, part in NCCL_KINDS.items() if part in key), None)
        if "nccl" in key and kind is not None:
            found[kind] += ms
    return found


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(
    variant: Variant, model: torch.nn.Module, fn: Callable, ids: torch.Tensor
) -> Callable[[], None]:
    """One training step of ``fn`` on ``ids`` (its own labels) as ``variant`` runs it."""
    loss_of = hf.loss_of(fn)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with variant.step_context():
            loss_of(ids).backward()
        variant.after_backward(model)

    return step


def measured(
    step: Callable[[], None], model: torch.nn.Module, device: torch.device, *, warmup: int, steps: int
) -> dict[str, Any]:
    """Step time, collectives per step and (on a GPU) peak memory and NCCL kernel time."""
    for _ in range(warmup):
        step()
    _synchronize(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    found: dict[str, Any] = {"step_ms": statistics.median(times)}
    with counted_collectives() as counts:
        step()
        _synchronize(device)
    found["collectives"] = counts
    if device.type == "cuda":
        from benchmarks.measure import peak_memory_above

        found["peak_mib"] = peak_memory_above(step, model, baseline=0) / 2**20
        found["nccl_ms"] = nccl_ms(step)
    return found


def run_worker(
    model_name: str, scenario: str, variant_name: str, device: torch.device, *, warmup: int, steps: int
) -> dict[str, Any]:
    """One variant on every rank; rank 0's row, with each rank's median step time. A rank that
    fails makes the row carry an "error" on every rank, and no rank waits in a collective."""
    variant = VARIANTS[variant_name]
    batch, sequence = TOKENS[model_name]
    world = dist.get_world_size()
    row: dict[str, Any] = {"model": model_name, "scenario": scenario, "variant": variant_name, "gpus": world}
    row["tokens_per_rank"] = batch * sequence

    def build() -> tuple[torch.nn.Module, Callable[[], None]]:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = hf.llama(MODELS[model_name], scenario, device=device, dtype=dtype)
        g = torch.Generator(device=device).manual_seed(INPUT_SEED + dist.get_rank())
        ids = torch.randint(
            0, MODELS[model_name]["vocab_size"], (batch, sequence), device=device, generator=g
        )
        return model, make_step(variant, model, variant.compile(model), ids)

    built = in_step(row, build, device)
    if built is None:
        return row
    model, step = built
    start = time.perf_counter()
    in_step(row, step, device)
    if "error" in row:
        return row
    _synchronize(device)
    row["first_call_s"] = time.perf_counter() - start
    found = in_step(row, lambda: measured(step, model, device, warmup=warmup, steps=steps), device)
    if found is None:
        return row
    row.update(found)
    row["tokens_per_s_per_gpu"] = row["tokens_per_rank"] / (row["step_ms"] * 1e-3)
    medians: list[Any] = [None] * world
    dist.all_gather_object(medians, row["step_ms"])
    row["step_ms_per_rank"] = medians
    return row


def worker(args: argparse.Namespace) -> int:
    """The ``--worker`` entry on each torchrun rank: rank 0 writes the row to ``args.out``."""
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        row = run_worker(
            args.models[0], args.scenarios[0], args.variants[0], device, warmup=args.warmup, steps=args.steps
        )
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps(row))
    finally:
        dist.destroy_process_group()
    return 0


def launch(
    gpus: int,
    model_name: str,
    scenario: str,
    variant: str,
    out: Path,
    *,
    device: str = "cuda",
    warmup: int,
    steps: int,
    timeout_s: float,
) -> dict[str, Any]:
    """The row of one case, run by torchrun on ``gpus`` ranks; it carries an "error" where the
    launch failed or timed out."""
    slug = "".join(c if c.isalnum() else "-" for c in f"{gpus}-{model_name}-{scenario}-{variant}").lower()
    result = (out / f"scaling-{slug}.json").resolve()
    result.unlink(missing_ok=True)
    args = ["--worker", "--device", device, "--out", str(result), "--models", model_name]
    args += ["--scenarios", scenario, "--variants", variant, "--warmup", str(warmup), "--steps", str(steps)]
    rc = torchrun(gpus, "benchmarks.scaling", args, timeout_s=timeout_s)
    if result.exists():
        return json.loads(result.read_text())
    return {
        "model": model_name,
        "scenario": scenario,
        "variant": variant,
        "gpus": gpus,
        "error": f"torchrun: {rc}",
    }


def with_efficiency(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with each one's scaling efficiency: its tokens a second per GPU over the same
    model, scenario and variant's on one GPU (absent where either is missing)."""
    single = {
        (r["model"], r["scenario"], r["variant"]): r["tokens_per_s_per_gpu"]
        for r in rows
        if r["gpus"] == 1 and "tokens_per_s_per_gpu" in r
    }
    out = []
    for r in rows:
        base = single.get((r["model"], r["scenario"], r["variant"]))
        r = dict(r)
        if base and "tokens_per_s_per_gpu" in r:
            r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / base
        out.append(r)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the rows (run ``with_efficiency`` first)."""
    lines = [
        "| model | scenario | variant | GPUs | step ms | tokens/s per GPU | efficiency | all-gather ms (MiB) | "
        "reduce-scatter ms (MiB) | all-reduce ms (calls) | peak MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['scenario']} | {r['variant']} | {r['gpus']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][:80]} | | | | | | |")
            continue
        efficiency = f"{r['scaling_efficiency']:.2f}" if "scaling_efficiency" in r else ""
        peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else ""
        lines.append(
            f"{head} {r['step_ms']:.2f} | {r['tokens_per_s_per_gpu']:.0f} | {efficiency} | "
            f"{_collective_cell(r, 'all_gather', 'all_gather_into_tensor')} | "
            f"{_collective_cell(r, 'reduce_scatter', 'reduce_scatter_tensor')} | "
            f"{_collective_cell(r, 'all_reduce', 'all_reduce', calls=True)} | {peak} |"
        )
    return "\n".join(lines)


def _collective_cell(row: dict[str, Any], kind: str, name: str, *, calls: bool = False) -> str:
    """A collective's NCCL milliseconds a step (on GPUs), then its MiB (or calls) a step."""
    ms = row.get("nccl_ms", {})
    counted = row["collectives"][name]
    amount = f"{counted['calls']}" if calls else f"{counted['bytes'] / 2**20:.0f}"
    return (f"{ms[kind]:.2f} " if kind in ms else "") + f"({amount})"


def main(argv: list[str] | None = None) -> int:
    """Run the suite on the GPU counts this machine has (or, with ``--worker``, one case on this
    torchrun rank) and print its table; 2 where no case could run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", nargs="+", type=int, default=list(GPUS))
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["1b"])
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=Path("results/scaling"))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=900, help="seconds one launch may take")
    parser.add_argument("--worker", action="store_true", help="one case on this torchrun rank, row to --out")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.worker:
        return worker(args)
    if args.device == "cpu":
        counts, variants = args.gpus, [v for v in args.variants if v in CPU_VARIANTS]
    else:
        from benchmarks.measure import without_te_gpu

        if without_te_gpu("the scaling suite"):
            return 2
        available = torch.cuda.device_count()
        counts, variants = [n for n in args.gpus if n <= available], args.variants
        if skipped := [n for n in args.gpus if n > available]:
            print(f"scaling suite: {skipped} GPUs skipped, this machine has {available}.", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model_name in args.models:
        for scenario in args.scenarios:
            for variant in variants:
                for gpus in counts:
                    launched = launch(
                        gpus,
                        model_name,
                        scenario,
                        variant,
                        args.out,
                        device=args.device,
                        warmup=args.warmup,
                        steps=args.steps,
                        timeout_s=args.timeout,
                    )
                    rows.append(launched)
                    (args.out / "scaling.json").write_text(json.dumps(with_efficiency(rows), indent=1))
    if not rows:
        print("scaling suite: nothing was measured.", file=sys.stderr)
        return 2
    print(f"# FSDP2 scaling, {args.device} (per rank: tokens as listed, median of {args.steps} steps)\n")
    print(table(with_efficiency(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
