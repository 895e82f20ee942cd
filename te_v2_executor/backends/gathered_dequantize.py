"""The weight FSDP2 gathered in FP8 (``fsdp.py``), made from its bytes: one pass on CUDA.

Each FP8 E4M3 value times the scale's inverse, both in the weight's dtype (the product rounded
once, as PyTorch's ``mul`` rounds it), except the values whose magnitude has the amax's FP8
code, which are the amax itself with their sign: te_v2's current-scaling cast of the result then
finds the whole weight's amax, and with it the gathered bytes (``fsdp.py``). ``dequantize`` runs
in PyTorch's ops, about ten elementwise passes, on any device; on CUDA one Triton kernel does
the same in one pass (a byte read and the weight written per value), on the compute stream where
FSDP2 calls its hook.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
_BLOCK = 1024


def dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor, top: torch.Tensor, out: torch.Tensor
) -> None:
    """Write into ``out`` the weight of the gathered FP8 bytes ``data`` (uint8), ``scale_inv``,
    the ``amax`` and ``top``, the FP8 code of the amax (module docstring)."""
    if out.is_cuda and out.is_contiguous() and data.is_contiguous():
        programs = -(-out.numel() // _BLOCK)
        _kernel()[(programs,)](data, out, scale_inv, amax, top, out.numel(), BLOCK=_BLOCK)
        return
    dequantize_in_torch(data, scale_inv, amax, top, out)


def dequantize_in_torch(
    data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor, top: torch.Tensor, out: torch.Tensor
) -> None:
    """``dequantize`` in PyTorch's ops: what the Triton kernel must match to the bit."""
    out.copy_(data.view(FP8_DTYPE))
    out.mul_(scale_inv.to(out.dtype))
    largest = (data & 0x7F) == top
    out.masked_fill_(largest & (data < 0x80), amax.to(out.dtype))
    out.masked_fill_(largest & (data >= 0x80), -amax.to(out.dtype))


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, compiled on first use (Triton is imported only where CUDA runs it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def dequantize_kernel(data_ptr, out_ptr, scale_inv_ptr, amax_ptr, top_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        code = tl.load(data_ptr + offsets, mask=inside, other=0)
        dtype = out_ptr.dtype.element_ty
        scale_inv = tl.load(scale_inv_ptr).to(dtype).to(tl.float32)
        amax = tl.load(amax_ptr).to(dtype)
        value = (code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale_inv).to(dtype)
        largest = (code & 0x7F) == tl.load(top_ptr)
        value = tl.where(largest, tl.where(code >= 0x80, -amax, amax), value)
        tl.store(out_ptr + offsets, value, mask=inside)

    return dequantize_kernel
