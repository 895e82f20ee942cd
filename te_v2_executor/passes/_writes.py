"""Where a trace writes into existing tensors, by storage: the one check behind every pass that
moves a read.

Thunder keeps in-place ops in the joint trace as writes (``copy_(src, dst)`` after it
functionalizes ``h.mul_(2)``, in-place symbols, te_v2's accumulating GEMMs) and renames a written
tensor's aliases with ``update_aliases``, so that later readers read the new names. A proxy
therefore stands for its storage's contents at the point it was made. A pass that moves a read
of a proxy to another position (a GEMM to the sum it is folded into, a GELU into the cast after
it), or lets one proxy stand for another (merged casts, dropped round trips), changes what is
read when the storage is written in between. ``Writes`` answers that question for every pass;
``stale_reads`` finds the reads that already see a later write, which is what Thunder's backward
does when a tensor it saved is written in place after the save.

Storage is over-approximated: every op that may return a view (Thunder's own list, and each
prim-level view) is taken to alias its first input, and a composite whose decomposition returns
an input or a view of it (``F.dropout(x, p=0.0)``) to alias that input; an op Thunder registered
automatically shares what PyTorch's function shares on fake tensors. A pass then refuses a fold
it could have made; it never makes one it should not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import thunder.torch as ltorch
import torch
from thunder.core import dtypes, prims
from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import TraceCtx
from thunder.executors import torchex
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten as torch_tree_flatten
from torch.utils._pytree import tree_map as torch_tree_map

from te_v2_executor.symbols import ACCUMULATE_ARG, ORDERED, SHARES_STORAGE, in_backward

_VIEW_OPS = {
    "reshape",
    "broadcast_in_dim",
    "transpose",
    "slice_prim",
    "squeeze",
    "unsqueeze",
    "view",
    "split",
    "shallow_copy",
    "contiguous",
    "expand",
    "flatten",
    "stride_order",
    # Thunder takes these for copies; PyTorch returns the input itself or a view of it (``ravel`` of
    # a contiguous tensor, ``cpu`` of a CPU one), so a write through one reaches the input.
    "ravel",
    "cpu",
    "resolve_neg",
    "resolve_conj",
    "unsafe_split",
}


def names_as_run(symbols: Iterable[Any]) -> set[str]:
    """The names of ``symbols`` and of the torch executor's symbols that run them, which differ
    for some (``prims.reshape`` runs as ``torch_prims_reshape_impl``, ``getitem`` as ``__getitem__``)."""
    names = set()
    for s in symbols:
        names.add(s.name)
        impl = torchex.ex.implmap.get(s.id)
        if impl is not None and impl.symbol is not None:
            names.add(impl.symbol.name)
    return names


# Ops whose output may share its first input's storage, by name, as Thunder's torch and prims
# versions and the torch executor's call them. Conversions are left to ``_same_dtype_cast``: one
# to another dtype is a copy.
_VIEW_NAMES = frozenset(
    names_as_run(ltorch._syms_returning_views | ltorch._syms_that_may_return_views)
    | names_as_run(s for module in (prims, ltorch) for n in _VIEW_OPS if (s := getattr(module, n, None)))
    | _VIEW_OPS
) - {"to", "convert_element_type"}
# Ops whose derivative reads none of the values of the tensors they take: a read by one does not
# make the backward read the tensor.
_VALUE_FREE_DERIVATIVES = frozenset(
    names_as_run([ltorch.add, ltorch.sub, ltorch.neg, ltorch.clone, ltorch.to, prims.convert_element_type])
    | {"copy_"}
    | _VIEW_NAMES
)
# Reads of a proxy that do not read its values: a cotangent placeholder, the renaming of a
# written tensor's aliases, the trace's return, te_v2's ordering of a write and its check of
# where two names' storage lies.
_NOT_VALUE_READS = frozenset(
    {"get_grad", "update_aliases", "python_return", "python_del", ORDERED.name, SHARES_STORAGE.name}
)


def reads_values(bsym: BoundSymbol) -> bool:
    """Whether ``bsym`` reads the values of the tensors it takes (not only their names)."""
    return bsym.sym.name not in _NOT_VALUE_READS


def _tensors(values: Iterable[Any]) -> list[TensorProxy]:
    return [v for v in values if isinstance(v, TensorProxy)]


def _in_place_name(name: str) -> bool:
    """Whether ``name`` is PyTorch's spelling of an in-place op: ``mul_``, ``__imul__``; not a
    dunder such as ``__getitem__``, which Thunder traces for indexing."""
    if name.startswith("__") and name.endswith("__"):
        return name.startswith("__i")
    return name.endswith("_")


def _inplace_flags() -> dict[str, int]:
    """The position of the ``inplace`` argument of each op that takes one (``F.silu(x,
    inplace=True)``), by the names its symbols run under."""
    return {
        name: at
        for sym, (_, at) in ltorch._inplace_to_out_of_place.items()
        if at >= 0
        for name in names_as_run([sym])
    }


_INPLACE_FLAGS = _inplace_flags()


def _written_as_flagged(bsym: BoundSymbol) -> bool:
    """Whether ``bsym`` is an op called with ``inplace=True``, which Thunder traces as the op
    itself (no ``copy_``) and PyTorch runs in place."""
    at = _INPLACE_FLAGS.get(bsym.sym.name)
    if at is None:
        return False
    flag = bsym.args[at] if len(bsym.args) > at else bsym.kwargs.get("inplace", False)
    return flag is True


def written_tensor(bsym: BoundSymbol) -> TensorProxy | None:
    """The existing tensor ``bsym`` writes into, or None: ``copy_``'s destination, an in-place op's
    first tensor argument, a te_v2 GEMM's ``accumulate_into``. ``prims.copy_(src, dst)`` writes its
    second argument; ``Tensor.copy_`` (``ltorch.copy_(dst, src)``) its first, as the
    ``prims.copy_`` it decomposes into says. A copy of a tensor into itself (``x.copy_(x)``)
    changes no value and writes nothing."""
    if bsym.sym.name == "copy_" and len(bsym.args) >= 2 and bsym.args[0] is bsym.args[1]:
        return None
    if bsym.sym.id == prims.PrimIDs.COPY_:
        return bsym.args[1]
    at = ACCUMULATE_ARG.get(bsym.sym)
    if at is not None:
        found = bsym.args[at] if len(bsym.args) > at else None
        return found if isinstance(found, TensorProxy) else None
    if bsym.subsymbols and bsym.subsymbols[-1].sym.name == "copy_":
        return bsym.subsymbols[-1].args[1]
    if bsym.sym.name == "copy_":  # an executor's prims.copy_, in the prim's order
        return bsym.args[1]
    tags = bsym.sym.tags or ()
    if prims.OpTags.IN_PLACE in tags or _in_place_name(bsym.sym.name) or _written_as_flagged(bsym):
        args = _tensors(bsym.flat_args)
        return args[0] if args else None
    return None


def copy_source(bsym: BoundSymbol) -> TensorProxy | None:
    """The tensor a ``copy_`` copies from (its argument other than the one it writes), or None for
    any other symbol."""
    if bsym.sym.name != "copy_":
        return None
    written = written_tensor(bsym)
    return next((p for p in _tensors(bsym.args) if p is not written), None)


def _aliased_pairs(bsym: BoundSymbol) -> Iterator[tuple[TensorProxy, TensorProxy]]:
    """(output, input) pairs of ``bsym`` that may share storage."""
    outs = _tensors(bsym.flat_outs)
    if bsym.sym.name == "update_aliases":
        yield from zip(outs, _tensors(bsym.args[0]), strict=False)
        return
    written = written_tensor(bsym)
    if written is not None:
        yield from ((o, written) for o in outs)
    elif bsym.sym.name in _VIEW_NAMES or bsym.sym is ORDERED or _same_dtype_cast(bsym):
        args = _tensors(bsym.flat_args)
        if args:
            yield from ((o, args[0]) for o in outs)
    elif (torch_function := _auto_registered_function(bsym.sym)) is not None:
        yield from _torch_aliases(bsym, torch_function)
    elif bsym.subsymbols:
        yield from _returned_inputs(bsym)


def _auto_registered() -> dict[int, tuple[Symbol, Callable[..., Any]]]:
    """Each op Thunder registered automatically, its symbol and the torch executor's symbol that
    runs it, with PyTorch's function, keyed by the symbol's identity: the torch executor's symbols
    are named by the bare function name, which ops of other modules share (``torch.linalg.matmul``
    runs as ``matmul``), and symbols compare equal by that name."""
    found = {}
    for sym in ltorch._torch_to_thunder_function_map.values():
        if not isinstance(sym, Symbol) or prims.OpTags.AUTO_REGISTERED not in (sym.tags or ()):
            continue
        if (function := getattr(sym.meta, "__torchfn", None)) is not None:
            found[id(sym)] = (sym, function)
            if (impl := torchex.ex.implmap.get(sym.id)) is not None and impl.symbol is not None:
                found[id(impl.symbol)] = (impl.symbol, function)
    return found


_AUTO_REGISTERED = _auto_registered()


def _auto_registered_function(sym: Symbol) -> Callable[..., Any] | None:
    """PyTorch's function that ``sym`` runs, where ``sym`` is (the torch executor's symbol of)
    an op Thunder registered automatically; else None."""
    found = _AUTO_REGISTERED.get(id(sym))
    return found[1] if found is not None and found[0] is sym else None


def _torch_aliases(
    bsym: BoundSymbol, torch_function: Callable[..., Any]
) -> Iterator[tuple[TensorProxy, TensorProxy]]:
    """(output, input) pairs of an op Thunder registered automatically, which runs PyTorch's own
    function: ``torch.positive(x)`` returns ``x``, ``torch.adjoint(x)`` a view of it. Told by
    running the function on fake tensors; every pair where that cannot run."""
    outs, args = _tensors(bsym.flat_outs), _tensors(bsym.flat_args)
    try:
        with FakeTensorMode():
            fake_args, fake_kwargs = torch_tree_map(ltorch._get_fake_arg, (bsym.args, bsym.kwargs))
            fake_outs = torch_function(*fake_args, **fake_kwargs)
    except Exception:
        yield from ((o, a) for o in outs for a in args)
        return
    storages = [_storage(t) for t in torch_tree_flatten(fake_args)[0] if isinstance(t, torch.Tensor)]
    fake_outs = [t for t in torch_tree_flatten(fake_outs)[0] if isinstance(t, torch.Tensor)]
    for out, fake in zip(outs, fake_outs, strict=False):
        yield from ((out, a) for a, storage in zip(args, storages, strict=False) if _storage(fake) == storage)


def _storage(t: torch.Tensor) -> int:
    """An id of ``t``'s storage, the same for every view of it (fake tensors included)."""
    return t.untyped_storage()._cdata


def _returned_inputs(bsym: BoundSymbol) -> Iterator[tuple[TensorProxy, TensorProxy]]:
    """(output, input) pairs of a composite whose decomposition returns an input or a view of it:
    ``F.dropout(x, p=0.0)`` decomposes into ``shallow_copy(x)``, and PyTorch returns ``x`` itself."""
    parent: dict[str, str] = {}
    for sub in bsym.subsymbols:
        for out, arg in _aliased_pairs(sub):
            if out.name != arg.name:
                parent[out.name] = parent.get(arg.name, arg.name)
    inputs = {t.name: t for t in _tensors(bsym.flat_args)}
    for out in _tensors(bsym.flat_outs):
        if (source := inputs.get(parent.get(out.name, ""))) is not None:
            yield out, source


def _same_dtype_cast(bsym: BoundSymbol) -> bool:
    """A conversion that may return its input itself (``x.to(x.dtype)``)."""
    if bsym.sym.name not in ("convert_element_type", "to"):
        return False
    a, out = bsym.args[0], bsym.output
    return isinstance(a, TensorProxy) and isinstance(out, TensorProxy) and a.dtype == out.dtype


@dataclass(frozen=True)
class StaleRead:
    """A read of ``tensor`` by ``reader`` after ``writer`` wrote into its storage."""

    reader: BoundSymbol
    tensor: TensorProxy
    writer: BoundSymbol


class Writes:
    """The writes into existing storage of one trace, and the positions of its bound symbols."""

    def __init__(self, trace: TraceCtx) -> None:
        self.bound_symbols = list(trace.bound_symbols)
        self._position = {id(b): i for i, b in enumerate(self.bound_symbols)}
        self._defined: dict[str, int] = {}
        self._parent: dict[str, str] = {}
        self._pairs: list[list[tuple[TensorProxy, TensorProxy]]] = []
        self._over_input: set[str] = set()
        inputs = {t.name for t in _tensors(tree_flatten((trace.args, trace.kwargs))[0])}
        for i, bsym in enumerate(self.bound_symbols):
            if bsym.sym.name.startswith("unpack"):
                inputs.update(t.name for t in _tensors(bsym.flat_outs))
            for out in _tensors(bsym.flat_outs):
                self._defined.setdefault(out.name, i)
            self._pairs.append(list(_aliased_pairs(bsym)))
            for out, arg in self._pairs[-1]:
                self._union(out.name, arg.name)
            if written_tensor(bsym) is None and bsym.sym.name != "update_aliases":
                self._over_input.update(out.name for out, _ in self._pairs[-1])
        self._inputs = inputs
        self._input_roots = {self._root(name) for name in inputs}
        self._writes: dict[str, list[int]] = {}
        for i, bsym in enumerate(self.bound_symbols):
            if (target := written_tensor(bsym)) is not None:
                self._writes.setdefault(self._root(target.name), []).append(i)

    def _root(self, name: str) -> str:
        while (parent := self._parent.get(name, name)) != name:
            self._parent[name] = self._parent.get(parent, parent)
            name = parent
        return name

    def _union(self, a: str, b: str) -> None:
        ra, rb = self._root(a), self._root(b)
        if ra != rb:
            self._parent[ra] = rb

    def root(self, p: TensorProxy) -> str:
        """The name that stands for ``p``'s storage: the same for every tensor that may share it."""
        return self._root(p.name)

    def position(self, bsym: BoundSymbol) -> int:
        """The index of ``bsym`` in the trace."""
        return self._position[id(bsym)]

    def storage_tensors(self, p: TensorProxy) -> list[TensorProxy]:
        """Every tensor of the trace that may share ``p``'s storage, ``p`` included."""
        root = self._root(p.name)
        return [t for b in self.bound_symbols for t in _tensors(b.flat_outs) if self._root(t.name) == root]

    def same_storage(self, a: TensorProxy, b: TensorProxy) -> bool:
        """Whether ``a`` and ``b`` may share storage (one is, or may be, a view of the other)."""
        return self._root(a.name) == self._root(b.name)

    def _write_positions(self, p: TensorProxy) -> list[int]:
        return self._writes.get(self._root(p.name), [])

    def unchanged(self, p: Any, a: int, b: int) -> bool:
        """Whether ``p``'s storage holds the same values at positions ``a`` and ``b`` (in either
        order): no bound symbol strictly between them writes into it."""
        lo, hi = min(a, b), max(a, b)
        return not any(lo < k < hi for k in self._write_positions(p))

    def last_write(self, ps: Iterable[Any]) -> int:
        """The position of the last bound symbol that writes into the storage of any of ``ps``;
        -1 when none does."""
        return max((k for p in ps for k in self._write_positions(p)), default=-1)

    def renamed_from(self, p: TensorProxy) -> TensorProxy:
        """The tensor ``p`` renames through Thunder's ``update_aliases`` (the same tensor when it
        runs), followed back to the first name that is no such rename; ``p`` itself otherwise."""
        while (at := self._defined.get(p.name)) is not None and (
            maker := self.bound_symbols[at]
        ).sym.name == "update_aliases":
            names = [t.name for t in _tensors(maker.flat_outs)]
            sources = _tensors(maker.flat_args)
            if len(names) != len(sources) or p.name not in names:
                break
            p = sources[names.index(p.name)]
        return p

    def written_since_made(self, p: TensorProxy, before: int) -> list[int]:
        """The positions of the writes into ``p``'s storage after ``p`` was made and before
        position ``before``: the writes a read of ``p`` at ``before`` sees that ``p`` did not hold."""
        made = self._defined.get(p.name, -1)
        return [k for k in self._write_positions(p) if made < k < before]

    def carriers(self, bsym: BoundSymbol) -> set[str]:
        """The names of the tensors that carry ``bsym``'s outputs on: the outputs, and what views,
        renames (``update_aliases``) and writes into them make of them after it."""
        names = {t.name for t in _tensors(bsym.flat_outs)}
        for pairs in self._pairs[self.position(bsym) + 1 :]:
            names.update(out.name for out, arg in pairs if arg.name in names)
        return names

    def ever_written(self, p: Any) -> bool:
        """Whether any bound symbol writes into ``p``'s storage."""
        return bool(self._write_positions(p))

    def reaches(self, p: Any, at: int, readers: Iterable[BoundSymbol]) -> bool:
        """Whether the values ``p`` holds at position ``at`` are still its values where each of
        ``readers`` stands: the check for a pass that lets ``p`` serve readers of another proxy."""
        return all(self.unchanged(p, at, self.position(r)) for r in readers)

    def moved_reads_unchanged(
        self, originals: Iterable[BoundSymbol], replacement: BoundSymbol, at: int
    ) -> bool:
        """Whether ``replacement``, put at position ``at`` in place of ``originals``, reads every
        tensor with the values the originals read it with."""
        originals = list(originals)
        return all(
            self.unchanged(p, self.position(b), at)
            for p in _tensors(replacement.flat_args)
            for b in originals
            if any(a is p for a in b.flat_args)
        )

    def made_here(self, p: TensorProxy) -> bool:
        """Whether ``p``'s storage was made by a bound symbol of the trace: no tensor that may
        share it is a trace input (an argument or what an unpack symbol gives)."""
        return self._root(p.name) not in self._input_roots

    def origin(self, p: TensorProxy) -> BoundSymbol | None:
        """The bound symbol that made ``p``'s storage; None where it is a trace input's."""
        if not self.made_here(p):
            return None
        root = self._root(p.name)
        return self.bound_symbols[min(i for name, i in self._defined.items() if self._root(name) == root)]

    def stale_reads(self) -> Iterator[StaleRead]:
        """Reads of a proxy after a later write into its storage: the reader sees values the proxy
        did not hold when it was made."""
        for j, bsym in enumerate(self.bound_symbols):
            if not reads_values(bsym):
                continue
            for p in _tensors(bsym.flat_args):
                if later := self.written_since_made(p, j):
                    yield StaleRead(bsym, p, self.bound_symbols[later[0]])

    def stale_backward_reads(self) -> Iterator[StaleRead]:
        """The backward's reads of a tensor after a write into its storage that came after the
        forward took the values the backward needs of it (``_taken``): those read values the
        forward did not."""
        for stale in self.stale_reads():
            if not in_backward(stale.reader):
                continue
            taken, at = self._taken(stale.tensor), self.position(stale.reader)
            if later := [k for k in self.written_since_made(stale.tensor, at) if k >= taken]:
                yield StaleRead(stale.reader, stale.tensor, self.bound_symbols[later[0]])

    def _taken(self, p: TensorProxy) -> int:
        """Where the forward took the values of ``p`` that the backward may read: where ``p`` was
        made, or, for an input, for an op's result over its input's storage (a view,
        ``F.dropout(x, p=0.0)``) and for the result of an op whose derivative reads no values (a
        cast: ``x.to(torch.bfloat16)``), whose backward reads none of its values, at the
        forward's first read of ``p`` whose derivative does (an op such as ``exp`` reads its own
        result in its backward, so there the values were taken where it was made). Thunder
        renames only the views it knows of after a write, so the
        forward reads the others after it under their old names (``v = F.dropout(x, p=0.0);
        x.add_(v); linear(v)``), and their backward reads what those reads read. A read of ``p``
        through ``te_v2_ordered`` (``write_order``), which stands for ``p`` waiting for a write,
        is a read of ``p``."""
        made = self._defined.get(p.name, -1)
        read_by_its_maker = made < 0 or self.bound_symbols[made].sym.name not in _VALUE_FREE_DERIVATIVES
        if p.name not in self._over_input and p.name not in self._inputs and read_by_its_maker:
            return made
        names = {p.name}
        for i in range(made + 1, len(self.bound_symbols)):
            bsym = self.bound_symbols[i]
            args = _tensors(bsym.flat_args)
            if bsym.sym is ORDERED and args and args[0].name in names:
                names.update(o.name for o in _tensors(bsym.flat_outs))
            elif (
                not in_backward(bsym)
                and reads_values(bsym)
                and bsym.sym.name not in _VALUE_FREE_DERIVATIVES
                and any(a.name in names for a in args)
            ):
                return i
        return len(self.bound_symbols)


def _where(bsym: BoundSymbol) -> str:
    """``bsym``'s name and, when Thunder recorded it, the source line it was traced from."""
    if bsym.sym.name == "python_return":
        return "the compiled function's return"
    if bsym.source_filename and bsym.source_positions is not None and bsym.source_positions.lineno:
        return f"{bsym.sym.name} at {bsym.source_filename}:{bsym.source_positions.lineno}"
    return bsym.sym.name


_STALE_READ = (
    "te_v2: {tensor} is needed by {reader} but was modified by an in-place operation ({writer}) "
    "before it is read. Thunder would silently compute with the modified values; eager PyTorch "
    "raises 'one of the variables needed for gradient computation has been modified by an "
    "inplace operation' where autograd saved the tensor itself. Clone the tensor before writing "
    "into it (`h = h.clone()`) or use the out-of-place op (`h = h * 2` instead of `h.mul_(2)`)."
)


def describe(writes: Writes, stale: StaleRead, template: str = _STALE_READ) -> str:
    """The error a stale read gets (or ``template`` filled the same way): the tensor (where its
    storage was made), its reader and the write, and how to avoid it."""
    t = stale.tensor
    origin = writes.origin(t)
    made = "an input of the compiled function" if origin is None else f"made by {_where(origin)}"
    tensor = f"tensor {t.name} ({dtypes.to_torch_dtype(t.dtype)}{list(t.shape)}, {made})"
    return template.format(tensor=tensor, reader=_where(stale.reader), writer=_where(stale.writer))


def check_no_new_stale_reads(before: TraceCtx, after: TraceCtx) -> None:
    """Raise if ``after``, made from ``before`` by te_v2's passes, reads a tensor after a write
    into it that ``before`` did not: a pass moved a read past a write, a te_v2 bug."""
    known = {s.tensor.name for s in Writes(before).stale_reads()}
    writes = Writes(after)
    for stale in writes.stale_reads():
        if stale.tensor.name not in known:
            raise RuntimeError(
                f"te_v2 internal error, please report: a pass moved a read past a write. {describe(writes, stale)}"
            )
