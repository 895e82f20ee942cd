"""The FP8 bytes of a weight's shard that FSDP2 gathers (``fsdp.py``): one pass on CUDA.

Each value times the whole weight's scale in float32, clamped to the FP8 format's largest
magnitude and rounded to the nearest E4M3 value, as TE's current-scaling cast rounds it.
``quantize`` runs in PyTorch's ops, four elementwise passes, on any device; on CUDA one Triton
kernel does the same in one pass (the shard read and a byte written per value), on the stream
where FSDP2 calls its pre-all-gather hook.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from te_v2_executor.backends.gathered_dequantize import FP8_DTYPE

_BLOCK = 1024


def quantize(shard: torch.Tensor, scale: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """The FP8 E4M3 bytes (uint8) of ``shard`` cast with the float32 ``scale`` (module docstring)."""
    if shard.is_cuda and shard.is_contiguous():
        out = torch.empty(shard.shape, dtype=torch.uint8, device=shard.device)
        programs = -(-shard.numel() // _BLOCK)
        _kernel()[(programs,)](shard, out, scale, fp8_max, shard.numel(), BLOCK=_BLOCK)
        return out
    return quantize_in_torch(shard, scale, fp8_max)


def quantize_in_torch(shard: torch.Tensor, scale: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """``quantize`` in PyTorch's ops: what the Triton kernel must match to the bit."""
    return (shard.float() * scale).clamp(-fp8_max, fp8_max).to(FP8_DTYPE).view(torch.uint8)


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, compiled on first use (Triton is imported only where CUDA runs it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_kernel(shard_ptr, out_ptr, scale_ptr, fp8_max, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        value = tl.load(shard_ptr + offsets, mask=inside, other=0).to(tl.float32) * tl.load(scale_ptr)
        value = tl.clamp(value, -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_ptr + offsets, value.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=inside)

    return quantize_kernel
