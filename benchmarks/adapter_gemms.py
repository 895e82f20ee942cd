"""peft's float32 adapter GEMMs at the Llama-3-8B dims, as ``narrowings`` runs them and as before.

    python -m benchmarks.adapter_gemms

For each projection shape and each adapter GEMM whose large operand ``narrowings`` narrows: the
time of the bfloat16 operand widened and multiplied in float32 (cuBLAS, CUDA cores) against the
mixed product (``backends/unquantized.py``), both with CUDA events over calls back to back (so
the larger of GPU and host time), the host time of one call, and the error of the mixed product
to a float64 one over cuBLAS float32's. A markdown table on stdout.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from benchmarks import shapes
from benchmarks.measure import without_te_gpu
from te_v2_executor.backends import unquantized

TOKENS = 8192
PROJECTIONS = [
    (shapes.HIDDEN, shapes.HIDDEN),
    (shapes.HIDDEN, 1024),
    (shapes.HIDDEN, shapes.FFN),
    (shapes.FFN, shapes.HIDDEN),
]


def _device_us(fn: Callable[[], torch.Tensor], calls: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def _host_us(fn: Callable[[], torch.Tensor], calls: int = 50) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return spent


def _cases(fin: int, fout: int) -> dict[str, tuple[Callable, tuple, tuple, dict]]:
    """name -> (GEMM, mixed operands, widened operands, keywords)."""
    rank = shapes.LORA_RANK
    x = torch.randn(TOKENS, fin, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(TOKENS, fout, device="cuda", dtype=torch.bfloat16)
    a, b = torch.randn(rank, fin, device="cuda") / 64, torch.randn(fout, rank, device="cuda") / 4
    h, dh = torch.randn(TOKENS, rank, device="cuda"), torch.randn(TOKENS, rank, device="cuda")
    dgrad = {"input_shape": (TOKENS, rank), "scale": 2.0}
    return {
        "x @ A^T": (unquantized.linear_fwd, (x, a, None), (x.float(), a, None), {}),
        "dy @ B": (unquantized.linear_dgrad, (dy, b), (dy.float(), b), dgrad),
        "dy^T @ h": (unquantized.linear_wgrad, (dy, h), (dy.float(), h), {"scale": 2.0}),
        "dh^T @ x": (unquantized.linear_wgrad, (dh, x), (dh, x.float()), {}),
    }


def main() -> int:
    if without_te_gpu("the adapter GEMM benchmark"):
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    print(
        "| in, out | GEMM | cast + float32 GEMM, us | mixed, us | host us, cast + float32 / mixed | error, mixed / float32 |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for fin, fout in PROJECTIONS:
        for name, (gemm, mixed, widened, kwargs) in _cases(fin, fout).items():
            exact = gemm(*(t.double() if isinstance(t, torch.Tensor) else t for t in widened), **kwargs)
            errors = [(gemm(*ops, **kwargs).double() - exact).abs().max().item() for ops in (mixed, widened)]
            wide, narrow = (functools.partial(gemm, *ops, **kwargs) for ops in (widened, mixed))
            print(
                f"| {fin}, {fout} | {name} | {_device_us(wide):.0f} | {_device_us(narrow):.0f} | "
                f"{_host_us(wide):.0f} / {_host_us(narrow):.0f} | {errors[0] / errors[1]:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
