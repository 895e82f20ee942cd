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


@pytest.fixture(autouse=True)
def _fold_every_activation(monkeypatch, request):
    """The GPU tests' models are small; fold their GELUs and SwiGLUs anyway, so that the fused
    kernel is what their parity checks check (a test of the size rule itself opts out with
    ``real_fold_size``)."""
    if backends.te_available() and "real_fold_size" not in request.keywords:
        from te_v2_executor.backends import te as kernels

        monkeypatch.setattr(kernels, "FOLD_MIN_ELEMENTS", 0)
    yield
