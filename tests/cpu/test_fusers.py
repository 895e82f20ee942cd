"""``executors()`` lists te_v2 then a fuser of elementwise ops, and a list without one is named in
a warning with its fix."""

from __future__ import annotations

import thunder
from thunder.executors.torch_compile import torch_compile_cat_ex, torch_compile_ex, torch_compile_xentropy_ex

from te_v2_executor import executors, make_te_v2, te_v2
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


def test_executors_list_pytorchs_attention_then_torch_compile_not_cudnn():
    """Without an attention executor Thunder decomposes a scaled-dot-product attention inside a
    region into two matrix products and a softmax (tests/gpu/test_hf_models.py runs one); Thunder
    0.2.6's cuDNN one raises while checking it with a current cuDNN frontend."""
    from thunder.executors.sdpaex import sdpa_ex

    assert executors()[1:] == [sdpa_ex, torch_compile_ex]
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
