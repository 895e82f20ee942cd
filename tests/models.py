"""Small models for the te_v2 tests, built from a linear factory.

With ``nn.Linear`` they are what te_v2 compiles; with ``te.Linear`` the TransformerEngine eager
baseline; both get the same weights through ``copy_weights``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

LinearFactory = Callable[..., nn.Module]


def torch_linear(in_features: int, out_features: int, bias: bool, **kw) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias, **kw)


class Stack(nn.Module):
    """Linears with an activation between them; ``frozen`` names the linears whose weight and
    bias do not train (the seed case freezes every even one)."""

    def __init__(
        self,
        dims: list[int],
        *,
        bias: bool = False,
        frozen: Callable[[int], bool] = lambda i: False,
        act: Callable[[torch.Tensor], torch.Tensor] = torch.relu,
        factory: LinearFactory = torch_linear,
        **kw,
    ) -> None:
        super().__init__()
        self.act = act
        self.linears = nn.ModuleList(factory(i, o, bias, **kw) for i, o in itertools.pairwise(dims))
        for i, lin in enumerate(self.linears):
            if frozen(i):
                lin.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, lin in enumerate(self.linears):
            x = lin(x)
            if i < len(self.linears) - 1:
                x = self.act(x)
        return x


def every_even(i: int) -> bool:
    return i % 2 == 0


class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable rank-``rank`` update B(A(x)), multiplied by
    ``scaling`` when it is given, as PEFT writes it."""

    def __init__(
        self,
        in_f: int,
        out_f: int,
        rank: int,
        *,
        factory: LinearFactory = torch_linear,
        scaling: float | None = None,
        **kw,
    ) -> None:
        super().__init__()
        self.base = factory(in_f, out_f, False, **kw)
        self.lora_a = factory(in_f, rank, False, **kw)
        self.lora_b = factory(rank, out_f, False, **kw)
        self.scaling = scaling
        self.base.requires_grad_(False)
        with torch.no_grad():
            self.lora_b.weight.normal_(0.0, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaling is None:
            return self.base(x) + self.lora_b(self.lora_a(x))
        result = self.base(x)
        return result + self.lora_b(self.lora_a(x)) * self.scaling


class LoRAStack(nn.Module):
    def __init__(
        self, dims: list[int], rank: int = 16, *, factory: LinearFactory = torch_linear, **kw
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            LoRALinear(i, o, rank, factory=factory, **kw) for i, o in itertools.pairwise(dims)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class BrokenBlock(nn.Module):
    """A linear and a GELU, then a graph break: Dynamo compiles one region for a stack of these
    and calls it for every block, each time with that block's weight."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.gelu(self.linear(x))
        torch._dynamo.graph_break()
        return y * 2


class Checkpointed(nn.Module):
    """Four linears; the middle two run under ``torch.utils.checkpoint``."""

    def __init__(self, dim: int, *, factory: LinearFactory = torch_linear, **kw) -> None:
        super().__init__()
        self.first = factory(dim, dim, False, **kw)
        self.inner = Stack([dim, dim, dim], factory=factory, **kw)
        self.last = factory(dim, dim, False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.first(x))
        x = checkpoint(self.inner, x, use_reentrant=False)
        return self.last(torch.relu(x))


class LlamaLikeBlock(nn.Module):
    """A Llama-shaped block: q, k and v read one normalized input, gate and up (SwiGLU) another,
    with residual adds; ``frozen`` names the linears that do not train."""

    def __init__(
        self, dim: int, *, frozen: tuple[str, ...] = (), factory: LinearFactory = torch_linear, **kw
    ) -> None:
        super().__init__()
        sizes = {"q": (dim, dim), "k": (dim, dim // 2), "v": (dim, dim // 2), "o": (dim, dim)}
        sizes |= {"gate": (dim, 2 * dim), "up": (dim, 2 * dim), "down": (2 * dim, dim)}
        for name, (n_in, n_out) in sizes.items():
            setattr(self, name, factory(n_in, n_out, False, **kw).requires_grad_(name not in frozen))

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        x = x + self.o(q * torch.sigmoid(torch.cat([k, v], -1)))
        h = self._norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class SwiGLUMLP(nn.Module):
    """Llama's MLP, ``down(silu(gate(x)) * up(x))``, with a residual add; ``lora`` puts a LoRA
    adapter on ``down``, which then reads the SwiGLU twice."""

    def __init__(
        self, dim: int, hidden: int, *, lora: bool = False, factory: LinearFactory = torch_linear, **kw
    ) -> None:
        super().__init__()
        self.gate = factory(dim, hidden, False, **kw)
        self.up = factory(dim, hidden, False, **kw)
        if lora:
            self.down = LoRALinear(hidden, dim, 16, factory=factory, **kw)
        else:
            self.down = factory(hidden, dim, False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class SharedWeight(nn.Module):
    """One weight used by two linears (tied weights)."""

    def __init__(self, dim: int, *, factory: LinearFactory = torch_linear, **kw) -> None:
        super().__init__()
        self.a = factory(dim, dim, False, **kw)
        self.b = factory(dim, dim, False, **kw)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def copy_weights(dst: nn.Module, src: nn.Module) -> nn.Module:
    """Copy parameters by name and mirror ``requires_grad``; returns ``dst``."""
    src_params = dict(src.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, p in dst.named_parameters(remove_duplicate=False):
            p.copy_(src_params[name])
            p.requires_grad_(src_params[name].requires_grad)
    return dst


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Gradients by parameter name (tied parameters once)."""
    return {name: p.grad for name, p in model.named_parameters()}


class TwoOutputs(nn.Module):
    """A linear of x and a view of x: x's gradient sums a dgrad and the second output's cotangent."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), x.view(x.shape)


class WriteAfterAdapter(nn.Module):
    """A frozen adapter B reads h, then h is written in place and returned; B's sum with the base
    is foldable into either GEMM, and B's must not move past the write."""

    def __init__(self, dim: int = 64, rank: int = 16, **kw) -> None:
        super().__init__()
        self.A = nn.Linear(dim, rank, bias=False, **kw)
        self.B = nn.Linear(rank, dim, bias=False, **kw).requires_grad_(False)
        self.base = nn.Linear(dim, dim, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.A(x)
        a = self.B(h)
        h.mul_(2.0)
        return a + self.base(x), h


class WrittenGemmOutputTimesAWeight(nn.Module):
    """A linear's output scaled in place, then multiplied by a trained vector, whose gradient
    reads the scaled output: fuzz seed 2027 program 9, shrunk."""

    def __init__(self, dim: int = 64, width: int = 32, **kw) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, width, bias=False, **kw)
        self.w = nn.Parameter(torch.randn(width, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.lin(x)
        v.mul_(-1.0)
        return v * self.w


class WriteIntoInputBeforeAdapter(nn.Module):
    """PEFT's LoRA forward with the input scaled in place between the base and the adapter."""

    def __init__(self, dim: int = 64, rank: int = 16, **kw) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim, bias=False, **kw).requires_grad_(False)
        self.lora_A = nn.Linear(dim, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, dim, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        x.mul_(0.5)
        return result + self.lora_B(self.lora_A(x))


class SumBesideAWrite(nn.Module):
    """x and then a's output are written in place, the second after a sum read it. With a 32-feature
    floor (``ClaimPolicy(min_features=32)``) a and c fall back to Thunder and b alone is te_v2's,
    so the sum, fused beside b, is the only earlier reader of a's output, and not te_v2's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 24, bias=False).requires_grad_(False)
        self.b = nn.Linear(32, 16, bias=False).requires_grad_(False)
        self.c = nn.Linear(16, 24, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        v = self.a(x)
        s = v + self.c(self.b(x))
        v.mul_(0.5)
        return s


class SavedThenWritten(nn.Module):
    """b saves h for its weight gradient, then h is written in place: eager refuses the backward.
    ``through``: the write goes into h itself ("tensor"), a slice of it or a view of it."""

    def __init__(self, dim: int = 64, through: str = "tensor", **kw) -> None:
        super().__init__()
        self.through = through
        self.a = nn.Linear(dim, dim, bias=False, **kw)
        self.b = nn.Linear(dim, dim, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.b(h)
        {"tensor": h, "slice": h[:, :8], "view": h.view(-1)}[self.through].mul_(2)
        return y + h


class WrittenThroughAnotherName(nn.Module):
    """h is written in place through one name of its storage and then read through another, as
    ``way`` says: its slice written and h returned ("returned slice"); a view written and h read by
    b ("flat view", "raveled", which Thunder takes for a copy, "transposed view"); the slice
    returned beside a read of h ("slice and base"); or a copy of a's weight written by row and read
    by F.linear ("weight row"). Thunder differentiates
    those reads as if the write had not happened. It differentiates right a write through h itself
    ("setitem"), the read of a reshape that copied (of a transposed h, "reshaped copy"), a write
    under no_grad ("no_grad write") or of the old values plus a number ("shifted"), whose
    derivative eager takes to be the identity too, and a read that carries no gradient ("mask",
    "no_grad mask"). A write into the whole of h under no_grad, read after it ("no_grad whole"),
    Thunder differentiates as a tensor without gradient, where eager takes the identity."""

    REFUSED = ("returned slice", "flat view", "raveled", "transposed view", "slice and base", "weight row")
    RIGHT = ("setitem", "reshaped copy", "no_grad write", "shifted", "mask", "no_grad mask")

    def __init__(self, way: str, dim: int = 64, **kw) -> None:
        super().__init__()
        self.way = way
        self.a = nn.Linear(dim, dim, bias=False, **kw)
        self.b = nn.Linear(dim, dim, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.way == "weight row":
            w = self.a.weight * 1.0
            w[0].zero_()
            return (torch.nn.functional.linear(x, w),)
        h = self.a(x) * 1.0
        if self.way == "returned slice":
            y = self.b(h)
            h[:, :8].mul_(-1.0)
            return y, h
        if self.way == "slice and base":
            t = h[:, :8]
            t.mul_(2.0)
            return self.b(h), t
        if self.way == "reshaped copy":
            t = h.t()
            flat = t.reshape(-1)
            t.mul_(3.0)
            return self.b(t.t()), flat
        if self.way == "setitem":
            h[:, :8] = h[:, :8] * 3.0
        elif self.way == "no_grad write":
            with torch.no_grad():
                h[:, :8].mul_(3.0)
        elif self.way == "shifted":
            h[:, :8].add_(1.5)
        elif self.way == "mask":
            h[:, :8].mul_(3.0)
            return (self.b(x) * (h > 0),)
        elif self.way in ("no_grad whole", "no_grad mask"):
            with torch.no_grad():
                h.clamp_(-0.5, 0.5)
            if self.way == "no_grad mask":
                return (self.b(x) * (h > 0),)
        else:
            view = {"flat view": h.view(-1), "raveled": h.ravel(), "transposed view": h.t()}[self.way]
            view[:8].mul_(3.0)
        return (self.b(h),)


class GraphBroken(nn.Module):
    """Two stacks with a Dynamo graph break between them: thunderfx compiles two regions."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.first, self.second = Stack([dim] * 3), Stack([dim] * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(torch.relu(x))


def tiny_llama(hidden: int, dtype: torch.dtype) -> nn.Module:
    """A random-weight Hugging Face ``LlamaForCausalLM`` on the CPU: 2 layers, 4 heads, 2 KV
    heads, MLP and vocabulary of twice ``hidden``, PyTorch's attention (needs transformers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2 * hidden,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)
