"""Everything te_v2 reads of ``te.autocast``: the recipe a linear traced now uses, the amax
reduction group a flush all-reduces over, and the prologue guard that retraces when the recipe
changes.

TransformerEngine keeps the enclosing ``te.autocast``'s settings in ``FP8GlobalStateManager``;
without TransformerEngine (the reference backend on a CPU) there is no autocast to read, and
these answer as outside one.
"""

from __future__ import annotations

import functools
from typing import Any

from te_v2_executor import backends
from te_v2_executor.backends import Backend
from te_v2_executor.recipes import DEFAULT_RECIPE, RecipeSpec, from_te


@functools.cache
def _global_state() -> Any:
    """TransformerEngine's ``FP8GlobalStateManager``, None without TransformerEngine."""
    if not backends.te_available():
        return None
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return FP8GlobalStateManager


def autocast_recipe() -> Any:
    """The recipe object of the enclosing ``te.autocast`` if FP8 is enabled there, else None."""
    manager = _global_state()
    if manager is None or not manager.is_fp8_enabled():
        return None
    return manager.get_fp8_recipe()


def active_recipe(configured: RecipeSpec | None) -> RecipeSpec:
    """The recipe a linear traced now uses.

    An executor configured with a recipe always uses it; otherwise the recipe of the enclosing
    ``te.autocast`` when FP8 is enabled there, otherwise DelayedScaling with TE's defaults.
    """
    if configured is not None:
        return configured
    te_recipe = autocast_recipe()
    return DEFAULT_RECIPE if te_recipe is None else from_te(te_recipe)


def amax_group(backend: Backend) -> Any:
    """The amax reduction group given to the enclosing ``te.autocast`` (None: torch.distributed's
    default group). The reference backend has no autocast, so it always reduces over the default."""
    manager = _global_state() if backend is Backend.TE else None
    return None if manager is None else manager.get_fp8_group()


class RecipeGuard:
    """Tells, in a compiled function's prologue, whether ``te.autocast``'s recipe is still the
    one its trace was made with; a mismatch makes Thunder retrace instead of reusing it."""

    def current_signature(self) -> str:
        """What identifies the recipe of the enclosing ``te.autocast`` (None outside one)."""
        return repr(autocast_recipe())
