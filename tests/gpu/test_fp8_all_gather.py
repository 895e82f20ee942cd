"""te_v2's FSDP2 FP8 all-gather on one GPU with TransformerEngine: FSDP2's CUDA streams.

On the CPU (``tests/cpu/test_fp8_all_gather.py``, ``tests/distributed``) nothing runs
concurrently. On a GPU, FSDP2 casts each layer's shard on its all-gather copy-in stream while
the compute stream still runs the previous layer, so what the hooks pass between the two
streams must not be reused early; a Hugging Face Llama sharded per decoder layer on one rank,
five steps, bitwise those of a BF16 all-gather, finds it if it is.
"""

from __future__ import annotations

import pytest

from tests.distributed.launch import assert_fp8_gather_is_bitwise, rank_results, torchrun
from tests.gpu.common import requires_te_gpu

pytestmark = requires_te_gpu


def test_an_fp8_all_gather_trains_bitwise_as_a_bf16_one_on_a_gpu(tmp_path):
    scenarios = ("fsdp2_current-llama", "fsdp2_fp8-llama")
    launch = torchrun(tmp_path, "cuda", *scenarios, ranks=1)
    if launch.returncode != 0:
        pytest.fail(f"torchrun failed:\n{launch.stdout[-4000:]}\n{launch.stderr[-8000:]}")
    bf16, fp8 = (rank_results(tmp_path, s, 1) for s in scenarios)
    for r in (*bf16, *fp8):
        assert "error" not in r, r.get("error")
    assert_fp8_gather_is_bitwise(bf16, fp8)
