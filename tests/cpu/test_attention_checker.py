"""Which attentions te_v2's cuDNN attention executor claims: those cuDNN's kernels run as
PyTorch's dispatcher would, and no other (the rest stay with Thunder's SDPA executor). The
kernels themselves run in tests/gpu/test_attention.py."""

from __future__ import annotations

import pytest
import torch
from thunder.core import devices, dtypes
from thunder.core.proxies import FloatProxy, IntegerProxy, TensorProxy
from thunder.core.trace import TraceCtx, tracectx

from te_v2_executor import attention

B, H, S, D = 2, 4, 64, 64


@pytest.fixture(autouse=True)
def hopper(monkeypatch):
    monkeypatch.setattr(attention, "_hopper", lambda device: True)
    monkeypatch.setattr(attention, "_pytorch_runs_cudnn", lambda *args: True)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    with tracectx(TraceCtx()):
        yield


def proxy(*shape, dtype=dtypes.bfloat16, device="cuda:0", requires_grad=False) -> TensorProxy:
    return TensorProxy(
        shape=shape, dtype=dtype, device=devices.to_device(device), requires_grad=requires_grad
    )


def qkv(**kw) -> tuple[TensorProxy, TensorProxy, TensorProxy]:
    return proxy(B, H, S, D, **kw), proxy(B, H, S, D, **kw), proxy(B, H, S, D, **kw)


@pytest.mark.parametrize(
    "mask, kwargs",
    [
        (None, {}),
        (None, dict(is_causal=True)),
        (lambda: proxy(B, 1, S, S, dtype=dtypes.bool8), {}),  # Hugging Face's causal mask
        (lambda: proxy(S, S, dtype=dtypes.bool8), {}),
        (lambda: proxy(1, H, S, S, dtype=dtypes.bool8), {}),
        (None, dict(scale=0.5)),
    ],
    ids=["none", "causal", "hf-mask", "2d-mask", "per-head-mask", "scale"],
)
def test_claims_what_cudnn_runs(mask, kwargs):
    assert attention._checker(*qkv(), mask() if mask else None, **kwargs)


def test_refuses_what_cudnn_does_not_run_as_pytorch_would():
    q, k, v = qkv()
    refused = {
        "float32": (*qkv(dtype=dtypes.float32), None),
        "cpu": (*qkv(device="cpu"), None),
        "grouped-query heads": (q, proxy(B, 1, S, D), proxy(B, 1, S, D), None),
        "head dim 100": (proxy(B, H, S, 100), proxy(B, H, S, 100), proxy(B, H, S, 100), None),
        "head dim 256": (proxy(B, H, S, 256), proxy(B, H, S, 256), proxy(B, H, S, 256), None),
        # an additive mask may be a trained bias's function, whose gradient this backward lacks
        "additive mask": (q, k, v, proxy(B, 1, S, S)),
        "additive mask needing a gradient": (q, k, v, proxy(B, 1, S, S, requires_grad=True)),
        "float32 mask": (q, k, v, proxy(B, 1, S, S, dtype=dtypes.float32)),
        "padding mask broadcast over queries": (q, k, v, proxy(B, 1, 1, S, dtype=dtypes.bool8)),
        "3-d inputs": (proxy(H, S, D), proxy(H, S, D), proxy(H, S, D), None),
    }
    for name, args in refused.items():
        assert not attention._checker(*args), name
    assert not attention._checker(q, k, v, None, 0.1), "dropout"
    assert not attention._checker(q, proxy(B, H, 2 * S, D), proxy(B, H, 2 * S, D), None, 0.0, True), (
        "causal, not square"
    )
    assert not attention._checker(q, k, v, proxy(B, 1, S, S, dtype=dtypes.bool8), 0.0, True), (
        "mask and causal"
    )
    symbolic = {"dropout_p": FloatProxy(value=0.0), "is_causal": IntegerProxy(value=False)}
    for name, value in symbolic.items():
        assert not attention._checker(q, k, v, None, **{name: value}), f"symbolic {name}"
    assert not attention._checker(q, k, v, None, scale=FloatProxy(value=0.5)), "symbolic scale"


def test_grouped_heads_are_claimed_only_for_the_grouped_symbol(monkeypatch):
    """``grouped_attention``'s symbol reads key and value heads shared by consecutive query heads
    (PyTorch's check asked with ``enable_gqa``); heads that do not divide the query's, or key and
    value heads that differ, are refused."""
    seen = []
    monkeypatch.setattr(attention, "_pytorch_runs_cudnn", lambda *args: seen.append(args[-1]) or True)
    q = proxy(B, H, S, D)
    grouped = (proxy(B, H // 2, S, D), proxy(B, H // 2, S, D))
    assert attention._checker(q, *grouped, None, grouped=True)
    assert not attention._checker(q, *grouped, None)
    assert seen == [True]
    refused = {
        "heads that do not divide": (proxy(B, 3, S, D), proxy(B, 3, S, D)),
        "key and value heads differ": (proxy(B, 1, S, D), proxy(B, 2, S, D)),
        "more key heads than query heads": (proxy(B, 2 * H, S, D), proxy(B, 2 * H, S, D)),
    }
    for name, (k, v) in refused.items():
        assert not attention._checker(q, k, v, None, grouped=True), name


def test_refuses_everything_off_hopper(monkeypatch):
    monkeypatch.setattr(attention, "_hopper", lambda device: False)
    assert not attention._checker(*qkv(), None)


def test_refuses_what_pytorchs_own_cudnn_check_refuses(monkeypatch):
    seen = []
    monkeypatch.setattr(attention, "_pytorch_runs_cudnn", lambda *args: seen.append(args) or False)
    q, k, v = qkv()
    mask = proxy(B, 1, S, S, dtype=dtypes.bool8)
    assert not attention._checker(q, k, v, mask)
    assert seen == [(q, k, v, mask, False, False)]
