"""FSDP2's FP8 all-gather of the weights te_v2 runs in FP8: half the bytes of a BF16 all-gather.

``fp8_all_gather(model, executor)``, called before ``fully_shard``, wraps the weight of every
``nn.Linear`` that te_v2 would run in FP8 in ``FP8GatheredWeight``, a tensor subclass that FSDP2's
all-gather extension hooks (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) call: each rank
casts its shard to FP8 E4M3 with the scale of the whole weight's amax (at each gather, one
all-reduce for the amaxes of all the wrapped weights of the FSDP2 module gathered; a backward's
gather casts for the forward's recipe and dtype, with the amax of the weight as it is then; one
Triton pass on CUDA: ``backends/gathered_quantize.py``), the all-gather moves the FP8 bytes, and
the gathered weight is the FP8 values times the scale's inverse, in the parameter's dtype (one
Triton pass on CUDA: ``backends/gathered_dequantize.py``), which is what the compiled function is
given.

Under per-tensor current scaling te_v2's cast of that weight makes exactly the FP8 values
gathered, with the same scale: the gathered weight's largest values are the amax itself, so te_v2
finds the same amax, and each other value, an FP8 value times nearly 1, rounds back to itself. So
te_v2 does not cast it: the post-gather hook records the gathered bytes and scale
(``gathered_weights``), and te_v2's forward and its backward's recast of the weight read them
(TE's FP8 transpose makes the dgrad's copy), the amax and cast passes over the whole weight
saved. The FP8 GEMMs are bitwise those of a BF16 all-gather (``tests/distributed``). The cast is
for the dtype te_v2 reads the weight in, FSDP2's mixed-precision ``param_dtype``;
``torch.autocast`` is refused (thunderfx leaves the linears of an autocast region to PyTorch).
Delayed scaling would round the gathered values a second time with another scale, so the hooks
refuse any recipe but per-tensor current scaling, by a ``ValueError`` that names the fix.

What else reads a wrapped weight reads the FP8-rounded values, so only the weight of an
``nn.Linear`` itself (not a subclass, such as attention's output projection, whose weight its
module reads directly), read by no other module (not tied), is wrapped, and only where te_v2
runs that linear in FP8 (its claim policy and TE's shape rules at a token count TE can run). A
wrapped linear that runs outside a compiled function (eagerly, after a graph break, or the model
called without its compiled callable) warns once; a call whose token count TE cannot run falls
back with te_v2's ``TEv2FallbackWarning``, reading the rounded weight.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._prims_common import suggest_memory_format

from te_v2_executor import autocast, checks, gathered_weights
from te_v2_executor.backends import Backend, gathered_dequantize, gathered_quantize
from te_v2_executor.backends.reference import scale_from_amax
from te_v2_executor.dynamo import EagerRunWarning
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
FP8_DTYPE = gathered_dequantize.FP8_DTYPE
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
        # the last forward's recipe and dtype, for the backward's gather
        self._forward: tuple[RecipeSpec, torch.dtype] | None = None
        self._batch: _AmaxBatch | None = None  # the shards whose amaxes are reduced with this one's

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

    def _forward_recipe(self) -> RecipeSpec:
        """The recipe a forward's gather casts for: the pinned one, else ``te.autocast``'s. Refused
        under ``torch.autocast``: thunderfx leaves linears of an autocast region to PyTorch, which
        would compute with the FP8-rounded weight."""
        if torch.is_autocast_enabled(self._tensor.device.type):
            raise ValueError(
                "te_v2's FP8 all-gather does not run under torch.autocast: thunderfx leaves linears "
                "inside an autocast region to PyTorch, which would compute with the FP8-rounded "
                "weights. Compute in bfloat16 with fully_shard(mp_policy=MixedPrecisionPolicy("
                "param_dtype=torch.bfloat16)) instead, or leave fp8_all_gather out"
            )
        recipe = self._recipe
        if recipe is None:
            if autocast.autocast_recipe() is None:
                raise ValueError(
                    "te_v2's FP8 all-gather ran outside te.autocast with a te_v2 executor that pins no "
                    "recipe: pin one with make_te_v2(recipe=current_scaling()), or run the forward "
                    "under te.autocast(recipe=Float8CurrentScaling())"
                )
            recipe = autocast.active_recipe(None)
        if recipe.scaling is not Scaling.CURRENT:
            raise ValueError(_NEEDS_CURRENT.format(scaling=recipe.scaling.value))
        return recipe

    def _cast(self, mesh: Any, mp_policy: Any) -> _Cast:
        """How this gather casts: for the recipe and in the dtype te_v2 will read the weight in
        (FSDP2's mixed-precision ``param_dtype``, else its own) of the last forward (a backward
        runs outside ``te.autocast``), with the whole weight's amax as it is now, in that dtype
        (all-reduced with those of the FSDP2 group, ``_AmaxBatch``): a weight written between
        the forward and the backward is gathered as it now is, as a BF16 gather gathers it."""
        backward = torch._C._current_graph_task_id() != -1  # inside autograd's backward
        if not (backward and self._forward is not None):
            dtype = getattr(mp_policy, "param_dtype", None) or self._tensor.dtype
            self._forward = (self._forward_recipe(), dtype)
        if self._batch is None:
            self._batch = _AmaxBatch.of_group_holding(self)
        return self._batch.cast(self, *self._forward, mesh.get_group())

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's shard in FP8 (as bytes) with the whole weight's scale; the scale's inverse,
        the amax and the FP8 code the amax casts to."""
        cast = self._cast(mesh, mp_policy)
        fp8_max = cast.recipe.fp8_max(forward=True)
        data = gathered_quantize.quantize(self._tensor.detach().to(cast.dtype), cast.scale, fp8_max)
        return (data,), (cast.scale_inv, cast.amax, cast.top)

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
        it the same scale and FP8 values, to the bit (module docstring). FSDP2 frees it with the
        gathered bytes when it reshards."""
        ((data,), (scale_inv, amax, top)) = all_gather_outputs, metadata
        weight = torch.empty(data.shape, dtype=param_dtype, device=data.device) if out is None else out
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(weight):
            gathered_dequantize.dequantize(data, scale_inv, amax, top, out=weight)
        _read_on_current_stream(scale_inv, amax, top)
        if self._batch is not None and _freed_when_this_pass_ends(self._batch.fsdp_group):
            fp8 = gathered_weights.GatheredFP8(data.view(FP8_DTYPE), scale_inv.reshape(1))
            gathered_weights.record(weight, fp8, self._forward[0])
        else:
            gathered_weights.forget(weight)
        return None if out is not None else (weight, (weight,))


def _read_on_current_stream(*tensors: torch.Tensor) -> None:
    """Keep ``tensors``' memory from reuse until the current stream's work so far has run.

    FSDP2 runs ``fsdp_pre_all_gather`` on its all-gather copy-in stream, and frees the metadata it
    made there as soon as ``fsdp_post_all_gather`` returns on the compute stream: without this,
    the next layer's gather could write its own scale into that memory before this layer's
    gathered weight was computed from it.
    """
    for t in tensors:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


_SCALE_INV_ROW = 256  # bytes: a CUDA allocation's alignment, and so every row's


@dataclasses.dataclass(frozen=True)
class _Cast:
    """How a gather casts weights: for ``recipe``, in ``dtype``, with each whole weight's
    ``amax`` (in that dtype, as float32), the ``scale`` it makes, the scale's inverse and the
    amax's FP8 code; one element a shard of a group, or one shard's own (``at``)."""

    recipe: RecipeSpec
    dtype: torch.dtype
    amax: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor
    top: torch.Tensor

    @classmethod
    def of(cls, amaxes: torch.Tensor, recipe: RecipeSpec, dtype: torch.dtype) -> _Cast:
        """The casts of the weights whose reduced amaxes are ``amaxes``. Each scale's inverse
        starts a row of ``_SCALE_INV_ROW`` bytes of its own: TE's GEMMs hand it to cuBLAS as a
        scale pointer, and with the inverses 4 bytes apart the GEMM of every weight but a
        group's first failed as not supported on an H100."""
        amax = amaxes.to(dtype).float()
        fp8_max = recipe.fp8_max(forward=True)
        scale = scale_from_amax(amax, fp8_max, recipe)
        top = (amax * scale).clamp(max=fp8_max).to(FP8_DTYPE).view(torch.uint8)
        rows = torch.empty(len(scale), _SCALE_INV_ROW // 4, dtype=torch.float32, device=scale.device)
        scale_inv = torch.reciprocal(scale, out=rows[:, 0])  # 1.0 / scale, as PyTorch computes it
        return cls(recipe, dtype, amax, scale, scale_inv, top)

    def at(self, index: int) -> _Cast:
        """The cast of the ``index``-th shard."""
        tensors = (self.amax, self.scale, self.scale_inv, self.top)
        return _Cast(self.recipe, self.dtype, *(t[index] for t in tensors))


# the models whose weights fp8_all_gather wrapped, whose FSDP2 groups a first gather checks
_MODELS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _fsdp_group_holding(shard: FP8GatheredWeight) -> tuple[str, Any] | None:
    """The name of the FSDP2 module whose parameter group holds ``shard``, and that group; None
    where FSDP2's private state is not found (another torch)."""
    for model in _MODELS:
        for name, module in model.named_modules():
            state = getattr(module, "_get_fsdp_state", None)
            group = getattr(state() if callable(state) else None, "_fsdp_param_group", None)
            if group is not None and any(_local(p) is shard for p in group.fsdp_params):
                return name, group
    return None


def _local(fsdp_param: Any) -> Any:
    return getattr(fsdp_param.sharded_param, "_local_tensor", None)


def _refuse_what_fsdp2_cannot_gather(name: str, group: Any) -> None:
    """Raise where the FSDP2 module ``name`` shards a wrapped weight along another dimension than
    its rows (``shard_placement_fn``: the hooks cast and gather whole rows), or reshards after the
    forward onto fewer ranks (``fully_shard(reshard_after_forward=<int>)``: FSDP2 would keep the
    gathered FP8 bytes as a parameter); FSDP2 would fail inside its own code."""
    for fsdp_param in group.fsdp_params:
        dim = getattr(getattr(fsdp_param, "fsdp_placement", None), "dim", 0)
        if isinstance(_local(fsdp_param), FP8GatheredWeight) and dim != 0:
            raise ValueError(
                f"te_v2's FP8 all-gather cannot run under fully_shard({name or 'model'}, "
                f"shard_placement_fn=...) sharding a wrapped weight along dim {dim}: it gathers "
                "weights sharded by rows (Shard(0), FSDP2's default). Shard the modules holding the "
                "weights fp8_all_gather wrapped by rows, or leave fp8_all_gather out"
            )
    fewer = getattr(group, "post_forward_mesh_info", None)
    if fewer is not None and fewer != group.mesh_info:  # a reshard onto fewer ranks
        raise ValueError(
            f"te_v2's FP8 all-gather cannot run under fully_shard({name or 'model'}, "
            "reshard_after_forward=<int>): FSDP2 reshards no all-gather extension onto fewer "
            "ranks. Shard the modules holding the weights fp8_all_gather wrapped with "
            "reshard_after_forward=True or False, or leave fp8_all_gather out"
        )


@dataclasses.dataclass(eq=False)
class _AmaxBatch:
    """The wrapped shards one FSDP2 parameter group gathers together, in the order FSDP2 casts
    them: a gather (forward or backward) of the first all-reduces the amaxes of all of them at
    once (one all-reduce a group, not one a weight), and the others', which FSDP2 calls after it
    within the same gather, take theirs. A shard that finds none reduces them all again (FSDP2
    calls every shard of the group at each gather, on every rank alike, so the ranks'
    all-reduces still match), and the first one's next gather reduces them all afresh: no amax
    outlives its gather.
    """

    shards: list[FP8GatheredWeight]
    fsdp_group: Any = None  # FSDP2's parameter group, None where it was not found
    amaxes: torch.Tensor | None = None  # this gather's, all-reduced, one a shard
    untaken: dict[int, int] = dataclasses.field(default_factory=dict)  # shard's index, by id
    casts: dict[tuple[RecipeSpec, torch.dtype], _Cast] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_group_holding(cls, shard: FP8GatheredWeight) -> _AmaxBatch:
        """The batch of the FSDP2 group holding ``shard``, made for all its shards at the first
        one's first gather (what FSDP2 cannot gather so, refused); ``shard`` alone where its group
        is not found."""
        found = _fsdp_group_holding(shard)
        if found is None:
            return cls([shard])
        name, group = found
        _refuse_what_fsdp2_cannot_gather(name, group)
        batch = cls([t for t in map(_local, group.fsdp_params) if isinstance(t, FP8GatheredWeight)], group)
        for member in batch.shards:
            member._batch = batch
        return batch

    def cast(self, shard: FP8GatheredWeight, recipe: RecipeSpec, dtype: torch.dtype, group: Any) -> _Cast:
        """How ``shard`` casts for ``recipe`` in ``dtype``, with the amax of the whole weight it
        is a part of over the ranks of ``group``; the scales are made for all the shards at once,
        at the first that casts for this recipe and dtype in this gather."""
        if shard is self.shards[0] or id(shard) not in self.untaken:
            tensors = [s._tensor.detach() for s in self.shards]
            amaxes = torch.stack(torch._foreach_norm(tensors, float("inf"))).float()
            torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
            self.amaxes, self.casts = amaxes, {}
            self.untaken = {id(s): i for i, s in enumerate(self.shards)}
        casts = self.casts.get((recipe, dtype))
        if casts is None:
            casts = self.casts[recipe, dtype] = _Cast.of(self.amaxes, recipe, dtype)
        return casts.at(self.untaken.pop(id(shard)))


def _freed_when_this_pass_ends(group: Any) -> bool:
    """Whether FSDP2 gathers ``group``'s weights for the forward or backward it runs now and
    frees them when that pass ends (it reshards after it). Only the bytes of such a gather are
    read in place of the weight: no write outside the pass, not even one through ``.data``
    (peft's ``merge_adapter``), which moves no version counter, can reach the weight while they
    are kept. A gather of an explicit ``unshard()``, or of a module that keeps its weights
    gathered after the pass (``reshard_after_forward=False``, ``set_reshard_after_backward
    (False)``), is cast as usual. Reads FSDP2's private state; where it is not found, False."""
    state = getattr(getattr(group, "_training_state", None), "name", None)
    backward = torch._C._current_graph_task_id() != -1  # a checkpoint's recompute included
    if state == "FORWARD" and not backward:
        return getattr(group, "post_forward_mesh_info", None) is not None
    if state in ("FORWARD", "PRE_BACKWARD"):
        return getattr(group, "reshard_after_backward", False) is True
    return False


# a checkpoint of a wrapped model (torch.save, torch.distributed.checkpoint) loads with weights_only
torch.serialization.add_safe_globals([FP8GatheredWeight, RecipeSpec, Scaling])


def _eligible(linear: torch.nn.Linear, executor: TEv2Executor, world_size: int) -> bool:
    """Whether te_v2 runs ``linear`` in FP8 at a token count TE can run, and FSDP2 shards its
    weight evenly over ``world_size`` ranks."""
    w, config = linear.weight, executor.config
    # TE runs on CUDA: a model still on the meta device or the CPU is sharded before it moves
    device = "cuda" if config.backend is Backend.TE else w.device.type
    cuda = device == "cuda" and torch.cuda.is_available()
    operands = checks.LinearOperands(
        x_shape=(checks.SHAPE_DIVISOR[Scaling.CURRENT], w.shape[1]),
        w_shape=tuple(w.shape),
        bias_shape=None if linear.bias is None else tuple(linear.bias.shape),
        dtypes=tuple(t.dtype for t in (w, linear.bias) if t is not None),
        device_type=device,
        compute_capability=torch.cuda.get_device_capability() if cuda else None,
    )
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
        if (
            type(module) is not torch.nn.Linear
            or uses[id(w)] != 1
            or not _eligible(module, executor, world_size)
        ):
            continue
        module.weight = torch.nn.Parameter(FP8GatheredWeight(w.data, executor.config.recipe), w.requires_grad)
        qualified = f"{name}.weight" if name else "weight"
        module.register_forward_pre_hook(_refuse_unsharded(qualified))
        module.register_forward_pre_hook(_gathered_outside_compiled(qualified))
        module.register_state_dict_post_hook(_plain_in_state_dict)
        wrapped.append(qualified)
    _MODELS.add(model)
    return wrapped


def _plain_in_state_dict(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, _: Any) -> None:
    """A state dict post-hook: a wrapped weight as the tensor inside the wrapper (a DTensor over
    it where FSDP2 shards it), so that what reads a state dict (safetensors, ``save_pretrained``,
    a model without ``fp8_all_gather``) gets a plain tensor; one rank's full state dict kept the
    wrapper. Loading copies into the wrapper, and a checkpoint loads in place, as before."""
    key = prefix + "weight"
    value = state_dict.get(key)
    local = getattr(value, "_local_tensor", value)
    if not isinstance(local, FP8GatheredWeight):
        return
    if local is value:
        state_dict[key] = local.unwrap()
        return
    from torch.distributed.tensor import DTensor

    state_dict[key] = DTensor.from_local(
        local.unwrap(),
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def _refuse_unsharded(name: str) -> Any:
    """A forward pre-hook that refuses a wrapped linear FSDP2 never sharded: its weight is still
    the wrapper."""

    def hook(module: torch.nn.Module, args: Any) -> None:
        if isinstance(module.weight, FP8GatheredWeight):  # FSDP2 registers the gathered weight
            raise ValueError(
                f"te_v2: {name} was wrapped by fp8_all_gather but is not sharded: call fully_shard "
                "on the model (or its blocks) after fp8_all_gather, or leave fp8_all_gather out"
            )

    return hook


def _gathered_outside_compiled(name: str) -> EagerRunWarning:
    """The warning of a wrapped linear run eagerly: on the FP8-rounded weight it gathers, without
    te_v2 (in a compiled function the warning is traced away)."""
    return EagerRunWarning(
        f"te_v2: {name}, gathered in FP8 by fp8_all_gather, runs outside a compiled function "
        "(eagerly, after a graph break, or the model called instead of its compiled callable), "
        "so on its FP8-rounded weight without te_v2: call the compiled model, or leave this "
        "linear out of fp8_all_gather"
    )
