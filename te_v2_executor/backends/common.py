"""What every numerics backend provides (``KernelBackend``), and what their GEMMs share.

``te.py`` and ``reference.py`` are modules that satisfy ``KernelBackend``: the te_v2 symbols call
them through ``LinearQuantState.numerics`` and nothing else, so one backend stands in for the
other. A CPU test compares both modules' signatures with this interface.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from te_v2_executor.gathered_weights import GatheredFP8
from te_v2_executor.recipes import RecipeSpec


class ScalingState(Protocol):
    """The quantization state of one direction of one linear: forward (x, W) or backward (dy).

    Delayed scaling exposes ``amax_history`` (history_len, n) and ``scale`` (n,), the tensors the
    flush updates in place; the stateless recipes have None.
    """

    recipe: RecipeSpec
    amax_history: torch.Tensor | None
    scale: torch.Tensor | None

    def __init__(self, recipe: RecipeSpec, *, forward: bool, device: torch.device) -> None: ...

    @classmethod
    def replaying(cls, recipe: RecipeSpec, scale: torch.Tensor) -> ScalingState:
        """A forward state quantizing with ``scale`` (input, weight) whose amaxes go nowhere: a
        checkpoint recompute's, quantizing as the original forward did."""
        ...

    def rescale(self, scale: torch.Tensor) -> ScalingState:
        """This replaying state, quantizing with ``scale`` from now on: a recast made again every
        step reuses its state rather than making one a call."""
        ...


class KernelBackend(Protocol):
    """The numerics of the te_v2 FP8 symbols, as one module's functions."""

    ScalingState: type[ScalingState]

    def linear_fwd(
        self,
        x: torch.Tensor | None,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        scaling: Any,
        *,
        compute_output: bool,
        save_input: bool,
        save_weight: bool,
        gelu: bool = False,
        up: torch.Tensor | None = None,
        x_q: Any = None,
        w_gathered: GatheredFP8 | None = None,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """y = x W^T + b and the column-wise FP8 copies of x and W the backward reads; x is None
        when only W's copy is wanted; ``x_q`` is x as ``quantize_input`` cast it; ``w_gathered``
        the FP8 bytes FSDP2 gathered W from, which the cast of W would make. With ``gelu`` or
        ``up``, the GEMM's input is ``activation_input`` of x."""
        ...

    def recast_weights(self, ws: tuple[torch.Tensor, ...], scalings: list[Any]) -> tuple[Any, ...]:
        """The column-wise FP8 copy of each of ``ws`` with its scaling (``linear_fwd``'s for a
        forward that only saves the weight's copy), in one call."""
        ...

    def quantize_input(
        self, x: torch.Tensor, scaling: Any, sharers: list[Any], *, columnwise: bool
    ) -> tuple[Any, Any]:
        """x cast once, with ``scaling``, for the forwards that read it: its row-wise copy, and with
        ``columnwise`` its column-wise one, as separate tensors; under delayed scaling the cast's
        amax is recorded into the input history of ``scaling`` and of each of ``sharers``."""
        ...

    def quantize_grad_output(
        self,
        dy: torch.Tensor,
        scaling: Any,
        *,
        rowwise: bool,
        columnwise: bool,
        bgrad: bool,
        gelu_input: torch.Tensor | None = None,
        swiglu_gate: torch.Tensor | None = None,
        swiglu_up: torch.Tensor | None = None,
    ) -> tuple[Any, torch.Tensor | None]:
        """dy quantized for dgrad (row-wise) and wgrad (column-wise), and the bias grad. With an
        activation's operands, ``activation_grad`` of dy is what is quantized."""
        ...

    def linear_dgrad(
        self,
        dy_q: Any,
        w_saved: Any,
        recipe: RecipeSpec,
        *,
        input_shape: tuple[int, ...],
        dtype: torch.dtype,
        accumulate_into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """dx = dy W, added into ``accumulate_into`` when given."""
        ...

    def linear_wgrad(
        self, dy_q: Any, x_saved: Any, recipe: RecipeSpec, *, dtype: torch.dtype
    ) -> torch.Tensor:
        """dW = dy^T x."""
        ...

    def update_delayed_scaling(
        self,
        amax: torch.Tensor,
        histories: list[torch.Tensor],
        scales: list[torch.Tensor],
        recipe: RecipeSpec,
        *,
        forward: bool,
    ) -> None:
        """The amax-history and scale update of every state of one flush, from their reduced
        current amaxes concatenated in order."""
        ...


def activation_input(
    x2d: torch.Tensor, *, gelu: bool = False, up: torch.Tensor | None = None
) -> torch.Tensor:
    """What a forward folded with an activation quantizes, as PyTorch's eager kernels compute it:
    gelu(x) with ``gelu``; SwiGLU's silu(x) * up with ``up``, x the gate; else x itself."""
    if gelu:
        return torch.nn.functional.gelu(x2d)
    if up is not None:
        return torch.nn.functional.silu(x2d) * up.reshape(x2d.shape)
    return x2d


def activation_grad(
    dy2d: torch.Tensor,
    *,
    gelu_input: torch.Tensor | None = None,
    swiglu_gate: torch.Tensor | None = None,
    swiglu_up: torch.Tensor | None = None,
) -> torch.Tensor:
    """What a dy quantization folded with an activation's backward quantizes, as PyTorch's
    autograd computes it from dy, the gradient of the activation's output: the GELU input's
    gradient with ``gelu_input``; with ``swiglu_gate``, the gradient of SwiGLU's up, or with
    ``swiglu_up`` too of its gate; else dy itself."""
    if gelu_input is not None:
        return torch.ops.aten.gelu_backward(dy2d, gelu_input.reshape(dy2d.shape))
    if swiglu_gate is None:
        return dy2d
    gate = swiglu_gate.reshape(dy2d.shape)
    if swiglu_up is None:
        return dy2d * torch.nn.functional.silu(gate)
    return torch.ops.aten.silu_backward(dy2d * swiglu_up.reshape(dy2d.shape), gate)


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the 2-D matrix a GEMM takes, its leading dimensions flattened; a 2-D tensor as it
    is (a reshape costs host time on every call). Shared by every backend's GEMMs."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def record_amax(amax: torch.Tensor, t: torch.Tensor) -> None:
    """Adds ``t``'s amax into the running max ``amax`` holds (delayed scaling's slot of the current
    history row), as TE's cast kernels do."""
    amax.copy_(torch.maximum(amax, t.abs().amax().float()))
