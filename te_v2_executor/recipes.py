"""FP8 recipes as te_v2 sees them: one frozen description shared by both backends.

A TransformerEngine recipe object (from ``te.autocast``) is converted to a ``RecipeSpec`` at
trace time; the TE backend keeps the original object for its own kernels, the CPU reference
reads the fields. Recipes te_v2 cannot run become a spec whose ``unsupported`` says why, so the
checker can fall back with that reason instead of failing later.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

import torch


class Scaling(enum.Enum):
    """How scaling factors are chosen."""

    DELAYED = "delayed"  # per tensor, from an amax history updated after each pass
    CURRENT = "current"  # per tensor, from the tensor's own amax
    BLOCK = "block"  # per 1x128 / 128x128 block (Float8BlockScaling)
    MXFP8 = "mxfp8"  # Blackwell only
    NVFP4 = "nvfp4"  # Blackwell only


_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@dataclass(frozen=True)
class RecipeSpec:
    """What te_v2 needs to know of an FP8 recipe; equal specs share traces and state."""

    scaling: Scaling = Scaling.DELAYED
    fp8_format: str = "HYBRID"  # "E4M3" everywhere, or "HYBRID": E4M3 forward, E5M2 backward
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"  # or "most_recent"
    reduce_amax: bool = True
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    unsupported: str = ""  # non-empty: why te_v2 cannot run this recipe
    te_recipe: Any = field(default=None, compare=False, repr=False)

    @property
    def stateful(self) -> bool:
        """Whether quantization keeps amax/scale state between passes (delayed scaling)."""
        return self.scaling is Scaling.DELAYED

    @property
    def per_tensor(self) -> bool:
        return self.scaling in (Scaling.DELAYED, Scaling.CURRENT)

    def fp8_dtype(self, *, forward: bool) -> torch.dtype:
        """FP8 dtype of forward operands (x, W) or backward ones (dy)."""
        if self.fp8_format == "E4M3" or forward:
            return torch.float8_e4m3fn
        return torch.float8_e5m2

    def fp8_max(self, *, forward: bool) -> float:
        return _FP8_MAX[self.fp8_dtype(forward=forward)]


def delayed_scaling(**fields: Any) -> RecipeSpec:
    """DelayedScaling, the default recipe on Hopper (same field names as TE's)."""
    return RecipeSpec(scaling=Scaling.DELAYED, **fields)


def current_scaling(**fields: Any) -> RecipeSpec:
    """Float8CurrentScaling: per-tensor scales from each tensor's own amax."""
    return RecipeSpec(scaling=Scaling.CURRENT, **fields)


def block_scaling(**fields: Any) -> RecipeSpec:
    """Float8BlockScaling: 1x128 blocks for activations and gradients, 128x128 for weights."""
    fields.setdefault("fp8_format", "E4M3")
    fields.setdefault("power_2_scale", True)
    return RecipeSpec(scaling=Scaling.BLOCK, **fields)


DEFAULT_RECIPE = delayed_scaling()


def _unsupported(te_recipe: Any) -> str:
    if getattr(te_recipe, "backward_override", None) is not None:
        return f"backward_override={te_recipe.backward_override!r} is not supported by te_v2"
    if callable(getattr(te_recipe, "amax_compute_algo", None)) or callable(
        getattr(te_recipe, "scaling_factor_compute_algo", None)
    ):
        return "a callable amax_compute_algo or scaling_factor_compute_algo is not supported by te_v2"
    if te_recipe.float8_block_scaling() and (
        te_recipe.x_block_scaling_dim,
        te_recipe.w_block_scaling_dim,
        te_recipe.grad_block_scaling_dim,
    ) != (1, 2, 1):
        return "Float8BlockScaling is supported with its default block shapes (1D x, 2D W, 1D dy) only"
    return ""


def from_te(te_recipe: Any) -> RecipeSpec:
    """Describe a TransformerEngine recipe object."""
    fmt = te_recipe.fp8_format.name if hasattr(te_recipe, "fp8_format") else "E4M3"
    common = {"fp8_format": fmt, "te_recipe": te_recipe}
    if te_recipe.delayed():
        spec = delayed_scaling(
            margin=te_recipe.margin,
            amax_history_len=te_recipe.amax_history_len,
            amax_compute_algo=te_recipe.amax_compute_algo
            if isinstance(te_recipe.amax_compute_algo, str)
            else "callable",
            reduce_amax=te_recipe.reduce_amax,
            **common,
        )
    elif te_recipe.float8_current_scaling() or te_recipe.float8_block_scaling():
        qparams = te_recipe.fp8_quant_fwd_inp
        make = current_scaling if te_recipe.float8_current_scaling() else block_scaling
        spec = make(power_2_scale=qparams.power_2_scale, amax_epsilon=qparams.amax_epsilon, **common)
    elif te_recipe.mxfp8():
        spec = RecipeSpec(scaling=Scaling.MXFP8, **common)
    elif te_recipe.nvfp4():
        spec = RecipeSpec(scaling=Scaling.NVFP4, **common)
    else:
        return RecipeSpec(
            unsupported=f"{type(te_recipe).__name__} is not supported by te_v2", te_recipe=te_recipe
        )
    return replace(spec, unsupported=_unsupported(te_recipe))
