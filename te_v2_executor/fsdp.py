"""FSDP2's FP8 all-gather of the weights te_v2 runs in FP8: half the bytes of a BF16 all-gather.

``fp8_all_gather(model, executor)``, called before ``fully_shard``, wraps the weight of every
``nn.Linear`` that te_v2 would run in FP8 in ``FP8GatheredWeight``, a tensor subclass that FSDP2's
all-gather extension hooks (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) call: each rank
casts its shard to FP8 E4M3 with the scale of the whole weight's amax (one all-reduce of the
shards' amaxes, or none after ``precompute_fp8_all_gather_scales``), the all-gather moves the FP8
bytes, and the gathered weight is the FP8 values times the scale's inverse, in the parameter's
dtype, which is what the forward and backward read.

Under per-tensor current scaling te_v2 then casts that weight to exactly the FP8 values gathered:
its amax is the whole weight's (the largest value maps onto the format's largest, which gathers
exactly), so its scale is the same to the last bit or two, and each value, an FP8 value times
nearly 1, rounds back to itself. The FP8 GEMMs are therefore bitwise those of a BF16 all-gather
(``tests/distributed``); te_v2 still casts the gathered weight again, an elementwise pass this
does not save yet. Delayed scaling would round the gathered values a second time with another
scale, so the hooks refuse any recipe but per-tensor current scaling, by a ``ValueError`` that
names the fix.

What else reads a wrapped weight reads the FP8-rounded values, so only weights read by nothing
but their ``nn.Linear`` are wrapped (not tied ones), and only where te_v2 runs that linear in FP8
(its claim policy and TE's shape rules at a token count TE can run); a call whose token count TE
cannot run falls back with te_v2's ``TEv2FallbackWarning``, reading the rounded weight.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._prims_common import suggest_memory_format

from te_v2_executor import autocast, checks
from te_v2_executor.backends.reference import scale_from_amax
from te_v2_executor.executor import TEv2Executor, te_v2
from te_v2_executor.recipes import RecipeSpec, Scaling

# what FSDP2 does to a parameter while it shards it and its optimizer steps: these keep the wrapper
_PRESERVED = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
}
FP8_DTYPE = torch.float8_e4m3fn
_NEEDS_CURRENT = (
    "te_v2's FP8 all-gather needs per-tensor current scaling, got {scaling} scaling: the gathered "
    "FP8 weight would be rounded again with another scale. Use make_te_v2(recipe=current_scaling()) "
    "or te.autocast(recipe=Float8CurrentScaling()), or leave fp8_all_gather out to gather in BF16"
)


class FP8GatheredWeight(torch.Tensor):
    """A weight (or its shard) that FSDP2 all-gathers in FP8; every other op sees the tensor inside.

    ``recipe``: the pinned recipe of the te_v2 executor that runs the weight's linear, or None to
    read ``te.autocast``'s at each gather in the forward (and reuse it in the backward's).
    """

    _tensor: torch.Tensor
    _recipe: RecipeSpec | None

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, recipe: RecipeSpec | None) -> FP8GatheredWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            memory_format=suggest_memory_format(tensor),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, recipe: RecipeSpec | None) -> None:
        self._tensor = tensor
        self._recipe = recipe
        self._gathered_with: RecipeSpec | None = None  # the recipe of the last forward's gather
        self._amax: tuple[torch.Tensor, int] | None = None  # the whole weight's amax, at a version

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        recipes = []

        def unwrap(t: FP8GatheredWeight) -> torch.Tensor:
            recipes.append(t._recipe)
            return t._tensor

        args, kwargs = pytree.tree_map_only(FP8GatheredWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: FP8GatheredWeight(t, recipes[0]), out)

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["_tensor"], {"recipe": self._recipe}

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], meta: dict[str, Any], outer_size: Any, outer_stride: Any
    ) -> FP8GatheredWeight:
        return FP8GatheredWeight(inner["_tensor"], meta["recipe"])

    def __repr__(self) -> str:
        return f"FP8GatheredWeight({self._tensor!r})"

    def unwrap(self) -> torch.Tensor:
        """The tensor inside: the weight's (or shard's) own values, unrounded."""
        return self._tensor

    def _gather_recipe(self) -> RecipeSpec:
        """The recipe this gather casts for, checked: per-tensor current scaling only."""
        te_recipe = autocast.autocast_recipe()
        if self._recipe is not None:
            recipe = self._recipe
        elif te_recipe is not None:
            recipe = self._gathered_with = autocast.active_recipe(None)
        elif self._gathered_with is not None:  # the backward's gather, outside te.autocast
            recipe = self._gathered_with
        else:
            raise ValueError(
                "te_v2's FP8 all-gather ran outside te.autocast with a te_v2 executor that pins no "
                "recipe: pin one with make_te_v2(recipe=current_scaling()), or run the forward under "
                "te.autocast(recipe=Float8CurrentScaling())"
            )
        if recipe.scaling is not Scaling.CURRENT:
            raise ValueError(_NEEDS_CURRENT.format(scaling=recipe.scaling.value))
        return recipe

    def _whole_amax(self, group: Any, dtype: torch.dtype) -> torch.Tensor:
        """The amax of the whole weight in ``dtype`` (rounding keeps the order of magnitudes, so
        it is the rounded amax): precomputed for this version of the shard, or reduced now."""
        if self._amax is not None and self._amax[1] == self._tensor._version:
            amax = self._amax[0]
        else:
            amax = self._tensor.detach().abs().amax().float()
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
        return amax.to(dtype).float()

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's shard in FP8 (as bytes) with the whole weight's scale, of the values in the
        dtype FSDP2 gathers (its mixed-precision ``param_dtype``); the scale's inverse, the amax
        and the FP8 value the amax casts to."""
        recipe = self._gather_recipe()
        fp8_max = recipe.fp8_max(forward=True)
        dtype = getattr(mp_policy, "param_dtype", None) or self._tensor.dtype
        amax = self._whole_amax(mesh.get_group(), dtype)
        scale = scale_from_amax(amax, fp8_max, recipe)
        shard = self._tensor.detach().to(dtype)
        data = (shard.float() * scale).clamp(-fp8_max, fp8_max).to(FP8_DTYPE)
        top = (amax * scale).clamp(max=fp8_max).to(FP8_DTYPE).float()
        return (data.view(torch.uint8),), (1.0 / scale, amax, top)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The gathered weight in ``param_dtype``: each FP8 value times the scale's inverse, and
        the largest ones the amax itself, so that te_v2's cast of it finds the same amax, and with
        it the same scale, to the bit. FSDP2 frees it with the gathered bytes when it reshards."""
        ((data,), (scale_inv, amax, top)) = all_gather_outputs, metadata
        q = data.view(FP8_DTYPE).float()
        values = torch.where(q.abs() == top, torch.copysign(amax, q), q * scale_inv)
        if out is None:
            weight = values.to(param_dtype)
            return weight, (weight,)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
            out.copy_(values)
        return None


# a checkpoint of a wrapped model (torch.save, torch.distributed.checkpoint) loads with weights_only
torch.serialization.add_safe_globals([FP8GatheredWeight, RecipeSpec, Scaling])


def _eligible(linear: torch.nn.Linear, executor: TEv2Executor, world_size: int) -> bool:
    """Whether te_v2 runs ``linear`` in FP8 at a token count TE can run, and FSDP2 shards its
    weight evenly over ``world_size`` ranks."""
    w = linear.weight
    cuda = w.device.type == "cuda" and torch.cuda.is_available()
    operands = checks.LinearOperands(
        x_shape=(checks.SHAPE_DIVISOR[Scaling.CURRENT], w.shape[1]),
        w_shape=tuple(w.shape),
        bias_shape=None if linear.bias is None else tuple(linear.bias.shape),
        dtypes=tuple(t.dtype for t in (w, linear.bias) if t is not None),
        device_type=w.device.type,
        compute_capability=torch.cuda.get_device_capability(w.device) if cuda else None,
    )
    config = executor.config
    recipe = config.recipe or RecipeSpec(scaling=Scaling.CURRENT)
    decision = checks.decide(operands, recipe, config.backend, config.claim)
    return decision.fp8 and w.shape[0] % world_size == 0


def fp8_all_gather(
    model: torch.nn.Module, executor: TEv2Executor = te_v2, *, world_size: int | None = None
) -> list[str]:
    """Make FSDP2 gather in FP8 the weights of ``model``'s linears that ``executor`` runs in FP8.

    Call it before ``fully_shard``; ``world_size`` is the number of ranks FSDP2 shards over (by
    default torch.distributed's world). A weight is wrapped where it belongs to one
    ``nn.Linear`` only (a tied weight, which another module reads, stays in BF16), te_v2 runs that
    linear in FP8 and its rows divide evenly among the ranks. Returns the names of the wrapped
    weights. Each gather needs per-tensor current scaling (module docstring).
    """
    recipe = executor.config.recipe
    if recipe is not None and recipe.scaling is not Scaling.CURRENT:
        raise ValueError(_NEEDS_CURRENT.format(scaling=recipe.scaling.value))
    if world_size is None:
        world_size = torch.distributed.get_world_size()
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    wrapped = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or isinstance(module.weight, FP8GatheredWeight):
            continue
        w = module.weight
        if hasattr(w, "device_mesh"):
            raise ValueError(
                f"fp8_all_gather: {name}.weight is sharded already; call fp8_all_gather(model, ...) "
                "before fully_shard, which then shards the wrapped weights"
            )
        if uses[id(w)] != 1 or not _eligible(module, executor, world_size):
            continue
        module.weight = torch.nn.Parameter(FP8GatheredWeight(w.data, executor.config.recipe), w.requires_grad)
        wrapped.append(f"{name}.weight" if name else "weight")
    return wrapped


@torch.no_grad()
def precompute_fp8_all_gather_scales(model: torch.nn.Module) -> None:
    """The whole-weight amax of every FP8-gathered weight of ``model``, in one all-reduce, for
    the next gathers: call it after the optimizer's step. A shard written after it (its version
    moves) is reduced again at its gather."""
    shards: collections.defaultdict[Any, list[FP8GatheredWeight]] = collections.defaultdict(list)
    for p in model.parameters():
        local = getattr(p, "_local_tensor", None)  # FSDP2's shard itself, which its gathers read
        if isinstance(local, FP8GatheredWeight):
            shards[p.device_mesh.get_group()].append(local)
    for group, found in shards.items():
        amaxes = torch.stack([s._tensor.abs().amax().float() for s in found])
        torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
        for shard, amax in zip(found, amaxes.unbind(), strict=True):
            shard._amax = (amax, shard._tensor._version)
