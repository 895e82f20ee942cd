"""``thunderfx`` with te_v2: Thunder's torch.compile route, with te_v2's executors and the rewrites
that must see Dynamo's whole graph, before Thunder's splitter cuts it into regions.

``thunder.dynamo.thunderfx(model, executors=te_v2_executor.executors())`` runs te_v2 as well;
this entry adds what an executor cannot do from inside one of Thunder's regions: attention masks
proved causal when Dynamo compiles (``causal_masks``), which halves a causal attention's work and
keeps the ops Hugging Face builds its mask from out of the split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from thunder.dynamo import ThunderCompiler
from thunder.dynamo.compiler import ThunderFXCompiledObject
from thunder.dynamo.utils import get_torch_compile_kwargs

from te_v2_executor import causal_masks
from te_v2_executor.executor import executors


class TEv2Compiler(ThunderCompiler):
    """Thunder's torch.compile backend, after te_v2's graph rewrites of each graph Dynamo hands it.

    ``causal_attentions`` counts the attentions ``causal_masks.fold`` made causal so far."""

    def __init__(self, *, fold_causal_masks: bool = True, **thunder_options: Any) -> None:
        super().__init__(**thunder_options)
        self.fold_causal_masks = fold_causal_masks
        self.causal_attentions = 0

    def __call__(self, gm: torch.fx.GraphModule, sample_args: list[Any]) -> Callable:
        if self.fold_causal_masks:
            self.causal_attentions += causal_masks.fold(gm)
        return super().__call__(gm, sample_args)


def thunderfx(fn: Callable, /, *, fold_causal_masks: bool = True, **kwargs: Any) -> ThunderFXCompiledObject:
    """``fn`` compiled as ``thunder.dynamo.thunderfx`` compiles it, with ``executors()`` unless
    ``executors=`` says otherwise, and attention masks proved causal run causal
    (``fold_causal_masks``). Other keyword arguments go to ``torch.compile`` or ``thunder.jit``,
    as thunderfx's do (``transforms=[TEv2CUDAGraphTransform()]``, ``dynamic=False``).

    The result is thunderfx's: ``last_traces``, ``last_backward_traces`` and
    ``_backend.subgraph_infos`` work alike."""
    kwargs.setdefault("executors", executors())
    compile_kwargs = get_torch_compile_kwargs(**kwargs)
    thunder_options = {k: v for k, v in kwargs.items() if k not in compile_kwargs}
    backend = TEv2Compiler(fold_causal_masks=fold_causal_masks, **thunder_options)
    return ThunderFXCompiledObject(backend, torch.compile(fn, backend=backend, **compile_kwargs))
