"""te_v2's activation-and-cast kernel on TransformerEngine: against PyTorch's GELU, SwiGLU and
their gradients followed by TE's own cast, and which kernels a step of a GELU or SwiGLU model
runs. (Parity of GELU models with te.Linear eager, delayed-scaling state included, is in
test_state_sync and test_te_parity; of SwiGLU models here.)"""

from __future__ import annotations

import pytest
import torch

from te_v2_executor.symbols import LINEAR_FWD, arg
from tests.gpu.common import (
    DTYPE,
    FP8_TOLS,
    jit_te_v2,
    requires_te_gpu,
    te_linear,
    te_v2_states,
    torch_linear,
    train_step,
    train_step_kernels,
)
from tests.helpers import bsyms_of, forward_trace
from tests.models import Stack, SwiGLUMLP, copy_weights, grads

pytestmark = requires_te_gpu

SHAPE = (528, 1040)  # multiples of 16 (TE's cast), not of the kernel's 64-wide tiles
FUSED_KERNEL = "_activation_cast_transpose_kernel"


def _te_cast(h: torch.Tensor, fp8_dtype: torch.dtype, scale: float, *, columnwise: bool):
    """TE's delayed-scaling cast of ``h``: row-wise data, column-wise data, scale_inv, amax."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    te_dtype = {torch.float8_e4m3fn: tex.DType.kFloat8E4M3, torch.float8_e5m2: tex.DType.kFloat8E5M2}
    amax = torch.zeros(1, device="cuda")
    quantizer = Float8Quantizer(torch.tensor([scale], device="cuda"), amax, te_dtype[fp8_dtype])
    quantizer.set_usage(rowwise=True, columnwise=columnwise)
    t = quantizer(h)
    return t._data, t._transpose, t._scale_inv, amax


def _signed_steps(codes: torch.Tensor) -> torch.Tensor:
    """FP8 codes (uint8, sign and magnitude) as integers ordered like their values: adjacent
    values are one apart, -0 and +0 both 0."""
    magnitude = (codes & 0x7F).to(torch.int16)
    return torch.where(codes >= 0x80, -magnitude, magnitude)


def _assert_same_fp8(ours: torch.Tensor, theirs: torch.Tensor, what: str):
    """Equal FP8 codes, but for rare elements one step apart: values on a rounding boundary, where
    the last fp32 bit of the GELU math (contracted multiply-adds, libdevice) decides."""
    steps = (_signed_steps(ours) - _signed_steps(theirs)).abs()
    differ = float((steps > 0).float().mean())
    print(f"{what}: {differ:.4%} of the codes one step apart, at most {int(steps.max())} steps")
    assert int(steps.max()) <= 1, f"{what}: codes {int(steps.max())} steps apart"
    assert differ < 1e-2, f"{what}: {differ:.2%} of the FP8 codes differ"


def _eager(kind, x: torch.Tensor, up: torch.Tensor | None, grad: torch.Tensor | None) -> torch.Tensor:
    """What PyTorch computes for ``kind``: its GELU kernels, or SwiGLU's forward and autograd's
    gradients of silu(x) * up (x the gate)."""
    from te_v2_executor.backends.activation_quantize import Kind

    if kind is Kind.GELU:
        return torch.nn.functional.gelu(x)
    if kind is Kind.GELU_GRAD:
        return torch.ops.aten.gelu_backward(grad, x)
    up = up if up is not None else torch.randn_like(x)  # up's gradient does not depend on it
    gate, up = x.detach().requires_grad_(), up.detach().requires_grad_()
    h = torch.nn.functional.silu(gate) * up
    if kind is Kind.SWIGLU:
        return h.detach()
    h.backward(grad)
    return (up.grad if kind is Kind.SWIGLU_GRAD_UP else gate.grad).detach()


@pytest.mark.parametrize("usage", ["both", "columnwise", "rowwise"])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("kind", ["GELU", "GELU_GRAD", "SWIGLU", "SWIGLU_GRAD_UP", "SWIGLU_GRAD_GATE"])
def test_kernel_matches_pytorch_then_te_cast(kind, fp8_dtype, usage):
    from te_v2_executor.backends.activation_quantize import _OPERANDS, Kind, activation_cast_transpose

    kind = Kind[kind]
    wants_up, wants_grad = _OPERANDS[kind]
    dtype = torch.bfloat16
    torch.manual_seed(0)
    x = (3 * torch.randn(SHAPE, device="cuda")).to(dtype)
    up = (3 * torch.randn(SHAPE, device="cuda")).to(dtype) if wants_up else None
    grad = torch.randn(SHAPE, device="cuda").to(dtype) if wants_grad else None
    h = _eager(kind, x, up, grad)
    scale = 64.0  # large enough that some e4m3 values saturate at 448
    row_te, col_te, scale_inv_te, amax_te = _te_cast(h, fp8_dtype, scale, columnwise=True)

    amax = torch.full((1,), 0.5, device="cuda")  # raised, as a history slot already written to
    row, col, scale_inv = activation_cast_transpose(
        kind,
        x,
        torch.tensor([scale], device="cuda"),
        amax,
        fp8_dtype,
        up=up,
        grad=grad,
        rowwise=usage != "columnwise",
        columnwise=usage != "rowwise",
    )
    assert (row is None) is (usage == "columnwise") and (col is None) is (usage == "rowwise")
    if row is not None:
        _assert_same_fp8(row, row_te, "row-wise")
    if col is not None:
        _assert_same_fp8(col, col_te, "column-wise")
    torch.testing.assert_close(scale_inv, scale_inv_te, rtol=0, atol=0)
    torch.testing.assert_close(
        amax, torch.maximum(amax_te, torch.tensor(0.5, device="cuda")), rtol=2**-7, atol=0
    )
    if fp8_dtype == torch.float8_e4m3fn and kind in (Kind.GELU, Kind.SWIGLU):
        assert (row_te.view(fp8_dtype).float().abs() == 448).any(), (
            "nothing saturated: the clamp went untested"
        )


def test_the_kernels_scale_inv_is_tes_for_any_scale():
    """The kernel's scale_inv is ``1 / scale`` rounded once, as TE's, for scales that are not
    powers of 2 (Triton's ``/`` divides approximately, up to 2 units in the last place off)."""
    from te_v2_executor.backends.activation_quantize import Kind, activation_cast_transpose

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16, 64, generator=g, device="cuda").to(torch.bfloat16)
    scales = torch.exp2(torch.empty(256, device="cuda").uniform_(-20, 20, generator=g))
    ours, te = [], []
    for scale in scales.tolist():
        amax = torch.zeros(1, device="cuda")
        scale_t = torch.tensor([scale], device="cuda")
        fp8 = torch.float8_e4m3fn
        ours.append(
            activation_cast_transpose(Kind.GELU, x, scale_t, amax, fp8, rowwise=True, columnwise=False)[2]
        )
        te.append(_te_cast(torch.nn.functional.gelu(x), fp8, scale, columnwise=False)[2])
    assert torch.equal(torch.cat(ours), torch.cat(te))


def test_nan_stays_nan_as_in_te_cast():
    """A NaN activation must stay NaN in FP8 (a clamp that drops NaN would hide a diverging run)."""
    from te_v2_executor.backends.activation_quantize import Kind, activation_cast_transpose

    x = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    x[3, 5] = float("nan")
    row_te, col_te, _, _ = _te_cast(torch.nn.functional.gelu(x), torch.float8_e4m3fn, 1.0, columnwise=True)
    one = torch.ones(1, device="cuda")
    row, col, _ = activation_cast_transpose(
        Kind.GELU, x, one, one.clone(), torch.float8_e4m3fn, rowwise=True, columnwise=True
    )
    assert torch.isnan(row.view(torch.float8_e4m3fn)[3, 5].float())
    assert torch.isnan(col.view(torch.float8_e4m3fn)[5, 3].float())
    assert int(row[3, 5]) == int(row_te[3, 5]) and int(col[5, 3]) == int(col_te[5, 3])


def test_the_kernel_refuses_float32():
    """Seen on an H200: float32 tiles stored both row-wise and transposed came out wrong (a
    quarter of the transposed codes), so the kernel takes bfloat16 only."""
    from te_v2_executor.backends.activation_quantize import Kind, activation_cast_transpose

    x = torch.randn(SHAPE, device="cuda")
    one = torch.ones(1, device="cuda")
    with pytest.raises(ValueError, match="bfloat16 only"):
        activation_cast_transpose(
            Kind.GELU, x, one, one.clone(), torch.float8_e4m3fn, rowwise=True, columnwise=True
        )


def test_a_float32_gelu_model_falls_back_to_pytorch_gelu_and_matches_te_linear():
    """float32 activations: the GELUs are still folded in the trace, but run as PyTorch's GELU
    followed by TE's cast, and the step matches te.Linear eager."""
    from transformer_engine.common.recipe import DelayedScaling

    model = Stack(
        [256] * 4, act=torch.nn.functional.gelu, factory=lambda i, o, b: te_linear(i, o, b, torch.float32)
    )
    twin = copy_weights(
        Stack(
            [256] * 4,
            act=torch.nn.functional.gelu,
            factory=lambda i, o, b: torch.nn.Linear(i, o, bias=b, device="cuda"),
        ),
        model,
    )
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    y_te = train_step(model, x, DelayedScaling())
    dx_te, x.grad = x.grad, None
    jitted = jit_te_v2(twin)
    y = train_step(jitted, x, DelayedScaling())
    assert sum(b.kwargs["gelu"] for b in bsyms_of(forward_trace(jitted), LINEAR_FWD)) == 2
    torch.testing.assert_close(y, y_te, **FP8_TOLS)
    torch.testing.assert_close(x.grad, dx_te, **FP8_TOLS)
    for name, grad in grads(twin).items():
        torch.testing.assert_close(grad, grads(model)[name], **FP8_TOLS, msg=name)
    names = train_step_kernels(jitted, x, DelayedScaling())
    assert not any(FUSED_KERNEL in n for n in names)


def test_a_gelu_model_step_runs_the_fused_kernel_and_no_other_gelu():
    """Four linears, GELUs between them, no bias: 3 GELUs, each once forward, once backward and
    once more in the backward for the wgrad's copy of its output (``input_recasts``)."""
    from transformer_engine.common.recipe import DelayedScaling

    model = Stack([256] * 5, act=torch.nn.functional.gelu, factory=torch_linear)
    x = torch.randn(512, 256, device="cuda", dtype=DTYPE)
    names = train_step_kernels(jit_te_v2(model), x, DelayedScaling())
    assert sum(FUSED_KERNEL in n for n in names) == 3 * 3
    assert [n for n in names if "gelu" in n.lower() and FUSED_KERNEL not in n] == []


@pytest.mark.real_fold_size
@pytest.mark.parametrize(("tokens", "width", "folds"), [(512, 1024, False), (4096, 16384, True)])
def test_only_gelus_large_enough_run_the_fused_kernel(tokens, width, folds):
    """The size rule (``kernels.FOLD_MIN_ELEMENTS``, 2**26 elements): a smaller GELU runs
    PyTorch's GELU kernels and TE's cast, whose launches cost the host less; 4096 x 16384 folds.
    Either runs three times a step: forward, backward, and the wgrad's recast."""
    from transformer_engine.common.recipe import DelayedScaling

    from te_v2_executor.backends import te as kernels

    assert (tokens * width >= kernels.FOLD_MIN_ELEMENTS) is folds
    model = Stack([1024, width, 1024], act=torch.nn.functional.gelu, factory=torch_linear)
    x = torch.randn(tokens, 1024, device="cuda", dtype=DTYPE)
    jitted = jit_te_v2(model)
    names = train_step_kernels(jitted, x, DelayedScaling())
    assert [b.kwargs["gelu"] for b in bsyms_of(forward_trace(jitted), LINEAR_FWD)] == [False, True]
    assert sum(FUSED_KERNEL in n for n in names) == (3 if folds else 0)
    pytorch_gelus = [n for n in names if "gelu" in n.lower() and FUSED_KERNEL not in n]
    assert len(pytorch_gelus) == (0 if folds else 3), pytorch_gelus


def _swiglu_mlps(factory) -> torch.nn.Module:
    return torch.nn.Sequential(*(SwiGLUMLP(256, 512, factory=factory) for _ in range(2)))


def test_a_swiglu_model_matches_te_linear_and_runs_the_fused_kernel_and_no_other_silu():
    """Two Llama MLPs: each SwiGLU is computed inside down's cast, its gradients inside gate's and
    up's, and again for down's wgrad (``input_recasts``): four fused kernels per MLP and step, no
    SiLU or multiply of PyTorch's; output and every
    gradient as te.Linear eager's, and the same delayed-scaling histories."""
    from transformer_engine.common.recipe import DelayedScaling

    model = _swiglu_mlps(te_linear)
    twin = copy_weights(_swiglu_mlps(torch_linear), model)
    x = torch.randn(512, 256, device="cuda", dtype=DTYPE, requires_grad=True)
    y_te = train_step(model, x, DelayedScaling())
    dx_te, x.grad = x.grad, None
    jitted = jit_te_v2(twin)
    y = train_step(jitted, x, DelayedScaling())
    assert [arg(b, "up") is not None for b in bsyms_of(forward_trace(jitted), LINEAR_FWD)] == [
        False,
        False,
        True,
    ] * 2
    torch.testing.assert_close(y, y_te, **FP8_TOLS)
    torch.testing.assert_close(x.grad, dx_te, **FP8_TOLS)
    for name, grad in grads(twin).items():
        torch.testing.assert_close(grad, grads(model)[name], **FP8_TOLS, msg=name)
    for (fwd, bwd), linear in zip(te_v2_states(jitted), _te_linears(model), strict=True):
        meta_fwd, meta_bwd = linear.fp8_meta["scaling_fwd"], linear.fp8_meta["scaling_bwd"]
        torch.testing.assert_close(fwd.amax_history[:, :2], meta_fwd.amax_history[:, :2], rtol=2**-7, atol=0)
        torch.testing.assert_close(bwd.amax_history[:, :1], meta_bwd.amax_history[:, :1], rtol=2**-7, atol=0)
    names = train_step_kernels(jitted, x, DelayedScaling())
    assert sum(FUSED_KERNEL in n for n in names) == 4 * 2
    others = [n for n in names if ("silu" in n.lower() or "MulFunctor" in n) and FUSED_KERNEL not in n]
    assert others == [], others


def _te_linears(model: torch.nn.Module) -> list:
    """The te.Linear modules of ``model`` in the order its forward calls them (gate, up, down)."""
    return [m for mlp in model for m in (mlp.gate, mlp.up, mlp.down)]
