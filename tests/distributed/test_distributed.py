"""te_v2 under data parallelism, two ranks launched by torchrun (see ``worker.py``).

On two CUDA GPUs with TransformerEngine (``make test-distributed``): NCCL, the TE backend under
``te.autocast`` with a custom amax reduction group. On CPU: gloo and the reference backend, the
same scenarios and checks (no autocast there: amaxes reduce over the default group).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from te_v2_executor import backends
from tests.distributed.launch import assert_fp8_gather_is_bitwise, rank_results, torchrun
from tests.distributed.worker import STEPS
from tests.gpu.common import FP8_TOLS

WORLD = 2
WRAPPERS = ("thunder_ddp", "fsdp_zero2", "fsdp_zero3", "torch_ddp", "fsdp2")
KINDS = ("full", "lora")
# a Hugging Face Llama's two decoder layers sharded one by one, through one Thunder region
SCENARIOS = [f"{w}-{m}" for w in WRAPPERS for m in KINDS] + ["fsdp2-llama", "fsdp2-llamafrozen"]
# the Llama under current scaling, its weights gathered in BF16 and in FP8 (te_v2_executor.fsdp)
CURRENT_SCENARIOS = ["fsdp2_current-llama", "fsdp2_fp8-llama"]

_two_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD and backends.te_available()
DEVICES = [
    pytest.param("cpu", id="cpu-gloo-reference"),
    pytest.param(
        "cuda",
        id="cuda-nccl-te",
        marks=[
            pytest.mark.distributed,
            pytest.mark.skipif(
                not _two_gpus,
                reason=f"needs {WORLD} CUDA GPUs with TransformerEngine (run `make test-distributed` on such a machine)",
            ),
        ],
    ),
]
# GEMMs one step needs (x needs no grad): full, 3 linears: 3 forward, 3 wgrad, 2 dgrad; LoRA,
# 2 layers of frozen base + adapters A, B: 6 forward, 4 adapter wgrads, 4 dgrads (B of both,
# A and base of the second layer), no base wgrad.
# The Llama: 2 layers of 7 projections and the head, 15 calls, each with its dgrad (the
# embedding trains); wgrads but for the frozen attention's 2 x 4.
NEEDED_GEMMS = {"full": 3 + 3 + 2, "lora": 6 + 4 + 4, "llama": 15 * 3, "llamafrozen": 15 * 3 - 8}
# te_v2 linears the reports list: the Llama's layers share one region
LINEARS = {"full": 3, "lora": 6, "llama": 8, "llamafrozen": 8}
FROZEN = {"lora": "base", "llamafrozen": "self_attn"}  # what the names of frozen weights hold
# amax_history and scale per direction a linear quantizes in: forward for each; backward (dy)
# for each but the LoRA model's first base, which runs neither dgrad nor wgrad
QUANT_STATE_TENSORS = {
    "full": 2 * (3 + 3),
    "lora": 2 * (6 + 5),
    "llama": 2 * (8 + 8),
    "llamafrozen": 2 * (8 + 8),
}


class Results:
    """The per-rank results of every scenario, from one torchrun launch per device kind, and of
    the restores of its checkpoints, from one more launch on a single rank."""

    def __init__(self, device: str, out: Path) -> None:
        self.device = device
        self.out = out
        checkpointed = [f"fsdp2_checkpoint-{k}" for k in KINDS]
        builtin = ["builtin_ddp-full"] if device == "cuda" else []
        self.launch = torchrun(
            out, device, *SCENARIOS, *CURRENT_SCENARIOS, *checkpointed, *builtin, ranks=WORLD
        )
        self.restore = torchrun(out, device, *(f"restored-{k}" for k in KINDS), ranks=1)
        self._loaded: dict[str, list[dict]] = {}

    def __getitem__(self, scenario: str) -> list[dict]:
        restored = scenario.startswith("restored-")
        launch = self.restore if restored else self.launch
        if launch.returncode != 0:
            pytest.fail(f"torchrun failed:\n{launch.stdout[-4000:]}\n{launch.stderr[-8000:]}")
        if scenario not in self._loaded:
            self._loaded[scenario] = rank_results(self.out, scenario, 1 if restored else WORLD)
        ranks = self._loaded[scenario]
        for rank, r in enumerate(ranks):
            if "error" in r:
                pytest.fail(f"{scenario} raised on rank {rank}:\n{r['error']}")
        return ranks


@pytest.fixture(params=DEVICES, scope="module")
def results(request, tmp_path_factory) -> Results:
    return Results(request.param, tmp_path_factory.mktemp(f"dist-{request.param}"))


def _shard(full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    """The rows of ``full`` rank ``rank`` holds under FSDP (dim 0 split evenly), or ``full``."""
    if local.shape == full.shape:
        return full
    rows = local.shape[0]
    return full[rank * rows : (rank + 1) * rows]


@pytest.mark.parametrize("scenario", SCENARIOS + CURRENT_SCENARIOS)
def test_weights_and_losses_match_a_single_process_run(results, scenario):
    for rank, r in enumerate(results[scenario]):
        losses, reference = torch.stack(r["losses"]), torch.stack(r["reference_losses"])
        assert losses.shape == (STEPS,)
        torch.testing.assert_close(losses, reference, **FP8_TOLS)
        assert set(r["weights"]) == set(r["reference_weights"])
        for name, w in r["weights"].items():
            ref = _shard(r["reference_weights"][name], w, rank)
            torch.testing.assert_close(w.float(), ref.float(), **FP8_TOLS, msg=lambda m, n=name: f"{n}: {m}")
    assert losses[-1] < losses[0], "training did not reduce the loss: the comparison would be vacuous"


def test_an_fp8_all_gather_trains_bitwise_as_a_bf16_one_moving_a_byte_a_value(results):
    """FP8 and BF16 all-gathers of the Llama step alike, the FP8 one moving a byte a value."""
    bf16, fp8 = results["fsdp2_current-llama"], results["fsdp2_fp8-llama"]
    assert_fp8_gather_is_bitwise(bf16, fp8)
    print(
        f"\n[{results.device}] all-gather bytes per step on rank 0: BF16 {bf16[0]['all_gather_bytes']:.0f}, "
        f"FP8 {fp8[0]['all_gather_bytes']:.0f}"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_restored_on_one_rank_trains_on_as_the_two_ranks_did(results, kind):
    """A torch.distributed.checkpoint of the FSDP2-sharded model and te_v2's quantization state,
    saved by two ranks after two steps, loaded on one (``quantization_state_template`` makes the
    tensors it loads into), then three more steps on the same global batches: the losses,
    weights and states of the two ranks that went on without stopping."""
    saved = results[f"fsdp2_checkpoint-{kind}"]
    (restored,) = results[f"restored-{kind}"]
    torch.testing.assert_close(torch.stack(restored["losses"]), torch.stack(saved[0]["losses"]), **FP8_TOLS)
    for rank, r in enumerate(saved):
        assert r["weights"].keys() == restored["weights"].keys()
        for name, w in r["weights"].items():
            torch.testing.assert_close(w, _shard(restored["weights"][name], w, rank), **FP8_TOLS)
    assert restored["quant_state"].keys() == saved[0]["quant_state"].keys()
    assert restored["quant_state"], "no quantization state was compared"
    for name, value in saved[0]["quant_state"].items():
        torch.testing.assert_close(restored["quant_state"][name], value, **FP8_TOLS)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_quantization_state_is_identical_on_every_rank(results, scenario):
    first, *others = (r["quant_state"] for r in results[scenario])
    kind = scenario.split("-")[1]
    assert len(first) == QUANT_STATE_TENSORS[kind], sorted(first)
    for other in others:
        assert first.keys() == other.keys()
        for key, value in first.items():
            assert torch.equal(value, other[key]), key
    assert any(v.abs().sum() > 0 for k, v in first.items() if k.endswith("amax_history"))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_amax_all_reduces_per_step_whatever_the_number_of_linears(results, scenario):
    device = results.device
    # on CUDA the te.autocast group is a custom one and must be the one used; the reference
    # backend has no autocast and reduces over the default group
    group = "amax group" if device == "cuda" else "other group"
    for r in results[scenario]:
        assert r["amax_all_reduces"] == [{group: 2}] * STEPS


def test_builtin_te_executor_reduces_amaxes_twice_per_linear(results):
    device = results.device
    if device != "cuda":
        pytest.skip("Thunder's built-in TE executor needs CUDA and TransformerEngine")
    for r in results["builtin_ddp-full"]:
        # per linear, forward and backward; over the default group, whatever autocast was given
        assert r["amax_all_reduces"] == [{"other group": 2 * LINEARS["full"]}] * STEPS
    ours = results["thunder_ddp-lora"][0]["amax_all_reduces"][-1]
    theirs = results["builtin_ddp-full"][0]["amax_all_reduces"][-1]
    print(
        f"\namax all-reduces per step: te_v2 {ours} for {LINEARS['lora']} linears, "
        f"built-in TE executor {theirs} for {LINEARS['full']} linears"
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_frozen_weights_run_no_wgrad_on_any_rank(results, scenario):
    device = results.device
    kind = scenario.split("-")[1]
    for r in results[scenario]:
        wgrad = {name: wgrad for name, claimed, _, wgrad in r["report"] if claimed}
        assert len(wgrad) == LINEARS[kind], r["report_text"]
        frozen = FROZEN.get(kind)
        for name, runs in wgrad.items():
            assert runs is (frozen is None or frozen not in name), (
                f"{name}: wgrad {'runs' if runs else 'missing'}\n{r['report_text']}"
            )
        if device == "cuda":
            assert r["gemm_kernels"] == NEEDED_GEMMS[kind], r["gemm_kernels"]
    if device == "cuda":
        print(
            f"\n[{scenario}] GEMM kernels per step on each rank: {[r['gemm_kernels'] for r in results[scenario]]}"
        )


@pytest.mark.parametrize("device", DEVICES)
def test_a_rank_that_raises_fails_the_run_with_its_error(device, tmp_path):
    start = time.monotonic()
    done = torchrun(tmp_path, device, "fail", ranks=WORLD, timeout_s=300)
    elapsed = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode != 0
    # torchrun names the failing rank as the root cause, with the exception it raised
    root_cause = output[output.index("Root Cause") :]
    assert "rank      : 1" in root_cause, output[-4000:]
    assert "RuntimeError: Expected w.shape=" in root_cause, output[-4000:]
    print(f"\n[{device}] a failing rank ended the run in {elapsed:.0f} s (exit code {done.returncode})")
