"""Quantization-state bookkeeping: who owns amax/scale state, and the once-per-pass flush.

Each linear call site of a compiled function owns one ``LinearQuantState`` (forward quantizers
for x and W, a backward one for dy). It is keyed by a ``StateKey``: the trace input its weight
derives from, the call's ordinal among the linears of that weight, the recipe and the backend,
none of which depend on the proxy names a retrace shifts; so a retrace (``eval()``, autocast,
freezing a weight, a new batch shape or grad mode) keeps the delayed-scaling history, as a
``te.Linear`` module would. The forward and its checkpoint recompute share the object.
``quantization_state_dict`` and ``load_quantization_state_dict`` save and restore the delayed
scaling tensors under string names made of the key.

A ``SyncGroup`` is what one sync symbol flushes: all delayed-scaling states of one direction of
one trace, updated with one concatenation, at most one all-reduce and one fused update. Inside a
``quantization_update_scope`` the flushes are held back and done once when it exits.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import thunder
import torch

from te_v2_executor import autocast, backends
from te_v2_executor.backends import Backend
from te_v2_executor.backends.common import KernelBackend
from te_v2_executor.compiled import PerFunction, compiled_functions
from te_v2_executor.recipes import RecipeSpec


class StateKey(NamedTuple):
    """What identifies a linear's state across the retraces of one compiled function.

    ``source``: the trace input the weight derives from through single-tensor-input ops (casts,
    views, slices), or the trace inputs one computed from several reads, as ``explain`` names it
    (``passes._trace.source_name``); ``ordinal``: the call's position among the linears
    of that trace whose weight has that source, in trace order (a weight used twice, or sliced in
    two, has two states).
    """

    source: str
    ordinal: int
    recipe: RecipeSpec
    backend: Backend

    @property
    def site(self) -> str:
        """``"{source}.{ordinal}"``, the start of the state's names in a state dict."""
        return f"{self.source}.{self.ordinal}"


# The delayed-scaling tensors of a state, by their names in a state dict ("forward.scale"): the
# direction (forward: the columns of x and W; backward: dy's), then the tensor.
_DIRECTIONS = {"forward": True, "backward": False}
_TENSORS = ("amax_history", "scale")


class LinearQuantState:
    """Quantization state of one linear call site; backend scaling states are made lazily on
    the device of the first call.

    ``name``: the weight's proxy, or for a state of the registry the trace input the weight derives
    from. ``key`` is None for the provisional state the lowering gives a linear when it is traced;
    the ``states`` pass (``passes/states.py``) swaps it for the registry's state of its key.
    """

    def __init__(self, name: str, recipe: RecipeSpec, backend: Backend, key: StateKey | None = None) -> None:
        self.name = name
        self.key = key
        self.recipe = recipe
        self.backend = backend
        self.amax_group: Any = None  # the amax reduction group seen by the last forward flush
        self._forward = None
        self._backward = None
        self._replays: dict[torch.device, Any] = {}
        self._loaded: dict[bool, dict[str, torch.Tensor]] = {}  # held until the scaling is made

    def __repr__(self) -> str:
        site = self.name if self.key is None else self.key.site
        return f"LinearQuantState({site}, {self.recipe.scaling.value}, {self.backend.value})"

    @functools.cached_property
    def numerics(self) -> KernelBackend:
        """The backend module the te_v2 symbols of this linear call (one cached lookup)."""
        return backends.load(self.backend)

    def forward_scaling(self, device: torch.device) -> Any:
        if self._forward is None:
            self._forward = self._new_scaling(forward=True, device=device)
        return self._forward

    def backward_scaling(self, device: torch.device) -> Any:
        if self._backward is None:
            self._backward = self._new_scaling(forward=False, device=device)
        return self._backward

    def replay_scaling(self, scale: torch.Tensor) -> Any:
        """A forward scaling state quantizing with ``scale`` whose amaxes go nowhere, for the
        casts the backward makes again with the scales the forward used (snapshotted by the
        forward sync): one per device, rescaled on each call."""
        replay = self._replays.get(scale.device)
        if replay is None:
            replay = self._replays[scale.device] = self.numerics.ScalingState.replaying(self.recipe, scale)
        return replay.rescale(scale)

    def _new_scaling(self, *, forward: bool, device: torch.device) -> Any:
        """A backend scaling state of one direction, holding the tensors loaded for it."""
        scaling = self.numerics.ScalingState(self.recipe, forward=forward, device=device)
        for name, value in self._loaded.pop(forward, {}).items():
            getattr(scaling, name).copy_(value)
        return scaling

    def scaling(self, *, forward: bool) -> Any:
        """The scaling state of one direction, None before its first use."""
        return self._forward if forward else self._backward

    def shape(self, direction: str, name: str) -> tuple[int, ...]:
        """The shape of a delayed-scaling tensor: ``amax_history`` or ``scale`` of "forward" or
        "backward"."""
        columns = 2 if _DIRECTIONS[direction] else 1
        return (self.recipe.amax_history_len, columns) if name == "amax_history" else (columns,)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Detached copies of the delayed-scaling tensors of each direction used (or loaded) so
        far, by ``"{direction}.{name}"``."""
        found = {}
        for direction, forward in _DIRECTIONS.items():
            scaling = self.scaling(forward=forward)
            for name in _TENSORS:
                value = self._loaded.get(forward, {}).get(name) if scaling is None else getattr(scaling, name)
                if value is not None:
                    found[f"{direction}.{name}"] = value.detach().clone()
        return found

    def current_amaxes(self) -> dict[bool, torch.Tensor | None]:
        """A copy of each direction's current amax row (what its casts record until the next
        flush), by ``forward``; for a direction not used yet, the row it will start from (loaded,
        or None: zeros). Stateless recipes have none."""
        found = {}
        for forward in (True, False):
            scaling = self.scaling(forward=forward)
            if scaling is None:
                loaded = self._loaded.get(forward, {}).get("amax_history")
                found[forward] = None if loaded is None else loaded[0].clone()
            elif scaling.amax_history is not None:
                found[forward] = scaling.amax_history[0].clone()
        return found

    def restore_current_amaxes(self, saved: dict[bool, torch.Tensor | None]) -> None:
        """Put back the rows ``current_amaxes`` copied."""
        for forward, row in saved.items():
            scaling = self.scaling(forward=forward)
            if scaling is not None and scaling.amax_history is not None:
                current = scaling.amax_history[0]
                current.zero_() if row is None else current.copy_(row)

    def load(self, direction: str, name: str, value: torch.Tensor) -> None:
        """Overwrite one delayed-scaling tensor in place (the kernels and CUDA graphs hold it),
        or keep a copy for when its direction is first used."""
        forward = _DIRECTIONS[direction]
        scaling = self.scaling(forward=forward)
        if scaling is None:
            self._loaded.setdefault(forward, {})[name] = value.detach().clone()
        else:
            getattr(scaling, name).copy_(value)


# What a flush does is decided in Python on each call; a CUDA graph capture would freeze it.
_CAPTURE_REFUSED = (
    "te_v2: a quantization-state flush is being captured into a CUDA graph, which would freeze "
    "its per-step decisions (quantization_update_scope, the te.autocast amax group). Use "
    "transforms=[te_v2_executor.TEv2CUDAGraphTransform()] instead of Thunder's CUDAGraphTransform: "
    "it captures everything else and runs the flushes between the graphs. Thunder's warm-up runs "
    "before the capture have already updated this function's scaling state: compile it again."
)


class TEv2SharedStateWarning(UserWarning):
    """One compiled region's linears quantize for several layers with one delayed-scaling state."""


class SyncGroup:
    """The delayed-scaling states one sync symbol updates, all of one recipe and direction.

    ``replayed``: forward states whose linears the backward recomputes; the forward flush first
    snapshots their scales so the recompute quantizes as the original forward did.
    ``backward``: a forward group's partner, the backward group of the same trace. Two backwards
    with no forward between them are those of a region that ran for several forwards first: one
    Dynamo reuses for several layers, whose linears then share their states
    (``TEv2SharedStateWarning``).
    """

    def __init__(
        self,
        states: tuple[LinearQuantState, ...],
        *,
        forward: bool,
        replayed: tuple[LinearQuantState, ...] = (),
        backward: SyncGroup | None = None,
    ) -> None:
        self.states = states
        self.forward = forward
        self.replayed = replayed
        self.backward = backward
        self.after_backward = False  # a backward group's last flush came after no forward
        self.warned = False

    def __repr__(self) -> str:
        direction = "forward" if self.forward else "backward"
        return f"SyncGroup({direction}, {len(self.states)} linears)"

    def snapshot_replayed_scales(self) -> torch.Tensor | None:
        """(len(replayed), 2) copy of the input and weight scales of the replayed states."""
        if not self.replayed:
            return None
        return torch.stack([s.scaling(forward=True).scale for s in self.replayed])

    def flush(self) -> None:
        """Update every state of the group once, or record them for the enclosing
        ``quantization_update_scope`` to update at its exit. Refuses to run inside a CUDA graph
        capture (see ``te_v2_executor.cuda_graphs``)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(_CAPTURE_REFUSED)
        self._note_pass()
        if self.forward:
            group = autocast.amax_group(self.states[0].backend)
            for s in self.states:
                s.amax_group = group
        if _deferred.depth:
            _deferred.add(self.states, forward=self.forward)
        else:
            update_delayed_scaling(self.states, forward=self.forward)

    def _note_pass(self) -> None:
        """Note a forward on the partner backward group; at a backward that follows another with
        no forward between them, warn once."""
        if self.forward:
            if self.backward is not None:
                self.backward.after_backward = False
            return
        if self.after_backward and not self.warned:
            self.warned = True
            sites = ", ".join(s.key.site for s in self.states[:3])
            warnings.warn(
                f"te_v2: a compiled region ran its backward twice with no forward between, so its "
                f"linears ({sites}{', ...' if len(self.states) > 3 else ''}) quantized for several "
                "forwards with one delayed-scaling state. If those forwards were different layers "
                "(Dynamo reuses one region for every layer whose code and guards match: torch's "
                "fully_shard per layer, regional compilation), the layers share their amax "
                "histories and scales, where te.Linear keeps one per layer: use current scaling "
                "(make_te_v2(recipe=current_scaling())), or compile the model whole. Calls of the "
                "same weights (a module applied twice in one step) share them as te.Linear's do",
                TEv2SharedStateWarning,
                stacklevel=3,
            )
        self.after_backward = True


def update_delayed_scaling(states: Iterable[LinearQuantState], *, forward: bool) -> None:
    """Reduce the current amax of every state of one recipe and amax group (one concatenation,
    at most one all-reduce) and update their histories and scales (one fused update)."""
    used = [(s, s.scaling(forward=forward)) for s in states]
    used = [(s, scaling) for s, scaling in used if scaling is not None]
    if not used:
        return
    first = used[0][0]
    histories = [scaling.amax_history for _, scaling in used]
    scales = [scaling.scale for _, scaling in used]
    amax = torch.cat([h[0] for h in histories])
    group = first.amax_group
    if (
        first.recipe.reduce_amax
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size(group) > 1
    ):
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    first.numerics.update_delayed_scaling(amax, histories, scales, first.recipe, forward=forward)


@contextlib.contextmanager
def current_amaxes_kept(states: Iterable[LinearQuantState]) -> Iterator[None]:
    """The amaxes ``states`` record inside the block undone on exit (each direction's current row
    as it was before, or as a direction first used inside started).

    For the warm-up calls before a CUDA graph capture: they quantize what the graph's first replay
    quantizes again, but not always the same values (an input the graph writes into in place is
    written once per call, dropout draws anew), and a larger amax recorded there would set the
    next scale as no step without graphs does.
    """
    saved = [(s, s.current_amaxes()) for s in states]
    try:
        yield
    finally:
        for state, rows in saved:
            state.restore_current_amaxes(rows)


class _Deferred:
    """States whose updates an open ``quantization_update_scope`` holds back."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: dict[tuple[bool, RecipeSpec, int], dict[int, LinearQuantState]] = {}

    def add(self, states: Iterable[LinearQuantState], *, forward: bool) -> None:
        for s in states:
            key = (forward, s.recipe, id(s.amax_group))
            self.pending.setdefault(key, {})[id(s)] = s

    def flush(self) -> None:
        pending, self.pending = self.pending, {}
        for (forward, _, _), states in pending.items():
            update_delayed_scaling(states.values(), forward=forward)


_deferred = _Deferred()


@contextlib.contextmanager
def quantization_update_scope() -> Iterator[None]:
    """Update delayed-scaling state once, at the end of the block, instead of after every pass.

    For gradient accumulation and other logical backwards made of several autograd calls: the
    amaxes of every forward and backward inside accumulate (as a running max), and on exit each
    state is updated once, forward and backward, with one reduction per recipe and amax group.
    Nested scopes update when the outermost one exits.
    """
    _deferred.depth += 1
    try:
        yield
    finally:
        _deferred.depth -= 1
        if not _deferred.depth:
            _deferred.flush()


class StateRegistry:
    """The linear states of one compiled function, by key, and a state dict loaded before they
    exist."""

    def __init__(self) -> None:
        self._states: dict[StateKey, LinearQuantState] = {}
        self._held: dict[str, torch.Tensor] = {}  # loaded before any state existed
        self._held_strict = True

    @property
    def states(self) -> dict[StateKey, LinearQuantState]:
        """Every state made so far, of every trace and recipe, by key."""
        return dict(self._states)

    def state(self, key: StateKey, name: str) -> LinearQuantState:
        """The state of ``key``, made (named ``name``) on its first request; a recipe change and
        back finds the old one again."""
        found = self._states.get(key)
        if found is None:
            found = self._states[key] = LinearQuantState(name, key.recipe, key.backend, key)
        return found

    def named_states(self) -> dict[str, LinearQuantState]:
        """The delayed-scaling states by the prefix of their state-dict names: the key's site,
        then the recipe where one site has states of several delayed recipes."""
        delayed = [s for s in self._states.values() if s.recipe.stateful]
        per_site = collections.Counter(s.key.site for s in delayed)
        return {
            s.key.site if per_site[s.key.site] == 1 else f"{s.key.site}.{_recipe_tag(s.recipe)}": s
            for s in delayed
        }

    def _addresses(self) -> dict[str, LinearQuantState]:
        """``named_states``, and each delayed state also by its site followed by its recipe, the
        name it is saved under where the saving function had several delayed recipes."""
        named = self.named_states()
        return {**{f"{s.key.site}.{_recipe_tag(s.recipe)}": s for s in named.values()}, **named}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of every delayed-scaling tensor, and of those loaded for states not made yet."""
        found = {name: value.clone() for name, value in self._held.items()}
        for prefix, s in self.named_states().items():
            found.update({f"{prefix}.{name}": value for name, value in s.tensors().items()})
        return found

    def matches(self, state_dict: dict[str, torch.Tensor]) -> list[tuple[str, LinearQuantState]]:
        """(name, state) of each entry of ``state_dict`` that names a tensor of one of these
        states; raises naming the entry whose shape differs from the state's."""
        named = self._addresses()
        found = []
        for name, value in state_dict.items():
            prefix, direction, tensor = _split(name)
            s = named.get(prefix)
            if s is None:
                continue
            expected = s.shape(direction, tensor)
            if tuple(value.shape) != expected:
                raise ValueError(
                    f"te_v2: quantization state {name!r} has shape {tuple(value.shape)}, but this "
                    f"function's has {expected} (amax_history_len={s.recipe.amax_history_len}); "
                    "load it into a function running the recipe it was saved with"
                )
            found.append((name, s))
        return found

    def hold(self, state_dict: dict[str, torch.Tensor], *, strict: bool) -> None:
        """Keep a state dict loaded before the first trace, for ``take_held`` to load into the
        states that trace makes."""
        self._held = {name: value.detach().clone() for name, value in state_dict.items()}
        self._held_strict = strict

    def take_held(self) -> None:
        """Load the held state dict into the states made so far (the ``states`` pass calls it after
        binding a trace); in strict mode an entry no state takes is an error."""
        if not self._held:
            return
        matched = self.matches(self._held)
        if self._held_strict:  # an error keeps the state dict held: each retry raises again
            _refuse_unknown(self._held.keys() - {name for name, _ in matched}, self.named_states())
        held, self._held = self._held, {}
        for name, s in matched:
            s.load(*_split(name)[1:], held[name])


registry_for = PerFunction(StateRegistry)
"""The registry of a Thunder compile data (one per ``thunder.jit`` callable)."""


def _recipe_tag(recipe: RecipeSpec) -> str:
    """The recipe in a state's names where one site has states of several delayed recipes: the
    fields that differ from DelayedScaling's defaults, e.g. ``delayed(amax_history_len=16)``."""
    default = RecipeSpec()
    changed = [
        f"{f.name}={getattr(recipe, f.name)}"
        for f in dataclasses.fields(recipe)
        if f.compare and getattr(recipe, f.name) != getattr(default, f.name)
    ]
    return f"delayed({','.join(changed)})"


def _split(name: str) -> tuple[str, str, str]:
    """A state-dict name as (state prefix, direction, tensor); empty strings for a name that is
    no delayed-scaling tensor's."""
    parts = name.rsplit(".", 2)
    if len(parts) != 3 or parts[1] not in _DIRECTIONS or parts[2] not in _TENSORS:
        return "", "", ""
    prefix, direction, tensor = parts
    return prefix, direction, tensor


def _refuse_unknown(unknown: Iterable[str], named: dict[str, LinearQuantState]) -> None:
    """Raise naming the state-dict entries no state of the function takes, if any."""
    if unknown := sorted(unknown):
        raise ValueError(
            f"te_v2: no delayed-scaling linear of this function has the quantization state "
            f"{', '.join(map(repr, unknown))} (its states: {', '.join(sorted(named)) or 'none'}); "
            "names are '{source}.{ordinal}.{forward|backward}.{amax_history|scale}' as "
            "quantization_state_dict gives them: load a state dict of the same model, or pass "
            "strict=False to skip these entries"
        )


def _registries_of(fn: Any) -> list[StateRegistry]:
    """The registries of a ``thunder.jit`` callable, or of each region of a ``thunderfx`` one."""
    compile_datas = [thunder.compile_data(f) for f in compiled_functions(fn)]
    if None in compile_datas:
        raise TypeError(f"te_v2: {fn!r} is neither a thunder.jit callable nor a thunderfx object")
    return [registry_for(cd) for cd in compile_datas]


def quantization_state_dict(fn: Any) -> dict[str, torch.Tensor]:
    """The delayed-scaling state of every linear of a compiled function, for a checkpoint.

    ``fn``: a ``thunder.jit`` callable or a ``thunderfx`` object (all its regions). Names are
    ``"{source}.{ordinal}.forward.amax_history"``, ``.forward.scale``, ``.backward.amax_history``
    and ``.backward.scale``, from each state's ``StateKey`` (where one linear has states of
    several delayed recipes, the recipe follows the ordinal); the values are detached copies,
    plain tensors on the state's device. A direction not used yet has no entry.
    """
    found: dict[str, torch.Tensor] = {}
    for registry in _registries_of(fn):
        found.update(registry.state_dict())  # a region compiled anew supersedes the older one
    return found


def load_quantization_state_dict(
    fn: Any, state_dict: dict[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Load a ``quantization_state_dict`` into a compiled function, in place.

    A ``thunder.jit`` callable may be loaded before its first call: the state dict is held and
    loaded into the states its first trace makes. A ``thunderfx`` object has states only once it
    has compiled its regions; each entry is loaded into every region with that linear.
    ``strict``: an entry no linear takes raises (checked at the first trace when held); a shape
    mismatch always raises. Entries missing from ``state_dict`` leave their states as they are.
    """
    registries = _registries_of(fn)
    if not registries:
        raise ValueError(
            "te_v2: this thunderfx function has compiled no region yet, so it has no quantization "
            "state to load into: call it once first, on a batch like the training ones and with "
            "grad enabled (a forward alone; the load overwrites the state that forward updates), "
            "then load. Under torch.no_grad() Dynamo compiles regions the training step does not reuse."
        )
    if len(registries) == 1 and not registries[0].states:
        if strict:
            _refuse_unknown([name for name in state_dict if not _split(name)[0]], {})
        registries[0].hold(state_dict, strict=strict)
        return
    matched = [m for registry in registries for m in registry.matches(state_dict)]
    if strict:
        named = {name: s for registry in registries for name, s in registry.named_states().items()}
        _refuse_unknown(state_dict.keys() - {name for name, _ in matched}, named)
    for name, s in matched:
        s.load(*_split(name)[1:], state_dict[name])
