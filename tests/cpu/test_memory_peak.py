"""``benchmarks.memory_peak``: the replay of a memory snapshot's trace finds the peak and the blocks
alive at it, named by the frames that allocated them; ``benchmarks.measure`` counts what CUDA graphs'
pools hold that no tensor does."""

from __future__ import annotations

from benchmarks.measure import idle_in_graph_pools
from benchmarks.memory_peak import graph_pool_ranges, live_at_peak


def _frame(filename: str, name: str) -> dict:
    return {"filename": filename, "line": 1, "name": name}


def test_the_peak_holds_the_blocks_alive_at_its_moment():
    gemm = [_frame("/x/torch/nn/modules/module.py", "_call_impl"), _frame("/x/te_v2/te.py", "_gemm")]
    events = [
        {"action": "alloc", "addr": 1, "size": 10, "frames": gemm},
        {"action": "free_completed", "addr": 99, "size": 7},  # allocated before the recording
        {"action": "alloc", "addr": 2, "size": 20},
        {"action": "free_requested", "addr": 1, "size": 10},  # not yet free: still counted
        {"action": "alloc", "addr": 3, "size": 5, "frames": gemm},
        {"action": "free_completed", "addr": 1, "size": 10},
        {"action": "free_completed", "addr": 3, "size": 5},
        {"action": "alloc", "addr": 4, "size": 12, "frames": gemm},
    ]
    peak, blocks = live_at_peak(events)
    assert peak == 35
    assert sorted(blocks) == [
        (5, "te.py:1:_gemm"),
        (10, "te.py:1:_gemm"),
        (20, "(no Python frame: made by autograd's engine, such as a zero gradient)"),
    ]


def test_with_ranges_only_the_blocks_inside_them_count():
    """``--captures``: only the graphs' pools' blocks are replayed, found from the segments."""
    segments = [
        {"segment_pool_id": (0, 0), "address": 0, "total_size": 100},
        {"segment_pool_id": (1, 0), "address": 1000, "total_size": 64},
    ]
    assert graph_pool_ranges(segments) == [(1000, 1064)]
    events = [
        {"action": "alloc", "addr": 10, "size": 50},
        {"action": "alloc", "addr": 1000, "size": 32},
        {"action": "alloc", "addr": 1032, "size": 16},
        {"action": "free_completed", "addr": 1000, "size": 32},
        {"action": "alloc", "addr": 20, "size": 40},
    ]
    peak, blocks = live_at_peak(events, graph_pool_ranges(segments))
    assert peak == 48 and sorted(size for size, _ in blocks) == [16, 32]


def test_only_private_pools_free_memory_counts_as_held():
    segments = [
        {"segment_pool_id": (0, 0), "total_size": 100, "allocated_size": 10},
        {"segment_pool_id": (1, 0), "total_size": 64, "allocated_size": 16},
        {"segment_pool_id": [1, 1], "total_size": 8, "allocated_size": 8},
    ]
    assert idle_in_graph_pools(segments) == 48
