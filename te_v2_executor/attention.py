"""Scaled-dot-product attention on cuDNN's fused kernels, forward and backward, for Thunder.

Hugging Face models traced by Dynamo (thunderfx, torch.compile) always pass an explicit causal
mask: their switch to ``is_causal=True`` is off while tracing. Thunder 0.2.6's SDPA executor runs
a masked attention on PyTorch's memory-efficient kernel, expands the mask to every head, and its
backward computes a gradient of that mask (one batch x heads x sequence x sequence tensor a
layer), which nobody reads (docs/performance.md, "Attention inside Thunder"). PyTorch itself
(eager and torch.compile) runs such an attention on cuDNN's kernels on Hopper; this executor does
the same inside Thunder, through
PyTorch's ``_scaled_dot_product_cudnn_attention`` and its backward, with no gradient for the
boolean mask (additive masks, which may need one, are left to Thunder's SDPA executor).

It claims only what those kernels run as PyTorch's dispatcher would (``_checker``); anything else
stays with the executors listed after it (Thunder's SDPA executor, then Thunder's decomposition).
It also claims ``grouped_attention``'s symbol, an attention whose key and value heads are each
shared by consecutive query heads, which cuDNN's kernels read as they are: the key and value
saved for the backward are the unrepeated ones, and their gradients come out per key/value head.
"""

from __future__ import annotations

from functools import partial
from numbers import Number
from typing import Any

import thunder.torch as ltorch
import torch
from thunder.core import dtypes
from thunder.core.proxies import NumberProxy, TensorProxy, pyval
from thunder.core.transforms import get_grad, put_grads
from thunder.extend import OperatorExecutor, register_executor

from te_v2_executor.grouped_attention import grouped_sdpa

attention_ex = OperatorExecutor("te_v2_cudnn_attention", version="0.1")
register_executor(attention_ex)

_DTYPES = (dtypes.bfloat16, dtypes.float16)
_MASKED = -65504.0  # PyTorch's fill for a masked position on its cuDNN path
_MAX_HEAD_DIM = 128


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied only where its last dim is not contiguous, which cuDNN's kernels need."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _bias(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean ``attn_mask`` as cuDNN's additive bias, exactly as PyTorch's own cuDNN path makes
    it (``convert_boolean_attn_mask_cudnn``): 0 where True and the finite ``_MASKED`` where False,
    with a leading dim per missing one. Finite, a row with no key left gives no NaN, forward or
    backward (with -inf, a padding row of a left-padded batch could put NaN into the gradients
    through a zero gradient); it then attends to every key, as PyTorch eager's does there."""
    if attn_mask is None:
        return None
    bias = torch.where(
        attn_mask.logical_not(), _MASKED, torch.zeros((), dtype=dtype, device=attn_mask.device)
    )
    return bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))


def _forward_meta(
    query: TensorProxy,
    key: TensorProxy,
    value: TensorProxy,
    attn_mask: TensorProxy | None,
    is_causal: bool,
    scale: float | None,
) -> tuple[TensorProxy, TensorProxy, TensorProxy, TensorProxy]:
    b, h, s_q, _ = query.shape
    stats = dict(device=query.device, requires_grad=False)
    return (
        TensorProxy(like=query, shape=(b, h, s_q, value.shape[-1])),
        TensorProxy(shape=(b, h, s_q, 1), dtype=dtypes.float32, **stats),  # logsumexp
        TensorProxy(shape=(), dtype=dtypes.int64, **stats),  # philox seed
        TensorProxy(shape=(), dtype=dtypes.int64, **stats),  # philox offset
    )


def _forward_impl(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    query, key, value = map(_unit_last_stride, (query, key, value))
    out, logsumexp, *_, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, _bias(attn_mask, query.dtype), True, 0.0, is_causal, False, scale=scale
    )
    return out, logsumexp, seed, offset


FORWARD = attention_ex.register_operator("te_v2_cudnn_attention_fwd", meta=_forward_meta, fn=_forward_impl)


def _backward_meta(
    grad: TensorProxy,
    query: TensorProxy,
    key: TensorProxy,
    value: TensorProxy,
    attn_mask: TensorProxy | None,
    out: TensorProxy,
    logsumexp: TensorProxy,
    seed: TensorProxy,
    offset: TensorProxy,
    is_causal: bool,
    scale: float | None,
) -> tuple[TensorProxy, TensorProxy, TensorProxy]:
    return TensorProxy(like=query), TensorProxy(like=key), TensorProxy(like=value)


def _backward_impl(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    query, key, value = map(_unit_last_stride, (query, key, value))
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad,
        query,
        key,
        value,
        out,
        logsumexp,
        seed,
        offset,
        _bias(attn_mask, query.dtype),
        None,
        None,
        query.shape[2],
        key.shape[2],
        0.0,
        is_causal,
        scale=scale,
    )


BACKWARD = attention_ex.register_operator("te_v2_cudnn_attention_bwd", meta=_backward_meta, fn=_backward_impl)


def _hopper(device: Any) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device.index) >= (9, 0)


def _pytorch_runs_cudnn(
    query: TensorProxy, key: TensorProxy, value: TensorProxy, attn_mask: Any, is_causal: bool, grouped: bool
) -> bool:
    """Whether PyTorch's own check of cuDNN attention (``can_use_cudnn_attention``: shapes,
    layouts, cuDNN version, deterministic mode, what its backward needs, key/value heads shared
    by query heads where ``grouped``) passes for tensors of these shapes, laid out contiguously,
    on this GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention

    with FakeTensorMode():
        fake = [
            None
            if t is None
            else torch.empty(t.shape, dtype=dtypes.to_torch_dtype(t.dtype), device=t.device.device_str())
            for t in (query, key, value, attn_mask)
        ]
    for t, proxy in zip(fake, (query, key, value, attn_mask), strict=True):
        if t is not None:
            t.requires_grad_(proxy.requires_grad)
    return can_use_cudnn_attention(SDPAParams(*fake, 0.0, is_causal, grouped), False)


def _checker(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: Any = 0.0,
    is_causal: Any = False,
    *,
    scale: Any = None,
    grouped: bool = False,
) -> bool:
    """Whether cuDNN's kernels run this attention as PyTorch's would: on a Hopper GPU, 16-bit
    4-D query, key and value of one dtype, batch and heads (with ``grouped``, key and value
    heads that divide the query's, ``grouped_attention``), head dim a multiple of 8 up to 128,
    no dropout (its random state stays Thunder's), dropout, causal flag and scale known when
    tracing (a symbolic one would be frozen into the kernels' arguments), a causal flag only on
    square attention, a boolean mask of the attention's full sequence-by-sequence shape broadcast
    at most over batch and heads; and PyTorch's own check of cuDNN attention passes for them.

    Not an additive mask: one computed in the trace from a trained tensor (a learned position
    bias) has a gradient, which the checker cannot see (its proxy says no gradient) and this
    backward does not compute; Thunder's SDPA executor does."""
    qkv = (query, key, value)
    if not all(isinstance(t, TensorProxy) and t.ndim == 4 and t.dtype == query.dtype for t in qkv):
        return False
    if query.dtype not in _DTYPES or query.device.type != "cuda" or not _hopper(query.device):
        return False
    if any(t.device != query.device for t in qkv) or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    (b, h, s_q, d), (_, h_kv, s_kv, d_v) = query.shape, value.shape
    if h_kv != h and not (grouped and 0 < h_kv < h and h % h_kv == 0):
        return False
    if key.shape != (b, h_kv, s_kv, d) or value.shape[0] != b:
        return False
    if not all(x % 8 == 0 and 0 < x <= _MAX_HEAD_DIM for x in (d, d_v)) or min(s_q, s_kv) == 0:
        return False
    if any(isinstance(a, NumberProxy) for a in (dropout_p, is_causal, scale)):
        return False  # a value the trace must not freeze into the kernels' arguments
    if not isinstance(dropout_p, Number) or dropout_p != 0 or not isinstance(is_causal, bool):
        return False
    if is_causal and (attn_mask is not None or s_q != s_kv):
        return False
    if attn_mask is not None:
        if not isinstance(attn_mask, TensorProxy) or not 2 <= attn_mask.ndim <= 4:
            return False
        leading = (1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape[:-2])
        if not (
            attn_mask.dtype == dtypes.bool8
            and attn_mask.device == query.device
            and tuple(attn_mask.shape[-2:]) == (s_q, s_kv)
            and leading[0] in (1, b)
            and leading[1] in (1, h)
        ):
            return False
    return _pytorch_runs_cudnn(query, key, value, attn_mask, is_causal, grouped)


def _execution_transform(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    out, *_ = FORWARD(query, key, value, attn_mask, pyval(is_causal), _scale(scale))
    return out


def _grad_transform(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    is_causal, scale = pyval(is_causal), _scale(scale)
    out, logsumexp, seed, offset = FORWARD(query, key, value, attn_mask, is_causal, scale)
    grads = BACKWARD(
        get_grad(out), query, key, value, attn_mask, out, logsumexp, seed, offset, is_causal, scale
    )
    put_grads((query, key, value), grads)
    return out


def _scale(scale: Any) -> float | None:
    return None if scale is None else float(pyval(scale))


for _symbol, _grouped in ((ltorch.scaled_dot_product_attention, False), (grouped_sdpa, True)):
    attention_ex.register_implementation(
        _symbol,
        checker=partial(_checker, grouped=_grouped),
        execution_transform=_execution_transform,
        grad_transform=_grad_transform,
    )
