"""The settings of a te_v2 executor: frozen values, checked when made, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field

from te_v2_executor.backends import Backend
from te_v2_executor.recipes import RecipeSpec

# Chosen by measurement (docs/performance.md, "Claim policy"): on an H200, LoRA adapters of rank
# 16 to 256 on Llama-3-8B MLPs made the step faster in BF16 than in FP8, whose quantization
# passes cost more than FP8 GEMMs save on so thin a matmul.
DEFAULT_MIN_FEATURES = 512


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"te_v2: {message}")


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

    ``silu``: te_v2 also takes SiLUs (``F.silu``, ``nn.SiLU()``), so that a SwiGLU,
    ``silu(gate) * up``, whose output only a te_v2 linear reads (Llama's MLP) is computed inside
    that linear's FP8 quantization, and its backward inside the quantizations of the gate's and
    up's gradients; an unfolded SiLU goes where an unfolded GELU goes. False leaves every SiLU to
    Thunder's other executors.
    """

    min_features: int = DEFAULT_MIN_FEATURES
    unquantized: bool = True
    gelu: bool = True
    silu: bool = True

    def __post_init__(self) -> None:
        _require(
            isinstance(self.min_features, int)
            and not isinstance(self.min_features, bool)
            and self.min_features >= 0,
            f"ClaimPolicy(min_features={self.min_features!r}) must be a whole number of features, "
            f"0 or more (0 claims every linear TE can run; the default is {DEFAULT_MIN_FEATURES})",
        )
        for name in ("unquantized", "gelu", "silu"):
            value = getattr(self, name)
            _require(isinstance(value, bool), f"ClaimPolicy({name}={value!r}) must be True or False")


@dataclass(frozen=True)
class TEv2Config:
    """Everything that distinguishes one te_v2 executor from another.

    ``recipe``: None follows ``te.autocast`` (DelayedScaling outside it); a ``RecipeSpec`` pins
    every trace of this executor to that recipe.

    ``skip_passes``: names of optional passes of ``te_v2_executor.passes.PIPELINE`` (the folds) not
    to run, to tell whether one of them is behind a difference in numerics or speed; the
    results stay correct without them, only slower.
    """

    backend: Backend = Backend.TE
    recipe: RecipeSpec | None = None
    claim: ClaimPolicy = field(default_factory=ClaimPolicy)
    skip_passes: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        _require(
            isinstance(self.backend, Backend),
            f"TEv2Config(backend={self.backend!r}) must be a te_v2_executor.Backend "
            "(make_te_v2(backend='te' or 'reference') converts a string)",
        )
        _require(
            self.recipe is None or isinstance(self.recipe, RecipeSpec),
            f"TEv2Config(recipe={self.recipe!r}) must be None (follow te.autocast) or a RecipeSpec "
            "such as te_v2_executor.delayed_scaling(); a TransformerEngine recipe object is given "
            "to te.autocast(recipe=...) instead",
        )
        _require(
            isinstance(self.claim, ClaimPolicy),
            f"TEv2Config(claim={self.claim!r}) must be a te_v2_executor.ClaimPolicy",
        )
        _require(
            isinstance(self.skip_passes, frozenset) and all(isinstance(n, str) for n in self.skip_passes),
            f"TEv2Config(skip_passes={self.skip_passes!r}) must be a frozenset of pass names",
        )
