"""The ``(gpu)`` examples of docs/*.md run on TransformerEngine and show what the docs say.

How examples are found, run and compared with their documented output:
tests/cpu/test_docs_examples.py. Here each example is also checked beyond what it prints.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import thunder
import torch

from te_v2_executor import explain
from te_v2_executor.symbols import (
    BACKWARD_SYNC,
    FORWARD_SYNC,
    LINEAR_FWD,
    LINEAR_WGRAD,
    is_recast,
    is_recompute,
)
from tests.cpu.test_docs_examples import EXAMPLES, check_example
from tests.gpu.common import requires_te_gpu
from tests.helpers import backward_trace, bsyms_of, forward_trace

# the docs show what users get: only the recasts the peak needs
pytestmark = [*requires_te_gpu, pytest.mark.peak_policy]


def _symbols(traces) -> set:
    return {b.sym for t in traces for b in t.bound_symbols}


def _nonzero_rows(history: torch.Tensor) -> list[int]:
    return [i for i in range(history.shape[0]) if history[i].any()]


def _check_quickstart(ns: dict[str, Any]) -> None:
    rows = explain(ns["jitted"]).linears
    assert [(r.claimed, r.recipe) for r in rows] == [(True, "delayed")] * 2
    assert all(p.grad is not None for p in ns["model"].parameters())
    assert bsyms_of(forward_trace(ns["jitted"]), FORWARD_SYNC)
    assert bsyms_of(backward_trace(ns["jitted"]), BACKWARD_SYNC)


def _check_recipes(ns: dict[str, Any]) -> None:
    assert thunder.cache_misses(ns["jitted"]) == 3


def _check_claim_policy(ns: dict[str, Any]) -> None:
    """The last model (every linear claimed) trains its adapters, not its base."""
    grads = {name: p.grad for name, p in ns["model"].named_parameters()}
    assert grads["base.weight"] is None
    assert grads["lora_a.weight"] is not None and grads["lora_b.weight"] is not None
    assert len(bsyms_of(backward_trace(ns["jitted"]), LINEAR_WGRAD)) == 2


def _check_grad_accumulation(ns: dict[str, Any]) -> None:
    """Four micro-batches, one update per direction: each history has rolled once, so only its
    last row can hold an amax (a dy that underflowed the initial scale records zero)."""
    rows = explain(ns["jitted"]).linears
    for row in rows:
        for forward in (True, False):
            history = row.state.scaling(forward=forward).amax_history
            assert set(_nonzero_rows(history)) <= {history.shape[0] - 1}, (row.name, forward)
    for history in (
        rows[0].state.scaling(forward=True).amax_history,
        rows[-1].state.scaling(forward=False).amax_history,
    ):
        assert _nonzero_rows(history) == [history.shape[0] - 1]


def _check_checkpointing(ns: dict[str, Any]) -> None:
    """The backward recomputes the two up projections, not the downs that produce the output."""
    backward = bsyms_of(backward_trace(ns["jitted"]), LINEAR_FWD)
    recomputed = [b for b in backward if is_recompute(b) and not is_recast(b)]
    assert sorted(b.kwargs["state"].name for b in recomputed) == ["t_mlps_0_up_weight", "t_mlps_1_up_weight"]


def _check_peft_lora(ns: dict[str, Any]) -> None:
    """LoRA weights get gradients, the frozen base none; te_v2 runs in thunderfx's regions."""
    assert torch.isfinite(ns["loss"])
    trained = {name for name, p in ns["model"].named_parameters() if p.grad is not None}
    assert trained == {name for name, p in ns["model"].named_parameters() if "lora_" in name}
    assert trained
    assert {LINEAR_FWD, FORWARD_SYNC} <= _symbols(ns["compiled"].last_traces)


def _check_cuda_graphs(ns: dict[str, Any]) -> None:
    """The steps replayed graphs; only the flushes ran outside them."""
    assert torch.isfinite(ns["loss"])
    outside = {
        b.sym for b in forward_trace(ns["jitted"]).bound_symbols if not b.sym.name.startswith("CUDAGraph")
    }
    assert FORWARD_SYNC in outside and LINEAR_FWD not in outside
    assert any(b.sym.name.startswith("CUDAGraph") for b in backward_trace(ns["jitted"]).bound_symbols)


def _check_cuda_graphs_thunderfx(ns: dict[str, Any]) -> None:
    """thunderfx's region replayed graphs, forward and backward."""
    import thunder

    assert torch.isfinite(ns["loss"])
    assert ns["transform"].cuda_graph_runner.cuda_graph_cache
    fns = [fn for info in ns["compiled"]._backend.subgraph_infos for fn in info.thunder_compiled_fns]
    for traces in (
        [thunder.last_traces(fn)[-1] for fn in fns],
        [thunder.last_backward_traces(fn)[-1] for fn in fns],
    ):
        assert any(b.sym.name.startswith("CUDAGraph") for t in traces for b in t.bound_symbols)


GPU_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "quickstart": _check_quickstart,
    "recipes": _check_recipes,
    "claim-policy": _check_claim_policy,
    "grad-accumulation": _check_grad_accumulation,
    "checkpointing": _check_checkpointing,
    "peft-lora": _check_peft_lora,
    "cuda-graphs": _check_cuda_graphs,
    "cuda-graphs-thunderfx": _check_cuda_graphs_thunderfx,
}


@pytest.mark.parametrize("name", [name for name, example in EXAMPLES.items() if example.gpu])
def test_gpu_example(name):
    if name == "peft-lora":
        missing = [m for m in ("transformers", "peft") if importlib.util.find_spec(m) is None]
        if missing:
            pytest.skip(f"the PEFT example needs {' and '.join(missing)}, not installed here")
        torch._dynamo.reset()  # thunderfx compiles through torch.compile; start from no cache
    check_example(EXAMPLES[name], GPU_CHECKS)
