"""The te_v2 kernels on TransformerEngine: quantizers, FP8 GEMMs and the fused scale update.

A ``KernelBackend`` (``common.py``), as ``reference.py`` is in plain torch; TE calls only, no
Thunder. Forward and backward are plain functions whose flags say which copy or GEMM to build,
after TE's ``BasicLinear._functional_forward``/``_functional_backward``, but with dgrad and wgrad
separate.

Hopper rule kept here, not in the passes: per-tensor FP8 cannot quantize column-wise only
("Columnwise-only per-tensor FP8 quantization is not implemented"), and the fused bias-grad
quantization needs both usages, so TE's casts always build the row-wise copy. te_v2's own
activation-and-cast kernel (``activation_quantize.py``: exact GELU, SwiGLU and their gradients),
used for delayed scaling, builds only what is asked.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformer_engine.pytorch  # noqa: F401  (loads TE's extension before the imports below)
import transformer_engine_torch as tex
from transformer_engine.common import recipe as te_recipes
from transformer_engine.pytorch.constants import TE_DType
from transformer_engine.pytorch.cpp_extensions import general_gemm
from transformer_engine.pytorch.cpp_extensions.gemm import get_cublas_workspace
from transformer_engine.pytorch.module.base import _2X_ACC_DGRAD, _2X_ACC_FPROP, _2X_ACC_WGRAD
from transformer_engine.pytorch.quantization import RecipeState, get_fp8_te_dtype
from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer, Float8Tensor
from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage
from transformer_engine.pytorch.utils import is_non_tn_fp8_gemm_supported

from te_v2_executor.backends.activation_quantize import Kind, activation_cast_transpose
from te_v2_executor.backends.common import activation_grad, activation_input, as_matrix, record_amax
from te_v2_executor.gathered_weights import GatheredFP8
from te_v2_executor.recipes import RecipeSpec, Scaling

_DEFAULT_SPLIT_ACCUMULATOR = {"fprop": _2X_ACC_FPROP, "dgrad": _2X_ACC_DGRAD, "wgrad": _2X_ACC_WGRAD}


@functools.cache
def _te_recipe_for(spec: RecipeSpec) -> Any:
    fmt = te_recipes.Format[spec.fp8_format]
    if spec.scaling is Scaling.DELAYED:
        return te_recipes.DelayedScaling(
            margin=spec.margin,
            fp8_format=fmt,
            amax_history_len=spec.amax_history_len,
            amax_compute_algo=spec.amax_compute_algo,
            reduce_amax=spec.reduce_amax,
        )
    if spec.scaling is Scaling.CURRENT:
        made = te_recipes.Float8CurrentScaling(fp8_format=fmt)
    elif spec.scaling is Scaling.BLOCK:
        made = te_recipes.Float8BlockScaling(fp8_format=fmt)
    else:
        raise ValueError(f"te_v2: no TransformerEngine recipe for {spec}")
    # per-role quantization parameters are class attributes, not constructor fields
    qparams = te_recipes.QParams(power_2_scale=spec.power_2_scale, amax_epsilon=spec.amax_epsilon)
    for role in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        setattr(made, role, qparams)
    return made


def te_recipe(spec: RecipeSpec) -> Any:
    """The TE recipe object of ``spec``: the user's own when it came from ``te.autocast``."""
    return spec.te_recipe if spec.te_recipe is not None else _te_recipe_for(spec)


def _split_accumulator(recipe: RecipeSpec, gemm: str) -> bool:
    """As ``te.Linear`` chooses: the recipe's per-GEMM setting, else TE's default."""
    params = getattr(te_recipe(recipe), f"fp8_gemm_{gemm}", None)
    return params.use_split_accumulator if params is not None else _DEFAULT_SPLIT_ACCUMULATOR[gemm]


def _configure(quantizers: list[Any], recipe: RecipeSpec, *, forward: bool) -> None:
    """Quantizer settings ``te.Linear`` applies: forward copies are saved for backward, so they
    must be torch.Tensor subclasses (not TE's internal storage); dy stays internal."""
    for q in quantizers:
        q.internal = not forward
    te = te_recipe(recipe)
    if recipe.scaling is Scaling.CURRENT:
        roles = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight") if forward else ("fp8_quant_bwd_grad",)
        for q, role in zip(quantizers, roles, strict=True):
            q.force_pow_2_scales = getattr(te, role).power_2_scale
            q.amax_epsilon = getattr(te, role).amax_epsilon


class ScalingState:
    """TE's recipe state and quantizers for one direction of one linear: forward (x, W) or
    backward (dy). Delayed scaling exposes ``amax_history`` and ``scale``; others have None."""

    def __init__(self, recipe: RecipeSpec, *, forward: bool, device: torch.device) -> None:
        self.recipe = recipe
        recipe_state = RecipeState.create(
            te_recipe(recipe),
            mode="forward" if forward else "backward",
            num_quantizers=2 if forward else 1,
            device=device,
        )
        self.amax_history = getattr(recipe_state, "amax_history", None)
        self.scale = getattr(recipe_state, "scale", None)
        self.quantizers = recipe_state.make_quantizers()
        _configure(self.quantizers, recipe, forward=forward)

    def shared_input_quantizer(self) -> Float8Quantizer:
        """A quantizer of the input with this state's scale whose amax goes to a scratch of its
        own (``quantize_input``); made on first use."""
        found = getattr(self, "_shared_input_quantizer", None)
        if found is None:
            own = self.quantizers[0]
            found = Float8Quantizer(own.scale, torch.zeros_like(own.amax), own.dtype)
            _configure([found], self.recipe, forward=True)
            self._shared_input_quantizer = found
        return found

    @classmethod
    def replaying(cls, recipe: RecipeSpec, scale: torch.Tensor) -> ScalingState:
        """A forward state quantizing with ``scale`` (input, weight) whose amaxes go nowhere."""
        state = cls.__new__(cls)
        state.recipe = recipe
        state.scale = scale
        state.amax_history = torch.zeros(1, 2, dtype=torch.float32, device=scale.device)
        dtype = get_fp8_te_dtype(te_recipe(recipe), True)
        state.quantizers = [
            Float8Quantizer(scale[i], state.amax_history[0][i].reshape((1,)), dtype) for i in range(2)
        ]
        _configure(state.quantizers, recipe, forward=True)
        return state

    def rescale(self, scale: torch.Tensor) -> ScalingState:
        """This replaying state, quantizing with ``scale`` from now on (its amaxes still go
        nowhere)."""
        self.scale = scale
        for i, quantizer in enumerate(self.quantizers):
            quantizer.scale = scale[i]
        return self


def _quantize(quantizer: Any, tensor: torch.Tensor) -> Any:
    """``quantizer(tensor)`` less its wrapper, which only serves autograd, casts into an existing
    tensor and amax-reduction groups, none of which te_v2 uses; on an H200's host the wrapper cost
    13 us a call, against 31 us for the cast itself."""
    return quantizer.quantize_impl(tensor)


def _keep_columnwise_only(q: Any) -> Any:
    q.update_usage(rowwise_usage=False, columnwise_usage=True)
    return q


# The activation folds' Triton kernel saves GPU time but costs host time to launch: on an H200,
# timed interleaved on the same compiled full-MLP step (docs/performance.md), it took 8192 x 14336
# (117M elements) from 1.00 to 0.99x te.Linear eager and 2048 x 14336 (29M) from 1.05 to 1.10x
# (GELU). Smaller tensors take PyTorch's activation and TE's cast, unless a CUDA graph is being
# captured, where the launch is paid once.
FOLD_MIN_ELEMENTS = 1 << 26


def _foldable(quantizer: Any, a: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Per-tensor delayed scaling, whose scale is known before the values so that one pass can
    cast, of bfloat16 operands (``a`` and those of ``others`` given, the only dtype the kernel is
    validated for) of one shape, large enough to gain from it, on a GPU whose FP8 GEMMs read
    transposed copies (Hopper; newer ones read the row-wise data only)."""
    operands = [a, *(t for t in others if t is not None)]
    return (
        isinstance(quantizer, Float8Quantizer)
        and all(t.dtype == torch.bfloat16 and t.shape == a.shape for t in operands)
        and a.numel() > 0
        and not is_non_tn_fp8_gemm_supported()
        and (a.numel() >= FOLD_MIN_ELEMENTS or torch.cuda.is_current_stream_capturing())
    )


def _fold_quantize(
    kind: Kind,
    a: torch.Tensor,
    quantizer: Float8Quantizer,
    recipe: RecipeSpec,
    *,
    up: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
    rowwise: bool,
    columnwise: bool,
    forward: bool,
) -> Any:
    """The FP8 copies of what ``kind`` computes from ``a`` (and ``up``, ``grad``), as the TE tensor
    ``quantizer`` would have made from them (amax recorded in its history slot)."""
    row, col, scale_inv = activation_cast_transpose(
        kind,
        a,
        quantizer.scale,
        quantizer.amax,
        recipe.fp8_dtype(forward=forward),
        up=up,
        grad=grad,
        rowwise=rowwise,
        columnwise=columnwise,
    )
    parts = dict(
        data=row, data_transpose=col, fp8_scale_inv=scale_inv, fp8_dtype=quantizer.dtype, quantizer=quantizer
    )
    if quantizer.internal:
        return Float8TensorStorage(fake_dtype=a.dtype, **parts)
    return Float8Tensor(shape=a.shape, dtype=a.dtype, requires_grad=False, device=a.device, **parts)


def _from_gathered(gathered: GatheredFP8, quantizer: Any, dtype: torch.dtype, *, columnwise: bool) -> Any:
    """The FP8 weight ``quantizer`` would cast, from the bytes FSDP2 gathered it from, with its
    transposed copy where ``columnwise`` (TE's FP8 transpose, a byte a value read and written).
    Where the GPU's GEMMs read the row-wise data for both usages, the saved copy gets data of its
    own: FSDP2 frees the gathered bytes when it reshards, before the backward reads them."""
    data = gathered.data.view(torch.uint8)
    if columnwise and is_non_tn_fp8_gemm_supported():
        data = data.clone()
    wq = Float8Tensor(
        shape=data.shape,
        dtype=dtype,
        data=data,
        fp8_scale_inv=gathered.scale_inv,
        fp8_dtype=quantizer.dtype,
        requires_grad=False,
        device=data.device,
        quantizer=quantizer,
    )
    wq.update_usage(rowwise_usage=True, columnwise_usage=columnwise)
    return wq


def linear_fwd(
    x: torch.Tensor | None,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    scaling: ScalingState,
    *,
    compute_output: bool,
    save_input: bool,
    save_weight: bool,
    gelu: bool = False,
    up: torch.Tensor | None = None,
    x_q: Any = None,
    w_gathered: GatheredFP8 | None = None,
) -> tuple[torch.Tensor | None, Any, Any]:
    """Forward GEMM y = x W^T + b, and the column-wise FP8 copies the backward needs.

    ``compute_output`` False (a recomputed forward whose y nobody reads) only quantizes; x is
    not read unless y or its copy is wanted. ``gelu`` or ``up``: the GEMM's input is gelu(x)
    or SwiGLU's silu(x) * up, computed within the quantization where the recipe allows.
    ``x_q``: x already quantized row-wise by ``quantize_input``, which the GEMM reads instead of
    casting x. ``w_gathered``: the FP8 bytes FSDP2 gathered W from, read instead of casting W.
    """
    input_quantizer, weight_quantizer = scaling.quantizers
    xq = x_q
    if x_q is None and (compute_output or save_input):
        x2d = as_matrix(x)
        up2d = as_matrix(up) if up is not None else None
        kind = Kind.GELU if gelu else Kind.SWIGLU if up is not None else None
        if kind is not None and _foldable(input_quantizer, x2d, up2d):
            xq = _fold_quantize(
                kind,
                x2d,
                input_quantizer,
                scaling.recipe,
                up=up2d,
                rowwise=compute_output,
                columnwise=save_input,
                forward=True,
            )
        else:
            input_quantizer.set_usage(rowwise=True, columnwise=save_input)
            xq = _quantize(input_quantizer, activation_input(x2d, gelu=gelu, up=up2d))
    wq = None
    if w_gathered is not None and (compute_output or save_weight):
        wq = _from_gathered(w_gathered, weight_quantizer, w.dtype, columnwise=save_weight)
    elif compute_output or save_weight:
        weight_quantizer.set_usage(rowwise=True, columnwise=save_weight)
        wq = _quantize(weight_quantizer, w)
    y = None
    if compute_output:
        if bias is not None and x.dtype == torch.float32:
            bias = bias.to(torch.bfloat16)  # cuBLAS FP8 GEMMs take no float32 bias (as te.Linear)
        y = _gemm(wq, xq, scaling.recipe, gemm="fprop", dtype=x.dtype, bias=bias)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], w.shape[0])
    return (
        y,
        _keep_columnwise_only(xq) if save_input else None,
        _keep_columnwise_only(wq) if save_weight else None,
    )


def recast_weights(ws: tuple[torch.Tensor, ...], scalings: list[ScalingState]) -> tuple[Any, ...]:
    """The column-wise FP8 copy of each of ``ws`` with its scaling's weight quantizer, as
    ``linear_fwd`` would make it for a recast, by one call to TE's multi-tensor cast: under delayed
    scaling one kernel for all of them, and one crossing into TE instead of one per weight."""
    quantizers = [scaling.quantizers[1] for scaling in scalings]
    for quantizer in quantizers:
        quantizer.set_usage(rowwise=True, columnwise=True)
    copies = tex.multi_tensor_quantize([w.contiguous() for w in ws], quantizers)
    return tuple(_keep_columnwise_only(copy) for copy in copies)


def quantize_input(
    x: torch.Tensor, scaling: ScalingState, sharers: list[ScalingState], *, columnwise: bool
) -> tuple[Any, Any]:
    """x cast once for several forwards: the row-wise copy their GEMMs read, and with
    ``columnwise`` the column-wise copy their wgrads read, as two tensors over one cast's data
    (so that the row-wise data is freed after the last forward, while the column-wise is saved).

    Under delayed scaling the cast records its amax into a zeroed scratch, which one foreach
    max then adds into the input history of ``scaling`` and of each of ``sharers``: each gets
    exactly what casting x itself would have recorded, whatever it recorded before.
    """
    input_quantizer = scaling.quantizers[0]
    shared = scaling.amax_history is not None and sharers
    quantizer = scaling.shared_input_quantizer() if shared else input_quantizer
    if shared:
        quantizer.amax.zero_()
    quantizer.set_usage(rowwise=True, columnwise=columnwise)
    xq = _quantize(quantizer, as_matrix(x))
    if shared:
        slots = [input_quantizer.amax, *(s.quantizers[0].amax for s in sharers)]
        torch._foreach_maximum_(slots, [quantizer.amax] * len(slots))
    return xq, _keep_columnwise_only(xq.detach()) if columnwise else None


def quantize_grad_output(
    dy: torch.Tensor,
    scaling: ScalingState,
    *,
    rowwise: bool,
    columnwise: bool,
    bgrad: bool,
    gelu_input: torch.Tensor | None = None,
    swiglu_gate: torch.Tensor | None = None,
    swiglu_up: torch.Tensor | None = None,
) -> tuple[Any, torch.Tensor | None]:
    """Quantize dy once for dgrad (row-wise) and wgrad (column-wise); bias grad alongside, fused
    into the quantization where TE has that kernel. With an activation's operands (``gelu_input``;
    ``swiglu_gate``, and ``swiglu_up`` for the gate's gradient) dy is the gradient of its output,
    and the gradient of its input is quantized, computed within the quantization where the
    recipe allows. Where only the bias grad is asked for, delayed scaling still records dy's amax,
    as ``te.Linear``'s ``bgrad_quantize`` does: a weight unfrozen later finds the history warm."""
    dy2d = as_matrix(dy)
    (quantizer,) = scaling.quantizers
    if gelu_input is not None or swiglu_gate is not None:
        x = as_matrix(gelu_input if gelu_input is not None else swiglu_gate)
        up = as_matrix(swiglu_up) if swiglu_up is not None else None
        if (rowwise or columnwise) and not bgrad and _foldable(quantizer, dy2d, x, up):
            if gelu_input is not None:
                kind = Kind.GELU_GRAD
            else:
                kind = Kind.SWIGLU_GRAD_GATE if up is not None else Kind.SWIGLU_GRAD_UP
            dy_q = _fold_quantize(
                kind,
                x,
                quantizer,
                scaling.recipe,
                up=up,
                grad=dy2d,
                rowwise=rowwise,
                columnwise=columnwise,
                forward=False,
            )
            return dy_q, None
        dy2d = activation_grad(dy2d, gelu_input=gelu_input, swiglu_gate=swiglu_gate, swiglu_up=swiglu_up)
    if not (rowwise or columnwise):
        if scaling.recipe.stateful:
            record_amax(quantizer.amax, dy2d)
        return None, dy2d.sum(0)
    quantizer.set_usage(rowwise=True, columnwise=columnwise)
    if bgrad and columnwise and scaling.recipe.per_tensor:
        dbias, dy_q = tex.bgrad_quantize(dy2d, quantizer)
        return dy_q, dbias
    return _quantize(quantizer, dy2d), dy2d.sum(0) if bgrad else None


# What general_gemm hands to TE's extension unchanged: per-tensor FP8 tensors (Float8Tensor is
# a subclass), which it neither unwraps, dequantizes nor routes to a custom GEMM.
_DIRECT_GEMM_INPUTS = (Float8TensorStorage,)
_GEMM_LAYOUT = {"fprop": "TN", "dgrad": "NN", "wgrad": "NT"}


def _gemm(
    a: Any,
    b: Any,
    recipe: RecipeSpec,
    *,
    gemm: str,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GEMM ``gemm`` (fprop, dgrad or wgrad) in TE's layout; with ``out``, its product is
    added into ``out``.

    Two per-tensor FP8 operands go straight to TE's extension with the arguments ``general_gemm``
    would pass it: its Python wrapper, which dispatches on tensor types te_v2 never makes, took
    15 of a GEMM's 36 us of host time on an H200. Other operands go through ``general_gemm``.
    """
    layout = _GEMM_LAYOUT[gemm]
    split = _split_accumulator(recipe, gemm)
    accumulate = out is not None
    if not (isinstance(a, _DIRECT_GEMM_INPUTS) and isinstance(b, _DIRECT_GEMM_INPUTS)):
        result, *_ = general_gemm(
            a,
            b,
            out_dtype=dtype,
            layout=layout,
            accumulate=accumulate,
            out=out,
            bias=bias,
            grad=gemm != "fprop",
            use_split_accumulator=split,
        )
        return result
    workspace = get_cublas_workspace(a.device.index, False, False)
    result, *_ = tex.generic_gemm(
        a,
        layout[0] == "T",
        b,
        layout[1] == "T",
        out,
        None,  # no output quantizer
        TE_DType[dtype],
        bias,
        TE_DType[torch.bfloat16 if bias is None else bias.dtype],
        False,  # no GELU epilogue
        None,
        gemm != "fprop",
        workspace,
        workspace.shape[0],
        accumulate,
        split,
        comm_overlap=None,
        comm_type=None,
        extra_output=None,
        bulk_overlap=False,
        alpha=1.0,
        beta=1.0 if accumulate else 0.0,
    )
    return result


def linear_dgrad(
    dy_q: Any,
    w_saved: Any,
    recipe: RecipeSpec,
    *,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    accumulate_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """dx = dy W, from row-wise dy and the column-wise W (TE's "NN" layout).

    With ``accumulate_into`` the GEMM adds dx into that tensor, as TE's fused backward linear +
    add does, and returns it (a non-contiguous one is reshaped into a copy, which is returned).
    """
    out = None if accumulate_into is None else as_matrix(accumulate_into).contiguous()
    dx = _gemm(w_saved, dy_q, recipe, gemm="dgrad", dtype=dtype, out=out)
    return dx if len(input_shape) == 2 else dx.view(input_shape)


def linear_wgrad(dy_q: Any, x_saved: Any, recipe: RecipeSpec, *, dtype: torch.dtype) -> torch.Tensor:
    """dW = dy^T x, from the column-wise dy and x (TE's "NT" layout)."""
    return _gemm(x_saved, dy_q, recipe, gemm="wgrad", dtype=dtype)


def update_delayed_scaling(
    amax: torch.Tensor,
    histories: list[torch.Tensor],
    scales: list[torch.Tensor],
    recipe: RecipeSpec,
    *,
    forward: bool,
) -> None:
    """One fused amax-history and scale update for every state (TE's own kernel, as
    ``FP8GlobalStateManager.reduce_and_update_fp8_tensors`` uses it)."""
    tex.fused_amax_and_scale_update_after_reduction(
        amax,
        histories,
        scales,
        recipe.amax_compute_algo,
        get_fp8_te_dtype(te_recipe(recipe), forward),
        recipe.margin,
    )
