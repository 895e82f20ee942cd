"""Launching the distributed worker and reading back what its ranks saved."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 480


def torchrun(
    out: Path, device: str, *scenarios: str, ranks: int, timeout_s: float = LAUNCH_TIMEOUT_S
) -> subprocess.CompletedProcess:
    """Run the worker's ``scenarios`` on ``ranks`` ranks; the completed process."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "tests.distributed.worker",
        "--out",
        str(out),
        "--device",
        device,
        *scenarios,
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def rank_results(out: Path, scenario: str, ranks: int) -> list[dict]:
    """What each rank saved for ``scenario``."""
    return [torch.load(out / f"{scenario}.rank{r}.pt", weights_only=False) for r in range(ranks)]


def assert_fp8_gather_is_bitwise(bf16_ranks: list[dict], fp8_ranks: list[dict]) -> None:
    """The Llama's seven projections a layer and its head gathered in FP8: losses and weights on
    every rank bitwise those of the BF16 all-gather; the weights' amaxes all-reduced once a
    gather of a sharded module; te_v2 reads every layer's gathered weight as its gathered FP8 bytes (each
    forward once, some dgrads again) and casts only the head, in its forward and its dgrad's
    recast, which the root keeps gathered through the backward (FSDP2's default); over several ranks each step's all-gathers that many
    bytes fewer, each layer's weights gathered in the forward and again in the backward, the
    root's (the head) once."""
    for bf16, fp8 in zip(bf16_ranks, fp8_ranks, strict=True):
        gathered = fp8["fp8_gathered"]
        assert len(gathered) == 2 * 7 + 1 and not bf16["fp8_gathered"], sorted(gathered)
        # the amaxes: one all-reduce a gather (two layers, forward and backward; the root, once)
        assert fp8["amax_all_reduces"] == [{"other group": 5}] * len(fp8["losses"]), fp8["amax_all_reduces"]
        reads = fp8["weight_reads"]
        assert reads["cast"] == 2 and reads["gathered"] >= len(gathered) - 1, reads
        assert bf16["weight_reads"].get("gathered", 0) == 0 and bf16["weight_reads"]["cast"] >= len(gathered)
        assert all(torch.equal(a, b) for a, b in zip(bf16["losses"], fp8["losses"], strict=True)), (
            bf16["losses"],
            fp8["losses"],
        )
        assert bf16["weights"].keys() == fp8["weights"].keys()
        for name, w in bf16["weights"].items():
            assert torch.equal(w, fp8["weights"][name]), name
        if bf16["world"] > 1:  # one rank's FSDP2 gathers nothing
            itemsize = next(iter(bf16["weights"].values())).itemsize
            fewer = sum((itemsize - 1) * n * (2 if ".layers." in name else 1) for name, n in gathered.items())
            assert bf16["all_gather_bytes"] - fp8["all_gather_bytes"] == fewer
