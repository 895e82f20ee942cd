"""An activation, or its gradient, fused with per-tensor FP8 quantization: one Triton kernel.

TransformerEngine fuses only its tanh-approximated GELU into a cast (``tex.gelu``/``tex.dgelu``),
and ``nn.GELU()``'s default is the exact, erf-based one; its SwiGLU kernels (``tex.swiglu``) read
gate and up as one concatenated tensor, which two separate linears (Llama's ``gate_proj`` and
``up_proj``) do not make. Unfused, the BF16 activation (or its gradient) is written by one kernel
and read back by TE's cast-transpose; here each tile is computed in registers and stored once per
FP8 copy asked for: row-wise, column-wise (transposed) or both.

What a ``Kind`` computes, each as PyTorch's eager kernels do (fp32 math with CUDA's libdevice
erf and exp, IEEE division, each op's result rounded to the input's dtype):

- ``GELU``: gelu(x); ``GELU_GRAD``: gelu_backward(grad, x).
- ``SWIGLU``: silu(x) * up, x the gate.
- ``SWIGLU_GRAD_UP``: grad * silu(x), the gradient of up.
- ``SWIGLU_GRAD_GATE``: silu_backward(grad * up, x), the gradient of the gate.

followed by TE's delayed-scaling cast: amax of the rounded values into ``amax``, saturating
round-to-nearest of ``value * scale`` (NaN stays NaN, as in TE's cast), and
``scale_inv = 1 / scale`` rounded once, as TE's reciprocal (Triton's ``/`` divides approximately).
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # PyTorch's kBeta: M_2_SQRTPI * M_SQRT1_2 * 0.5
# 64 x 64 tiles, 4 warps: within 1 to 13% of the best of five tile shapes measured on an H200 for
# each direction and usage at 8192 x 14336 (docs/performance.md).
_BLOCK = 64


class Kind(enum.IntEnum):
    """What the kernel quantizes; the operands each reads besides x are in ``_OPERANDS``."""

    GELU = 0
    GELU_GRAD = 1
    SWIGLU = 2
    SWIGLU_GRAD_UP = 3
    SWIGLU_GRAD_GATE = 4


# kind -> (reads up, reads grad)
_OPERANDS = {
    Kind.GELU: (False, False),
    Kind.GELU_GRAD: (False, True),
    Kind.SWIGLU: (True, False),
    Kind.SWIGLU_GRAD_UP: (False, True),
    Kind.SWIGLU_GRAD_GATE: (True, True),
}


@triton.jit
def _rounded(value, like):
    """``value`` rounded to ``like``'s dtype and widened back: where PyTorch's kernel stores."""
    return value.to(like.dtype).to(tl.float32)


@triton.jit
def _activation_cast_transpose_kernel(
    x_ptr,
    up_ptr,
    grad_ptr,
    row_ptr,
    col_ptr,
    scale_ptr,
    scale_inv_ptr,
    amax_ptr,
    M,
    N,
    KIND: tl.constexpr,
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
    if KIND == 0 or KIND == 1:
        cdf = 0.5 * (1.0 + libdevice.erf(xf * _SQRT1_2))
        if KIND == 0:
            value = xf * cdf
        else:
            grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            value = grad * (cdf + xf * (libdevice.exp(-0.5 * xf * xf) * _INV_SQRT_2PI))
    else:
        denominator = 1.0 + libdevice.exp(-xf)
        if KIND == 4:
            up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            sigmoid = libdevice.div_rn(1.0, denominator)
            value = _rounded(grad * up, x) * sigmoid * libdevice.fma(xf, 1.0 - sigmoid, 1.0)
        else:
            silu = _rounded(libdevice.div_rn(xf, denominator), x)
            if KIND == 2:
                value = silu * tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            else:
                value = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * silu
    value = _rounded(value, x)
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
        tl.store(scale_inv_ptr, libdevice.div_rn(1.0, scale))


def activation_cast_transpose(
    kind: Kind,
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    up: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """FP8 copies of what ``kind`` computes from a 2-D bfloat16 ``x`` (and ``up``, ``grad`` of its
    shape, as ``kind`` reads them).

    Returns the row-wise (M, N) and column-wise (N, M) data as uint8 (TE's storage), each None
    unless asked for, and ``scale_inv``. ``amax`` (one float32) is raised to the values' amax in
    place, as TE's cast updates a delayed-scaling history slot.
    """
    wants_up, wants_grad = _OPERANDS[kind]
    operands = [x, *([up] if wants_up else []), *([grad] if wants_grad else [])]
    if any(t is None for t in operands) or (up is not None) != wants_up or (grad is not None) != wants_grad:
        raise ValueError(
            f"te_v2: activation_cast_transpose({kind.name}) takes x, up: {wants_up}, grad: {wants_grad}"
        )
    if x.dim() != 2 or x.numel() == 0 or any(t.shape != x.shape for t in operands):
        raise ValueError(
            f"te_v2: activation_cast_transpose takes non-empty 2-D tensors of one shape, got "
            f"{[tuple(t.shape) for t in operands]}"
        )
    if any(t.dtype != torch.bfloat16 for t in operands):
        raise ValueError(
            "te_v2: activation_cast_transpose is validated for bfloat16 only (float32 tiles stored "
            "both row-wise and transposed came out wrong on an H200); quantize with TE instead"
        )
    x, up, grad = (t.contiguous() if t is not None else x for t in (x, up, grad))
    m, n = x.shape
    row = torch.empty((m, n), dtype=torch.uint8, device=x.device) if rowwise else None
    col = torch.empty((n, m), dtype=torch.uint8, device=x.device) if columnwise else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    _activation_cast_transpose_kernel[(triton.cdiv(m, _BLOCK), triton.cdiv(n, _BLOCK))](
        x,
        up,
        grad,
        row.view(fp8_dtype) if row is not None else scale_inv,
        col.view(fp8_dtype) if col is not None else scale_inv,
        scale,
        scale_inv,
        amax,
        m,
        n,
        KIND=int(kind),
        ROWWISE=rowwise,
        COLUMNWISE=columnwise,
        FP8_MAX=torch.finfo(fp8_dtype).max,
        BLOCK=_BLOCK,
        num_warps=4,
    )
    return row, col, scale_inv
