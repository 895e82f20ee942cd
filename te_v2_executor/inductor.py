"""Thunder's torch.compile fusion executor, its regions called without Dynamo.

te_v2 fuses nothing itself; the ops between its GEMMs go to a fusion executor listed after it,
and Thunder's general one, ``torch_compile_ex``, compiles each region with ``torch.compile``.
Thunder's trace already fixes what a region does and the dtypes and shapes it sees, yet every
call of every region goes through Dynamo again: its frame hook, its cache lookup, the guards of
each input, then AOTAutograd's wrappers. A 16-layer Llama calls about 180 regions a step, and
that host time, not the GPU's, bounds the step where the GEMMs are small (docs/performance.md,
"Where the host time goes").

``inductor_ex`` is the same executor with the same ops and the same Inductor: each region's
Thunder trace is recorded as an FX graph (``make_fx``, on fake tensors) and compiled by
``torch._inductor.compile`` once per input layout (sizes, strides, dtype, device of each tensor,
the value of each number), and the compiled code is called directly. Inductor's generated code
checks each tensor's sizes and strides itself, and copies inputs that are not aligned as it
assumed. What the direct route does not key on goes through Dynamo as before: tensor
subclasses, values that are not numbers, numbers that change between calls on tensors of one
layout (a random seed, a step count: Dynamo makes them dynamic, where each value would compile
here), a region that has seen more than ``MAX_LAYOUTS`` layouts, and a region that writes in
place, whose result may depend on which of its inputs alias each other, which Dynamo guards and
the layout does not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from thunder.core.symbol import BoundSymbol
from thunder.executors.torch_compile import TorchCompileExecutor, torch_compile_ex
from thunder.executors.utils import Region
from thunder.extend import register_executor

MAX_LAYOUTS = 8

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_NUMBERS = (bool, int, float, complex, type(None), torch.dtype, torch.device)


def _layout(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """What a compiled region is specialized on: the position, sizes, strides, dtype and device of
    each tensor, then the position, type and value of each number; None if an argument is
    neither a plain tensor nor a number."""
    tensors, numbers = [], []
    for i, a in enumerate(args):
        if type(a) in _PLAIN_TENSORS:
            tensors.append((i, a.shape, a.stride(), a.dtype, a.device))
        elif type(a) in _NUMBERS:
            numbers.append((i, type(a), a))
        else:
            return None
    return tuple(tensors), tuple(numbers)


class DirectRegion:
    """One fusion region's torch callable, compiled by Inductor per input layout and called
    without Dynamo; through ``torch.compile`` where the layout cannot key it."""

    def __init__(self, fn: Callable, *, mode: str | None = None, fullgraph: bool = True) -> None:
        self.fn = fn
        self.compiled: dict[tuple[tuple[Any, ...], tuple[Any, ...]], Callable] = {}
        self._dynamo_options = dict(mode=mode, fullgraph=fullgraph)
        self._dynamo: Callable | None = None
        self.writes = False

    def __call__(self, *args: Any) -> Any:
        key = _layout(args)
        compiled = self.compiled.get(key) if key is not None else None
        if compiled is None:
            if (
                key is None
                or self.writes
                or len(self.compiled) >= MAX_LAYOUTS
                or any(tensors == key[0] for tensors, _ in self.compiled)
            ):
                return self.through_dynamo(*args)
            from torch.fx.experimental.proxy_tensor import make_fx

            graph = make_fx(self.fn, tracing_mode="fake")(*args)
            self.writes = _writes(graph)
            if self.writes:
                return self.through_dynamo(*args)
            compiled = self.compiled[key] = torch._inductor.compile(graph, list(args))
        return compiled(*args)

    def through_dynamo(self, *args: Any) -> Any:
        """The call as Thunder's torch.compile executor makes it."""
        if self._dynamo is None:
            self._dynamo = _torch_compile(self.fn, **self._dynamo_options)
        return self._dynamo(*args)


def _writes(graph: torch.fx.GraphModule) -> bool:
    """Whether ``graph`` has an op that writes in place (``copy_``, ``mul_``)."""
    return any(
        isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
        for node in graph.graph.nodes
        if node.op == "call_function"
    )


_torch_compile = torch.compile


@contextlib.contextmanager
def _compiling_directly() -> Iterator[None]:
    """Within, ``torch.compile(fn, ...)`` makes a ``DirectRegion``: Thunder's executor builds
    each region's callable and hands it to ``torch.compile``, the one step this executor
    changes."""

    def direct(fn: Callable, *, mode: str | None = None, fullgraph: bool = True, **_: Any) -> DirectRegion:
        return DirectRegion(fn, mode=mode, fullgraph=fullgraph)

    with mock.patch.object(torch, "compile", direct):
        yield


class InductorExecutor(TorchCompileExecutor):
    """Thunder's torch.compile executor (same ops, same regions, same Inductor), whose regions
    are called without Dynamo (``DirectRegion``)."""

    def __init__(self, name: str = "te_v2_inductor") -> None:
        super().__init__(name)
        self._implmap = torch_compile_ex._implmap

    def fuse(self, region: Region, fusion_counter: int) -> BoundSymbol:
        with _compiling_directly():
            return super().fuse(region, fusion_counter)


inductor_ex = InductorExecutor()
register_executor(inductor_ex)
