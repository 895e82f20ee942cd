"""te_v2's cuDNN attention executor against PyTorch: the outputs and input gradients of
``F.scaled_dot_product_attention`` as PyTorch's own dispatcher computes them (cuDNN's kernels on
Hopper) and within twice its error of a float64 reference; cuDNN's kernels run, not the
memory-efficient ones or two matrix products and a softmax; no gradient computed for a boolean
mask, and an additive one's gradient kept."""

from __future__ import annotations

import pytest
import thunder
import torch
import torch.nn.functional as F

from benchmarks.measure import kernel_names
from te_v2_executor import executors
from tests.gpu.common import executors_run, requires_te_gpu

pytestmark = requires_te_gpu

B, H, S, D = 2, 8, 512, 128


def _causal(b: int, s: int = S) -> torch.Tensor:
    """Hugging Face's mask under tracing: boolean, batch x 1 x queries x keys."""
    return torch.ones(s, s, dtype=torch.bool, device="cuda").tril().expand(b, 1, s, s)


CASES = {
    "causal": (lambda: None, dict(is_causal=True)),
    "hf-mask": (lambda: _causal(B), {}),
    "2d-mask": (lambda: _causal(1)[0, 0], dict(scale=0.05)),
    "per-head-mask": (lambda: torch.rand(1, H, S, S, device="cuda") < 0.9, {}),
    "no-mask": (lambda: None, {}),
}


def _inputs(
    b: int = B, h: int = H, s: int = S, d: int = D, *, heads_inner: bool = False
) -> list[torch.Tensor]:
    """Query, key and value of shape b x h x s x d; with ``heads_inner``, laid out as Hugging Face's
    projections leave them (b x s x h x d in memory, transposed)."""
    g = torch.Generator("cuda").manual_seed(0)
    shape = (b, s, h, d) if heads_inner else (b, h, s, d)
    made = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    return [(t.transpose(1, 2) if heads_inner else t).requires_grad_() for t in made]


def _run(fn, inputs: list[torch.Tensor], mask, kwargs, grad: torch.Tensor) -> list[torch.Tensor]:
    for t in inputs:
        t.grad = None
    out = fn(*inputs, mask, **kwargs)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in inputs)]


def _sdpa(q, k, v, mask, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


def _check_against_pytorch(
    case: str, inputs: list[torch.Tensor], mask, kwargs, grad: torch.Tensor
) -> set[str]:
    """Assert that ``executors()``'s outputs and input grads are within twice PyTorch eager's
    error of a float64 reference (and close to eager's); return the executors that ran."""
    jitted = thunder.jit(_sdpa, executors=executors())
    ours = _run(jitted, inputs, mask, kwargs, grad)
    eager = _run(_sdpa, inputs, mask, kwargs, grad)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    wide_mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    exact = _run(_sdpa, wide, wide_mask, kwargs, grad.double())
    for name, o, e, x in zip(("out", "dq", "dk", "dv"), ours, eager, exact, strict=True):
        err_ours = (o.double() - x).abs().max().item()
        err_eager = (e.double() - x).abs().max().item()
        print(f"[{case}] {name}: max error ours {err_ours:.2e}, PyTorch eager {err_eager:.2e}")
        assert err_ours <= 2 * err_eager + 1e-3, (name, err_ours, err_eager)
        torch.testing.assert_close(o, e, rtol=2e-2, atol=2e-2)
    return executors_run([thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]])


@pytest.mark.parametrize("case", CASES)
def test_outputs_and_grads_match_pytorchs_attention(case):
    make_mask, kwargs = CASES[case]
    grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    ran = _check_against_pytorch(case, _inputs(), make_mask(), kwargs, grad)
    assert "te_v2_cudnn_attention" in ran, ran


@pytest.mark.parametrize(
    "b, h, s, d, masked",
    [
        (1, 3, 17, 64, True),
        (2, 2, 1, 64, False),
        (1, 2, 100, 80, True),
        (1, 2, 64, 100, False),
        (2, 4, 256, 64, True),
    ],
    ids=["s17-masked", "s1", "d80-masked", "d100", "s256-hf-layout"],
)
def test_odd_shapes_and_layouts_match_pytorch_whichever_executor_runs_them(b, h, s, d, masked):
    """Shapes cuDNN may not run fall to Thunder's SDPA executor or its decomposition; wherever
    they run, the results follow PyTorch's."""
    mask = _causal(b, s) if masked else None
    inputs = _inputs(b, h, s, d, heads_inner=s == 256)
    grad = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    ran = _check_against_pytorch(f"{b}x{h}x{s}x{d}", inputs, mask, {}, grad)
    print(f"ran on {sorted(ran)}")


def test_a_learned_additive_mask_gets_its_gradient():
    """An additive mask computed from a trained tensor (a learned position bias) has a gradient,
    which te_v2's attention does not compute: such a mask is left to Thunder's SDPA executor.
    The mask is expanded to the batch: Thunder 0.2.6's SDPA executor refuses a mask that requires
    grad and broadcasts over it (usage.md, troubleshooting)."""
    inputs = _inputs()
    bias = torch.randn(1, H, S, S, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)

    def attend(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(bias * 0.5).expand(B, -1, -1, -1))

    grads = []
    for fn in (thunder.jit(attend, executors=executors()), attend):
        bias.grad = None
        fn(*inputs, bias).backward(grad)
        grads.append(bias.grad)
    assert grads[0] is not None
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-2, atol=2e-2)


def test_rows_with_no_key_left_match_pytorch_and_stay_finite():
    """A left-padded batch's causal mask leaves its padding rows no key. Masked positions are
    filled with a finite value, as on PyTorch's cuDNN path, so those rows give no NaN, forward or
    backward; their gradient is zero (no loss there), so every gradient is what PyTorch's is,
    whatever a kernel puts in a row with no key."""
    inputs = _inputs()
    mask = _causal(B).clone()
    mask[1, :, :, :16] = False  # the second sequence's first 16 tokens are padding
    grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    grad[1, :, :16] = 0  # padding positions have no loss
    jitted = thunder.jit(_sdpa, executors=executors())
    ours = _run(jitted, inputs, mask, {}, grad)
    ran = executors_run([thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]])
    assert "te_v2_cudnn_attention" in ran, ran
    eager = _run(_sdpa, inputs, mask, {}, grad)
    ours[0][1, :, :16] = eager[0][1, :, :16] = 0  # rows with no key: kernels differ on those
    for name, o, e in zip(("out", "dq", "dk", "dv"), ours, eager, strict=True):
        assert torch.isfinite(o).all(), name
        torch.testing.assert_close(o, e, rtol=2e-2, atol=2e-2, msg=name)


def test_cudnns_kernels_run_and_no_mask_is_expanded_to_every_head():
    """Thunder's SDPA executor runs a masked attention on the memory-efficient kernel, expanding
    the mask to every head, and its backward computes a gradient of that expanded mask
    (docs/performance.md): each a batch x heads x sequence x sequence tensor, which the step's
    peak here stays below."""
    s = 2048
    inputs, mask = _inputs(s=s), _causal(B, s)
    grad = torch.randn(B, H, s, D, device="cuda", dtype=torch.bfloat16)
    jitted = thunder.jit(_sdpa, executors=executors())
    for _ in range(2):
        _run(jitted, inputs, mask, {}, grad)
    torch.cuda.synchronize()
    names = kernel_names(lambda: _run(jitted, inputs, mask, {}, grad))
    cudnn = [n for n in names if "cudnn" in n.lower() and "sdpa" in n.lower()]
    assert len(cudnn) == 2, names  # one forward, one backward
    assert not [n for n in names if "fmha" in n.lower() or "gemm" in n.lower()], names
    for t in inputs:
        t.grad = None
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _run(jitted, inputs, mask, {}, grad)
    peak = torch.cuda.max_memory_allocated() - baseline
    expanded_mask = B * H * s * s * 2
    print(
        f"\npeak above inputs {peak / 2**20:.0f} MiB; a mask expanded to every head {expanded_mask / 2**20:.0f} MiB"
    )
    assert peak < expanded_mask


def test_grouped_keys_and_values_run_on_cudnn_unrepeated():
    """``grouped_scaled_dot_product_attention`` (what ``grouped_attention.fold`` makes of an
    attention over Hugging Face's ``repeat_kv``) runs on cuDNN's kernels over the unrepeated key
    and value, causal or masked: the forward's attention reads 4 key/value heads for 16 query
    heads, and the output and every input gradient are what PyTorch eager computes over the
    repeat, whose backward sums each repeated head's gradient over its group."""
    from te_v2_executor import attention
    from te_v2_executor.grouped_attention import grouped_scaled_dot_product_attention

    b, h, kv, s, d = 2, 16, 4, 512, 64
    g = torch.Generator("cuda").manual_seed(0)
    inputs = [
        torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for n in (h, kv, kv)
    ]
    grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def repeated(q, k, v, mask, **kwargs):
        k, v = (t[:, :, None].expand(b, kv, h // kv, s, d).reshape(b, h, s, d) for t in (k, v))
        return _sdpa(q, k, v, mask, **kwargs)

    jitted = thunder.jit(grouped_scaled_dot_product_attention, executors=executors())
    for mask, kwargs in ((None, dict(is_causal=True)), (_causal(b, s), dict(scale=0.1))):
        ours = _run(jitted, inputs, mask, kwargs, grad)
        eager = _run(repeated, inputs, mask, kwargs, grad)
        for name, o, e in zip(("out", "dq", "dk", "dv"), ours, eager, strict=True):
            assert o.shape == e.shape, name
            torch.testing.assert_close(o, e, rtol=1e-2, atol=1e-2, msg=name)
        (call,) = [
            b for b in thunder.last_traces(jitted)[-1].bound_symbols if b.sym.id == attention.FORWARD.id
        ]
        assert [t.shape[1] for t in call.args[:3]] == [h, kv, kv]
        assert "te_v2_cudnn_attention" in executors_run(thunder.last_backward_traces(jitted)[-1:])
