"""The settings of a te_v2 executor: frozen values, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field

from te_v2_executor.backends import Backend
from te_v2_executor.recipes import RecipeSpec


@dataclass(frozen=True)
class ClaimPolicy:
    """Which eligible linears te_v2 takes.

    ``min_features``: a linear whose in- or out-features are below it stays on Thunder's default
    path (matmuls that small, such as rank-16 LoRA adapters, lose more to quantization than FP8
    GEMMs gain). 0 claims every linear TE can run.
    """

    min_features: int = 0


@dataclass(frozen=True)
class TEv2Config:
    """Everything that distinguishes one te_v2 executor from another.

    ``recipe``: None follows ``te.autocast`` (DelayedScaling outside it); a ``RecipeSpec`` pins
    every trace of this executor to that recipe.
    """

    backend: Backend = Backend.TE
    recipe: RecipeSpec | None = None
    claim: ClaimPolicy = field(default_factory=ClaimPolicy)
