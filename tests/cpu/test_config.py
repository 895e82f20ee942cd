"""Settings are checked when made: a nonsense value raises, naming the setting and what it takes."""

from __future__ import annotations

import pytest

from te_v2_executor import Backend, ClaimPolicy, TEv2Config, delayed_scaling, make_te_v2, passes


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"min_features": -5}, "min_features=-5"),
        ({"min_features": 1.5}, "min_features=1.5"),
        ({"min_features": True}, "min_features=True"),
        ({"unquantized": "no"}, "unquantized='no'"),
        ({"gelu": None}, "gelu=None"),
    ],
)
def test_a_claim_policy_refuses_nonsense(fields, named):
    with pytest.raises(ValueError, match=rf"ClaimPolicy\({named}\)"):
        ClaimPolicy(**fields)


def test_a_claim_policy_takes_zero_and_the_default():
    assert ClaimPolicy(min_features=0).min_features == 0
    assert ClaimPolicy().min_features == 512


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"backend": "te"}, "backend='te'"),
        ({"recipe": "delayed"}, "recipe='delayed'"),
        ({"claim": 512}, "claim=512"),
        ({"skip_passes": ("sums",)}, r"skip_passes=\('sums',\)"),
    ],
)
def test_a_config_refuses_values_of_the_wrong_kind(fields, named):
    with pytest.raises(ValueError, match=rf"TEv2Config\({named}\)"):
        TEv2Config(**fields)


def test_make_te_v2_converts_what_the_config_checks():
    ex = make_te_v2(backend="reference", recipe=delayed_scaling(), skip_passes=["sums"])
    assert ex.config.backend is Backend.REFERENCE
    assert ex.config.skip_passes == frozenset({"sums"})


@pytest.mark.parametrize("name", ["states", "syncs", "no_such_pass"])
def test_only_optional_passes_can_be_skipped(name):
    with pytest.raises(
        ValueError,
        match=rf"'{name}', which is no optional pass; the optional ones are weight_recasts, shared_inputs, merge_casts",
    ):
        make_te_v2(backend="reference", skip_passes=[name])


def test_the_optional_passes_are_the_folds():
    assert passes.OPTIONAL == (
        "weight_recasts",
        "shared_inputs",
        "merge_casts",
        "round_trips",
        "scales",
        "sums",
        "narrowings",
        "gelus",
        "swiglus",
        "activation_handback",
        "widenings",
        "input_recasts",
        "recast_batches",
    )
