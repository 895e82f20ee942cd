"""The unquantized GEMMs of a bfloat16 operand and a float32 one on the GPU (peft's float32 LoRA
adapters after ``narrowings``): the float32 product, as accurate as cuBLAS's float32 GEMM of the
widened operands to within a small factor (tensor cores add the products of one instruction with
truncation), computed on tensor cores, not on the CUDA cores float32 GEMMs run on."""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks.measure import GEMM_KERNEL
from te_v2_executor.backends import unquantized
from tests.gpu.common import requires_te_gpu

pytestmark = requires_te_gpu

T, IN, OUT, RANK = 2048, 1024, 3584, 16
FLOAT32_GEMM_KERNEL = re.compile(r"f32f32|sgemm|ffma", re.IGNORECASE)  # CUDA-core float32 GEMMs


def _adapter_gemms() -> dict[str, tuple]:
    """Each adapter GEMM whose large operand ``narrowings`` narrows: (function, args, kwargs,
    the same GEMM of the widened operands)."""
    torch.manual_seed(0)
    x = torch.randn(T, IN, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, OUT, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(RANK, IN, device="cuda") / 32
    b = torch.randn(OUT, RANK, device="cuda") / 4
    h, dh = torch.randn(T, RANK, device="cuda"), torch.randn(T, RANK, device="cuda")
    acc = torch.randn(T, RANK, device="cuda")
    return {
        "x @ A^T": (unquantized.linear_fwd, (x, a, None), {}, (x.float(), a, None)),
        "x @ A^T, scaled into a buffer": (
            unquantized.linear_fwd,
            (x, a, None, acc.clone()),
            {"scale": 0.375},
            (x.float(), a, None, acc.clone()),
        ),
        "dy @ B": (
            unquantized.linear_dgrad,
            (dy, b),
            {"input_shape": (T, RANK), "scale": 2.0},
            (dy.float(), b),
        ),
        "dy^T @ h": (unquantized.linear_wgrad, (dy, h), {"scale": 2.0}, (dy.float(), h)),
        "dh^T @ x": (unquantized.linear_wgrad, (dh, x), {}, (dh, x.float())),
    }


CASES = ["x @ A^T", "x @ A^T, scaled into a buffer", "dy @ B", "dy^T @ h", "dh^T @ x"]


def test_the_cases_are_the_adapter_gemms():
    assert list(_adapter_gemms()) == CASES


@pytest.mark.parametrize("case", CASES)
def test_the_mixed_product_is_as_accurate_as_cublas_float32(case):
    torch.backends.cuda.matmul.allow_tf32 = False
    fn, args, kwargs, widened = _adapter_gemms()[case]
    mixed, float32 = fn(*args, **kwargs), fn(*widened, **kwargs)
    exact = fn(*(t.double() if isinstance(t, torch.Tensor) else t for t in widened), **kwargs)
    assert mixed.dtype == torch.float32
    error, float32_error = ((r.double() - exact).abs().max().item() for r in (mixed, float32))
    # measured on an H200: 2 to 15 times cuBLAS's float32 error at the 8B Llama's adapter shapes;
    # the truncation to two pieces, a product accurate to 16 bits, is over 100 times
    assert error <= 32 * float32_error, (error, float32_error)


def test_the_mixed_products_run_on_tensor_cores():
    gemms = _adapter_gemms().values()
    for fn, args, kwargs, _ in gemms:  # warm up cuBLAS's heuristics
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for fn, args, kwargs, _ in gemms:
            fn(*args, **kwargs)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gemm_names = [n for n in names if GEMM_KERNEL.search(n)]
    assert len(gemm_names) == len(gemms), gemm_names
    assert not [n for n in gemm_names if FLOAT32_GEMM_KERNEL.search(n)], gemm_names
