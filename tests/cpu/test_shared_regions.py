"""A thunderfx region Dynamo reuses for several layers shares its linears' delayed-scaling states
among them; te_v2 says so when the region's backward runs twice with no forward between (not
when a forward alone runs before a training step, as loading a state dict into thunderfx asks)."""

from __future__ import annotations

import warnings

import torch
from thunder.dynamo import thunderfx

from te_v2_executor import TEv2SharedStateWarning, delayed_scaling, make_te_v2
from te_v2_executor.compiled import compiled_functions
from tests.helpers import CLAIM_ALL


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Layers(torch.nn.Module):
    """Three layers; ``regional`` leaves the loop over them to Python, so Dynamo compiles each
    layer's forward as a frame of its own, one region for all three, as regional compilation and
    torch's ``fully_shard`` per layer make it do."""

    def __init__(self, regional: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(3))
        if regional:
            self.forward = torch._dynamo.disable(self.forward, recursive=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _shared_state_warnings(regional: bool) -> tuple[int, list[str]]:
    compiled = thunderfx(
        Layers(regional),
        executors=[make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=delayed_scaling())],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            compiled(torch.randn(32, 64, requires_grad=True)).sum().backward()
    return len(compiled_functions(compiled)), [
        str(w.message) for w in caught if w.category is TEv2SharedStateWarning
    ]


def test_a_region_reused_for_several_layers_warns_once():
    regions, messages = _shared_state_warnings(regional=True)
    assert regions == 1  # the three layers' linears quantize with one state
    (message,) = messages
    assert "ran its backward twice with no forward between" in message
    assert "current_scaling()" in message


def test_a_model_compiled_whole_does_not_warn():
    regions, messages = _shared_state_warnings(regional=False)
    assert regions == 1 and messages == []


def test_a_forward_alone_before_training_steps_does_not_warn():
    """As ``load_quantization_state_dict`` asks of a thunderfx function: a forward alone first."""
    compiled = thunderfx(
        Layers(regional=False),
        executors=[make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=delayed_scaling())],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", TEv2SharedStateWarning)
        compiled(torch.randn(32, 64, requires_grad=True))
        for _ in range(2):
            compiled(torch.randn(32, 64, requires_grad=True)).sum().backward()
