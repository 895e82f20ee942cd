"""The ``widenings`` pass: the backward recomputes the exact widenings it reads, so the forward saves
bfloat16 tensors where it saved their float32 copies (a Hugging Face model's RMSNorm input and
peft's float32 adapters), with bitwise the same gradients; never across an in-place write."""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
import torch.nn.functional as F
from thunder.dynamo import thunderfx
from thunder.executors.torch_compile import torch_compile_ex

from te_v2_executor import make_te_v2
from te_v2_executor.compiled import compiled_functions
from te_v2_executor.symbols import UNQUANTIZED_DGRAD, UNQUANTIZED_WGRAD
from tests.helpers import forward_trace

TOKENS, DIM, RANK, VOCAB = 32, 64, 16, 128  # TOKENS <= VOCAB: token i's label is i


class HFLike(torch.nn.Module):
    """A bfloat16 block as Hugging Face and peft write it: RMSNorm in float32, a frozen base
    linear with a float32 LoRA adapter (peft casts the adapter's input to its dtype), a head.
    ``write_after_cast``: the normed activation is written in place after its float32 cast, into
    itself ("tensor") or through a view of it ("view"); "" writes nothing."""

    def __init__(self, write_after_cast: str = "") -> None:
        super().__init__()
        self.write_after_cast = write_after_cast
        self.norm = torch.nn.Parameter(torch.ones(DIM, dtype=torch.bfloat16))
        self.base = torch.nn.Linear(DIM, DIM, bias=False, dtype=torch.bfloat16).requires_grad_(False)
        self.lora_a = torch.nn.Linear(DIM, RANK, bias=False)
        self.lora_b = torch.nn.Linear(RANK, DIM, bias=False)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = self.norm * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        wide = h.float()
        if self.write_after_cast == "tensor":
            h.mul_(0.5)
        elif self.write_after_cast == "view":  # read on through the written view, as Thunder differentiates
            h = h.view(-1).mul_(0.5).view(h.shape)
        y = self.base(h) + self.lora_b(self.lora_a(wide)).to(torch.bfloat16)
        return self.head(y)


def _step(model: torch.nn.Module, skip: list[str]) -> tuple[object, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16, requires_grad=True)
    jitted = thunder.jit(model, executors=[make_te_v2(backend="reference", skip_passes=skip)])
    F.cross_entropy(jitted(x).float(), torch.arange(TOKENS) % VOCAB).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return jitted, {**grads, "x": x.grad}


def _saved_widenings(jitted) -> list[str]:
    """The tensors the forward saves that are float32 casts of another tensor, or views of one."""
    trace = forward_trace(jitted)
    producers = thunder.core.utils.producers(trace)
    found = []
    for p in thunder.core.pytree.tree_flatten(trace.bound_symbols[-1].args[1])[0]:
        producer = producers.get(p, None) if isinstance(p, thunder.core.proxies.TensorProxy) else None
        while producer is not None and producer.sym.name in ("expand", "broadcast_in_dim", "reshape"):
            producer = producers.get(producer.args[0], None)
        if (
            producer is not None
            and producer.sym.name in ("to", "convert_element_type")
            and p.dtype == thunder.float32
        ):
            found.append(p.name)
    return found


@pytest.mark.parametrize(
    "write_after_cast", ["", "tensor", "view"], ids=["plain", "written-after-cast", "written-through-a-view"]
)
def test_the_backward_recomputes_widenings_with_the_same_gradients(write_after_cast):
    model = HFLike(write_after_cast)
    twin = copy.deepcopy(model)
    # without narrowings, whose adapter GEMMs read no float32 copy at all (test_narrowings.py)
    jitted, grads = _step(model, skip=["narrowings"])
    plain, plain_grads = _step(twin, skip=["narrowings", "widenings"])
    # without the pass: x's float32 copy (RMSNorm's), the adapter's float32 input and more
    assert len(_saved_widenings(plain)) >= 2
    # the adapter's input is not recomputed from the normed activation written after the cast
    assert len(_saved_widenings(jitted)) == (1 if write_after_cast else 0)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=0, msg=name)


def test_an_adapters_float32_copy_is_made_where_its_wgrad_runs():
    """Through thunderfx, whose dataflow fusion orders the backward anew, the recomputed float32
    input of the adapter's wgrad (te_v2's GEMM, which no fuser fuses) is cast after the backward
    reached the adapter, not at its start, where it went as a lone cast of a saved tensor (at the
    8B Llama's dims under LoRA, 448 MiB for one down_proj adapter). Without narrowings, which
    has the wgrad read the bfloat16 tensor instead (test_narrowings.py)."""
    model = HFLike()
    te_v2 = make_te_v2(backend="reference", skip_passes=["narrowings"])
    compiled = thunderfx(model, executors=[te_v2, torch_compile_ex])
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16, requires_grad=True)
    F.cross_entropy(compiled(x).float(), torch.arange(TOKENS) % VOCAB).backward()
    (jitted,) = compiled_functions(compiled)
    order = thunder.last_backward_traces(jitted)[-1].bound_symbols
    made_at = {p.name: at for at, b in enumerate(order) for p in b.flat_proxy_outs}
    (adapter_wgrad,) = [b for b in order if b.sym is UNQUANTIZED_WGRAD and b.output.shape == (RANK, DIM)]
    wide = adapter_wgrad.args[1]
    assert wide.dtype == thunder.float32
    first_gemm = min(at for at, b in enumerate(order) if b.sym in (UNQUANTIZED_DGRAD, UNQUANTIZED_WGRAD))
    assert made_at[wide.name] > first_gemm, "the float32 copy is made before the backward reaches its wgrad"


class WithLoss(HFLike):
    """HFLike with its loss inside, as Hugging Face's causal LM computes it: the cross-entropy of
    the float32 logits, whose backward reads their log-softmax."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x).float()
        return F.cross_entropy(logits, torch.arange(TOKENS))


def _saved_of_shape(jitted, shape: tuple[int, ...]) -> list[thunder.dtypes.dtype]:
    saved = thunder.core.pytree.tree_flatten(forward_trace(jitted).bound_symbols[-1].args[1])[0]
    return [p.dtype for p in saved if isinstance(p, thunder.core.proxies.TensorProxy) and p.shape == shape]


def test_the_backward_recomputes_the_log_softmax_of_widened_logits():
    model = WithLoss()
    twin = copy.deepcopy(model)
    torch.manual_seed(0)
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16)
    jitted = thunder.jit(model, executors=[make_te_v2(backend="reference")])
    jitted(x).backward()
    plain = thunder.jit(twin, executors=[make_te_v2(backend="reference", skip_passes=["widenings"])])
    plain(x).backward()
    # the float32 log-softmax over the vocabulary, or the bfloat16 logits it is computed from
    assert _saved_of_shape(plain, (TOKENS, VOCAB)) == [thunder.float32]
    assert _saved_of_shape(jitted, (TOKENS, VOCAB)) == [thunder.bfloat16]
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
