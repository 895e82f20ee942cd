"""The memory a forward CUDA graph saves for the backward, given to the backward's graph as it
reads it for the last time.

A forward graph writes what the backward reads into its pool, at addresses its replays keep, so
that memory stays allocated for the whole step; the backward graph's temporaries and gradients
then come from memory of their own, and a graphed step holds the saved tensors, the gradients
and the backward's temporaries at once, where a step without graphs frees each saved tensor at
its last read and reuses the memory. This module does what torch.compile's CUDA graph trees do
for that: the backward graph is captured in its forward's pool, on the same stream, and each
saved tensor only the backward reads is freed to that pool in the capture, after the backward's
last read of it, so that the backward's later allocations (temporaries, gradients) reuse it. The
forward's replays write there again at the next step. The backward graph's copies of its other
inputs (the cotangents: the logits' is as large as the logits) are made in that pool too and
freed there after the graph's own last read of them (``ReleasePoints.copies_releasable``): each
call copies into them after its forward's replay, the last to write there before it.

What makes that safe, each checked here or by the runner (``cuda_graphs._CheckedRunner``):

- Only memory the forward's capture allocated in that pool (``pool_blocks``), reached from no
  output but the saved-only ones (``saved_only_outputs``: saved for the backward, no tensor over
  their storage returned to the caller or read outside the graphs), and read by no later symbol
  of the backward (``ReleasePoints``) is freed. Nothing else is captured into that pool after the
  backward's graphs, so no allocation lands there again.
- The tensors autograd saved over freed memory are marked as written after each backward replay,
  so a second backward over the same forward (``retain_graph=True``) raises autograd's "modified
  by an inplace operation" error instead of reading the backward's temporaries.
- A gradient the backward graph handed to autograd may lie in memory the next forward replay
  writes. Where one is still held then (``.grad`` kept for accumulation), the runner moves it to
  memory of its own first (``relocate_held``).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from thunder.core import prims
from thunder.core.proxies import ProxyTag, TensorProxy
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import TraceCtx
from torch.utils._pytree import tree_leaves

from te_v2_executor.passes._writes import Writes

RELEASE_NAME = "te_v2_release_saved"
_BOOKKEEPING = frozenset({"python_del", "clear_mutable_collection"})


def _tensor_proxies(values: Iterable[Any]) -> list[TensorProxy]:
    return [v for v in values if isinstance(v, TensorProxy)]


def saved_only_outputs(
    fused: TraceCtx, writes: Writes, is_graph: Callable[[BoundSymbol], bool]
) -> dict[str, frozenset[int]]:
    """For each graph of the training forward ``fused``, by name, the positions among its outputs
    of those only the backward reads: saved for it, with no tensor over their storage (``writes``,
    over the trace before fusion) returned to the caller or read by a symbol outside the graphs.

    Empty where the trace does not return (caller's outputs, saved tensors) as Thunder's
    forwards do."""
    ret = fused.bound_symbols[-1]
    if ret.sym.id != prims.PrimIDs.RETURN or len(ret.args) != 2:
        return {}
    user, saved = ret.args
    kept = {writes.root(t) for t in _tensor_proxies(tree_leaves(user))}
    kept.update(
        writes.root(t)
        for b in fused.bound_symbols[:-1]
        if not is_graph(b) and b.sym.name not in _BOOKKEEPING
        for t in _tensor_proxies(b.flat_args)
    )
    saved_roots = {writes.root(t) for t in _tensor_proxies(tree_leaves(saved))} - kept
    return {
        b.sym.name: frozenset(
            i for i, o in enumerate(b.output) if isinstance(o, TensorProxy) and writes.root(o) in saved_roots
        )
        for b in fused.bound_symbols
        if is_graph(b)
    }


class ReleasePoints:
    """Where a backward graph reads each saved tensor for the last time in the backward: the
    graph's inputs it may free, and its function's symbols with a call freeing each after its last
    reader.

    ``trace`` is the backward before fusion, whose top-level symbols the graphs are runs of;
    ``writes`` is over it with fusions unfolded, so that a view made inside a fusion shares its
    input's storage. ``release`` is what the freeing calls call."""

    def __init__(self, trace: TraceCtx, writes: Writes, release: Callable[..., None]) -> None:
        self.writes = writes
        self.release = release
        self._position = {id(b): i for i, b in enumerate(trace.bound_symbols)}
        self._last: dict[str, int] = {}
        for i, b in enumerate(trace.bound_symbols):
            if b.sym.name not in _BOOKKEEPING:
                for t in _tensor_proxies(b.flat_args):
                    self._last[writes.root(t)] = i

    def releasable(self, bsyms: list[BoundSymbol], inputs: list[Any], outputs: list[Any]) -> list[int]:
        """The positions of the graph's inputs the forward's graphs hold (tagged
        ``STATIC_MEMORY_LOCATION``) that nothing after the graph reads and that no output of it
        may share storage with."""
        end = max((self._position[id(b)] for b in bsyms if id(b) in self._position), default=-1)
        return [
            i
            for i, root in self._unreturned(inputs, outputs)
            if ProxyTag.STATIC_MEMORY_LOCATION in inputs[i].tags and self._last.get(root, -1) <= end
        ]

    def copies_releasable(self, inputs: list[Any], outputs: list[Any], written: set[str]) -> list[int]:
        """The positions of the graph's other inputs, which it reads from copies of its own (the
        cotangents), that no output of it may share storage with and that it writes into none of
        (``written``, by root: such a copy is written back after each replay): each copy may be
        freed after the graph's own last read of it, whatever later graphs read."""
        return [
            i
            for i, root in self._unreturned(inputs, outputs)
            if ProxyTag.STATIC_MEMORY_LOCATION not in inputs[i].tags and root not in written
        ]

    def _unreturned(self, inputs: list[Any], outputs: list[Any]) -> list[tuple[int, str]]:
        returned = {self.writes.root(o) for o in _tensor_proxies(outputs)}
        return [
            (i, root)
            for i, p in enumerate(inputs)
            if isinstance(p, TensorProxy) and (root := self.writes.root(p)) not in returned
        ]

    def with_releases(
        self, bsyms: list[BoundSymbol], inputs: list[Any], positions: list[int]
    ) -> list[BoundSymbol]:
        """``bsyms`` with a call freeing each input at ``positions`` after the last symbol that
        reads a tensor over its storage (at the start where none does), the input kept named
        until then."""
        after: dict[int, list[TensorProxy]] = {}
        for i in positions:
            root = self.writes.root(inputs[i])
            readers = [
                j
                for j, b in enumerate(bsyms)
                if b.sym.name not in _BOOKKEEPING
                and any(self.writes.root(t) == root for t in _tensor_proxies(b.flat_args))
            ]
            after.setdefault(max(readers, default=-1), []).append(inputs[i])
        freed = {inputs[i].name for i in positions}
        released = list(after.pop(-1, []))
        out = [self._release_bsym(released)] if released else []
        for j, b in enumerate(bsyms):
            if b.sym.id == prims.PrimIDs.DEL:
                b = _deleting_none_of(b, freed)
            if b is not None:
                out.append(b)
            if j in after:
                out.append(self._release_bsym(after[j]))
        return out

    def _release_bsym(self, tensors: list[TensorProxy]) -> BoundSymbol:
        return BoundSymbol(_RELEASE, tuple(tensors), {}, None, [], _call_ctx={RELEASE_NAME: self.release})


def _deleting_none_of(bsym: BoundSymbol, names: set[str]) -> BoundSymbol | None:
    """The ``python_del`` ``bsym`` without the tensors named in ``names``, which a later call
    frees through their names (None where it deleted nothing else)."""
    kept = [p for p in bsym.args if getattr(p, "name", None) not in names]
    if len(kept) == len(bsym.args):
        return bsym
    return bsym.from_bsym(args=tuple(kept)) if kept else None


_RELEASE = Symbol(name=RELEASE_NAME, meta=None, is_prim=False)


def memory_of(t: Any) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s memory: ``t`` itself where it has storage, and those a
    wrapper subclass (TE's ``Float8Tensor``: its data, transpose and scale) holds."""
    if not isinstance(t, torch.Tensor):
        return []
    own = [t] if storage_start(t) is not None else []
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return own
    inner = [v for v in vars(t).values() if isinstance(v, torch.Tensor) and v is not t]
    return own + [m for v in inner for m in memory_of(v)]


def storage_start(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage starts, or None for a tensor with none of its own."""
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


def storages(values: Iterable[Any]) -> dict[int, torch.Tensor]:
    """The storages holding ``values``' memory, by where they start, each with a tensor over it."""
    return {storage_start(m): m for v in values for m in memory_of(v)}


def pool_blocks(device: torch.device, pool: tuple[int, int]) -> dict[int, int]:
    """The blocks allocated in the graph memory pool ``pool`` on ``device``, by address, with
    their sizes."""
    blocks = {}
    for segment in torch.cuda.memory_snapshot():
        if segment["device"] != device.index or tuple(segment.get("segment_pool_id", ())) != tuple(pool):
            continue
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                blocks[address] = block["size"]
            address += block["size"]
    return blocks


@contextlib.contextmanager
def allocating_in(pool: tuple[int, int], stream: torch.cuda.Stream) -> Iterator[None]:
    """Allocations of this thread on ``stream`` come from the graph memory pool ``pool`` (whose
    blocks a capture on ``stream`` reuses) while the context lasts, as CUDA graph trees allocate
    a graph's inputs."""
    device = stream.device.index
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)
        try:
            yield
        finally:
            torch._C._cuda_endAllocateToPool(device, pool)
            torch._C._cuda_releasePool(device, pool)
    torch.cuda.current_stream().wait_stream(stream)


def free_to_pool(t: torch.Tensor) -> None:
    """Gives ``t``'s storage's memory back to the allocator now, leaving every tensor over it
    reading that memory without owning it (what CUDA graph trees do to a dead output)."""
    torch._C._free_And_Remove_DeleterFn(t.untyped_storage()._cdata)


def owns_its_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage frees its memory through the caching allocator when it dies."""
    return torch._C._has_Standard_Deleter(t.untyped_storage()._cdata)


def relocate_held(
    handed: Iterable[Any], last: dict[int, weakref.ref], parameters: Iterable[torch.Tensor]
) -> None:
    """Moves each gradient of ``handed`` (``cuda_graphs._Handed``) still held since the backward
    graph handed it out to memory of its own, so that the forward's next replay, which may write
    where it lies, leaves it as it is. Its holders are the tensor handed out (``last``, by
    position) and the ``.grad`` of ``parameters`` autograd made of it; each is set to the new
    memory in place, so every name of it sees the move.

    Raises where something else still reads that memory (a view of a gradient, a gradient kept
    after ``.grad`` was set to None), which cannot be moved with it."""
    grads = [p.grad for p in parameters if p.grad is not None]
    for h in handed:
        if (
            torch._C._storage_Use_Count(h.storage._cdata) == h.own
            and sys.getrefcount(h.storage) <= h.own_python
        ):
            continue
        t = last[h.position]() if h.position in last else None
        holders = [g for g in (t, *grads) if g is not None and g.untyped_storage()._cdata == h.storage._cdata]
        if holders:
            whole = torch.empty((0,), dtype=torch.uint8, device=holders[0].device).set_(h.storage)
            moved = whole.clone().untyped_storage()
            with torch.no_grad():
                for g in holders:
                    g.set_(moved, g.storage_offset(), g.size(), g.stride())
            del whole
        if (
            torch._C._storage_Use_Count(h.storage._cdata) != h.own
            or sys.getrefcount(h.storage) > h.own_python
        ):
            raise RuntimeError(
                "te_v2: a gradient a backward CUDA graph returned is still read, other than through "
                "a parameter's .grad (a view of it, or the tensor kept after .grad was set to None), "
                "when the forward graph replays into memory it may lie in "
                "(TEv2CUDAGraphTransform(reuse_saved_memory=True)). Keep a copy (.clone()) instead, "
                "or leave reuse_saved_memory off."
            )
