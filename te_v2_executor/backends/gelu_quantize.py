"""Exact GELU, or its backward, fused with per-tensor FP8 quantization: one Triton kernel.

TransformerEngine fuses only its tanh-approximated GELU into a cast (``tex.gelu``/``tex.dgelu``),
and ``nn.GELU()``'s default is the exact, erf-based one. Unfused, the BF16 activation (or its
gradient) is written by one kernel and read back by TE's cast-transpose; here each tile is
computed in registers and stored once per FP8 copy asked for: row-wise, column-wise (transposed)
or both. The numerics are PyTorch's GELU kernels' (fp32 math with CUDA's libdevice erf and exp,
one rounding to the input's dtype)
followed by TE's delayed-scaling cast: amax of the rounded values into ``amax``, saturating
round-to-nearest of ``value * scale`` (NaN stays NaN, as in TE's cast), and
``scale_inv = 1 / scale``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # PyTorch's kBeta: M_2_SQRTPI * M_SQRT1_2 * 0.5
# 64 x 64 tiles, 4 warps: within 1 to 13% of the best of five tile shapes measured on an H200 for
# each direction and usage at 8192 x 14336 (docs/performance.md).
_BLOCK = 64


@triton.jit
def _gelu_cast_transpose_kernel(
    x_ptr,
    grad_ptr,
    row_ptr,
    col_ptr,
    scale_ptr,
    scale_inv_ptr,
    amax_ptr,
    M,
    N,
    BACKWARD: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    cdf = 0.5 * (1.0 + libdevice.erf(xf * _SQRT1_2))
    if BACKWARD:
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        value = grad * (cdf + xf * (libdevice.exp(-0.5 * xf * xf) * _INV_SQRT_2PI))
    else:
        value = xf * cdf
    value = value.to(x.dtype).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(value), axis=1), axis=0))
    scale = tl.load(scale_ptr)
    quantized = tl.clamp(value * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if ROWWISE:
        tl.store(row_ptr + offsets, quantized.to(row_ptr.dtype.element_ty), mask=mask)
    if COLUMNWISE:
        transposed = cols[:, None].to(tl.int64) * M + rows[None, :]
        mask_t = (cols[:, None] < N) & (rows[None, :] < M)
        tl.store(col_ptr + transposed, tl.trans(quantized).to(col_ptr.dtype.element_ty), mask=mask_t)
    if tl.program_id(0) == 0 and tl.program_id(1) == 0:
        tl.store(scale_inv_ptr, 1.0 / scale)


def gelu_cast_transpose(
    x: torch.Tensor,
    grad: torch.Tensor | None,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """FP8 copies of ``gelu(x)``, or with ``grad`` of ``gelu'(x) * grad``, for a 2-D bfloat16 ``x``.

    Returns the row-wise (M, N) and column-wise (N, M) data as uint8 (TE's storage), each None
    unless asked for, and ``scale_inv``. ``amax`` (one float32) is raised to the values' amax in
    place, as TE's cast updates a delayed-scaling history slot.
    """
    if x.dim() != 2 or x.numel() == 0 or (grad is not None and grad.shape != x.shape):
        raise ValueError(f"te_v2: gelu_cast_transpose takes non-empty 2-D tensors, got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16 or (grad is not None and grad.dtype != torch.bfloat16):
        raise ValueError(
            "te_v2: gelu_cast_transpose is validated for bfloat16 only (float32 tiles stored both "
            "row-wise and transposed came out wrong on an H200); quantize gelu(x) with TE instead"
        )
    x = x.contiguous()
    grad = grad.contiguous() if grad is not None else None
    m, n = x.shape
    row = torch.empty((m, n), dtype=torch.uint8, device=x.device) if rowwise else None
    col = torch.empty((n, m), dtype=torch.uint8, device=x.device) if columnwise else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    _gelu_cast_transpose_kernel[(triton.cdiv(m, _BLOCK), triton.cdiv(n, _BLOCK))](
        x,
        grad if grad is not None else x,
        row.view(fp8_dtype) if row is not None else scale_inv,
        col.view(fp8_dtype) if col is not None else scale_inv,
        scale,
        scale_inv,
        amax,
        m,
        n,
        BACKWARD=grad is not None,
        ROWWISE=rowwise,
        COLUMNWISE=columnwise,
        FP8_MAX=torch.finfo(fp8_dtype).max,
        BLOCK=_BLOCK,
        num_warps=4,
    )
    return row, col, scale_inv
