"""Can te_v2 run this linear, and if not, which rule says no: decided once per linear.

Each rule returns the empty string when the linear passes, or the rule it breaks, phrased so a
fallback warning or the explain report can quote it. Capability rules say what te_v2 cannot run
(a user should hear about those); the claim policy says what it chooses not to run. ``decide``
applies them and remembers the ``Decision``, which the checker, the grad transform, the fallback
warnings and the report all read. The rules are pure; ``operands`` reads the CUDA device's
compute capability, and ``decide`` memoizes. Nothing here warns.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy

from te_v2_executor.backends import Backend
from te_v2_executor.config import ClaimPolicy
from te_v2_executor.recipes import RecipeSpec, Scaling

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Divisor every GEMM dimension (tokens, in-features, out-features) must have, per scaling mode.
# Per-tensor FP8 on Hopper needs 16 for all three GEMMs (TE's own check_dim_for_fp8_exec looks at
# the forward only); block scaling quantizes in 128-wide blocks along both dimensions.
SHAPE_DIVISOR = {
    Scaling.DELAYED: 16,
    Scaling.CURRENT: 16,
    Scaling.BLOCK: 128,
    Scaling.MXFP8: 32,
    Scaling.NVFP4: 128,
}
BLACKWELL_ONLY = (Scaling.MXFP8, Scaling.NVFP4)


@dataclass(frozen=True)
class LinearOperands:
    """The facts of one linear call the checks look at."""

    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    bias_shape: tuple[int, ...] | None
    dtypes: tuple[torch.dtype, ...]  # x, w[, bias]
    device_type: str  # "cuda", "cpu", ...
    compute_capability: tuple[int, int] | None  # of the CUDA device, None elsewhere

    @property
    def tokens(self) -> int:
        return math.prod(self.x_shape[:-1])

    def describe(self) -> str:
        dtype = str(self.dtypes[0]).removeprefix("torch.")
        bias = "" if self.bias_shape is None else " with bias"
        return f"x{list(self.x_shape)} @ W{list(self.w_shape)}^T{bias} ({dtype}, {self.device_type})"


def operands(x: TensorProxy, w: TensorProxy, bias: TensorProxy | None) -> LinearOperands:
    """The facts of a traced linear the checks need."""
    device = x.device.devicetype.name.lower()
    capability = None
    if device == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(x.device.index or 0)
    return LinearOperands(
        x_shape=tuple(x.shape),
        w_shape=tuple(w.shape),
        bias_shape=None if bias is None else tuple(bias.shape),
        dtypes=tuple(dtypes.to_torch_dtype(t.dtype) for t in (x, w, bias) if t is not None),
        device_type=device,
        compute_capability=capability,
    )


def _check_device(op: LinearOperands, backend: Backend) -> str:
    if backend is Backend.TE and op.device_type != "cuda":
        return f"TransformerEngine runs on CUDA tensors only (got {op.device_type})"
    return ""


def _check_dtypes(op: LinearOperands) -> str:
    if op.dtypes[0] not in SUPPORTED_DTYPES:
        return f"FP8 linears take float32, bfloat16 or float16 inputs (got {op.dtypes[0]})"
    if any(d != op.dtypes[0] for d in op.dtypes):
        return f"input, weight and bias must share one dtype (got {', '.join(map(str, op.dtypes))})"
    return ""


def _check_recipe(op: LinearOperands, recipe: RecipeSpec, backend: Backend) -> str:
    if recipe.unsupported:
        return recipe.unsupported
    if recipe.scaling in BLACKWELL_ONLY:
        if backend is Backend.REFERENCE:
            return f"the reference backend does not emulate {recipe.scaling.value}"
        if op.compute_capability is not None and op.compute_capability < (10, 0):
            return f"{recipe.scaling.value} recipes need a Blackwell GPU (sm_100+), this one is sm_{op.compute_capability[0]}{op.compute_capability[1]}"
    return ""


def _check_shapes(op: LinearOperands, recipe: RecipeSpec) -> str:
    if len(op.w_shape) != 2 or len(op.x_shape) < 2:
        return "te_v2 takes a 2-D weight and an input of shape (*, in_features) with at least one leading dim"
    divisor = SHAPE_DIVISOR[recipe.scaling]
    dims = {"tokens": op.tokens, "in_features": op.w_shape[1], "out_features": op.w_shape[0]}
    bad = [f"{name}={value}" for name, value in dims.items() if value % divisor]
    if bad:
        return f"{recipe.scaling.value}-scaled FP8 GEMMs need tokens, in_features and out_features divisible by {divisor} ({', '.join(bad)})"
    return ""


def policy_rule_broken(op: LinearOperands, policy: ClaimPolicy) -> str:
    """Why te_v2 keeps ``op`` out of FP8 by choice, or "" if it does not: an empty GEMM, which has
    nothing to quantize (a batch of no tokens), or a linear the claim policy finds too small."""
    empty = {"tokens": op.tokens, "in_features": op.w_shape[-1], "out_features": op.w_shape[0]}
    if zero := [name for name, value in empty.items() if value == 0]:
        return f"an empty GEMM ({', '.join(f'{name}=0' for name in zero)}) has nothing to quantize"
    smallest = min(op.w_shape)
    if smallest < policy.min_features:
        return f"claim policy: min(in_features, out_features)={smallest} is below min_features={policy.min_features}, too small to gain from FP8"
    return ""


def capability_rule_broken(op: LinearOperands, recipe: RecipeSpec, backend: Backend) -> str:
    """The first rule that stops te_v2 from running ``op`` with ``recipe`` on ``backend``, or ""."""
    for reason in (
        _check_device(op, backend),
        _check_dtypes(op),
        _check_recipe(op, recipe, backend),
        _check_shapes(op, recipe),
    ):
        if reason:
            return reason
    return ""


@dataclass(frozen=True)
class Decision:
    """How te_v2 runs one linear: ``rule`` is "" for FP8, else the rule that keeps it out of FP8;
    ``by_policy`` says that rule is the claim policy's choice (the linear may run unquantized)
    rather than something te_v2 cannot run (it falls back to Thunder's default path)."""

    operands: LinearOperands
    rule: str
    by_policy: bool

    @property
    def fp8(self) -> bool:
        """Whether te_v2 runs the linear in FP8."""
        return not self.rule


@functools.lru_cache(maxsize=4096)
def decide(op: LinearOperands, recipe: RecipeSpec, backend: Backend, policy: ClaimPolicy) -> Decision:
    """The decision for ``op``: the capability rules first, then the claim policy."""
    rule = capability_rule_broken(op, recipe, backend)
    if rule:
        return Decision(op, rule, by_policy=False)
    rule = policy_rule_broken(op, policy)
    return Decision(op, rule, by_policy=bool(rule))
