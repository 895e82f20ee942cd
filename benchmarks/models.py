"""Benchmark models: stacks of MLP or attention-projection blocks, full, LoRA, alternate-frozen."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from benchmarks.shapes import BLOCKS, HIDDEN, LORA_RANK

SCENARIOS = ("full", "lora", "alternate-frozen", "inference")


class Adapted(nn.Module):
    """A linear, plus a LoRA update B(A(x)) when ``rank`` is set (base then frozen)."""

    def __init__(self, in_f: int, out_f: int, factory: Callable, rank: int | None) -> None:
        super().__init__()
        self.base = factory(in_f, out_f)
        self.lora = None
        if rank:
            self.base.requires_grad_(False)
            device = self.base.weight.device
            self.lora = nn.Sequential(
                nn.Linear(in_f, rank, bias=False, device=device, dtype=torch.bfloat16),
                nn.Linear(rank, out_f, bias=False, device=device, dtype=torch.bfloat16),
            )
            nn.init.normal_(self.lora[1].weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return y if self.lora is None else y + self.lora(x)


class Blocks(nn.Module):
    """``depth`` blocks of ``kind``; LoRA adapters on every linear (the adapters stay plain
    nn.Linear in every variant, as PEFT adds them)."""

    def __init__(
        self, kind: str, depth: int, scenario: str, factory: Callable, *, rank: int = LORA_RANK
    ) -> None:
        super().__init__()
        self.kind = kind
        rank = rank if scenario == "lora" else None
        self.layers = nn.ModuleList(
            Adapted(i, o, factory, rank) for _ in range(depth) for i, o in BLOCKS[kind]
        )
        if scenario == "alternate-frozen":
            for i, layer in enumerate(self.layers):
                if i % 2 == 0:
                    layer.requires_grad_(False)
        if scenario == "inference":
            self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # by index: slicing a ModuleList inside thunder.jit intermittently fails to trace
        for i in range(0, len(self.layers), 2):
            h = self.layers[i](x)
            h = torch.nn.functional.gelu(h) if self.kind == "mlp" else h[..., :HIDDEN]
            x = self.layers[i + 1](h)
        return x


def needed_flops(model: Blocks, tokens: int, training: bool) -> float:
    """FLOPs a step needs: 2MKN forward per linear; in training 2MKN more for a dgrad whose
    result something trainable needs, and 2MKN for the wgrad of a trained weight."""

    def work(lin: nn.Module, input_needs_grad: bool) -> float:
        gemm = 2.0 * tokens * lin.weight.shape[0] * lin.weight.shape[1]
        return gemm * (1 + (training and input_needs_grad) + (training and lin.weight.requires_grad))

    total, upstream_trains = 0.0, False
    for layer in model.layers:
        total += work(layer.base, upstream_trains)
        if layer.lora is not None:
            a, b = layer.lora
            total += work(a, upstream_trains) + work(b, upstream_trains or a.weight.requires_grad)
        upstream_trains = upstream_trains or any(p.requires_grad for p in layer.parameters())
    return total


def linear_factories() -> dict[str, Callable]:
    """How each variant builds a base linear."""

    def torch_linear(i: int, o: int) -> nn.Module:
        return nn.Linear(i, o, bias=False, device="cuda", dtype=torch.bfloat16)

    def te_linear(i: int, o: int) -> nn.Module:
        import transformer_engine.pytorch as te

        return te.Linear(i, o, bias=False, params_dtype=torch.bfloat16, device="cuda")

    return {"torch": torch_linear, "te": te_linear}
