"""te_v2 under data parallelism, ranks launched by torchrun (see ``worker.py``).

On two CUDA GPUs with TransformerEngine (``make test-distributed``): NCCL, the TE backend under
``te.autocast`` with a custom amax reduction group, two ranks; on a machine of one GPU, the same
scenarios on one NCCL rank, whose collectives move nothing and whose failing-rank check cannot
run. On CPU: gloo and the reference backend, two ranks, the same scenarios and checks (no
autocast there: amaxes reduce over the default group).
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
from tests.helpers import nvfuser_installed

WORLD = 2
WRAPPERS = ("thunder_ddp", "fsdp_zero2", "fsdp_zero3", "torch_ddp", "fsdp2")
KINDS = ("full", "lora")
# a Hugging Face Llama's two decoder layers sharded one by one, through one Thunder region
SCENARIOS = [f"{w}-{m}" for w in WRAPPERS for m in KINDS] + ["fsdp2-llama", "fsdp2-llamafrozen"]
# the Llama under current scaling, its weights gathered in BF16 and in FP8 (te_v2_executor.fsdp)
CURRENT_SCENARIOS = ["fsdp2_current-llama", "fsdp2_fp8-llama"]
# Thunder's FSDP with nvFuser after te_v2: on CUDA where nvFuser is installed
NVFUSER_SCENARIOS = [f"fsdp_nvfuser-{m}" for m in KINDS]

_gpus = torch.cuda.device_count() if torch.cuda.is_available() and backends.te_available() else 0


def _cuda(ranks: int, name: str, reason: str):
    return pytest.param(
        ("cuda", ranks),
        id=name,
        marks=[pytest.mark.distributed, pytest.mark.skipif(_gpus < ranks, reason=reason)],
    )


TWO_RANKS = [
    pytest.param(("cpu", WORLD), id="cpu-gloo-reference"),
    _cuda(
        WORLD,
        "cuda-nccl-te",
        f"needs {WORLD} CUDA GPUs with TransformerEngine (run `make test-distributed` on such a machine)",
    ),
]
DEVICES = [*TWO_RANKS, _cuda(1, "cuda-nccl-te-one-rank", "needs a CUDA GPU with TransformerEngine")]


# GEMMs one step needs (x needs no grad): full, 3 linears: 3 forward, 3 wgrad, 2 dgrad; LoRA,
# 2 layers of frozen base + adapters A, B: 6 forward, 4 adapter wgrads, 4 dgrads (B of both,
# A and base of the second layer), no base wgrad.
# The Llama: 2 layers of 7 projections and the head, 15 calls, each with its dgrad (the
# embedding trains); wgrads but for the frozen attention's 2 x 4; and the rotary embedding's
# one matmul of its frequencies by the positions, in the forward.
NEEDED_GEMMS = {"full": 3 + 3 + 2, "lora": 6 + 4 + 4, "llama": 15 * 3 + 1, "llamafrozen": 15 * 3 - 8 + 1}
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
    """The per-rank results of every scenario, from one torchrun launch on ``world`` ranks of a
    device kind, and of the restores of its checkpoints, from one more launch on a single rank.
    A scenario this device cannot run skips, with the reason."""

    def __init__(self, device: str, world: int, out: Path) -> None:
        self.device, self.world, self.out = device, world, out
        self.not_run: dict[str, str] = {}
        if device != "cuda" or world < 2:
            self.not_run["builtin_ddp-full"] = (
                "Thunder's built-in TE executor needs CUDA, and reduces amaxes over several ranks only"
            )
        if device != "cuda" or not nvfuser_installed():
            why = "nvFuser is not installed" if device == "cuda" else "nvFuser runs on CUDA only"
            self.not_run.update(dict.fromkeys(NVFUSER_SCENARIOS, why))
        checkpointed = [f"fsdp2_checkpoint-{k}" for k in KINDS]
        launched = [
            s
            for s in (*SCENARIOS, *CURRENT_SCENARIOS, *NVFUSER_SCENARIOS, *checkpointed, "builtin_ddp-full")
            if s not in self.not_run
        ]
        self.launch = torchrun(out, device, *launched, ranks=world)
        self.restore = torchrun(out, device, *(f"restored-{k}" for k in KINDS), ranks=1)
        self._loaded: dict[str, list[dict]] = {}

    def __getitem__(self, scenario: str) -> list[dict]:
        if scenario in self.not_run:
            pytest.skip(f"{scenario}: {self.not_run[scenario]}")
        restored = scenario.startswith("restored-")
        launch = self.restore if restored else self.launch
        ranks = 1 if restored else self.world
        if not all((self.out / f"{scenario}.rank{r}.pt").exists() for r in range(ranks)):
            pytest.fail(f"torchrun failed:\n{launch.stdout[-4000:]}\n{launch.stderr[-8000:]}")
        if scenario not in self._loaded:
            self._loaded[scenario] = rank_results(self.out, scenario, ranks)
        ranks = self._loaded[scenario]
        for rank, r in enumerate(ranks):
            if "error" in r:
                pytest.fail(f"{scenario} raised on rank {rank}:\n{r['error']}")
        return ranks


@pytest.fixture(params=DEVICES, scope="module")
def results(request, tmp_path_factory) -> Results:
    device, world = request.param
    return Results(device, world, tmp_path_factory.mktemp(f"dist-{device}-{world}"))


def _shard(full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    """The rows of ``full`` rank ``rank`` holds under FSDP (dim 0 split evenly), or ``full``."""
    if local.shape == full.shape:
        return full
    rows = local.shape[0]
    return full[rank * rows : (rank + 1) * rows]


def test_every_launch_exits_cleanly(results):
    """Each rank saves a scenario's results as it ends, so the tests judge them even where a
    launch then fails on its way out; this one says whether it did."""
    for launch in (results.launch, results.restore):
        assert launch.returncode == 0, f"{launch.stdout[-2000:]}\n{launch.stderr[-6000:]}"


@pytest.mark.parametrize("scenario", SCENARIOS + CURRENT_SCENARIOS + NVFUSER_SCENARIOS)
def test_weights_and_losses_match_a_single_process_run(results, scenario):
    for rank, r in enumerate(results[scenario]):
        losses, reference = torch.stack(r["losses"]), torch.stack(r["reference_losses"])
        assert losses.shape == (STEPS,)
        torch.testing.assert_close(losses, reference, **FP8_TOLS)
        assert set(r["weights"]) == set(r["reference_weights"])
        for name, w in r["weights"].items():
            ref = _shard(r["reference_weights"][name], w, rank)
            torch.testing.assert_close(w.float(), ref.float(), **FP8_TOLS, msg=lambda m, n=name: f"{n}: {m}")
        # every matrix that trains has moved, here and in the single-process run: the
        # comparison is not one of untouched weights (each step's batch differs, so the loss
        # need not go down; a bfloat16 norm's step may round away)
        for name, before in r["initial_weights"].items():
            if before.dim() == 2:
                assert not torch.equal(r["reference_weights"][name], before), f"{name} did not train"
                assert not torch.equal(r["weights"][name], _shard(before, r["weights"][name], rank)), name


def test_an_fp8_all_gather_trains_bitwise_as_a_bf16_one_moving_a_byte_a_value(results):
    """FP8 and BF16 all-gathers of the Llama step alike, the FP8 one moving a byte a value."""
    bf16, fp8 = results["fsdp2_current-llama"], results["fsdp2_fp8-llama"]
    assert_fp8_gather_is_bitwise(bf16, fp8)
    print(
        f"\n[{results.device}] all-gather bytes per step on rank 0: BF16 {bf16[0]['all_gather_bytes']:.0f}, "
        f"FP8 {fp8[0]['all_gather_bytes']:.0f}"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_restored_on_one_rank_trains_on_as_the_saving_ranks_did(results, kind):
    """A torch.distributed.checkpoint of the FSDP2-sharded model and te_v2's quantization state,
    saved by the launch's ranks after two steps, loaded on one (``quantization_state_template``
    makes the tensors it loads into), then three more steps on the same global batches: the
    losses, weights and states of the ranks that went on without stopping."""
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


@pytest.mark.parametrize("scenario", SCENARIOS + NVFUSER_SCENARIOS)
def test_quantization_state_is_identical_on_every_rank(results, scenario):
    first, *others = (r["quant_state"] for r in results[scenario])
    kind = scenario.split("-")[1]
    assert len(first) == QUANT_STATE_TENSORS[kind], sorted(first)
    for other in others:
        assert first.keys() == other.keys()
        for key, value in first.items():
            assert torch.equal(value, other[key]), key
    assert any(v.abs().sum() > 0 for k, v in first.items() if k.endswith("amax_history"))


@pytest.mark.parametrize("scenario", SCENARIOS + NVFUSER_SCENARIOS)
def test_two_amax_all_reduces_per_step_whatever_the_number_of_linears(results, scenario):
    # on CUDA the te.autocast group is a custom one and must be the one used; the reference
    # backend has no autocast and reduces over the default group; one rank reduces nothing, as
    # TE's own update does not
    group = "amax group" if results.device == "cuda" else "other group"
    per_step = {group: 2} if results.world > 1 else {}
    for r in results[scenario]:
        assert r["amax_all_reduces"] == [per_step] * STEPS


def test_builtin_te_executor_reduces_amaxes_twice_per_linear(results):
    for r in results["builtin_ddp-full"]:
        # per linear, forward and backward; over the default group, whatever autocast was given
        assert r["amax_all_reduces"] == [{"other group": 2 * LINEARS["full"]}] * STEPS
    ours = results["thunder_ddp-lora"][0]["amax_all_reduces"][-1]
    theirs = results["builtin_ddp-full"][0]["amax_all_reduces"][-1]
    print(
        f"\namax all-reduces per step: te_v2 {ours} for {LINEARS['lora']} linears, "
        f"built-in TE executor {theirs} for {LINEARS['full']} linears"
    )


@pytest.mark.parametrize("scenario", SCENARIOS + NVFUSER_SCENARIOS)
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
            assert len(r["gemm_kernels"]) == NEEDED_GEMMS[kind], r["gemm_kernels"]
    if device == "cuda":
        counts = [len(r["gemm_kernels"]) for r in results[scenario]]
        print(f"\n[{scenario}] GEMM kernels per step on each rank: {counts}")


def test_nvfuser_fuses_around_te_v2_under_thunders_fsdp(results):
    """nvFuser listed after te_v2 under Thunder's FSDP (ZeRO-3) takes the ops between te_v2's
    GEMMs, forward and backward, on every rank."""
    for scenario in NVFUSER_SCENARIOS:
        for r in results[scenario]:
            assert {"nvfuser", "te_v2_ops"} <= r["executors_run"], r["executors_run"]


@pytest.mark.parametrize("device_ranks", TWO_RANKS)
def test_a_rank_that_raises_fails_the_run_with_its_error(device_ranks, tmp_path):
    device, _ = device_ranks
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
