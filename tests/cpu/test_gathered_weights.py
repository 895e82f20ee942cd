"""Which weights te_v2 reads as the FP8 bytes FSDP2 gathered (``te_v2_executor.gathered_weights``):
only the tensor the hooks wrote, unchanged, under the recipe it was cast with; anything else is
cast again, so that a weight changed since its gather is never read as its old bytes."""

from __future__ import annotations

import gc

import pytest
import torch

from te_v2_executor import current_scaling, delayed_scaling, gathered_weights

RECIPE = current_scaling()


def _record() -> tuple[torch.Tensor, gathered_weights.GatheredFP8]:
    weight = torch.randn(64, 32)
    scale_inv = torch.tensor([0.01])
    fp8 = gathered_weights.GatheredFP8((weight / scale_inv).to(torch.float8_e4m3fn), scale_inv)
    gathered_weights.record(weight, fp8, RECIPE)
    return weight, fp8


@pytest.fixture
def recorded():
    """A gathered weight and the FP8 bytes recorded for it."""
    return _record()


def test_the_weight_as_written_is_found_under_its_recipe(recorded):
    weight, fp8 = recorded
    assert gathered_weights.find(weight, RECIPE) is fp8
    # another name of the same tensor: FSDP2's parameter over the hooks' weight, a full view
    assert (
        gathered_weights.find(torch.nn.Parameter(torch.as_strided(weight, (64, 32), (32, 1))), RECIPE) is fp8
    )
    assert gathered_weights.find(weight.view(64, 32), RECIPE) is fp8


def test_a_weight_written_in_place_since_is_cast_again(recorded):
    weight, _ = recorded
    with torch.no_grad():
        weight.mul_(2)
    assert gathered_weights.find(weight, RECIPE) is None


@pytest.mark.parametrize(
    "other",
    [
        lambda w: w.clone(),
        lambda w: w[:, :16],
        lambda w: w[32:],
        lambda w: w.t(),
        lambda w: w.view(32, 64),
        lambda w: w.to(torch.bfloat16),
    ],
    ids=["a copy", "a column slice", "a row slice", "the transpose", "another shape", "another dtype"],
)
def test_another_tensor_is_cast(recorded, other):
    weight, _ = recorded
    assert gathered_weights.find(other(weight), RECIPE) is None


def test_a_weight_read_under_another_recipe_is_cast(recorded):
    weight, _ = recorded
    assert gathered_weights.find(weight, current_scaling(power_2_scale=True)) is None
    assert gathered_weights.find(weight, delayed_scaling()) is None


def test_bytes_freed_by_a_reshard_are_not_read(recorded):
    weight, fp8 = recorded
    fp8.data.untyped_storage().resize_(0)  # as FSDP2 frees the all-gather output
    found = gathered_weights.find(weight, RECIPE) is not None  # (no repr of freed bytes)
    assert not found


def test_the_record_of_a_weight_that_died_is_dropped():
    weight, _ = _record()
    key = weight.untyped_storage()._cdata
    assert key in gathered_weights._RECORDS
    del weight
    gc.collect()
    assert key not in gathered_weights._RECORDS


def test_an_inference_tensor_is_cast():
    with torch.inference_mode():
        assert gathered_weights.find(torch.randn(64, 32), RECIPE) is None
