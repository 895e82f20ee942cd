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
