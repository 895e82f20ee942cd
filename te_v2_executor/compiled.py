"""The Thunder functions behind a user's compiled callable, and what te_v2 keeps per function.

A ``thunder.jit`` callable is one function; a ``thunder.dynamo.thunderfx`` object is one per
region Dynamo handed Thunder. te_v2 keeps its quantization states and its reports per function,
keyed by the function's Thunder compile data (which lives as long as the function).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def compiled_functions(fn: Any) -> list[Any]:
    """``fn`` itself, or for a ``thunder.dynamo.thunderfx`` object the ``thunder.jit`` function of
    each region it compiled, in the order Dynamo made them."""
    from thunder.dynamo.compiler import ThunderFXCompiledObject

    if not isinstance(fn, ThunderFXCompiledObject):
        return [fn]
    return [jitted for info in fn._backend.subgraph_infos for jitted in info.thunder_compiled_fns]


class PerFunction(Generic[T]):
    """One ``T`` per Thunder compile data, made by ``factory`` on its first request; a trace
    built outside any compile data (a direct call of a pass) shares one."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._made: weakref.WeakKeyDictionary[Any, T] = weakref.WeakKeyDictionary()
        self._unowned = factory()

    def __call__(self, compile_data: Any) -> T:
        """The ``T`` of ``compile_data`` (the shared one for None)."""
        if compile_data is None:
            return self._unowned
        found = self._made.get(compile_data)
        if found is None:
            found = self._made[compile_data] = self._factory()
        return found


def module_input_names() -> dict[str, str]:
    """The parameters and buffers of the module being compiled now, by the name of the proxy its
    trace reads each as: their qualified names, dots as underscores (``linears_0_weight``).

    Thunder names the proxy of a parameter after the local name it was first read under (``w``,
    in ``def lin(w): return F.linear(x, w)``), so a retrace that reads the parameters in another
    order gives that name to another one; the prologue Thunder built for this trace (each of its
    versions) says which parameter each proxy is. Empty outside a compilation, and for a
    function, whose inputs are its arguments. Reads Thunder's private compile-stats context,
    where its prologue traces are.
    """
    from thunder.core import compile_data, prims

    _, stats = compile_data._compile_data.get()
    prologues = getattr(stats, "last_prologue_traces", None)
    if not prologues:
        return {}
    unpacks = (prims.PrimIDs.UNPACK_PARAMETER, prims.PrimIDs.UNPACK_BUFFER)
    return {
        bsym.output.name: bsym.args[1].replace(".", "_")
        for prologue in prologues
        for bsym in prologue.bound_symbols
        if bsym.sym.id in unpacks and isinstance(bsym.args[1], str)
    }
