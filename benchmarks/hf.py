"""The real-model suite: Hugging Face ``LlamaForCausalLM`` through every FP8 route users compare.

    python -m benchmarks.run --suite hf [--out results]                  # every model, scenario, variant
    python -m benchmarks.hf --models 8b --scenarios lora --variants "thunderfx + te_v2"
    python -m benchmarks.hf --models 1b --scenarios full --rounds 2 \
        --variants "thunderfx + te_v2" "torchao float8 + torch.compile"  # in turn, twice

Random weights at Llama-3-8B's layer dims (2 layers) and of the Llama-3.2-1B class (16 layers),
4 x 2048 tokens, forward and backward of the model's own loss (``use_cache=False``, as training
code calls it), DelayedScaling for the TE routes
(torchao: tensorwise scaling). Scenarios: peft LoRA r=16 on all seven projections, and full
fine-tuning. Each variant runs in a process of its own (``--worker``): Dynamo and torch.compile
keep state across compilations of one model class, so variants in one process do not measure
what a user's would. Each row also checks the gradients: the cosine of each projection family's
gradients to those of BF16 eager on the same weights and batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import shapes
from benchmarks.measure import make_step, measure, warm_up_process, without_te_gpu
from te_v2_executor.passes import OPTIONAL

MODELS = {
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32768,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32768,
    ),
}
SCENARIOS = ("lora", "full")
BATCH, SEQUENCE = 4, 2048
FAMILIES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK = 16


def _cold_env(cache: Path) -> dict[str, str]:
    """The environment of a worker that compiles cold, as a user's first run does: empty Inductor
    and Triton caches of its own, so nothing an earlier worker compiled is reused, while what the
    worker compiles once (the same region in every layer) is, as in a user's process."""
    return {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }


def _thunderfx(
    listing: Callable[[], list], transforms: Callable[[], list] = list, *, causal: bool = True
) -> Callable[[torch.nn.Module], Callable]:
    """The builder of a ``te_v2_executor.thunderfx`` callable with the executors ``listing()``
    lists and the transforms ``transforms()`` makes, imported in the worker that builds it;
    ``causal``: whether masks proved causal run causal (without it, it is Thunder's thunderfx)."""

    def build(model: torch.nn.Module) -> Callable:
        from te_v2_executor import thunderfx

        return thunderfx(model, executors=listing(), transforms=transforms(), fold_causal_masks=causal)

    return build


def _cuda_graphs(**options: bool) -> Callable[[], list]:
    """The transforms of a variant with CUDA graphs: ``TEv2CUDAGraphTransform(**options)``."""

    def transforms() -> list:
        from te_v2_executor import TEv2CUDAGraphTransform

        return [TEv2CUDAGraphTransform(**options)]

    return transforms


def _te_v2_fusers() -> list:
    from te_v2_executor import executors

    return executors()[1:]


def _te_v2_default() -> list:
    from te_v2_executor import executors

    return executors()


def _te_v2_without(pass_name: str) -> Callable[[], list]:
    """The default list with a te_v2 that skips the optional pass ``pass_name``."""

    def listing() -> list:
        from te_v2_executor import executors, make_te_v2

        return executors(make_te_v2(skip_passes=[pass_name]))

    return listing


def _te_v2_attention(where: str) -> list:
    """The default list with attention elsewhere: "sdpa" on Thunder's SDPA executor rather than
    te_v2's, "inductor" where thunderfx's splitter sends it while Thunder's defaults hold a cuDNN
    attention executor that cannot run (``executors()`` removes it; this list leaves it)."""
    from thunder.executors.sdpaex import sdpa_ex
    from thunder.executors.torch_compile import torch_compile_ex

    from te_v2_executor import executors, te_v2

    return [te_v2, sdpa_ex, torch_compile_ex] if where == "inductor" else [te_v2, *executors()[2:]]


def _te_v2_thunder_defaults() -> list:
    import thunder

    from te_v2_executor import te_v2

    return [te_v2, *thunder.get_default_executors()]


def _nvfuser_after(te_v2_first: bool) -> Callable[[], list]:
    """The default list with nvFuser in place of Thunder's torch.compile executor, without te_v2
    unless ``te_v2_first`` (an error where nvFuser is not installed)."""

    def listing() -> list:
        from thunder.executors.nvfuserex import nvfuserex

        from te_v2_executor import executors

        if nvfuserex is None:
            raise RuntimeError("nvFuser is not installed")
        te_v2, *attention, _ = executors()
        return [te_v2, *attention, nvfuserex] if te_v2_first else [*attention, nvfuserex]

    return listing


def _builtin_te(model: torch.nn.Module) -> Callable:
    import thunder
    from thunder.dynamo import thunderfx
    from thunder.executors.transformer_engineex import TransformerEngineTransform, transformer_engine_ex

    executors = [transformer_engine_ex, *thunder.get_default_executors()]
    return thunderfx(model, executors=executors, transforms=[TransformerEngineTransform()])


def _to_te_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Every ``nn.Linear`` but the LoRA adapters swapped for a ``te.Linear`` with its weights, as
    HF accelerate's TransformerEngine backend does."""
    import transformer_engine.pytorch as te

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and "lora_" not in f"{name}.{child_name}":
                swapped = te.Linear(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    params_dtype=child.weight.dtype,
                    device=child.weight.device,
                )
                with torch.no_grad():
                    swapped.weight.copy_(child.weight)
                    if child.bias is not None:
                        swapped.bias.copy_(child.bias)
                swapped.weight.requires_grad_(child.weight.requires_grad)
                setattr(module, child_name, swapped)
    return model


def torchao_float8(model: torch.nn.Module, *, fsdp_float8_all_gather: bool = False) -> torch.nn.Module:
    """``model`` with torchao float8 training (tensorwise scaling) on every linear but the
    adapters; with ``fsdp_float8_all_gather``, FSDP2 gathers their weights in FP8."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def wanted(module: torch.nn.Linear, fqn: str) -> bool:
        return "lora_" not in fqn and module.in_features % 16 == 0 and module.out_features % 16 == 0

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    return convert_to_float8_training(model, config=config, module_filter_fn=wanted)


def _torchao(model: torch.nn.Module) -> Callable:
    """torchao float8 training on every linear but the adapters, compiled: torchtitan's route."""
    return torch.compile(torchao_float8(model))


# name -> (builder of the callable a step runs, whether it runs under te.autocast)
VARIANTS: dict[str, tuple[Callable[[torch.nn.Module], Callable], bool]] = {
    "HF eager BF16": (lambda model: model, False),
    "torch.compile BF16": (torch.compile, False),
    "te.Linear eager": (_to_te_linears, True),
    "torchao float8 + torch.compile": (_torchao, False),
    "thunderfx BF16": (_thunderfx(_te_v2_fusers, causal=False), False),
    "thunderfx + built-in TE": (_builtin_te, True),
    "thunderfx + te_v2": (_thunderfx(_te_v2_default), True),
    "thunderfx + te_v2 + CUDA graphs": (_thunderfx(_te_v2_default, _cuda_graphs()), True),
}
# Ablations of the default list, for choosing it, and of each optional pass, for keeping it: run
# with --variants.
ABLATIONS = {
    "thunderfx + te_v2, Thunder's default executors": (
        _thunderfx(_te_v2_thunder_defaults, causal=False),
        True,
    ),
    "thunderfx + te_v2, Thunder's SDPA attention": (_thunderfx(lambda: _te_v2_attention("sdpa")), True),
    "thunderfx + te_v2, attention in TorchInductor": (_thunderfx(lambda: _te_v2_attention("inductor")), True),
    "thunderfx BF16, nvFuser": (_thunderfx(_nvfuser_after(False), causal=False), False),
    "thunderfx + te_v2, masked attention": (_thunderfx(_te_v2_default, causal=False), True),
    "thunderfx + te_v2, nvFuser": (_thunderfx(_nvfuser_after(True)), True),
    "thunderfx + te_v2 + CUDA graphs, saved memory reused": (
        _thunderfx(_te_v2_default, _cuda_graphs(reuse_saved_memory=True)),
        True,
    ),
    "thunderfx + te_v2 + CUDA graphs, one pool": (
        _thunderfx(_te_v2_default, _cuda_graphs(share_mem_pool=True)),
        True,
    ),
    **{f"thunderfx + te_v2 without {name}": (_thunderfx(_te_v2_without(name)), True) for name in OPTIONAL},
}
# Every variant a worker can run, by name.
RUNNABLE = {**VARIANTS, **ABLATIONS}


def build_model(model: str, scenario: str) -> torch.nn.Module:
    """The random-weight Llama of ``model``, in BF16 on the GPU, with LoRA adapters for "lora"."""
    return llama(MODELS[model], scenario)


def llama(
    dims: dict[str, int],
    scenario: str,
    *,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> torch.nn.Module:
    """A random-weight ``LlamaForCausalLM`` of ``dims`` (``LlamaConfig`` fields), in BF16 on the
    GPU unless told otherwise; for "lora", with peft adapters of rank 16 on every projection,
    ``lora_B`` drawn at random (peft zeroes it, which would leave every ``lora_A`` gradient zero)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**dims, max_position_embeddings=SEQUENCE, attn_implementation="sdpa")
    llama = LlamaForCausalLM(config).to(device, dtype)
    if scenario == "full":
        return llama
    from peft import LoraConfig, get_peft_model

    adapters = LoraConfig(
        r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules=list(FAMILIES)
    )
    peft_model = get_peft_model(llama, adapters)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return peft_model


def needed_flops(model: str, scenario: str) -> float:
    """GEMM work of one training step: every linear's forward, the dgrads the step needs (not the
    first layer's q/k/v under LoRA, whose input gradient nothing reads), the wgrads of trained
    weights, and causal attention (half of the S x S products), forward and backward."""
    c = MODELS[model]
    h, f, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = h * c["num_key_value_heads"] // c["num_attention_heads"]
    tokens = BATCH * SEQUENCE
    lora = scenario == "lora"
    block = {
        "q": (h, h),
        "k": (h, kv),
        "v": (h, kv),
        "o": (h, h),
        "gate": (h, f),
        "up": (h, f),
        "down": (f, h),
    }
    total = 0.0
    for layer in range(layers):
        for name, (n_in, n_out) in block.items():
            gemm = 2.0 * tokens * n_in * n_out
            dgrad = 0.0 if lora and layer == 0 and name in ("q", "k", "v") else gemm
            total += gemm + dgrad + (0.0 if lora else gemm)
            if lora:  # the adapter's two GEMMs: forward and wgrad each, dgrad where its input needs one
                adapter = 2.0 * tokens * LORA_RANK
                total += 3 * adapter * n_out + (3 if dgrad else 2) * adapter * n_in
        total += 3 * 2.0 * BATCH * SEQUENCE * SEQUENCE * h  # QK^T and PV, causal half, fwd + 2x bwd
    head = 2.0 * tokens * h * c["vocab_size"]
    return total + head * (2 if lora else 3)


def family_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each projection family's gradients (adapters' under LoRA), flattened into one float32
    vector on the CPU."""
    found: dict[str, list[torch.Tensor]] = {f: [] for f in FAMILIES}
    for name, p in model.named_parameters():
        family = next((f for f in FAMILIES if f"{f}." in name), None)
        if family is not None and p.grad is not None:
            found[family].append(p.grad.detach().float().flatten().cpu())
    return {f: torch.cat(g) for f, g in found.items() if g}


def grad_cosines(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each family's cosine, in float64: float32 sums over the 10^8 gradients of a family of the
    8B dims are off by percents (cosines of 1.008 were printed)."""
    return {
        f: float(torch.nn.functional.cosine_similarity(grads[f].double(), reference[f].double(), dim=0))
        for f in reference
        if f in grads
    }


def batch(model_name: str) -> torch.Tensor:
    """The token ids every variant of ``model_name`` trains on, which are also its labels."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return torch.randint(0, MODELS[model_name]["vocab_size"], (BATCH, SEQUENCE), device="cuda", generator=g)


def loss_of(fn: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    """The causal LM loss of ``fn`` (a model or a compiled one) on a batch that is its own labels,
    without the key/value cache Hugging Face builds by default, which training never reads and
    which splits every attention out of thunderfx's Thunder regions (docs/usage.md)."""
    return lambda ids: fn(input_ids=ids, labels=ids, use_cache=False).loss


def run_worker(
    model_name: str, scenario: str, variant: str, *, warmup: int, steps: int, profile: Path | None = None
) -> dict[str, Any]:
    """One variant of one model and scenario in this process: figures and gradient cosines; with
    ``profile``, also where a step's time goes (``_profile``), written there."""
    build, fp8 = RUNNABLE[variant]
    warm_up_process()
    model = build_model(model_name, scenario)
    ids = batch(model_name)
    make_step(loss_of(model), model, ids, fp8=False, training=True)()
    reference = family_grads(model)
    model.zero_grad(set_to_none=True)
    fn = build(model)
    row: dict[str, Any] = {"model": model_name, "scenario": scenario, "variant": variant}
    step = make_step(loss_of(fn), model, ids, fp8=fp8, training=True)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    row["first_call_s"] = time.perf_counter() - start
    # as in measure's default, the trained weights' gradients count as the model's, not the step's
    baseline += sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    flops = needed_flops(model_name, scenario)
    row.update(measure(step, model, flops=flops, warmup=warmup, steps=steps, baseline=baseline))
    _add_throughputs(row)
    if profile is not None:
        row.update(_profile(step, profile, title=f"{model_name} {scenario}, {variant}"))
    step()
    row["grad_cosine"] = grad_cosines(family_grads(model), reference)
    return row


def _add_throughputs(row: dict[str, Any]) -> None:
    """The figures a row derives from its step time and TFLOP/s: tokens a second and the share
    of the H200's dense FP8 peak."""
    row["tokens_per_s"] = BATCH * SEQUENCE / (row["step_ms"] * 1e-3)
    row["fp8_peak_share"] = row["tflops"] / shapes.H200_DENSE_FP8_TFLOPS


def _profile(step: Callable[[], None], path: Path, *, title: str) -> dict[str, float]:
    """Write where one step's time goes to ``path`` (kernels by kind and by GPU time, then the
    hottest Python functions) and its timeline beside it (a gzipped Chrome trace); return the
    figures: GPU busy, the GPU's idle time in forward and backward, the host time to issue a
    step, the regions a forward calls."""
    from benchmarks.profile_step import (
        host_ms,
        kernel_kinds,
        kernel_table,
        kernel_times,
        python_profile,
        timeline,
    )

    kernels = kernel_times(step)
    figures = {"gpu_busy_ms": sum(ms for _, _, ms in kernels), "host_ms": host_ms(step)}
    figures.update(timeline(step, path.with_suffix(".trace.json.gz")))
    sections = {
        f"# {title}": ", ".join(f"{k} {v:.2f}" for k, v in figures.items()),
        "GPU time by kind of kernel": kernel_kinds(kernels),
        "The step's kernels by GPU time": kernel_table(kernels[:60]),
    }
    python_profile(step, path, sections)
    return figures


def run_suite(
    out: Path,
    *,
    models: list[str],
    scenarios: list[str],
    variants: list[str],
    warmup: int,
    steps: int,
    timeout_s: float,
    profile: bool = False,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Every (model, scenario, variant) in a fresh process, rows in the order run; with
    ``profile``, each also writes its kernel tables beside its JSON row. With ``rounds`` above 1,
    each model and scenario runs its variants in turn that many times, and each row merges a
    variant's rounds (``merged_rounds``): processes started one after another on one machine
    differ by more than the variants compared (docs/performance.md, "Run-to-run variance")."""
    rows = []
    for model_name in models:
        for scenario in scenarios:
            runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
            for r in range(rounds):
                for variant in variants:
                    slug = re.sub(r"[^A-Za-z0-9]+", "-", variant).strip("-").lower()
                    slug += f"-round{r}" if rounds > 1 else ""
                    result = out / f"hf-{model_name}-{scenario}-{slug}.json"
                    run = _run_worker_process(
                        result,
                        (model_name, scenario, variant),
                        warmup=warmup,
                        steps=steps,
                        timeout_s=timeout_s,
                        profile=profile,
                    )
                    runs[variant].append(run)
            for variant in variants:
                rows.append(merged_rounds(runs[variant]))
                print(_line(rows[-1], rows), file=sys.stderr, flush=True)
    return rows


def _run_worker_process(
    result: Path, case: tuple[str, str, str], *, warmup: int, steps: int, timeout_s: float, profile: bool
) -> dict[str, Any]:
    """The row of one (model, scenario, variant) ``case`` run by a worker process of its own,
    which writes it to ``result``; the row carries an "error" where the worker failed."""
    model_name, scenario, variant = case
    cmd = [sys.executable, "-m", "benchmarks.hf", "--worker", "--out", str(result)]
    cmd += ["--models", model_name, "--scenarios", scenario, "--variants", variant]
    cmd += ["--warmup", str(warmup), "--steps", str(steps)]
    cmd += ["--profile"] if profile else []
    row = {"model": model_name, "scenario": scenario, "variant": variant}
    try:
        with tempfile.TemporaryDirectory(prefix="te_v2_bench_cache_") as cache:
            done = subprocess.run(
                cmd, timeout=timeout_s, capture_output=True, text=True, env=_cold_env(Path(cache))
            )
        if done.returncode == 0:
            return json.loads(result.read_text())
        result.with_suffix(".stderr.txt").write_text(done.stderr)
        row["error"] = (done.stderr.strip().splitlines() or ["no output"])[-1]
    except subprocess.TimeoutExpired:
        row["error"] = f"timed out after {timeout_s:.0f} s"
    return row


def merged_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for a variant's rounds: the first completed round's row, with the median of the
    rounds' median step times (and the throughputs it gives), every round's median under
    "step_ms_rounds", and p10 to p90 spanning all rounds; a row that failed in some round says
    how many under "failed_rounds". Where every round failed, the first round's error."""
    done = [r for r in runs if "error" not in r]
    if not done:
        return runs[0]
    if len(runs) == 1:
        return done[0]
    row = dict(done[0])
    medians = [r["step_ms"] for r in done]
    row["step_ms"] = statistics.median(medians)
    row["step_ms_rounds"] = medians
    row["step_ms_p10_p90"] = [
        min(r["step_ms_p10_p90"][0] for r in done),
        max(r["step_ms_p10_p90"][1] for r in done),
    ]
    row["tflops"] = done[0]["tflops"] * done[0]["step_ms"] / row["step_ms"]
    _add_throughputs(row)
    if len(done) < len(runs):
        row["failed_rounds"] = len(runs) - len(done)
    return row


def _baseline(row: dict[str, Any], rows: list[dict[str, Any]], variant: str) -> float | None:
    for r in rows:
        if (r["model"], r["scenario"], r["variant"]) == (row["model"], row["scenario"], variant):
            return r.get("step_ms")
    return None


def _line(r: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    head = f"| {r['model']} | {r['scenario']} | {r['variant']} |"
    if "error" in r:
        return f"{head} failed: {r['error'][:100]} | | | | | | | |"
    ratios = []
    for anchor in ("torchao float8 + torch.compile", "te.Linear eager"):
        base = _baseline(r, rows, anchor)
        ratios.append(f"{r['step_ms'] / base:.2f}" if base else "")
    worst = min(r["grad_cosine"].values()) if r["grad_cosine"] else math.nan
    return (
        f"{head} {r['step_ms']:.1f} | {ratios[0]} | {ratios[1]} | {r['tokens_per_s'] / 1e3:.0f}k | "
        f"{r['tflops']:.0f} ({100 * r['fp8_peak_share']:.0f}%) | {r['peak_mib_above_model']:.0f} | "
        f"{r['first_call_s']:.0f} | {worst:.4f} |"
    )


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table; "x torchao" and "x TE" are the step time over those anchors' in the same
    model and scenario; "min cos" the lowest projection family's gradient cosine to BF16 eager."""
    lines = [
        "| model | scenario | variant | step ms | x torchao | x TE | tokens/s | TFLOP/s (% FP8 peak) | peak MiB above model | first call s | min cos |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    return "\n".join(lines + [_line(r, rows) for r in rows])


def main(argv: list[str] | None = None) -> int:
    """Run the suite (or, with ``--worker``, one variant of it) and print its table; 2 without a
    GPU with TransformerEngine."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--variants", nargs="+", choices=tuple(RUNNABLE), default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("results/hf"))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=900, help="seconds one variant may take")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the variants in turn this many times; rows merge the rounds",
    )
    parser.add_argument("--worker", action="store_true", help="run one variant here, write its row to --out")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also write where each variant's step time goes (.kernels.md, .kernels.trace.json.gz)",
    )
    args = parser.parse_args(argv)
    if without_te_gpu("the hf suite"):
        return 2
    if args.worker:
        warnings.simplefilter("ignore")
        row = run_worker(
            args.models[0],
            args.scenarios[0],
            args.variants[0],
            warmup=args.warmup,
            steps=args.steps,
            profile=args.out.with_suffix(".kernels.md") if args.profile else None,
        )
        args.out.write_text(json.dumps(row))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_suite(
        args.out,
        models=args.models,
        scenarios=args.scenarios,
        variants=args.variants,
        warmup=args.warmup,
        steps=args.steps,
        timeout_s=args.timeout,
        profile=args.profile,
        rounds=args.rounds,
    )
    (args.out / "hf.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "results": rows}, indent=1)
    )
    print(
        f"# Hugging Face Llama on {torch.cuda.get_device_name()} ({BATCH} x {SEQUENCE} tokens, median of {args.steps} steps"
        + (f", median of {args.rounds} rounds' medians)\n" if args.rounds > 1 else ")\n")
    )
    print(table(rows))
    from benchmarks.plots import write_hf_plots

    for path in write_hf_plots(rows, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
