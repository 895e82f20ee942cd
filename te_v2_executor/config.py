"""The settings of a te_v2 executor: frozen values, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field

from te_v2_executor.backends import Backend
from te_v2_executor.recipes import RecipeSpec

# Chosen by measurement (docs/performance.md, "Claim policy"): on an H200, LoRA adapters of rank
# 16 to 256 on Llama-3-8B MLPs made the step faster in BF16 than in FP8, whose quantization
# passes cost more than FP8 GEMMs save on so thin a matmul.
DEFAULT_MIN_FEATURES = 512


@dataclass(frozen=True)
class ClaimPolicy:
    """Which linears TE could run te_v2 takes.

    ``min_features``: a linear whose in- or out-features are below it stays on Thunder's default
    path, by choice: no warning, a "claim policy" fallback in ``explain``. 0 claims every linear
    TE can run.

    ``gelu``: te_v2 also takes exact GELUs (``F.gelu``, ``nn.GELU()``), so that one whose output
    only a te_v2 linear reads is computed inside that linear's FP8 quantization, and its backward
    inside the quantization of the gradient; an unfused one runs PyTorch's own GELU kernels.
    False leaves every GELU to Thunder's other executors.
    """

    min_features: int = DEFAULT_MIN_FEATURES
    gelu: bool = True


@dataclass(frozen=True)
class TEv2Config:
    """Everything that distinguishes one te_v2 executor from another.

    ``recipe``: None follows ``te.autocast`` (DelayedScaling outside it); a ``RecipeSpec`` pins
    every trace of this executor to that recipe.
    """

    backend: Backend = Backend.TE
    recipe: RecipeSpec | None = None
    claim: ClaimPolicy = field(default_factory=ClaimPolicy)
