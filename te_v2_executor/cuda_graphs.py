"""CUDA graphs for traces te_v2 runs in: Thunder's ``CUDAGraphTransform``, flushes left out.

A small step is bound by the host: Python issues its kernels more slowly than the GPU runs them
(docs/performance.md). Replaying the forward and the backward as CUDA graphs removes that cost.
Everything is captured except te_v2's quantization-state flushes, which run eagerly between the
graphs: what they do is decided in Python on every call (an open ``quantization_update_scope``
holds the update back; the ``te.autocast`` amax group picks the all-reduce), and a capture would
freeze the decision of the first step. The flush symbols refuse to be captured, so Thunder's
plain ``CUDAGraphTransform`` fails with an error naming this transform instead of updating the
state wrongly. Forwards the backward recomputes and the casts it makes again (activation
checkpointing, ``weight_recasts`` and ``input_recasts``) are captured: they quantize with the
scales the forward sync snapshot, an input of the backward's graph. As the forward graph holds
what the forward saves from one step to the next, those passes make every recast they can under
CUDA graphs, not only those that lower the step's peak.

A replay overwrites what the previous replay of the same graph returned. So that no backward
reads a tensor a later replay overwrote, every replay marks its outputs (gradients aside, below)
as written in place: autograd then refuses a saved tensor the next forward's replay overwrote (a
second forward before the first one's backward) with its "modified by an inplace operation"
error, where it would otherwise compute a wrong gradient without a word. A graph reads its
parameters in place: a call with other parameters there (a region Dynamo compiled once and calls
for every layer whose guards match) gets graphs of its own, and a replay that finds a parameter
moved to other memory since the capture raises, naming it.

A graph reads the tensors it does not read in place (inputs, buffers) from copies it makes on
each call, so a write into one (``x.mul_(2)``, a running statistic's ``add_``) would reach only
the copy: each replay copies what the graph wrote back into the caller's tensor. And the warm-up
calls before a capture write into what the graph reads in place (a buffer ``thunder.jit`` passes
as it is), which gets its values back before the first replay, so each step writes once.

A backward graph hands its gradients to autograd as tensors over the graph's memory, which
autograd keeps as ``.grad`` where it would otherwise copy them there: the weight gradients exist
once, not twice. The next replay of that graph writes into the same memory; where a gradient is
still in use then (``.grad`` kept for accumulation, a gradient ``torch.autograd.grad`` returned),
the replay hands out a copy of what it wrote and gives the memory back what it held, so the
holder reads what it read before. ``copy_gradients=True`` (and ``share_mem_pool=True``, where
another graph's replay may write into a backward graph's memory) returns a copy of each. A
forward replay returns new tensors over its memory, so what autograd ties to one (``retain_grad``,
hooks) is that call's alone.

``reuse_saved_memory=True`` captures each backward graph in its forward graph's pool and frees
there, in the capture, what only the backward reads, after its last read (``graph_memory``), so
that the forward's saved tensors and the backward's memory overlap as without graphs.

    jitted = thunder.jit(model, executors=[te_v2, torch_compile_ex], transforms=[TEv2CUDAGraphTransform()])
    compiled = thunderfx(model, executors=executors(), transforms=[TEv2CUDAGraphTransform()])
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from inspect import Parameter, Signature
from typing import Any
from unittest import mock

import thunder.transforms.cudagraph
import torch
from thunder.core import prims
from thunder.core.proxies import ProxyTag, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceTag, from_trace, reset_tracectx, set_tracectx
from thunder.executors.data_dependent_partition import consecutive_fusion
from thunder.transforms.cudagraph import CUDAGraphRunner, CUDAGraphTransform
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from te_v2_executor.graph_memory import (
    ReleasePoints,
    allocating_in,
    free_to_pool,
    owns_its_memory,
    pool_blocks,
    relocate_held,
    saved_only_outputs,
    storage_start,
    storages,
)
from te_v2_executor.passes._writes import Writes, written_tensor
from te_v2_executor.state import LinearQuantState, current_amaxes_kept
from te_v2_executor.symbols import SYNC_SYMBOLS


class TEv2CUDAGraphTransform(CUDAGraphTransform):
    """Thunder's CUDA graph transform, keeping te_v2's state flushes out of the graphs.

    As with Thunder's transform, outputs (the forward's result, saved activations, gradients)
    live in the graphs' static buffers and are overwritten by the next replay, and those buffers
    stay allocated between steps. A backward that would read a saved tensor a later replay
    overwrote raises instead. Gradients go to ``.grad`` without a copy, unless
    ``copy_gradients`` or ``share_mem_pool`` (where another graph's replay may write into a
    backward graph's outputs); then each is a copy. With ``reuse_saved_memory`` each backward
    graph is captured in its forward graph's pool and gives it back the memory of what only the
    backward reads after its last read of it (``graph_memory``): a lower peak on large steps, and
    a second backward over one forward raises.
    """

    def __init__(
        self, *, share_mem_pool: bool = False, copy_gradients: bool = False, reuse_saved_memory: bool = False
    ) -> None:
        super().__init__(share_mem_pool=share_mem_pool)
        self.cuda_graph_runner = _CheckedRunner(
            share_mem_pool=share_mem_pool,
            copy_gradients=copy_gradients or share_mem_pool,
            reuse_saved_memory=reuse_saved_memory and not share_mem_pool,
        )

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        if bsym.sym in SYNC_SYMBOLS:
            return False
        return super().can_fuse(bsym)

    def transform_trace_post_optimization(self, trace: TraceCtx, **kwargs) -> TraceCtx:
        """Fuses ``trace`` into graphs, each a run of consecutive symbols it can capture; a
        backward's saved tensors that the forward's graphs keep at fixed addresses are read in
        place rather than copied.

        Thunder's transform groups symbols by the fusion the compile options name, and
        ``thunderfx`` names dataflow fusion, which never groups a symbol autodiff tagged as the
        backward's (te_v2's) with one it did not (a fusion region): a Llama's backward became a
        graph per run of either, each with a memory pool and input copies of its own, kept between
        steps. A graph needs no reordering, so this groups consecutive symbols: one graph between
        two symbols that stay out.

        Thunder's transform finds the saved tensors at fixed positions of the backward trace,
        which hold for ``thunder.jit``'s traces but not for every region ``thunderfx`` makes; this
        finds them by name. Where they cannot be matched to the forward's, every saved tensor is
        copied into the graph's own buffers, which is slower but never reads a stale address.
        """
        unfused = from_trace(trace)
        unfused.bound_symbols = _unfused(trace.bound_symbols)
        writes = Writes(unfused)
        runner = self.cuda_graph_runner
        with mock.patch.object(thunder.transforms.cudagraph, "fuse_bound_symbols", consecutive_fusion):
            if trace.siginfo().name != "backward_fn":
                fused = super().transform_trace_post_optimization(trace, **kwargs)
                if TraceTag.AUGMENTED_FORWARD in fused.tags:
                    runner.saved_only.update(
                        saved_only_outputs(fused, writes, lambda b: b.sym.executor is self)
                    )
            else:
                runner.release_points = ReleasePoints(trace, writes, runner.release)
                try:
                    fused = self._backward_graphs(trace, **kwargs)
                finally:
                    runner.release_points = None
        self._tell_written_arguments(fused, writes)
        if trace.siginfo().name == "backward_fn":
            self.cuda_graph_runner.gradient_graphs.update(
                b.sym.name for b in fused.bound_symbols if b.sym.executor is self
            )
        return fused

    def _tell_written_arguments(self, fused: TraceCtx, writes: Writes) -> None:
        """Tells the runner which arguments each of ``fused``'s graphs writes into, or into what
        may share their storage: an input of the trace, or a tensor made before the graph, which
        other names of it may read after (``writes`` is over the trace before fusion, fusions
        unfolded)."""
        for bsym in fused.bound_symbols:
            if bsym.sym.executor is not self:
                continue
            written = _written_roots(bsym.subsymbols, writes)
            self.cuda_graph_runner.written_arguments[bsym.sym.name] = tuple(
                i for i, p in enumerate(bsym.args) if isinstance(p, TensorProxy) and writes.root(p) in written
            )

    def _backward_graphs(self, trace: TraceCtx, **kwargs) -> TraceCtx:
        """The backward's graphs, its saved tensors the forward's graphs hold tagged as read in
        place."""
        static = self.outputs_from_forward
        self.outputs_from_forward = None
        saved = _saved_tensors(trace)
        if static is not None and saved is not None and len(saved) == len(static):
            for is_static, proxy in zip(static, saved, strict=True):
                if is_static:
                    proxy.tags.add(ProxyTag.STATIC_MEMORY_LOCATION)
        return self.generate_fused_trace(trace, **kwargs)


@dataclass
class _Replayed:
    """What a captured graph reads in place and writes: the positions of the arguments it reads
    in place, those with an address with it at capture, the buffers of its arguments by position,
    the outputs it marks as written (a forward's that no argument shares storage with) and the
    positions among the outputs' leaves of those that are plain tensors, the outputs a backward
    graph hands to autograd over its memory and the positions of those it copies, and the outputs
    over an argument's copy with that argument's position (``_CheckedRunner._aliased``). ``outputs``,
    the graph's static outputs, is held so that its ``id``, the runner's key for this entry, stays
    its own.

    With the saved tensors' memory reused (``graph_memory``): a forward graph's capture stream and
    pool, the storages of its saved-only outputs by where they start, the positions of those
    outputs, and the backward graphs captured in its pool (``partners``); a backward graph's
    ``released``, the forward's outputs over memory it freed, and ``last_handed``, the gradients
    it last handed out, by position."""

    outputs: Any
    in_place: frozenset[int]
    fixed: list[tuple[int, torch.Tensor, int]]
    inputs: tuple[Any, ...]
    written: list[torch.Tensor] = field(default_factory=list)
    fresh: list[int] = field(default_factory=list)
    handed: list[_Handed] = field(default_factory=list)
    copied: list[int] = field(default_factory=list)
    aliased: list[tuple[int, int]] = field(default_factory=list)
    stream: Any = None
    pool: tuple[int, int] | None = None
    saved_only: dict[int, torch.Tensor] = field(default_factory=dict)
    saved_positions: frozenset[int] = frozenset()
    partners: list[_Replayed] = field(default_factory=list)
    released: list[torch.Tensor] = field(default_factory=list)
    last_handed: dict[int, weakref.ref] = field(default_factory=dict)


@dataclass
class _Pairing:
    """How a backward graph is captured in its forward's pool: the forward's entry, how many of
    the graph's arguments reach each storage it frees, by where the storage starts, and the
    positions of the arguments it reads from copies it makes in that pool and frees there."""

    forward: _Replayed
    plan: dict[int, int]
    pooled: list[int]


@dataclass
class _Handed:
    """One output a backward graph hands to autograd: its position among the outputs' leaves, its
    storage, and, with nothing handed out, how many references the storage has and how many the
    storage's Python object has (one kept without any tensor over it adds only to the latter)."""

    position: int
    storage: torch.UntypedStorage
    own: int = 0
    own_python: int = 0


class _CheckedRunner(CUDAGraphRunner):
    """Thunder's graph runner, whose replays check what the graph reads in place, mark what it
    writes and hand the gradients to autograd without a copy.

    A graph reads its parameters, and the saved tensors its forward's graphs hold, at the
    addresses they had when it was captured. A call that passes other tensors there (a region
    Dynamo compiled once and calls for each layer whose guards match, a parameter replaced by
    another) gets a graph of its own, where Thunder's runner would copy them into the captured
    ones, overwriting the first layer's weights with the next one's. A tensor whose memory
    moved (FSDP2 unshards parameters into memory it frees again) would be read from memory that
    holds something else, so a replay that finds one moved raises. Outputs get their version
    counters bumped, except those that share storage with an argument the graph reads in place (a
    parameter, or a view of one): those are not the graph's to mark, and marking them would make
    autograd refuse a weight another function saved, a tied embedding's for one.

    Of the arguments a graph writes into (``written_arguments``, by graph and position), one it
    reads from a copy is written back from the copy after each replay, and one it reads in place
    (a buffer ``thunder.jit`` passes as it is) gets back the values it had before the capture,
    whose warm-up calls wrote into it. An output over the memory of an argument the graph reads
    from a copy (the argument returned as it is, or a view of it: Thunder returns the input an
    in-place write goes to, and a flush between two graphs passes it on) is returned over the
    caller's argument, not the copy, so that a later graph's write reaches the caller's tensor.
    Arguments over one memory are read from views of one copy, or all in place where one is.
    The amaxes the warm-up calls recorded into te_v2's quantization states are put back too, as
    the first replay records them again: the warm-ups need not quantize the same values (each
    writes once more into an input the graph writes into, and dropout draws anew).

    The graphs named in ``gradient_graphs`` (backward graphs) return each output that shares
    storage with nothing else they read or return as a new tensor over the graph's memory, which
    autograd, seeing no other reference, keeps as ``.grad`` instead of copying it. Where that
    memory is still referenced at the next replay (``.grad`` kept for accumulation), the replay
    keeps its values: it hands out a copy of what it wrote and gives the memory its values back.
    Their other outputs, and all of them with ``copy_gradients``, are returned as copies: none is
    memory a later replay writes into. Each replay of another graph returns its outputs as new
    tensors over its memory (``detach``, which shares the version counter the replays bump), so
    that what autograd ties to a returned tensor (``retain_grad``, hooks) is that call's alone,
    as without graphs.
    """

    def __init__(
        self, *, share_mem_pool: bool = False, copy_gradients: bool = False, reuse_saved_memory: bool = False
    ) -> None:
        super().__init__(share_mem_pool=share_mem_pool)
        self.replayed: dict[int, _Replayed] = {}
        self.written_arguments: dict[str, tuple[int, ...]] = {}
        self.gradient_graphs: set[str] = set()
        self.copy_gradients = copy_gradients
        self.reuse_saved_memory = reuse_saved_memory
        self.saved_only: dict[str, frozenset[int]] = {}
        self.releasable: dict[str, list[int]] = {}
        self.copies_releasable: dict[str, list[int]] = {}
        self.release_points: ReleasePoints | None = None
        self._shared: dict[int, torch.Tensor] = {}
        self._plan: dict[int, int] = {}
        self._released: dict[int, int] = {}

    def make_cache_key(self, fn_name: str, *args: Any) -> tuple:
        """Thunder's key (the graph, which arguments it reads in place, the layouts of all), with
        what each argument read in place is (``_identity``) and which arguments share memory
        (``_sharing``)."""
        key = super().make_cache_key(fn_name, *args)
        fixed = tuple(_identity(a) for a, in_place in zip(args, key[1], strict=True) if in_place)
        return (*key, fixed, _sharing(args))

    def make_static_inputs_mask(self, fn_name: str, *args: Any) -> tuple[bool, ...]:
        """Thunder's (parameters, and the saved tensors the forward's graphs hold), and each
        argument over the memory of one of those: a copy of it would not see a write through the
        other."""
        mask = super().make_static_inputs_mask(fn_name, *args)
        addresses = [_address(a, storage=True) for a in args]
        fixed = {at for at, in_place in zip(addresses, mask, strict=True) if in_place} - {None}
        return tuple(in_place or at in fixed for at, in_place in zip(addresses, mask, strict=True))

    def get_static_buffer(self, x: Any) -> Any:
        """Thunder's copy of an argument, or, for one that shares memory with another the graph
        reads from a copy, its view of the copy they share (``_shared_copies``)."""
        shared = self._shared.get(id(x))
        return super().get_static_buffer(x) if shared is None else shared.copy_(x)

    def make_python_callable_from_symbols(
        self, fn_name: str, bsyms: list[BoundSymbol], inputs: list[Any], outputs: list[Any]
    ) -> Callable:
        """Thunder's graph function, its objects (quantization states) named by its own trace
        alone.

        A function's globals map each object's name to the object, merged from what its symbols
        remember: a bound symbol remembers the name each of its objects had in every trace that
        printed it, and shares that memory with the symbol it was copied from. Thunder's method
        prints the graph's trace, which numbers its objects from 0, and then gathers the globals
        under whatever trace is current. So a name another trace gave another object (the
        backward's own names, or the forward's, which a recomputed forward remembers) could bind
        a linear to another linear's state, which then quantized with the wrong scale without a
        word. Here the symbols are copies that remember nothing, and the globals are gathered
        under the graph's trace.

        In a backward, with the saved tensors' memory reused, the function frees each input it may
        free (``ReleasePoints``: a saved tensor the forward's graph holds, or its own copy of
        another input) after its last reader, when capturing (``release``).
        """
        points = self.release_points
        if self.reuse_saved_memory and points is not None:
            self.releasable[fn_name] = points.releasable(bsyms, inputs, outputs)
            written = _written_roots(bsyms, points.writes)
            self.copies_releasable[fn_name] = points.copies_releasable(inputs, outputs, written)
            freed = sorted((*self.releasable[fn_name], *self.copies_releasable[fn_name]))
            bsyms = points.with_releases(bsyms, inputs, freed)
        signature = Signature(
            Parameter(getattr(p, "name", f"arg{i}"), Parameter.POSITIONAL_ONLY) for i, p in enumerate(inputs)
        )

        def region_fn() -> None:
            pass

        region_fn.__signature__ = signature
        region_fn.__name__ = fn_name
        region = TraceCtx(region_fn)
        region.args, region.kwargs = inputs, {}
        region.bound_symbols = [b.from_bsym(_object_ctx={}) for b in bsyms]
        region.bound_symbols.append(prims.python_return.bind(outputs, output=None))
        token = set_tracectx(region)
        try:
            return region.python_callable()
        finally:
            reset_tracectx(token)

    def release(self, *tensors: Any) -> None:
        """Frees, while a backward graph is captured in its forward's pool, the storages of
        ``tensors`` the capture's plan holds once every argument reaching them has called this
        (``graph_memory``); does nothing otherwise (the warm-up calls, a graph captured alone)."""
        if not self._plan or not torch.cuda.is_current_stream_capturing():
            return
        for at, tensor in ((at, m) for t in tensors for at, m in storages([t]).items()):
            if at in self._plan:
                self._plan[at] -= 1
                if self._plan[at] == 0:
                    free_to_pool(tensor)
                    self._released[at] = tensor.untyped_storage()._cdata

    def _pairing(self, name: str, args: list[Any], static_args_mask: tuple[bool, ...]) -> _Pairing | None:
        """How the backward graph ``name`` is captured in its forward's pool, or None where it
        frees nothing there: its arguments it may free (read in place, by no later symbol) over
        memory a forward graph's capture allocated for the backward alone, reached by none of its
        other arguments; and, where it frees some, its arguments it reads from copies that share
        memory with no other argument and that it may free after its last read of them (a
        cotangent as large as the logits), copied into that pool rather than memory of their own."""
        positions = [i for i in self.releasable.get(name, ()) if static_args_mask[i]]
        wanted = storages(args[i] for i in positions)
        forward = next((r for r in self.replayed.values() if r.saved_only.keys() & wanted.keys()), None)
        if forward is None:
            return None
        device = next(t.device for t in wanted.values())
        blocks = pool_blocks(device, forward.pool)
        others = storages(a for i, a in enumerate(args) if i not in positions)
        plan: dict[int, int] = {}
        for i in positions:
            for at, tensor in storages([args[i]]).items():
                if (
                    at in forward.saved_only
                    and at not in others
                    and blocks.get(at, 0) >= tensor.untyped_storage().nbytes()
                    and owns_its_memory(tensor)
                ):
                    plan[at] = plan.get(at, 0) + 1
        if not plan:
            return None
        addresses = [_address(a, storage=True) for a in args]
        pooled = [
            i
            for i in self.copies_releasable.get(name, ())
            if not static_args_mask[i]
            and type(args[i]) is torch.Tensor
            and addresses[i] is not None
            and addresses.count(addresses[i]) == 1
        ]
        return _Pairing(forward, plan, pooled)

    def _capture(
        self,
        fn: Callable,
        args: list[Any],
        static_args_mask: tuple[bool, ...],
        stream: Any,
        pool: Any,
        pooled: list[int],
    ) -> tuple:
        """Thunder's ``build_cuda_graph`` (copies of the arguments not read in place, three warm-up
        calls, one capture), on ``stream`` and into ``pool`` (a new pool for None), which a
        forward graph and its backward's share; the copies of the arguments at ``pooled`` are
        made in ``pool`` and planned to be freed there."""
        static_inputs = []
        for i, (a, in_place) in enumerate(zip(args, static_args_mask, strict=True)):
            if i in pooled:
                with allocating_in(pool, stream):
                    a = self.get_static_buffer(a)
                self._plan[storage_start(a)] = 1
            elif not in_place:
                a = self.get_static_buffer(a)
            static_inputs.append(a)
        static_inputs = tuple(static_inputs)
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn(*static_inputs)
        stream.synchronize()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, pool=pool):
            outputs = fn(*static_inputs)
        return graph, static_inputs, outputs

    def build_cuda_graph(self, fn: Callable, args: list[Any], static_args_mask: tuple[bool, ...]) -> tuple:
        name = next(name for name, (callable_, _) in self.python_callables.items() if callable_ is fn)
        in_place_writes = [i for i in self.written_arguments.get(name, ()) if static_args_mask[i]]
        states = {
            id(s): s
            for b in self.trace_symbols[name][0]
            for s in tree_leaves(b.kwargs)
            if isinstance(s, LinearQuantState)
        }
        device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
        reusing = self.reuse_saved_memory and device is not None
        pairing = self._pairing(name, args, static_args_mask) if reusing and name in self.releasable else None
        stream, pool = None, None
        if pairing is not None:
            stream, pool = pairing.forward.stream, pairing.forward.pool
        elif reusing and self.saved_only.get(name):
            stream = torch.cuda.Stream(device)
        self._shared = _shared_copies(args, static_args_mask)
        self._plan, self._released = (pairing.plan if pairing else {}), {}
        try:
            with torch.no_grad(), current_amaxes_kept(states.values()):
                values = [args[i].clone() for i in in_place_writes]
                if stream is None:
                    built = super().build_cuda_graph(fn, args, static_args_mask)
                else:
                    built = self._capture(
                        fn, args, static_args_mask, stream, pool, pairing.pooled if pairing else []
                    )
                for i, value in zip(in_place_writes, values, strict=True):
                    args[i].copy_(value)
        finally:
            self._shared, self._plan = {}, {}
        outputs = built[2]
        in_place = [i for i, static in enumerate(static_args_mask) if static]
        fixed = [(i, args[i], at) for i in in_place if (at := _address(args[i])) is not None]
        leaves = tree_leaves(outputs)
        replayed = _Replayed(outputs, frozenset(in_place), fixed, built[1])
        replayed.aliased = self._aliased(name, leaves, built[1], args, in_place)
        read = {_address(a, storage=True) for a in (*args, *built[1])} - {None} - self._released.keys()
        if name in self.gradient_graphs:
            replayed.handed = [] if self.copy_gradients else _handed(leaves, read)
            kept = {h.position for h in replayed.handed} | {at for at, _ in replayed.aliased}
            replayed.copied = [
                i for i, t in enumerate(leaves) if i not in kept and _address(t, storage=True) is not None
            ]
        else:
            marked = [
                i
                for i, t in enumerate(leaves)
                if isinstance(t, torch.Tensor)
                and not t.is_inference()
                and _address(t, storage=True) not in read
            ]
            replayed.written = [leaves[i] for i in marked]
            replayed.fresh = [i for i in marked if type(leaves[i]) is torch.Tensor]
        if pairing is not None:
            self._check_nothing_returned_was_freed(name, leaves)
            forward = pairing.forward
            pairing.forward.partners.append(replayed)
            replayed.released = [
                forward.outputs[i]
                for i in forward.saved_positions
                if storages([forward.outputs[i]]).keys() & self._released.keys()
            ]
        elif stream is not None:
            self._keep_saved_only(replayed, name, stream, built, args)
        self.replayed[id(outputs)] = replayed
        return built

    def _check_nothing_returned_was_freed(self, name: str, leaves: list[Any]) -> None:
        """Raises where the backward graph ``name`` returns a tensor over a storage its capture
        freed (a view of a saved tensor the trace analysis did not see), which its own later
        temporaries would overwrite."""
        freed = set(self._released.values())
        if any(t.untyped_storage()._cdata in freed for leaf in leaves for t in storages([leaf]).values()):
            raise RuntimeError(
                f"te_v2 internal error: CUDA graph {name} returns a tensor over memory it gave back to "
                "its forward's pool; please report it. TEv2CUDAGraphTransform(reuse_saved_memory=False) "
                "avoids this path."
            )

    def _keep_saved_only(
        self, replayed: _Replayed, name: str, stream: Any, built: tuple, args: list[Any]
    ) -> None:
        """Notes, for the forward graph ``name``, its capture stream and pool and the storages of
        its saved-only outputs (``saved_only``) that no other output, argument or copy of one
        reaches: the memory its backward's graphs may free."""
        outputs = built[2]
        positions = self.saved_only[name]
        others = storages(o for i, o in enumerate(outputs) if i not in positions)
        others.update(storages((*args, *built[1])))
        replayed.stream, replayed.pool = stream, built[0].pool()
        replayed.saved_positions = positions
        replayed.saved_only = {
            at: t for at, t in storages(outputs[i] for i in positions).items() if at not in others
        }

    def _aliased(
        self, name: str, leaves: list[Any], copies: tuple[Any, ...], args: list[Any], in_place: list[int]
    ) -> list[tuple[int, int]]:
        """The outputs over the memory of an argument the graph reads from a copy (an input
        returned as it is, or a view of it), as (position among ``leaves``, argument): each call
        returns them over the caller's argument, as the same call without graphs does, where the
        graph's would hold its copy.

        Raises where the copy's layout differs from the argument's, so that no view of the copy
        maps onto the argument.
        """
        copied = {
            at: i
            for i, copy in enumerate(copies)
            if i not in in_place and (at := _address(copy, storage=True)) is not None
        }
        aliased = [
            (position, copied[at])
            for position, t in enumerate(leaves)
            if (at := _address(t, storage=True)) in copied
        ]
        for position, i in aliased:
            if (copies[i].stride(), copies[i].dtype) != (args[i].stride(), leaves[position].dtype):
                argument = getattr(self.trace_symbols[name][1][i], "name", f"argument {i}")
                raise RuntimeError(
                    f"te_v2: CUDA graph {name} returns a view of {argument}, which it reads from a copy "
                    "of another layout or as another dtype, so the view cannot be given over the "
                    "argument itself. Leave TEv2CUDAGraphTransform out for this function."
                )
        return aliased

    def call_cuda_graph(self, fn_name: str, *args: Any) -> Any:
        """Thunder's call (a capture on the first call with these arguments, then a replay), with
        the checks and hand-overs of the class docstring."""
        key = self.make_cache_key(fn_name, *args)
        entry = self.cuda_graph_cache.get(key)
        if entry is None:
            fn, _ = self.python_callables[fn_name]
            entry = self.build_cuda_graph(fn, args, self.make_static_inputs_mask(fn_name, *args))
            self.cuda_graph_cache[key] = entry
        graph, static_inputs, outputs = entry
        replayed = self.replayed[id(outputs)]
        self._check_in_place(fn_name, replayed)
        if replayed.partners:
            parameters = [t for _, t, _ in replayed.fixed if isinstance(t, torch.nn.Parameter)]
            for partner in replayed.partners:
                relocate_held(partner.handed, partner.last_handed, parameters)
        held = _held(replayed)
        for i, (static_input, given) in enumerate(zip(static_inputs, args, strict=True)):
            if static_input is not given and isinstance(given, torch.Tensor) and i not in replayed.in_place:
                static_input.copy_(given)
        graph.replay()
        torch.autograd.graph.increment_version(replayed.written)
        torch.autograd.graph.increment_version(replayed.released)
        if copied_back := [
            i for i in self.written_arguments.get(fn_name, ()) if replayed.inputs[i] is not args[i]
        ]:
            with torch.no_grad():
                for i in copied_back:
                    args[i].copy_(replayed.inputs[i])
        return _hand_over(replayed, held, args)

    def _check_in_place(self, fn_name: str, replayed: _Replayed) -> None:
        """Raises if an argument ``fn_name`` reads in place is no longer where it was captured."""
        for i, tensor, address in replayed.fixed:
            if _address(tensor) != address:
                name = getattr(self.trace_symbols[fn_name][1][i], "name", f"argument {i}")
                raise RuntimeError(
                    f"te_v2: {name}, which CUDA graph {fn_name} reads in place, is no longer where it was "
                    "when the graph was captured (its memory was freed and allocated again, as FSDP2 "
                    "does when it unshards a parameter, or `param.data = ...` does), so a replay "
                    "would read whatever is there now. "
                    "Leave TEv2CUDAGraphTransform out where parameters move between steps."
                )


def _handed(leaves: list[Any], read: set[int]) -> list[_Handed]:
    """The outputs among ``leaves`` a backward graph can hand to autograd: tensors whose storage
    nothing it read and no other output shares (two gradients kept as ``.grad`` over one memory
    would each see the other's in-place updates)."""
    storages = [_address(t, storage=True) if isinstance(t, torch.Tensor) else None for t in leaves]
    handed = [
        _Handed(i, leaves[i].untyped_storage())
        for i, at in enumerate(storages)
        if at is not None and at not in read and storages.count(at) == 1
    ]
    for h in handed:
        h.own, h.own_python = torch._C._storage_Use_Count(h.storage._cdata), sys.getrefcount(h.storage)
    return handed


def _held(replayed: _Replayed) -> dict[int, torch.Tensor]:
    """The values of the handed outputs something still reads (``.grad`` kept for accumulation, a
    gradient ``torch.autograd.grad`` returned, a view of one), by position, before a replay
    overwrites them."""
    if not replayed.handed:
        return {}
    leaves = tree_leaves(replayed.outputs)
    held = {}
    for h in replayed.handed:
        references = torch._C._storage_Use_Count(h.storage._cdata)
        if references < h.own:
            raise RuntimeError(
                f"te_v2 internal error: a gradient buffer of a CUDA graph has {references} references, "
                f"fewer than the {h.own} te_v2 holds; please report it. "
                "TEv2CUDAGraphTransform(copy_gradients=True) avoids this path."
            )
        if references > h.own or sys.getrefcount(h.storage) > h.own_python:
            held[h.position] = leaves[h.position].clone()
    return held


def _hand_over(replayed: _Replayed, held: dict[int, torch.Tensor], args: tuple[Any, ...]) -> Any:
    """The graph's outputs, each handed output a new tensor over the graph's memory, or, where
    that memory is still read (``held``), a copy of what the replay wrote, with the memory given
    back its values; each copied output a copy, each fresh one a new tensor over its memory; each
    aliased one the caller's argument (``args``) itself, or the same view of it, as Thunder
    returns without graphs."""
    leaves, spec = tree_flatten(replayed.outputs)
    for position, i in replayed.aliased:
        out, copy, given = leaves[position], replayed.inputs[i], args[i]
        offset = given.storage_offset() + out.storage_offset() - copy.storage_offset()
        layout = (out.size(), out.stride(), offset)
        whole = layout == (given.size(), given.stride(), given.storage_offset())
        leaves[position] = given if whole else given.as_strided(*layout)
    for i in replayed.copied:
        leaves[i] = leaves[i].clone()
    for i in replayed.fresh:
        leaves[i] = leaves[i].detach()
    for h in replayed.handed:
        static = leaves[h.position]
        if (value := held.get(h.position)) is not None:
            leaves[h.position] = static.clone()
            static.copy_(value)
            replayed.last_handed.pop(h.position, None)
        else:
            leaves[h.position] = torch.empty((0,), dtype=static.dtype, device=static.device).set_(
                h.storage, static.storage_offset(), static.size(), static.stride()
            )
            replayed.last_handed[h.position] = weakref.ref(leaves[h.position])
    return tree_unflatten(leaves, spec)


def _address(t: Any, *, storage: bool = False) -> int | None:
    """Where ``t``'s first element is (with ``storage``, where its storage starts), or None for
    what has no memory (not a tensor, a wrapper subclass, an empty storage: every one of those is
    at 0, so none shares memory with another)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return (t.untyped_storage().data_ptr() if storage else t.data_ptr()) or None
    except (RuntimeError, NotImplementedError):
        return None


def _sharing(args: tuple[Any, ...]) -> tuple[tuple[int, int] | None, ...]:
    """For each argument over the memory of an earlier one, that one's position and how far from
    its start this one starts; None for the others. A graph whose arguments share memory reads
    them from views of one copy, and one whose arguments do not, from copies of their own."""
    first: dict[int, int] = {}
    found = []
    for i, a in enumerate(args):
        at = _address(a, storage=True)
        j = i if at is None else first.setdefault(at, i)
        found.append(None if j == i else (j, a.storage_offset() - args[j].storage_offset()))
    return tuple(found)


def _shared_copies(args: list[Any], static_args_mask: tuple[bool, ...]) -> dict[int, torch.Tensor]:
    """Copies for the arguments a graph reads from copies that share memory with one another (by
    ``id``): views of one buffer laid out over it as the arguments are over their memory, so that
    a write through one is read through the others, as without graphs, and each gets back the
    other's writes when they are written back. Thunder's runner copied each on its own: the view
    an in-place add wrote into was written back, then the copy of the whole tensor over it."""
    groups: dict[int, list[torch.Tensor]] = {}
    for a, in_place in zip(args, static_args_mask, strict=True):
        if not in_place and (at := _address(a, storage=True)) is not None:
            groups.setdefault(at, []).append(a)
    views = {}
    for members in (m for m in groups.values() if len(m) > 1):
        if len({t.dtype for t in members}) > 1:
            raise RuntimeError(
                "te_v2: a CUDA graph reads arguments of different dtypes over one memory, which it "
                "cannot copy as one. Leave TEv2CUDAGraphTransform out for this function."
            )
        start = min(t.storage_offset() for t in members)
        end = max(t.storage_offset() + _extent(t) for t in members)
        buffer = torch.empty(end - start, dtype=members[0].dtype, device=members[0].device)
        for t in members:
            views[id(t)] = buffer.as_strided(t.size(), t.stride(), t.storage_offset() - start)
    return views


def _extent(t: torch.Tensor) -> int:
    """How many elements from its first one ``t`` spans in its memory."""
    return (
        0 if t.numel() == 0 else 1 + sum((n - 1) * step for n, step in zip(t.size(), t.stride(), strict=True))
    )


def _identity(t: Any) -> int:
    """What a graph reading ``t`` in place reads: a parameter is itself (so that one whose memory
    moved finds the graph captured for it, which raises), another tensor its memory (a saved
    tensor the forward also returned is a new tensor over that memory on each backward), and a
    tensor with no memory of its own (a wrapper subclass, an FP8 copy) is itself."""
    if isinstance(t, torch.nn.Parameter):
        return id(t)
    return _address(t) or id(t)


def _written_roots(bsyms: list[BoundSymbol], writes: Writes) -> set[str]:
    """The roots (``writes``) of what ``bsyms``, fusions unfolded, write into in place."""
    return {writes.root(t) for b in _unfused(bsyms) if (t := written_tensor(b)) is not None}


def _unfused(bsyms: list[BoundSymbol]) -> list[BoundSymbol]:
    """``bsyms`` with each fusion's symbols in its place, where ``Writes`` sees what they write."""
    return [s for b in bsyms for s in (_unfused(b.subsymbols) if b.sym.is_fusion else [b])]


def _unpacked(trace: TraceCtx, name: str) -> BoundSymbol | None:
    """The ``unpack_sequence`` of the collection called ``name`` in ``trace``, if there is one."""
    for bsym in trace.bound_symbols:
        if bsym.sym.id == prims.PrimIDs.UNPACK_SEQUENCE and getattr(bsym.args[0], "name", None) == name:
            return bsym
    return None


def _saved_tensors(trace: TraceCtx) -> list | None:
    """The tensors a backward trace unpacks from the forward's saved ``C0`` collection, in order."""
    saved = _unpacked(trace, "saved_for_backward")
    if saved is None or not saved.output:
        return None
    tensors = _unpacked(trace, saved.output[0].name)
    return list(tensors.output) if tensors is not None else None
