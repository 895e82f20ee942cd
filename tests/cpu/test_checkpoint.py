"""``quantization_state_template``: what a torch.distributed.checkpoint's quantization state loads
into (the restore on another number of ranks runs in tests/distributed)."""

from __future__ import annotations

import pytest
import thunder
import torch
import torch.distributed.checkpoint as dcp

from te_v2_executor import (
    load_quantization_state_dict,
    make_te_v2,
    quantization_state_dict,
    quantization_state_template,
)
from tests.helpers import CLAIM_ALL
from tests.models import Stack


def _trained(steps: int):
    jitted = thunder.jit(Stack([32] * 3), executors=[make_te_v2(backend="reference", claim=CLAIM_ALL)])
    for _ in range(steps):
        jitted(torch.randn(16, 32)).sum().backward()
    return jitted


def test_a_checkpoints_quantization_state_loads_through_its_template(tmp_path):
    saved = quantization_state_dict(_trained(3))
    dcp.save({"model": {"w": torch.ones(2)}, "quantization": saved}, checkpoint_id=tmp_path)
    template = quantization_state_template(tmp_path)
    assert {n: (t.shape, t.dtype) for n, t in template.items()} == {
        n: (t.shape, t.dtype) for n, t in saved.items()
    }
    dcp.load({"quantization": template}, checkpoint_id=tmp_path)
    fresh = _trained(1)
    load_quantization_state_dict(fresh, template)
    for name, value in quantization_state_dict(fresh).items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)


def test_a_checkpoint_without_the_key_is_refused_naming_its_keys(tmp_path):
    dcp.save(
        {"model": {"w": torch.ones(2)}, "quant": quantization_state_dict(_trained(1))}, checkpoint_id=tmp_path
    )
    with pytest.raises(
        ValueError, match=r"no quantization state under 'quantization' \(its top-level keys: model, quant\)"
    ):
        quantization_state_template(tmp_path)
    assert quantization_state_template(tmp_path, key="quant")
