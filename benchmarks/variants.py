"""The variants compared: how each one turns the benchmark model into a step function."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import thunder
import torch

from benchmarks.models import Blocks, linear_factories
from te_v2_executor import ClaimPolicy, TEv2CUDAGraphTransform, executors, make_te_v2, te_v2
from te_v2_executor.passes import OPTIONAL

DEFAULT_TE_V2 = "te_v2, executors()"  # what README tells users to write


@dataclass(frozen=True)
class Variant:
    name: str
    fp8: bool  # runs under te.autocast
    linear: str  # "torch" or "te": what the base linears are
    compile: Callable[[torch.nn.Module], Callable] | None  # None: eager


def _fusers() -> dict[str, list]:
    from thunder.executors.nvfuserex import nvfuserex
    from thunder.executors.torch_compile import torch_compile_ex

    fusers = {"": [], " + torch.compile": [torch_compile_ex]}
    if nvfuserex is not None:
        fusers[" + nvFuser"] = [nvfuserex]
    return fusers


def _builtin(fusers: list) -> Callable:
    from thunder.executors.transformer_engineex import TransformerEngineTransform, transformer_engine_ex

    return lambda m: thunder.jit(
        m, executors=[transformer_engine_ex, *fusers], transforms=[TransformerEngineTransform()]
    )


def _thunder(fusers: list) -> Callable:
    return lambda m: thunder.jit(m, executors=fusers)


def _te_v2(fusers: list, executor=te_v2) -> Callable:
    return lambda m: thunder.jit(m, executors=[executor, *fusers])


def _te_v2_graphed(fusers: list) -> Callable:
    """te_v2 with forward and backward replayed as CUDA graphs (a fresh transform per model)."""
    return lambda m: thunder.jit(m, executors=[te_v2, *fusers], transforms=[TEv2CUDAGraphTransform()])


def variants(*, lora: bool) -> list[Variant]:
    """Every variant, Thunder ones with and without each fusion executor installed (and each
    fuser alone in BF16)."""
    found = [Variant("torch bf16 eager", False, "torch", None), Variant("te.Linear eager", True, "te", None)]
    for suffix, fusers in _fusers().items():
        if fusers:
            found.append(Variant(f"thunder bf16{suffix}", False, "torch", _thunder(fusers)))
        found.append(Variant(f"builtin TE{suffix}", True, "torch", _builtin(fusers)))
        found.append(Variant(f"te_v2{suffix}", True, "torch", _te_v2(fusers)))
    found.append(Variant(DEFAULT_TE_V2, True, "torch", lambda m: thunder.jit(m, executors=executors())))
    compile_fusers = _fusers()[" + torch.compile"]
    found.append(
        Variant("te_v2 + torch.compile + CUDA graphs", True, "torch", _te_v2_graphed(compile_fusers))
    )
    if lora:  # against the default claim policy, which keeps rank-16 adapters in BF16
        fp8_adapters = make_te_v2(claim=ClaimPolicy(min_features=0))
        found.append(
            Variant(
                "te_v2 + torch.compile, adapters FP8",
                True,
                "torch",
                _te_v2(compile_fusers, fp8_adapters),
            )
        )
    return found


def ablations() -> list[Variant]:
    """Variants that switch one te_v2 optimisation off (a claim, or an optional pass), for
    ``benchmarks.interleaved`` only."""
    compile_fusers = _fusers()[" + torch.compile"]
    no_gelu = make_te_v2(claim=ClaimPolicy(gelu=False))
    thunder_adapters = make_te_v2(claim=ClaimPolicy(unquantized=False))
    without_pass = [
        Variant(
            f"te_v2 + torch.compile without {name}",
            True,
            "torch",
            _te_v2(compile_fusers, make_te_v2(skip_passes=[name])),
        )
        for name in OPTIONAL
    ]
    return [
        *without_pass,
        Variant("te_v2 + torch.compile, GELU not claimed", True, "torch", _te_v2(compile_fusers, no_gelu)),
        Variant(
            "te_v2 + torch.compile, adapters on Thunder",
            True,
            "torch",
            _te_v2(compile_fusers, thunder_adapters),
        ),
    ]


def build(
    variant: Variant, reference: Blocks, kind: str, depth: int, scenario: str
) -> tuple[torch.nn.Module, Callable]:
    """The variant's model (weights copied from ``reference``) and its step function."""
    model = Blocks(kind, depth, scenario, linear_factories()[variant.linear])
    weights = dict(reference.named_parameters())
    with torch.no_grad():  # by parameter, as te.Linear's state_dict also holds FP8 metadata
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    return model, model if variant.compile is None else variant.compile(model)


def reference_model(kind: str, depth: int, scenario: str) -> Blocks:
    """The weights every variant of one configuration starts from."""
    torch.manual_seed(0)
    return Blocks(kind, depth, scenario, linear_factories()["torch"])
