"""The flush's amax reduction across ranks: two CPU processes over gloo, reference backend."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, results) -> None:
    import thunder

    from te_v2_executor import delayed_scaling, explain, make_te_v2
    from tests.helpers import CLAIM_ALL
    from tests.models import Stack

    dist.init_process_group("gloo", rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}")
    calls = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        torch.manual_seed(0)
        model = Stack([64] * 4)
        jitted = thunder.jit(
            model,
            executors=[
                make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=delayed_scaling(amax_history_len=4))
            ],
        )
        x = torch.randn(32, 64) * (rank + 1)  # rank 1's amaxes are larger
        jitted(x).sum().backward()
        histories = [
            (r.state.scaling(forward=True).amax_history, r.state.scaling(forward=False).amax_history)
            for r in explain(jitted).linears
        ]
        results.put((rank, calls, histories, x.abs().amax()))
    finally:
        dist.destroy_process_group()


def test_one_amax_all_reduce_per_flush_whatever_the_number_of_linears():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, results)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    got = {r[0]: r[1:] for r in (results.get(timeout=240) for _ in range(WORLD))}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for calls, _, _ in got.values():
        # one concatenated all-reduce for the forward flush, one for the backward: 3 linears, 3 x 2 and 3 x 1 amaxes
        assert calls == [6, 3]
    (_, hist0, amax0), (_, hist1, amax1) = got[0], got[1]
    for (f0, b0), (f1, b1) in zip(hist0, hist1, strict=True):
        assert torch.equal(f0, f1) and torch.equal(b0, b1)  # every rank holds the reduced state
    assert torch.equal(hist0[0][0][-1, 0], torch.maximum(amax0, amax1))  # the max over ranks
