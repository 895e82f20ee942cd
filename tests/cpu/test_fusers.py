"""``executors()`` lists te_v2 then a fuser of elementwise ops, and a list without one is named in
a warning with its fix."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import thunder
import thunder.extend
from thunder.executors.torch_compile import torch_compile_cat_ex, torch_compile_ex, torch_compile_xentropy_ex
from thunder.extend import OperatorExecutor

from te_v2_executor import executor as executor_module
from te_v2_executor import executors, make_te_v2, te_v2
from te_v2_executor.executor import TEv2PerformanceWarning
from te_v2_executor.fusers import fuses_elementwise, missing_fuser


def test_only_general_fusers_count_as_fusing_elementwise_ops():
    assert fuses_elementwise(torch_compile_ex)
    assert not fuses_elementwise(torch_compile_xentropy_ex)  # regions around cross-entropy only
    assert not fuses_elementwise(torch_compile_cat_ex)
    assert not fuses_elementwise(te_v2)


def test_executors_list_te_v2_first_then_a_fuser():
    listed = executors()
    assert listed[0] is te_v2
    assert any(fuses_elementwise(ex) for ex in listed[1:])
    mine = make_te_v2(backend="reference")
    assert executors(mine)[0] is mine and executors(mine)[1:] == listed[1:]


def test_executors_list_attention_executors_then_torch_compile_not_thunders_cudnn():
    """Without an attention executor Thunder decomposes a scaled-dot-product attention inside a
    region into two matrix products and a softmax (tests/gpu/test_attention.py runs one); Thunder
    0.2.6's cuDNN one raises while checking it with a current cuDNN frontend. The fuser is
    Thunder's torch.compile executor, its regions called without Dynamo (test_inductor.py)."""
    from thunder.executors.sdpaex import sdpa_ex

    from te_v2_executor.attention import attention_ex
    from te_v2_executor.inductor import inductor_ex

    assert executors()[1:] == [attention_ex, sdpa_ex, inductor_ex]
    assert "cudnn" not in {ex.name for ex in executors()}


def test_a_list_with_no_fuser_after_te_v2_is_named_with_the_fix():
    defaults = list(thunder.get_default_executors())
    if any(fuses_elementwise(ex) for ex in defaults):  # nvFuser installed: Thunder's list fuses
        assert missing_fuser([te_v2, *defaults], te_v2) == ""
    else:
        message = missing_fuser([te_v2, *defaults], te_v2)
        assert f"(after it: {', '.join(ex.name for ex in defaults)})" in message
        assert "use executors=te_v2_executor.executors()" in message
    assert "(after it: none)" in missing_fuser([te_v2], te_v2)
    assert missing_fuser([torch_compile_ex, te_v2], te_v2), "a fuser before te_v2 fuses nothing after it"
    assert missing_fuser([te_v2, torch_compile_ex], te_v2) == ""
    assert missing_fuser(executors(), te_v2) == ""


def _with_fake_cudnn(monkeypatch, pygraph: type) -> OperatorExecutor:
    """A 'cudnn' executor among Thunder's defaults, as Thunder registers one where the cuDNN
    frontend imports, and a frontend module whose graphs are ``pygraph``."""
    fake = OperatorExecutor("cudnn")
    monkeypatch.setattr(thunder.extend, "get_executor", lambda name: fake if name == "cudnn" else None)
    monkeypatch.setattr(thunder.extend, "_default_executors", [fake, *thunder.get_default_executors()])
    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(pygraph=pygraph, __version__="1.32.0"))
    monkeypatch.setattr(executor_module, "_warned", set())
    return fake


def test_a_cudnn_attention_that_cannot_run_leaves_thunders_defaults_with_a_warning(monkeypatch):
    """thunderfx's splitter checks nodes with Thunder's default executors: a cuDNN attention
    checker that raises there sends every attention to TorchInductor (docs/performance.md)."""
    fake = _with_fake_cudnn(monkeypatch, type("pygraph", (), {}))
    with pytest.warns(TEv2PerformanceWarning, match=r"scaled_dot_product_flash_attention.*\(1\.32\.0\)"):
        listed = executors()
    assert fake not in thunder.get_default_executors()
    assert fake not in listed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        executors()  # once


def test_a_cudnn_attention_that_can_run_stays_in_thunders_defaults(monkeypatch):
    pygraph = type("pygraph", (), {"scaled_dot_product_flash_attention": lambda self: None})
    fake = _with_fake_cudnn(monkeypatch, pygraph)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        executors()
    assert fake in thunder.get_default_executors()
