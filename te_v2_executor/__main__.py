"""``python -m te_v2_executor``: compile a small frozen-base model with te_v2 and print, per
linear, which of dgrad / wgrad / bgrad run and which FP8 copies the forward saves.

On a GPU with TransformerEngine it uses the TE backend; elsewhere the plain-torch reference.
"""

from __future__ import annotations

import argparse
import warnings

import thunder
import torch
from torch import nn

from te_v2_executor import TEv2FallbackWarning, backends, explain, make_te_v2


class FrozenBaseModel(nn.Module):
    """A frozen input projection, two frozen MLP layers with trainable rank-16 LoRA adapters,
    and a trainable output head with bias."""

    def __init__(self, dim: int = 1024, rank: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.base = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(2))
        self.lora_a = nn.ModuleList(nn.Linear(dim, rank, bias=False) for _ in range(2))
        self.lora_b = nn.ModuleList(nn.Linear(rank, dim, bias=False) for _ in range(2))
        self.head = nn.Linear(dim, dim, bias=True)
        self.proj.requires_grad_(False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for base, a, b in zip(self.base, self.lora_a, self.lora_b, strict=True):
            x = torch.nn.functional.gelu(base(x) + b(a(x)))
        return self.head(x)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("auto", "te", "reference"), default="auto")
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args(argv)

    backend = args.backend
    if backend == "auto":
        backend = "te" if torch.cuda.is_available() and backends.te_available() else "reference"
    device = "cuda" if backend == "te" else "cpu"
    dtype = torch.bfloat16 if backend == "te" else torch.float32
    model = FrozenBaseModel().to(device=device, dtype=dtype)
    executor = make_te_v2(backend=backend)
    jitted = thunder.jit(model, executors=[executor])
    x = torch.randn(args.tokens, model.proj.in_features, device=device, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TEv2FallbackWarning)  # the report lists every fallback
        loss = jitted(x).float().square().mean()
        loss.backward()
    print(f"te_v2 backend: {backend} ({device}, {str(dtype).removeprefix('torch.')}), {args.tokens} tokens")
    print(explain(jitted))
    print(f"loss after one step: {loss.item():.4f}")


if __name__ == "__main__":
    main()
