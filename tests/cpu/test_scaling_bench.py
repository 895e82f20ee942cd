"""The FSDP2 scaling suite (``benchmarks.scaling``) on two CPU ranks: gloo, te_v2's reference
backend, a tiny Hugging Face Llama. Its worker runs a step, measures it, and counts each step's
collectives: FSDP2 gathers every decoder layer in the forward and again in the backward and the
root once (te_v2's FP8 all-gather a byte a weight value), reduce-scatters the gradients of each
group that trains, and te_v2 under current scaling adds no all-reduce but, with its FP8
all-gather, one of each weight's amax in the forward."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from benchmarks import hf, scaling

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 400
WORLD = 2


def _param_bytes(model: torch.nn.Module, *, trained: bool = False) -> tuple[int, int]:
    """(bytes of the decoder layers' parameters, bytes of the others), trained ones only if asked."""

    def size(module: torch.nn.Module) -> int:
        return sum(p.nbytes for p in module.parameters() if p.requires_grad or not trained)

    layers = sum(size(layer) for layer in scaling.decoder_layers(model))
    return layers, size(model) - layers


def _linear_weight_bytes(module: torch.nn.Module) -> int:
    return sum(m.weight.nbytes for m in module.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize(
    ("scenario", "variant"),
    [
        ("full", "thunderfx + te_v2"),
        ("lora", "thunderfx + te_v2"),
        ("full", "thunderfx + te_v2, FP8 all-gather"),
    ],
)
def test_the_worker_measures_fsdp2_and_counts_its_collectives(scenario, variant, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    if scenario == "lora":
        pytest.importorskip("peft")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    row = scaling.launch(
        WORLD,
        "tiny",
        scenario,
        variant,
        tmp_path,
        device="cpu",
        warmup=1,
        steps=2,
        timeout_s=LAUNCH_TIMEOUT_S,
    )
    assert "error" not in row, row
    assert row["gpus"] == WORLD and len(row["step_ms_per_rank"]) == WORLD
    assert row["step_ms"] > 0 and row["tokens_per_s_per_gpu"] == pytest.approx(
        row["tokens_per_rank"] / (row["step_ms"] * 1e-3)
    )
    model = hf.llama(scaling.TINY, scenario, device="cpu", dtype=torch.float32)
    layers, root = _param_bytes(model)
    trained_layers, trained_root = _param_bytes(model, trained=True)
    n = scaling.TINY["num_hidden_layers"]
    counts = row["collectives"]
    # the root stays gathered from its forward through the backward; in FP8 every linear's
    # weight (the layers' projections, the head) moves a byte a value, not 4
    fewer = 0
    if "FP8" in variant:
        in_layers = sum(_linear_weight_bytes(layer) for layer in scaling.decoder_layers(model))
        fewer = 3 * (2 * in_layers + _linear_weight_bytes(model) - in_layers) // 4
    assert counts["all_gather_into_tensor"] == {"calls": 2 * n + 1, "bytes": 2 * layers + root - fewer}
    assert counts["reduce_scatter_tensor"]["calls"] == n + (trained_root > 0)
    # FSDP2 pads what it reduce-scatters to its alignment
    assert 0 <= counts["reduce_scatter_tensor"]["bytes"] - (trained_layers + trained_root) <= 1024
    # the FP8 all-gather's amaxes: one all-reduce a gather of a sharded module (each layer in the
    # forward and the backward, the root, whose head is wrapped, once), whatever its linears
    assert counts["all_reduce"]["calls"] == (2 * n + 1 if "FP8" in variant else 0)


def test_efficiency_is_tokens_per_gpu_over_the_same_variants_on_one_gpu():
    def row(variant: str, gpus: int, tokens_per_s: float | None) -> dict:
        found = {"model": "1b", "scenario": "full", "variant": variant, "gpus": gpus}
        return found | ({"tokens_per_s_per_gpu": tokens_per_s} if tokens_per_s else {"error": "x"})

    rows = scaling.with_efficiency(
        [row("a", 1, 100.0), row("a", 2, 90.0), row("b", 2, 80.0), row("a", 4, None), row("b", 1, 100.0)]
    )
    assert [r.get("scaling_efficiency") for r in rows] == [1.0, 0.9, 0.8, None, 1.0]
    assert "failed: x" in scaling.table(rows[3:4])
