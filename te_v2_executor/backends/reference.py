"""The te_v2 kernels in plain torch: FP8 emulated through torch's float8 dtypes.

A ``KernelBackend`` (``common.py``), as ``te.py`` is on TransformerEngine, on any device.
Quantization follows TE's rules (per-tensor delayed or current scales, 1x128 / 128x128 blocks),
and each GEMM reads only the copy it needs: the forward reads row-wise x and W, dgrad row-wise
dy and the column-wise (transposed) W, wgrad the column-wise dy and x. A copy the passes did
not ask for is absent, so a missing one fails loudly here on the CPU instead of in a GPU kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from te_v2_executor.backends.common import activation_grad, activation_input, as_matrix, record_amax
from te_v2_executor.gathered_weights import GatheredFP8
from te_v2_executor.recipes import RecipeSpec

BLOCK = 128
_FP32_MAX = torch.finfo(torch.float32).max


@dataclass
class Plane:
    """One FP8 copy of a 2-D tensor: data, and the inverse scales of its blocks."""

    data: torch.Tensor  # float8, (rows, cols)
    scale_inv: torch.Tensor  # float32, (ceil(rows / block[0]), ceil(cols / block[1]))
    block: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.data.shape
        s = self.scale_inv.repeat_interleave(self.block[0], 0)[:rows]
        s = s.repeat_interleave(self.block[1], 1)[:, :cols]
        return self.data.float() * s

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale_inv.nbytes


class ReferenceQuantizedTensor(torch.Tensor):
    """An FP8 operand: a row-wise copy, a column-wise (transposed) copy, or both.

    A torch.Tensor subclass (an empty carrier) so autograd can save it for backward like TE's
    Float8Tensor; the copies live in attributes.
    """

    rowwise: Plane | None
    columnwise: Plane | None

    @staticmethod
    def wrap(
        rowwise: Plane | None, columnwise: Plane | None, device: torch.device
    ) -> ReferenceQuantizedTensor:
        carrier = torch.Tensor._make_subclass(ReferenceQuantizedTensor, torch.empty(0, device=device))
        carrier.rowwise, carrier.columnwise = rowwise, columnwise
        return carrier

    def plane(self, usage: str) -> Plane:
        found = getattr(self, usage)
        if found is None:
            raise RuntimeError(f"te_v2 reference: the {usage} FP8 copy this GEMM reads was not built")
        return found

    def copy_(self, src: ReferenceQuantizedTensor, non_blocking: bool = False) -> ReferenceQuantizedTensor:
        """``src``'s FP8 copies written into this one's (made where it has none of that shape), as
        TE's ``Float8Tensor`` copies its data: what a CUDA graph runner does with an FP8 operand it
        reads from a buffer of its own (``torch.empty_like(x).copy_(x)``, then ``copy_`` on each
        call)."""
        for usage in ("rowwise", "columnwise"):
            theirs, mine = getattr(src, usage, None), getattr(self, usage, None)
            if theirs is None or mine is None or mine.data.shape != theirs.data.shape:
                mine = (
                    None
                    if theirs is None
                    else Plane(theirs.data.clone(), theirs.scale_inv.clone(), theirs.block)
                )
                setattr(self, usage, mine)
            else:
                mine.data.copy_(theirs.data, non_blocking=non_blocking)
                mine.scale_inv.copy_(theirs.scale_inv, non_blocking=non_blocking)
        return self

    def keep_columnwise_only(self) -> ReferenceQuantizedTensor:
        self.rowwise = None
        return self


class ScalingState:
    """Scaling state of one direction of one linear: forward (x, W) or backward (dy).

    Delayed scaling keeps ``amax_history`` (history_len, n) and ``scale`` (n,) as TE does; the
    other recipes are stateless.
    """

    def __init__(self, recipe: RecipeSpec, *, forward: bool, device: torch.device) -> None:
        self.recipe = recipe
        self.forward = forward
        n = 2 if forward else 1
        self.amax_history = self.scale = None
        if recipe.stateful:
            self.scale = torch.ones(n, dtype=torch.float32, device=device)
            self.amax_history = torch.zeros(recipe.amax_history_len, n, dtype=torch.float32, device=device)

    @classmethod
    def replaying(cls, recipe: RecipeSpec, scale: torch.Tensor) -> ScalingState:
        """A forward state quantizing with ``scale`` (input, weight) whose amaxes go nowhere."""
        state = cls(recipe, forward=True, device=scale.device)
        state.scale = scale
        state.amax_history = torch.zeros(1, 2, dtype=torch.float32, device=scale.device)
        return state

    def rescale(self, scale: torch.Tensor) -> ScalingState:
        self.scale = scale
        return self


def scale_from_amax(amax: torch.Tensor, fp8_max: float, recipe: RecipeSpec) -> torch.Tensor:
    """The scale that maps ``amax`` onto ``fp8_max`` under ``recipe`` (its epsilon and power-of-2
    rule), as TE's current-scaling quantizers compute it; 1 for an amax of 0."""
    amax = amax.float().clamp(min=recipe.amax_epsilon)
    scale = torch.where(amax > 0, _divided(fp8_max, amax), torch.ones_like(amax))
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)
    if recipe.power_2_scale:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _divided(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` in float32, rounded once, as TE's kernels divide: PyTorch's
    ``float / tensor`` multiplies by the rounded reciprocal, a unit in the last place off for
    about a quarter of denominators, and so an FP8 value off where a scaled value lies near a
    rounding boundary."""
    return torch.full_like(denominator, numerator).div_(denominator)


def _block_amax(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = t.shape
    padded = torch.nn.functional.pad(t.abs().float(), (0, -cols % block[1], 0, -rows % block[0]))
    grid = padded.reshape(math.ceil(rows / block[0]), block[0], math.ceil(cols / block[1]), block[1])
    return grid.amax(dim=(1, 3))


def _cast(
    t: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], fp8_dtype: torch.dtype, fp8_max: float
) -> Plane:
    rows, cols = t.shape
    s = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    data = (t.float() * s).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return Plane(data, 1.0 / scale, block)


def _quantize(
    t: torch.Tensor, state: ScalingState, index: int, *, weight: bool, rowwise: bool, columnwise: bool
) -> ReferenceQuantizedTensor:
    """Quantize a 2-D tensor into the copies asked for, updating delayed-scaling amax."""
    recipe = state.recipe
    fp8_dtype, fp8_max = recipe.fp8_dtype(forward=state.forward), recipe.fp8_max(forward=state.forward)
    if recipe.per_tensor:
        whole = tuple(t.shape)
        if recipe.stateful:
            record_amax(state.amax_history[0, index], t)
            scale = state.scale[index].reshape(1, 1)
        else:
            scale = scale_from_amax(t.abs().amax().reshape(1, 1), fp8_max, recipe)
        return _per_tensor(_cast(t, scale, whole, fp8_dtype, fp8_max), rowwise=rowwise, columnwise=columnwise)

    block = (BLOCK, BLOCK) if weight else (1, BLOCK)

    def blocks(src: torch.Tensor) -> Plane:
        return _cast(
            src, scale_from_amax(_block_amax(src, block), fp8_max, recipe), block, fp8_dtype, fp8_max
        )

    return ReferenceQuantizedTensor.wrap(
        blocks(t) if rowwise else None, blocks(t.t()) if columnwise else None, t.device
    )


def _per_tensor(plane: Plane, *, rowwise: bool, columnwise: bool) -> ReferenceQuantizedTensor:
    """The copies asked for of a per-tensor FP8 ``plane``: as TE's cast-transpose, the column-wise
    copy holds the same FP8 values, transposed (into memory of its own)."""
    transposed = None
    if columnwise:
        data = plane.data.t().clone(memory_format=torch.contiguous_format)
        transposed = Plane(data, plane.scale_inv, plane.block[::-1])
    return ReferenceQuantizedTensor.wrap(plane if rowwise else None, transposed, plane.data.device)


def _from_gathered(gathered: GatheredFP8, *, rowwise: bool, columnwise: bool) -> ReferenceQuantizedTensor:
    """The copies of a weight FSDP2 gathered in FP8, from its bytes: what casting it makes."""
    plane = Plane(gathered.data, gathered.scale_inv.reshape(1, 1), tuple(gathered.data.shape))
    return _per_tensor(plane, rowwise=rowwise, columnwise=columnwise)


def _bias_add(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.float()


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
    x_q: ReferenceQuantizedTensor | None = None,
    w_gathered: GatheredFP8 | None = None,
) -> tuple[torch.Tensor | None, ReferenceQuantizedTensor | None, ReferenceQuantizedTensor | None]:
    """Forward GEMM y = x W^T + b, and the column-wise FP8 copies the backward needs.

    ``compute_output`` False (a recomputed forward whose y nobody reads) only quantizes; x is
    not read unless y or its copy is wanted. ``gelu`` or ``up``: the GEMM's input is
    ``activation_input`` of x, as PyTorch's eager kernels round it. ``x_q``: x already quantized
    row-wise by ``quantize_input``, which the GEMM reads instead of casting x. ``w_gathered``: the
    FP8 bytes FSDP2 gathered W from, read instead of casting W.
    """
    xq = x_q
    if x_q is None and (compute_output or save_input):
        x2d = activation_input(as_matrix(x), gelu=gelu, up=up)
        xq = _quantize(x2d, scaling, 0, weight=False, rowwise=compute_output, columnwise=save_input)
    wq = None
    if w_gathered is not None and (compute_output or save_weight):
        wq = _from_gathered(w_gathered, rowwise=compute_output, columnwise=save_weight)
    elif compute_output or save_weight:
        wq = _quantize(w, scaling, 1, weight=True, rowwise=compute_output, columnwise=save_weight)
    y = None
    if compute_output:
        y2d = xq.plane("rowwise").dequantize() @ wq.plane("rowwise").dequantize().t()
        y = _bias_add(y2d, bias).to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
    return (
        y,
        xq.keep_columnwise_only() if save_input else None,
        wq.keep_columnwise_only() if save_weight else None,
    )


def recast_weights(
    ws: tuple[torch.Tensor, ...], scalings: list[ScalingState]
) -> tuple[ReferenceQuantizedTensor, ...]:
    """The column-wise FP8 copy of each of ``ws``, as ``linear_fwd`` makes a recast's."""
    return tuple(
        linear_fwd(None, w, None, s, compute_output=False, save_input=False, save_weight=True)[2]
        for w, s in zip(ws, scalings, strict=True)
    )


def quantize_input(
    x: torch.Tensor, scaling: ScalingState, sharers: list[ScalingState], *, columnwise: bool
) -> tuple[ReferenceQuantizedTensor, ReferenceQuantizedTensor | None]:
    """x cast once for several forwards: the row-wise copy their GEMMs read, and with
    ``columnwise`` the column-wise copy their wgrads read, as two tensors; each of ``sharers``
    records the amax its own cast of x would have."""
    x2d = as_matrix(x)
    xq = _quantize(x2d, scaling, 0, weight=False, rowwise=True, columnwise=columnwise)
    if scaling.recipe.stateful:
        for s in sharers:
            record_amax(s.amax_history[0, 0], x2d)
    saved = ReferenceQuantizedTensor.wrap(None, xq.columnwise, x.device) if columnwise else None
    return ReferenceQuantizedTensor.wrap(xq.rowwise, None, x.device), saved


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
) -> tuple[ReferenceQuantizedTensor | None, torch.Tensor | None]:
    """Quantize dy once for dgrad (row-wise) and wgrad (column-wise); bias grad alongside. With an
    activation's operands, dy is the gradient of its output and ``activation_grad`` of it is
    quantized. Where only the bias grad is asked for, delayed scaling still records dy's amax, as
    TE's ``bgrad_quantize`` does for ``te.Linear``."""
    dy2d = activation_grad(as_matrix(dy), gelu_input=gelu_input, swiglu_gate=swiglu_gate, swiglu_up=swiglu_up)
    dbias = dy2d.float().sum(0).to(dy.dtype) if bgrad else None
    dyq = None
    if rowwise or columnwise:
        dyq = _quantize(dy2d, scaling, 0, weight=False, rowwise=rowwise, columnwise=columnwise)
    elif scaling.recipe.stateful:
        record_amax(scaling.amax_history[0, 0], dy2d)
    return dyq, dbias


def linear_dgrad(
    dy_q: ReferenceQuantizedTensor,
    w_saved: ReferenceQuantizedTensor,
    recipe: RecipeSpec,
    *,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    accumulate_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """dx = dy W, from row-wise dy and the column-wise (transposed) W; added into
    ``accumulate_into`` in place (one rounding, as the GEMM's own accumulation) when given."""
    dx = (dy_q.plane("rowwise").dequantize() @ w_saved.plane("columnwise").dequantize().t()).reshape(
        input_shape
    )
    if accumulate_into is None:
        return dx.to(dtype)
    return accumulate_into.copy_(accumulate_into.float() + dx)


def linear_wgrad(
    dy_q: ReferenceQuantizedTensor,
    x_saved: ReferenceQuantizedTensor,
    recipe: RecipeSpec,
    *,
    dtype: torch.dtype,
) -> torch.Tensor:
    """dW = dy^T x, from the column-wise dy and x."""
    dw = dy_q.plane("columnwise").dequantize() @ x_saved.plane("columnwise").dequantize().t()
    return dw.to(dtype)


def update_delayed_scaling(
    amax: torch.Tensor,
    histories: list[torch.Tensor],
    scales: list[torch.Tensor],
    recipe: RecipeSpec,
    *,
    forward: bool,
) -> None:
    """TE's fused amax-and-scale update, state by state: ``amax`` is every state's reduced
    current amax, concatenated in order."""
    fp8_max = recipe.fp8_max(forward=forward)
    for history, scale, current in zip(
        histories, scales, amax.split([s.numel() for s in scales]), strict=True
    ):
        history[0].copy_(current)
        chosen = history.amax(dim=0) if recipe.amax_compute_algo == "max" else history[0].clone()
        new_scale = _divided(fp8_max / 2**recipe.margin, chosen)
        new_scale = torch.where((chosen > 0) & torch.isfinite(chosen), new_scale, scale)
        scale.copy_(torch.where(torch.isinf(new_scale), torch.full_like(new_scale, _FP32_MAX), new_scale))
        history.copy_(torch.roll(history, -1, 0))
        history[0].zero_()
