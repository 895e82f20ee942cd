"""``thunderfx`` with te_v2: Thunder's torch.compile route, with te_v2's executors and the rewrites
that must see Dynamo's whole graph, before Thunder's splitter cuts it into regions.

``thunder.dynamo.thunderfx(model, executors=te_v2_executor.executors())`` runs te_v2 as well;
this entry adds what an executor cannot do from inside one of Thunder's regions: attention masks
proved causal when Dynamo compiles (``causal_masks``), which halves a causal attention's work and
keeps the ops Hugging Face builds its mask from out of the split; grouped-query attentions over
unrepeated keys and values (``grouped_attention``); checkpointed functions no gradient flows
through called inline, where Thunder would keep their linears from te_v2
(``gradless_checkpoints``); a region te_v2 refuses to
compile, because Thunder would differentiate it wrong, run eagerly instead (``EagerOnRefusal``);
and a warning where a linear of the model runs eagerly, outside what Dynamo compiled, so without
te_v2 (a graph break Dynamo makes at each layer Hugging Face checkpoints, for one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from thunder.dynamo import ThunderCompiler
from thunder.dynamo.compiler import ThunderFXCompiledObject
from thunder.dynamo.utils import SubgraphInfo, get_torch_compile_kwargs

from te_v2_executor import causal_masks, gradless_checkpoints, grouped_attention
from te_v2_executor.executor import TEv2Executor, _warn_once, executors
from te_v2_executor.passes.stale_reads import EAGER_FALLBACK_OPTION, RefusedProgram


class TEv2Compiler(ThunderCompiler):
    """Thunder's torch.compile backend, after te_v2's graph rewrites of each graph Dynamo hands it.

    ``causal_attentions`` counts the attentions ``causal_masks.fold`` made causal so far,
    ``grouped_attentions`` those ``grouped_attention.fold`` made read unrepeated keys and values,
    and ``inlined_checkpoints`` the checkpointed functions no gradient flows through that
    ``gradless_checkpoints.inline`` called inline, so that te_v2 runs their linears."""

    def __init__(
        self, *, fold_causal_masks: bool = True, fold_grouped_attentions: bool = True, **thunder_options: Any
    ) -> None:
        super().__init__(**{EAGER_FALLBACK_OPTION: True, **thunder_options})
        self.fold_causal_masks = fold_causal_masks
        self.fold_grouped_attentions = fold_grouped_attentions
        self.causal_attentions = 0
        self.grouped_attentions = 0
        self.inlined_checkpoints = 0

    def __call__(self, gm: torch.fx.GraphModule, sample_args: list[Any]) -> Callable:
        self.inlined_checkpoints += gradless_checkpoints.inline(gm)
        if self.fold_causal_masks:
            self.causal_attentions += causal_masks.fold(gm)
        if self.fold_grouped_attentions:
            self.grouped_attentions += grouped_attention.fold(gm)
        split = super().__call__(gm, sample_args)
        info = self.subgraph_infos[-1]
        originals = {id(c.compiled_fn): m for m, c in info.submodule_to_compiled_functions.items()}
        for name, region in list(split.named_children()):
            if region in info.thunder_compiled_fns and (
                eager := _eager_twin(region, originals.get(id(region)))
            ):
                where = f"region {name} of Dynamo's graph {len(self.subgraph_infos) - 1}"
                setattr(split, name, EagerOnRefusal(region, eager, where, info))
        return split


class EagerOnRefusal(torch.nn.Module):
    """One of Thunder's regions, run as Dynamo captured it, eagerly, once te_v2 refuses to compile
    it (``RefusedProgram``).

    te_v2 refuses a forward Thunder 0.2.6 would differentiate wrong (a write in place into the
    region's input that requires grad, an activation a graph break hands over) while compiling
    it, before any of it runs; the same call then runs the region's graph module (``eager``,
    ``_eager_twin``), over the same parameters, with eager's gradients and its linears without
    FP8, and warns once, naming the region (``where``) and the refusal. The refused function
    leaves ``info.thunder_compiled_fns``, as it has no traces."""

    def __init__(
        self, jitted: torch.nn.Module, eager: torch.nn.Module, where: str, info: SubgraphInfo
    ) -> None:
        super().__init__()
        self.jitted = jitted
        self.eager = eager
        self.where = where
        self.refused = False
        self._info = info

    def forward(self, *args: Any) -> Any:
        if not self.refused:
            try:
                return self.jitted(*args)
            except RefusedProgram as e:
                self.refused = True
                self._info.thunder_compiled_fns.remove(self.jitted)
                _warn_once(
                    f"te_v2: {self.where} runs eagerly, its linears without te_v2 and so in the model's "
                    f"dtype, because te_v2 refused to compile it: {e}"
                )
        return self.eager(*args)


def _eager_twin(jitted: torch.nn.Module, original: torch.nn.Module | None) -> torch.nn.Module | None:
    """What runs a Thunder region as Dynamo captured it: the copy Thunder's splitter kept from
    before it rewrote checkpointed functions into Thunder's ops (which run only traced), where
    that copy holds no parameter or buffer (Dynamo passes them in, so the copy reads the model's
    own); else the region's own graph where it checkpoints nothing; else None (not wrapped)."""
    if (
        original is not None
        and next(original.parameters(), None) is None
        and next(original.buffers(), None) is None
    ):
        return original
    graph = jitted._model
    if any(n.target is torch.ops.higher_order.tag_activation_checkpoint for n in graph.graph.nodes):
        return None
    return graph


def thunderfx(
    fn: Callable,
    /,
    *,
    fold_causal_masks: bool = True,
    fold_grouped_attentions: bool = True,
    warn_eager_linears: bool = True,
    **kwargs: Any,
) -> ThunderFXCompiledObject:
    """``fn`` compiled as ``thunder.dynamo.thunderfx`` compiles it, with ``executors()`` unless
    ``executors=`` says otherwise, attention masks proved causal run causal
    (``fold_causal_masks``), attentions over keys and values repeated to every query head read
    the unrepeated ones (``fold_grouped_attentions``, ``grouped_attention``), and checkpointed
    functions no gradient flows through called inline (``gradless_checkpoints``). Other keyword
    arguments go to ``torch.compile`` or ``thunder.jit``, as thunderfx's do
    (``transforms=[TEv2CUDAGraphTransform()]``, ``dynamic=False``).

    The result is thunderfx's: ``last_traces``, ``last_backward_traces`` and
    ``_backend.subgraph_infos`` work alike. With ``warn_eager_linears``, each ``nn.Linear`` of a
    module ``fn`` gets a forward pre-hook (``EagerRunWarning``), so that where one runs eagerly,
    outside what Dynamo compiled, and so in the model's dtype without te_v2, the first such
    linear warns (``TEv2FallbackWarning``). Subclasses of ``nn.Linear`` get none: Dynamo may run
    such a module's call eagerly and still compile its ``forward``, which te_v2 then runs."""
    kwargs.setdefault("executors", executors())
    if (
        warn_eager_linears
        and isinstance(fn, torch.nn.Module)
        and any(isinstance(e, TEv2Executor) for e in kwargs["executors"])
    ):
        _warn_where_linears_run_eagerly(fn)
    compile_kwargs = get_torch_compile_kwargs(**kwargs)
    thunder_options = {k: v for k, v in kwargs.items() if k not in compile_kwargs}
    backend = TEv2Compiler(
        fold_causal_masks=fold_causal_masks,
        fold_grouped_attentions=fold_grouped_attentions,
        **thunder_options,
    )
    return ThunderFXCompiledObject(backend, torch.compile(fn, backend=backend, **compile_kwargs))


class EagerRunWarning:
    """A forward pre-hook that warns once (``TEv2FallbackWarning``) where its module runs
    eagerly, outside any function Dynamo compiled; in a compiled function it is traced away.

    Hooks given one ``group`` warn only for the first of them to run eagerly. A hook is an object,
    not a closure, so that a model that holds it can still be pickled (``torch.save(model)``) and
    deep-copied. Dynamo never compiles ``__call__`` as a frame of its own, which it does where it
    runs the module eagerly (a frame it skipped): there ``is_compiling()`` would be traced as true
    and the warning lost."""

    def __init__(self, message: str, group: list[str] | None = None) -> None:
        self.message = message
        self.group = [] if group is None else group

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling() and not self.group:
            self.group.append(self.message)
            _warn_once(self.message)


torch._dynamo.eval_frame.skip_code(EagerRunWarning.__call__.__code__)


def _warn_where_linears_run_eagerly(model: torch.nn.Module) -> None:
    """Hooks every ``nn.Linear`` of ``model`` that has no ``EagerRunWarning`` yet (a model compiled
    again, or its copy) so that the first one to run eagerly warns, naming itself: one warning for
    a model, whose other linears most likely run eagerly for the same reason, so the new hooks
    join the group of those it has (a submodule compiled before)."""
    linears = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    hooked = {
        m: h for _, m in linears for h in m._forward_pre_hooks.values() if isinstance(h, EagerRunWarning)
    }
    group = next(iter(hooked.values())).group if hooked else []
    for name, module in linears:
        if module in hooked:
            continue
        message = (
            f"te_v2: {name or 'the model'} (an nn.Linear) ran outside the compiled function, so in "
            "the model's dtype without te_v2 or FP8, and likely other linears too: Dynamo broke "
            "the graph around it, or the model itself was called instead of its compiled callable. "
            "Hugging Face gradient checkpointing (gradient_checkpointing_enable) makes Dynamo break "
            "the graph at each checkpointed layer: turn it off to run the layers in FP8 "
            "(docs/usage.md, Troubleshooting). explain(compiled) lists the linears te_v2 runs; "
            "thunderfx(..., warn_eager_linears=False) leaves the model unhooked."
        )
        module.register_forward_pre_hook(EagerRunWarning(message, group))
