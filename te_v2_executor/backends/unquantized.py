"""The GEMMs of the linears te_v2 runs without FP8: those its claim policy keeps out of it.

Plain torch (cuBLAS on a GPU, any device otherwise), the same products Thunder's default path
computes, in the operands' own dtype. Run as te_v2 symbols rather than left to Thunder, they get
what te_v2's FP8 linears get: dgrad and wgrad apart, so that an unconsumed one never runs, and a
sum with another tensor folded into the GEMM (``accumulate_into``, cuBLAS beta = 1) instead of an
elementwise kernel, and so is a constant factor (a LoRA adapter's ``scaling``: cuBLAS's alpha); a
fusion executor would otherwise wrap that elementwise work, with the GEMMs around it, in a region
of its own (at small token counts a torch.compile region costs more host time than its
kernels take on the GPU: docs/performance.md).
"""

from __future__ import annotations

import torch

from te_v2_executor.backends.common import as_matrix

# The pieces a float32 operand is split into: 8 significant bits each, 24 in all, float32's.
PIECES = 3


def _truncated(t: torch.Tensor) -> torch.Tensor:
    """The bfloat16 truncation of ``t`` (float32, rows contiguous): the upper half of each value's
    bits, as a view of ``t`` (little-endian)."""
    return t.view(torch.bfloat16)[..., 1::2]


def bfloat16_pieces(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` (float32, contiguous) as ``PIECES`` bfloat16 tensors, stacked along a new dimension at
    ``dim``, whose sum is ``t`` exactly for every finite value of magnitude 2^-110 or more, and
    zero: each piece is the truncation of what the earlier ones left, a difference float32 holds
    exactly. Two subtractions and the stack: three kernels."""
    high = _truncated(t)
    rest = t - high
    middle = _truncated(rest)
    return torch.stack([high, middle, _truncated(rest - middle)], dim)


def _pieces_matrix(t: torch.Tensor, along: int) -> torch.Tensor:
    """The bfloat16 pieces of the float32 matrix ``t`` (M, K) as one matrix: stacked, (3M, K),
    ``along`` 0; side by side, (M, 3K), ``along`` 1; split from ``t``'s storage as it lies, row- or
    column-major, so that a transposed weight is not copied first."""
    rows, cols = t.shape
    if t.stride(1) == 1 or t.stride(0) != 1:
        pieces = bfloat16_pieces(t.contiguous(), along)
        return pieces.view(-1, cols) if along == 0 else pieces.view(rows, -1)
    pieces = bfloat16_pieces(t.t().contiguous(), 1 - along)
    return (pieces.view(cols, -1) if along == 0 else pieces.view(-1, rows)).t()


def _mixed_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32 on a GPU, where one operand is bfloat16 and the other float32: one
    bfloat16 GEMM of the bfloat16 operand and the float32 one's pieces (module docstring), the
    pieces' products then summed."""
    (m, _), (_, n) = a.shape, b.shape
    if b.dtype == torch.float32:
        product = torch.mm(a, _pieces_matrix(b, 1), out_dtype=torch.float32)
        return product.view(m, PIECES, n).sum(1)
    product = torch.mm(_pieces_matrix(a, 0), b, out_dtype=torch.float32)
    return product.view(PIECES, m, n).sum(0)


def _product(
    a: torch.Tensor, b: torch.Tensor, accumulate_into: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``scale * (a @ b)`` (cuBLAS's alpha), or with ``accumulate_into`` that tensor plus it,
    computed in its buffer (a non-contiguous one is reshaped into a copy first, which is what is
    returned)."""
    if a.dtype != b.dtype and not a.is_cuda:
        a, b = a.float(), b.float()
    if a.dtype != b.dtype:
        product = _mixed_product(a, b)
        if accumulate_into is not None:
            return accumulate_into.reshape(product.shape).add_(product, alpha=scale)
        return product if scale == 1 else product.mul_(scale)
    if accumulate_into is not None:
        out = accumulate_into.reshape(a.shape[0], b.shape[1])
        return out.addmm_(a, b, alpha=scale)
    if scale == 1:
        return torch.mm(a, b)
    return torch.addmm(a.new_empty(()), a, b, beta=0, alpha=scale)  # beta = 0: input unread


def linear_fwd(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    accumulate_into: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
) -> torch.Tensor:
    """y = x W^T + b; with ``accumulate_into`` or ``scale`` (the symbol's meta admits them
    without a bias only), y = accumulate_into + scale * x W^T."""
    if accumulate_into is None and scale == 1 and x.dtype == w.dtype:
        return torch.nn.functional.linear(x, w, bias)
    return _product(as_matrix(x), w.t(), accumulate_into, scale).view(*x.shape[:-1], w.shape[0])


def linear_dgrad(
    dy: torch.Tensor,
    w: torch.Tensor,
    accumulate_into: torch.Tensor | None = None,
    *,
    input_shape: tuple[int, ...],
    scale: float = 1.0,
) -> torch.Tensor:
    """dx = scale * dy W, added into ``accumulate_into`` when given."""
    return _product(as_matrix(dy), w, accumulate_into, scale).view(input_shape)


def linear_wgrad(dy: torch.Tensor, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """dW = scale * dy^T x."""
    return _product(as_matrix(dy).t(), as_matrix(x), None, scale)
