"""Fixtures shared by the CPU and GPU suites."""

from __future__ import annotations

import pytest
import torch

from te_v2_executor import executor as executor_module
from te_v2_executor import make_te_v2
from te_v2_executor.passes import _peak as peak
from tests.helpers import CLAIM_ALL


@pytest.fixture
def reference_te_v2():
    """A te_v2 executor on the plain-torch reference backend, following te.autocast, claiming
    every linear it can run."""
    return make_te_v2(backend="reference", claim=CLAIM_ALL)


@pytest.fixture
def dynamo_reset_after():
    """Dynamo's cache emptied after the test: a later compile of the same model class on other
    shapes would trace with dynamic ones."""
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _fresh_fallback_warnings():
    """Fallback warnings are once per process; each test sees its own."""
    executor_module._warned.clear()
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _every_recast(request, monkeypatch):
    """Every recast ``weight_recasts`` and ``input_recasts`` can make is made, wherever the peak
    lies, so that the suite tests what a recast does on small models; a test marked
    ``peak_policy`` sees which recasts the peak needs (``passes/_peak.py``)."""
    if "peak_policy" not in request.keywords:
        monkeypatch.setattr(peak, "live_bytes", lambda trace, writes: None)
