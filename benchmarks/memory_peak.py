"""What is alive at the peak of one training step of a Hugging Face Llama variant, and who made it.

    python -m benchmarks.memory_peak --model 8b --scenario full --variant "thunderfx + te_v2"

After three steps, one more runs under ``torch.cuda.memory._record_memory_history``; replaying its
allocations and frees gives the moment the step's allocated bytes peak and the blocks alive then,
which are printed grouped by the frames that allocated them (te_v2's symbols, Thunder's traces,
Inductor's kernels), largest first. Run one variant per process, as ``benchmarks.hf`` does.

A step replayed from CUDA graphs allocates nothing: its memory is the graphs' pools, which their
captures filled. ``--captures`` records the first step instead, whose captures allocate there, and
replays only the pools' blocks: the most the pools hold at once, against what they reserve (the
rest is fragments), and who allocated it.

    python -m benchmarks.memory_peak --model 1b --captures \
        --variant "thunderfx + te_v2 + CUDA graphs, saved memory reused"
"""

from __future__ import annotations

import argparse
import bisect
import collections
import sys
from typing import Any

import torch

from benchmarks import hf
from benchmarks.measure import make_step, warm_up_process

MiB = 2**20
# Frames of the machinery between a caller and the allocation, which name no tensor's origin.
_PLUMBING = (
    "torch/utils/_",
    "torch/_ops",
    "contextlib",
    "torch/_dynamo/eval_frame",
    "torch/nn/modules/module.py",
    "torch/autograd/function.py",
    "torch/_tensor.py",
)


def _site(frames: list[dict[str, Any]], depth: int = 4) -> str:
    kept = [f for f in frames if not any(s in f["filename"] for s in _PLUMBING)][:depth]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in kept) or (
        "(no Python frame: made by autograd's engine, such as a zero gradient)"
    )


def live_at_peak(
    events: list[dict[str, Any]], within: list[tuple[int, int]] | None = None
) -> tuple[int, list[tuple[int, str]]]:
    """The peak of the allocated bytes over ``events`` (a snapshot's device trace) and the blocks
    alive then, as (bytes, allocation site); with ``within``, only of blocks inside those
    (start, end) address ranges."""
    ranges = sorted(within or ())
    starts = [start for start, _ in ranges]
    live: dict[int, tuple[int, str]] = {}
    current, peak, at_peak = 0, -1, []
    for e in events:
        if within is not None and not _inside(e["addr"], starts, ranges):
            continue
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames", [])))
            current += e["size"]
            if current > peak:
                peak, at_peak = current, list(live.values())
        elif e["action"] == "free_completed" and e["addr"] in live:
            current -= live.pop(e["addr"])[0]
    return peak, at_peak


def _inside(address: int, starts: list[int], ranges: list[tuple[int, int]]) -> bool:
    """Whether ``address`` lies in one of the sorted, disjoint ``ranges`` (``starts``: theirs)."""
    i = bisect.bisect_right(starts, address) - 1
    return i >= 0 and address < ranges[i][1]


def graph_pool_ranges(segments: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The address ranges of the ``segments`` (a snapshot's) that belong to a private pool, as a
    CUDA graph's memory does."""
    return [
        (s["address"], s["address"] + s["total_size"])
        for s in segments
        if tuple(s["segment_pool_id"]) != (0, 0)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(hf.MODELS), default="8b")
    parser.add_argument("--scenario", choices=hf.SCENARIOS, default="full")
    parser.add_argument("--variant", choices=tuple(hf.RUNNABLE), default="thunderfx + te_v2")
    parser.add_argument("--top", type=int, default=25, help="allocation sites printed")
    parser.add_argument(
        "--captures",
        action="store_true",
        help="record the first step, whose CUDA graph captures allocate the graphs' pools, and "
        "replay only the pools' blocks: what a replay holds there at once",
    )
    args = parser.parse_args(argv)
    build, fp8 = hf.RUNNABLE[args.variant]
    warm_up_process()
    model = hf.build_model(args.model, args.scenario)
    step = make_step(hf.loss_of(build(model)), model, hf.batch(args.model), fp8=fp8, training=True)
    for _ in range(0 if args.captures else 3):
        step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=1_000_000)
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    within = graph_pool_ranges(snapshot["segments"]) if args.captures else None
    peak, blocks = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()], within)
    sites: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, site in blocks:
        sites[site][0] += size
        sites[site][1] += 1
    where = "in the graphs' pools at once" if args.captures else "allocated above the step's start"
    print(f"{args.variant}, {args.model} {args.scenario}: {peak / MiB:.0f} MiB {where}")
    if args.captures:
        reserved = sum(end - start for start, end in within)
        print(f"the pools reserve {reserved / MiB:.0f} MiB in {len(within)} segments")
    print("| MiB | blocks | allocated at |\n| ---: | ---: | --- |")
    for site, (size, count) in sorted(sites.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| {size / MiB:.0f} | {count} | `{site}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
