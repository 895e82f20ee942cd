"""Fixtures shared by the CPU and GPU suites."""

from __future__ import annotations

import pytest
import torch

from te_v2_executor import executor as executor_module
from te_v2_executor import make_te_v2
from tests.helpers import CLAIM_ALL


@pytest.fixture
def reference_te_v2():
    """A te_v2 executor on the plain-torch reference backend, following te.autocast, claiming
    every linear it can run."""
    return make_te_v2(backend="reference", claim=CLAIM_ALL)


@pytest.fixture(autouse=True)
def _fresh_fallback_warnings():
    """Fallback warnings are once per process; each test sees its own."""
    executor_module._warned.clear()
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
