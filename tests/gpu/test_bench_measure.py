"""``benchmarks.measure`` on a GPU: a CUDA graph's temporaries count in a step's peak."""

from __future__ import annotations

import torch

from benchmarks.measure import peak_memory_above
from tests.gpu.common import requires_te_gpu

pytestmark = requires_te_gpu

MIB = 2**20


def test_a_replayed_graphs_temporaries_count_in_the_peak():
    x = torch.randn(4096, 4096, device="cuda")
    out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        doubled = x * 2
        out.copy_(doubled + 1)
        del doubled
    graph.replay()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - baseline < MIB, "a replay allocates nothing"
    peak = peak_memory_above(graph.replay, torch.nn.Linear(1, 1), baseline)
    assert peak >= 2 * x.nbytes - MIB, "both 64 MiB temporaries are live at once in the graph's pool"
    torch.testing.assert_close(out, x * 2 + 1)
