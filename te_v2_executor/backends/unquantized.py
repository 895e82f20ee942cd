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


def _product(
    a: torch.Tensor, b: torch.Tensor, accumulate_into: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``scale * (a @ b)`` (cuBLAS's alpha), or with ``accumulate_into`` that tensor plus it,
    computed in its buffer (a non-contiguous one is reshaped into a copy first, which is what is
    returned)."""
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
    if accumulate_into is None and scale == 1:
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
