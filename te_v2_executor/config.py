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

    ``min_features``: a linear whose in- or out-features are below it stays out of FP8, by choice:
    no warning, and ``explain`` names the policy. 0 runs every linear TE can run in FP8.

    ``unquantized``: te_v2 still runs the linears the policy keeps out of FP8, in their own dtype
    (plain cuBLAS GEMMs, as Thunder's default path would), so that their unconsumed gradients
    never run and a sum with their output folds into the GEMM: at small token counts the
    torch.compile regions Thunder would wrap them in cost more host time than they save. False
    leaves them to Thunder's default path.

    ``gelu``: te_v2 also takes exact GELUs (``F.gelu``, ``nn.GELU()``), so that one whose output
    only a te_v2 linear reads is computed inside that linear's FP8 quantization, and its backward
    inside the quantization of the gradient; an unfolded one goes back to a fusion executor listed
    after te_v2 when that one could fuse it with a neighbour, and otherwise runs PyTorch's own
    GELU kernels.
    False leaves every GELU to Thunder's other executors.
    """

    min_features: int = DEFAULT_MIN_FEATURES
    unquantized: bool = True
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
