"""te_v2's FSDP2 FP8 all-gather on one GPU with TransformerEngine: FSDP2's CUDA streams.

On the CPU (``tests/cpu/test_fp8_all_gather.py``, ``tests/distributed``) nothing runs
concurrently. On a GPU, FSDP2 casts each layer's shard on its all-gather copy-in stream while
the compute stream still runs the previous layer, so what the hooks pass between the two
streams must not be reused early: the weight each eagerly run linear reads is checked against
its own gathered FP8 values. A Hugging Face Llama sharded per decoder layer trains five steps
bitwise as with a BF16 all-gather in ``tests/distributed`` (on one NCCL rank where the machine has
one GPU).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.gpu.common import requires_te_gpu
from tests.helpers import file_store_process_group

pytestmark = requires_te_gpu


@pytest.fixture
def one_nccl_rank(tmp_path):
    """A NCCL process group of this process alone, on the current GPU."""
    with file_store_process_group("nccl", str(tmp_path / "store"), device_id=torch.device("cuda", 0)):
        yield


def test_each_layer_reads_its_own_gathered_fp8_weight_while_the_gpu_lags(one_nccl_rank):
    """Eight layers of two large linears, each sharded on its own, run eagerly three times: the
    weight each linear reads is exactly its own FP8 values times its own scale's inverse, though
    FSDP2 casts the next layer's shard on its copy-in stream while this layer still computes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from te_v2_executor import current_scaling, make_te_v2
    from te_v2_executor.fsdp import fp8_all_gather
    from tests.helpers import CLAIM_ALL, gathered_on_one_rank

    torch.manual_seed(0)
    dim = 4096
    model = torch.nn.Sequential(
        *(
            torch.nn.Sequential(torch.nn.Linear(dim, dim, bias=False), torch.nn.Linear(dim, dim, bias=False))
            for _ in range(8)
        )
    ).to("cuda", torch.bfloat16)
    for i, p in enumerate(model.parameters()):
        p.data.mul_(1 + i)  # a scale of its own for each weight
    executor = make_te_v2(recipe=current_scaling(), claim=CLAIM_ALL)
    mesh = init_device_mesh("cuda", (1,))

    linears = [m for layer in model for m in layer]
    expected = [gathered_on_one_rank(m.weight, executor.config.recipe)[1] for m in linears]
    assert len(fp8_all_gather(model, executor, world_size=1)) == len(linears)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    seen: list[list[torch.Tensor]] = [[] for _ in linears]
    for i, m in enumerate(linears):
        m.register_forward_pre_hook(lambda mod, args, i=i: seen[i].append(mod.weight.detach().clone()))
    x = torch.randn(16384, dim, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the linears run eagerly, which warns
        for _ in range(3):
            model(x)
    torch.cuda.synchronize()
    wrong = [
        (i, call)
        for i, calls in enumerate(seen)
        for call, w in enumerate(calls)
        if not torch.equal(w, expected[i])
    ]
    assert all(len(calls) == 3 for calls in seen) and not wrong, (
        f"(linear, call) read another weight: {wrong}"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_te_reads_the_gathered_fp8_bytes_as_its_cast_would_make_them(one_nccl_rank, dtype):
    """TE's forward GEMM and dgrad from the gathered FP8 bytes (row-wise, and TE's FP8 transpose
    for the dgrad's copy) are, to the bit, those from TE's cast of the gathered weight."""
    from te_v2_executor import current_scaling
    from te_v2_executor.backends import te as numerics
    from tests.helpers import forward_and_dgrad_through_gathered_weight

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(2048, 4096, generator=g, device="cuda") * torch.logspace(-3, 0, 4096, device="cuda")).to(
        dtype
    )
    x = torch.randn(256, 4096, generator=g, device="cuda", dtype=dtype)
    dy = torch.randn(256, 2048, generator=g, device="cuda", dtype=dtype)
    from_bytes, from_cast = forward_and_dgrad_through_gathered_weight(numerics, x, w, dy, current_scaling())
    assert all(torch.equal(a, b) for a, b in zip(from_bytes, from_cast, strict=True))
    assert from_bytes[1].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(2048, 1024), (257, 48)])
@pytest.mark.parametrize(("scale_inv", "top"), [(1 / 3.7, 0x7E), (2.0**-7, 0x55), (1e-4, 0x01)])
def test_the_gathered_weight_is_made_in_one_kernel_as_pytorchs_ops_make_it(dtype, shape, scale_inv, top):
    """The post-gather hook's Triton kernel writes, to the bit, what its PyTorch ops write: every
    FP8 code but NaN's, times a scale's inverse not exact in the dtype, the amax's code in both
    signs replaced by the amax."""
    from te_v2_executor.backends import gathered_dequantize

    g = torch.Generator(device="cuda").manual_seed(0)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8, device="cuda")
    data = codes[torch.randint(len(codes), shape, generator=g, device="cuda")]
    scale_inv_t = torch.tensor(scale_inv, device="cuda")
    top_t = torch.tensor(top, dtype=torch.uint8, device="cuda")
    amax = (top_t.view(torch.float8_e4m3fn).float() * scale_inv_t).to(dtype).float() * 1.01
    kernel, ops = (torch.full(shape, float("nan"), dtype=dtype, device="cuda") for _ in range(2))
    gathered_dequantize.dequantize(data, scale_inv_t, amax, top_t, out=kernel)
    gathered_dequantize.dequantize_in_torch(data, scale_inv_t, amax, top_t, out=ops)
    assert torch.equal(kernel.view(torch.uint8), ops.view(torch.uint8))
    assert (kernel == amax.to(dtype)).any() and (kernel == -amax.to(dtype)).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(2048, 1024), (257, 48)])
@pytest.mark.parametrize("scale", [448 / 3.7, 2.0**7, 448 / 1e-4])
def test_a_shard_is_cast_in_one_kernel_as_pytorchs_ops_cast_it(dtype, shape, scale):
    """The pre-all-gather hook's Triton kernel writes, to the bit, what its PyTorch ops write:
    random values over the format's range, the values half-way between neighbouring FP8 values
    (exactly so where the scale is a power of 2: ties round to even), and values beyond the
    amax, clamped to the largest FP8 value in both signs."""
    from te_v2_executor.backends import gathered_quantize

    g = torch.Generator(device="cuda").manual_seed(0)
    shard = torch.randn(shape, generator=g, device="cuda") * (448 / scale / 3)
    codes = torch.arange(0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn).float()
    halfway = (codes[:-1] + codes[1:]) / 2 / scale
    flat = shard.view(-1)
    flat[: 2 * len(halfway)] = torch.cat([halfway, -halfway])
    flat[-2:] = torch.tensor([1.5, -1.5], device="cuda") * 448 / scale
    shard = shard.to(dtype)
    scale_t = torch.tensor(scale, dtype=torch.float32, device="cuda")
    kernel = gathered_quantize.quantize(shard, scale_t, 448.0)
    ops = gathered_quantize.quantize_in_torch(shard, scale_t, 448.0)
    assert kernel.dtype == torch.uint8 and kernel.shape == shard.shape
    assert torch.equal(kernel, ops), (kernel != ops).sum()
    assert {0x7E, 0xFE} <= set(kernel.view(-1)[-2:].tolist())
