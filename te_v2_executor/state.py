"""Quantization-state bookkeeping: who owns amax/scale state, and the once-per-pass flush.

Each linear call site of a compiled function owns one ``LinearQuantState`` (forward quantizers
for x and W, a backward one for dy). It is keyed by the names of its input and weight proxies,
which Thunder keeps stable across retraces of one function, so freezing or unfreezing a weight
(a retrace) keeps the delayed-scaling history, as a ``te.Linear`` module would. The forward and
its checkpoint recompute share the object.

A ``SyncGroup`` is what one sync symbol flushes: all delayed-scaling states of one direction of
one trace, updated with one concatenation, at most one all-reduce and one fused update. Inside a
``quantization_update_scope`` the flushes are held back and done once when it exits.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

import torch

from te_v2_executor.backends import Backend, kernels
from te_v2_executor.recipes import RecipeSpec


class LinearQuantState:
    """Quantization state of one linear call site; backend scaling states are made lazily on
    the device of the first call."""

    def __init__(self, key: tuple[str, str], name: str, recipe: RecipeSpec, backend: Backend) -> None:
        self.key = key
        self.name = name
        self.recipe = recipe
        self.backend = backend
        self.amax_group: Any = None  # the amax reduction group seen by the last forward flush
        self._forward = None
        self._backward = None

    def __repr__(self) -> str:
        return f"LinearQuantState({self.name}, {self.recipe.scaling.value}, {self.backend.value})"

    @functools.cached_property
    def kernels(self) -> ModuleType:
        return kernels(self.backend)

    def forward_scaling(self, device: torch.device) -> Any:
        if self._forward is None:
            self._forward = self.kernels.ScalingState(self.recipe, forward=True, device=device)
        return self._forward

    def backward_scaling(self, device: torch.device) -> Any:
        if self._backward is None:
            self._backward = self.kernels.ScalingState(self.recipe, forward=False, device=device)
        return self._backward

    def scaling(self, *, forward: bool) -> Any:
        """The scaling state of one direction, None before its first use."""
        return self._forward if forward else self._backward


# What a flush does is decided in Python on each call; a CUDA graph capture would freeze it.
_CAPTURE_REFUSED = (
    "te_v2: a quantization-state flush is being captured into a CUDA graph, which would freeze "
    "its per-step decisions (quantization_update_scope, the te.autocast amax group). Use "
    "transforms=[te_v2_executor.TEv2CUDAGraphTransform()] instead of Thunder's CUDAGraphTransform: "
    "it captures everything else and runs the flushes between the graphs. Thunder's warm-up runs "
    "before the capture have already updated this function's scaling state: compile it again."
)


class SyncGroup:
    """The delayed-scaling states one sync symbol updates, all of one recipe and direction.

    ``replayed``: forward states whose linears the backward recomputes; the forward flush first
    snapshots their scales so the recompute quantizes as the original forward did.
    """

    def __init__(
        self,
        states: tuple[LinearQuantState, ...],
        *,
        forward: bool,
        replayed: tuple[LinearQuantState, ...] = (),
    ) -> None:
        self.states = states
        self.forward = forward
        self.replayed = replayed

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
        if self.forward:
            group = self.states[0].kernels.amax_group()
            for s in self.states:
                s.amax_group = group
        if _deferred.depth:
            _deferred.add(self.states, forward=self.forward)
        else:
            update_delayed_scaling(self.states, forward=self.forward)


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
    first.kernels.update_delayed_scaling(amax, histories, scales, first.recipe, forward=forward)


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
    """The linear states of one compiled function, and the explain report of each of its traces
    (keyed by what te_v2 runs in it, so a cache hit on an older trace finds that trace's report)."""

    def __init__(self) -> None:
        self._states: dict[tuple[str, str], LinearQuantState] = {}
        self.reports: dict[Any, Any] = {}
        self.latest_report: Any = None

    def record(self, key: Any, report: Any) -> None:
        self.reports[key] = self.latest_report = report

    def state(
        self, key: tuple[str, str], name: str, recipe: RecipeSpec, backend: Backend
    ) -> LinearQuantState:
        """The state of call site ``key``; a new one when the recipe or backend changed."""
        found = self._states.get(key)
        if found is None or found.recipe != recipe or found.backend is not backend:
            found = self._states[key] = LinearQuantState(key, name, recipe, backend)
        return found


_registries: weakref.WeakKeyDictionary[Any, StateRegistry] = weakref.WeakKeyDictionary()
_unowned = StateRegistry()


def registry_for(compile_data: Any) -> StateRegistry:
    """The registry of a Thunder compile data (one per ``thunder.jit`` callable)."""
    if compile_data is None:
        return _unowned
    found = _registries.get(compile_data)
    if found is None:
        found = _registries[compile_data] = StateRegistry()
    return found
