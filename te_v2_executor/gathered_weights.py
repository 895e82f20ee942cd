"""The FP8 bytes FSDP2 gathered for a weight (``fsdp.py``), found again by the weight te_v2 reads.

``fp8_all_gather``'s hooks give FSDP2 the gathered weight in the parameter's dtype, which is what
a compiled function receives; they ``record`` here the FP8 bytes and the scale's inverse that
weight was made from. te_v2's forward (and a backward's recast of the weight) ``find`` them by
the weight it is given and builds its FP8 weight from those bytes instead of casting the weight
again: under per-tensor current scaling that cast makes exactly them (``fsdp.py``).

The hooks record only a gather FSDP2 frees when the forward or backward that made it ends, and
forget the weight otherwise (an explicit ``unshard()``, a module not resharded after the pass):
a write that moves no version counter (through ``.data``, as peft's ``merge_adapter`` writes)
then has no window outside that pass. Within it, such a write (a backward hook's, say) is not
seen, as te_v2 does not see one into a weight whose FP8 copy its forward saved. A weight
matches only while it is the tensor the hooks wrote, unchanged since: the same storage, offset,
shape, strides and dtype; its version counter where the hooks left it (an in-place write moves
it); its storage not yet freed by FSDP2's reshard; and read under the recipe it was cast with.
Anything else casts the weight as usual.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from te_v2_executor.recipes import RecipeSpec, Scaling


@dataclasses.dataclass(frozen=True)
class GatheredFP8:
    """A whole weight as FSDP2 gathered it: ``data`` (float8, the weight's shape) times
    ``scale_inv`` (float32, one value, shape (1,)) is the weight."""

    data: torch.Tensor
    scale_inv: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Record:
    weight: weakref.ref
    layout: tuple[Any, ...]
    version: int
    recipe: RecipeSpec
    fp8: GatheredFP8


# by the address of the weight's storage (its StorageImpl), alive while the weight is
_RECORDS: dict[int, _Record] = {}


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def record(weight: torch.Tensor, fp8: GatheredFP8, recipe: RecipeSpec) -> None:
    """Remember that ``weight``, as it is now, is ``fp8`` cast under ``recipe``."""
    key = weight.untyped_storage()._cdata

    def forget(dead: weakref.ref) -> None:
        found = _RECORDS.get(key)
        if found is not None and found.weight is dead:
            del _RECORDS[key]

    _RECORDS[key] = _Record(weakref.ref(weight, forget), _layout(weight), weight._version, recipe, fp8)


def forget(weight: torch.Tensor) -> None:
    """Drop what was recorded of ``weight``: its values are no longer those bytes' to read."""
    _RECORDS.pop(weight.untyped_storage()._cdata, None)


def find(w: torch.Tensor, recipe: RecipeSpec) -> GatheredFP8 | None:
    """The gathered FP8 bytes ``w`` is still exactly made of, for a cast under ``recipe``; None
    where there are none (module docstring), or while a CUDA graph is captured (its replays would
    read bytes FSDP2 has since freed)."""
    if not _RECORDS or recipe.scaling is not Scaling.CURRENT or w.is_inference():
        return None
    found = _RECORDS.get(w.untyped_storage()._cdata)
    if (
        found is None
        or found.weight() is None
        or found.recipe != recipe
        or found.version != w._version
        or found.layout != _layout(w)
        or found.fp8.data.untyped_storage().nbytes() == 0
    ):
        return None
    if w.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return found.fp8
