"""GPU-suite fixtures."""

from __future__ import annotations

import pytest

from te_v2_executor import backends


@pytest.fixture(autouse=True)
def _fresh_te_global_state():
    """TE eager modules register in a process-global buffer that every ``te.autocast`` exit
    updates; clear it so one test's modules do not launch kernels in the next one's profile."""
    if backends.te_available():
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        FP8GlobalStateManager.reset()
    yield
