"""te_v2's outputs and gradients on the reference backend, case by case.

Two references: the eager FP8 emulation (the same kernels without Thunder, every gradient
computed), which te_v2 must match exactly, and plain float32, which it must track within FP8's
accuracy (SQNR floors).
"""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
from thunder.executors.torch_compile import torch_compile_ex

from te_v2_executor import ClaimPolicy, block_scaling, current_scaling, delayed_scaling, make_te_v2
from te_v2_executor.symbols import (
    GELU,
    GELU_BACKWARD,
    LINEAR_DGRAD,
    LINEAR_FWD,
    UNQUANTIZED_DGRAD,
    UNQUANTIZED_FWD,
)
from tests.helpers import CLAIM_ALL, backward_trace, bsyms_of, eager_emulation, sqnr_db
from tests.models import (
    Checkpointed,
    LoRALinear,
    LoRAStack,
    SharedWeight,
    Stack,
    SwiGLUMLP,
    every_even,
    grads,
)

RECIPES = {
    "delayed": delayed_scaling(amax_history_len=16),
    "current": current_scaling(),
    "block": block_scaling(),
}
# SQNR floors (dB) against float32, about 1.5 dB under the lowest seen over these cases: FP8
# error compounds through the 4-linear stacks (E5M2 gradients lose most). A misrouted or
# missing gradient scores near 0 dB.
FWD_FLOOR, GRAD_FLOOR = 20.0, 8.0


def _models(dim: int):
    return {
        "seed": lambda: Stack([dim] * 5, frozen=every_even),
        "bias": lambda: Stack([dim] * 3, bias=True),
        "lora": lambda: LoRAStack([dim] * 3, rank=16),
        "shared": lambda: SharedWeight(dim),
        "checkpoint": lambda: Checkpointed(dim),
        "gelu": lambda: Stack([dim] * 4, act=torch.nn.functional.gelu),
        "swiglu": lambda: torch.nn.Sequential(SwiGLUMLP(dim, 2 * dim), SwiGLUMLP(dim, 2 * dim)),
    }


def _run(model, x, *, executors=None, emulate=None):
    x = x.detach().clone().requires_grad_(x.requires_grad)
    fn = thunder.jit(model, executors=executors) if executors else model
    if emulate is not None:
        with eager_emulation(emulate):
            y = fn(x)
            y.sum().backward()
    else:
        y = fn(x)
        y.sum().backward()
    return y, grads(model), x.grad


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("case", ["seed", "bias", "lora", "shared", "checkpoint", "gelu", "swiglu"])
@pytest.mark.parametrize("shape", ["2d", "3d"])
def test_matches_eager_emulation_and_tracks_float32(recipe, case, shape):
    dim = 128 if recipe == "block" else 64
    rank16_block = recipe == "block" and case == "lora"
    if rank16_block:
        pytest.skip(
            "rank-16 adapters are below block scaling's 128 granularity (a fallback, tested elsewhere)"
        )
    model = _models(dim)[case]()
    x = torch.randn(*((4, 32) if shape == "3d" else (128,)), dim, requires_grad=True)

    ex = make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=RECIPES[recipe])
    y, g, dx = _run(model, x, executors=[ex])
    y_emu, g_emu, dx_emu = _run(copy.deepcopy(model), x, emulate=RECIPES[recipe])
    y_ref, g_ref, dx_ref = _run(copy.deepcopy(model), x)

    torch.testing.assert_close(y, y_emu, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_emu, rtol=0, atol=0)
    assert sqnr_db(y, y_ref) > FWD_FLOOR
    assert sqnr_db(dx, dx_ref) > GRAD_FLOOR
    for name, grad in g.items():
        assert (grad is None) == (g_ref[name] is None), name
        if grad is not None:
            torch.testing.assert_close(grad, g_emu[name], rtol=0, atol=0, msg=name)
            assert sqnr_db(grad, g_ref[name]) > GRAD_FLOOR, name


def test_weight_cast_under_autocast_still_gets_its_gradient(reference_te_v2):
    """Thunder issue #1966: under torch.autocast the weight reaching linear is a bf16 cast whose
    proxy says requires_grad=False; consumption still keeps its wgrad."""
    model = Stack([64, 64, 64])
    x = torch.randn(32, 64)
    jitted = thunder.jit(model, executors=[reference_te_v2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = jitted(x)
    y.float().sum().backward()
    reference = copy.deepcopy(model)
    for p in reference.parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = reference(x)
    y_ref.float().sum().backward()
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        assert p.grad.dtype == torch.float32
        assert sqnr_db(p.grad, p_ref.grad) > GRAD_FLOOR, name


def test_freezing_then_unfreezing_retraces_with_right_gradients(reference_te_v2):
    model = Stack([64] * 3)
    jitted = thunder.jit(model, executors=[reference_te_v2])
    x = torch.randn(32, 64)
    model.linears[0].requires_grad_(False)
    jitted(x).sum().backward()
    assert model.linears[0].weight.grad is None
    model.linears[0].requires_grad_(True)
    model.zero_grad()
    jitted(x).sum().backward()
    assert thunder.cache_misses(jitted) == 2
    emulated = copy.deepcopy(model)
    emulated.zero_grad()
    _, g_emu, _ = _run(emulated, x, emulate=delayed_scaling())
    # the second step runs with updated delayed-scaling state: close to, not equal to, step one
    for name, grad in grads(model).items():
        assert sqnr_db(grad, g_emu[name]) > GRAD_FLOOR, name


def test_bias_only_backwards_keep_the_dy_history_warm_for_a_weight_unfrozen_later():
    """Under delayed scaling, a backward that needs only a linear's bias gradient (weight frozen,
    input without grad) still records dy's amax, as ``te.Linear``'s ``bgrad_quantize`` does: when
    the weight is unfrozen, its first wgrad quantizes dy with a scale from that history, not the
    initial 1, which flushed gradients of 1e-6 to zero (relative error 1.0)."""
    from te_v2_executor.state import registry_for

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    te_v2 = make_te_v2(backend="reference", recipe=delayed_scaling(amax_history_len=4), claim=CLAIM_ALL)
    jitted = thunder.jit(model, executors=[te_v2])
    cotangents = []
    for step, weight_trains in enumerate([False, False, True]):
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(step))
        cotangents.append(torch.randn(32, 32, generator=torch.Generator().manual_seed(10 + step)) * 1e-6)
        model.weight.requires_grad_(weight_trains)
        jitted(x).backward(cotangents[-1])
        (state,) = registry_for(thunder.compile_data(jitted)).states.values()
        history = state.scaling(forward=False).amax_history
        assert torch.equal(history.max(), torch.stack(cotangents).abs().amax()), step
    exact = cotangents[-1].double().t() @ x.double()
    assert (model.weight.grad.double() - exact).norm() / exact.norm() < 0.1


def _accumulating(jitted) -> list:
    """The GEMMs of both traces that add their product into another tensor's buffer."""
    at = {LINEAR_DGRAD: 2, UNQUANTIZED_FWD: 3, UNQUANTIZED_DGRAD: 2}
    bsyms = [*thunder.last_traces(jitted)[-1].bound_symbols, *backward_trace(jitted).bound_symbols]
    return [b.sym for b in bsyms if b.sym in at and b.args[at[b.sym]] is not None]


@pytest.mark.parametrize("unquantized", [True, False], ids=["unquantized-adapters", "thunder-adapters"])
@pytest.mark.parametrize("fusers", [[], [torch_compile_ex]], ids=["thunder", "torch.compile"])
def test_folding_sums_into_gemms_changes_no_output_or_gradient(fusers, unquantized):
    """Sums folded into a GEMM that adds its product into the other summand give, in float32,
    the outputs and gradients of the separate sums: an adapter's output added into its base's,
    and the dgrads of a base and its adapter added into one another. With the adapters on
    Thunder's default path, only the base dgrad can accumulate."""
    model = LoRAStack([64, 128, 64], rank=16)
    twin = copy.deepcopy(model)
    x = torch.randn(32, 64, requires_grad=True)

    def run(m, skip=()):
        claim = ClaimPolicy(min_features=64, unquantized=unquantized)  # adapters out of FP8
        ex = make_te_v2(backend="reference", claim=claim, skip_passes=skip)
        jitted = thunder.jit(m, executors=[ex, *fusers])
        xx = x.detach().clone().requires_grad_()
        y = jitted(xx)
        y.sum().backward()
        return jitted, y, grads(m), xx.grad

    jitted, y, g, dx = run(model)
    if unquantized:
        assert sorted(_accumulating(jitted), key=str) == [UNQUANTIZED_DGRAD] * 2 + [UNQUANTIZED_FWD] * 2
    else:
        assert _accumulating(jitted) == [LINEAR_DGRAD] * 2
    plain, y_plain, g_plain, dx_plain = run(twin, skip=["sums"])
    assert not _accumulating(plain)
    torch.testing.assert_close(y, y_plain, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_plain, rtol=0, atol=0)
    assert g.keys() == g_plain.keys()
    for name, grad in g.items():
        assert (grad is None) == (g_plain[name] is None), name
        if grad is not None:
            torch.testing.assert_close(grad, g_plain[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("dtype", "scaling"), [(torch.float32, 2.0), (torch.bfloat16, 0.3)], ids=["float32", "bfloat16"]
)
def test_unquantized_adapters_with_peft_scaling_match_thunders_path(dtype, scaling):
    """PEFT-scaled LoRA linears run unquantized, the scaling and sums folded into their GEMMs,
    give the outputs and gradients of the same linears on Thunder's default path: bitwise in
    float32 with a power-of-two scaling; in bfloat16 to its rounding, which the folded GEMMs do
    once where Thunder's elementwise ops round after each step."""

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [
            LoRALinear(64, 128, 16, scaling=scaling),
            torch.nn.GELU(),
            LoRALinear(128, 64, 16, scaling=scaling),
        ]
        return torch.nn.Sequential(*layers).to(dtype)

    x = torch.randn(32, 64, dtype=dtype)
    results = []
    for unquantized in (True, False):
        m = model()
        claim = ClaimPolicy(min_features=256, unquantized=unquantized)  # no FP8 to amplify a last bit
        jitted = thunder.jit(m, executors=[make_te_v2(backend="reference", claim=claim)])
        xx = x.detach().clone().requires_grad_()
        y = jitted(xx)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=dtype).reshape(y.shape))
        results.append((y, xx.grad, *grads(m).values()))
    tols = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}
    for a, b in zip(*results, strict=True):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, **tols)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fusers", [[], [torch_compile_ex]], ids=["thunder", "torch.compile"])
def test_folding_gelus_changes_no_gradient(fusers, dtype):
    """GELUs computed inside the quantizations give bitwise the outputs and gradients of GELUs
    run on their own by PyTorch's kernels (the first GELU's output is also returned, so only its
    backward folds; unfolded GELUs are kept from torch.compile to compare like with like)."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stack = Stack([64] * 4, act=torch.nn.functional.gelu)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.stack.linears[0](x))
            return self.stack(h), h

    model = Model().to(dtype)
    twin = copy.deepcopy(model)
    x = torch.randn(32, 64, dtype=dtype)

    def run(m, skip=()):
        ex = make_te_v2(backend="reference", claim=CLAIM_ALL, skip_passes=["activation_handback", *skip])
        jitted = thunder.jit(m, executors=[ex, *fusers])
        xx = x.detach().clone().requires_grad_()
        y, h = jitted(xx)
        torch.autograd.backward((y, h), (torch.ones_like(y), torch.full_like(h, 0.5)))
        return jitted, (y, h), grads(m), xx.grad

    jitted, out, g, dx = run(model)
    assert len(bsyms_of(thunder.last_traces(jitted)[-1], GELU)) == 1  # the returned one
    assert not bsyms_of(backward_trace(jitted), GELU_BACKWARD)
    plain, out_plain, g_plain, dx_plain = run(twin, skip=["gelus"])
    assert len(bsyms_of(backward_trace(plain), GELU_BACKWARD)) == 3
    for a, b in zip((*out, dx), (*out_plain, dx_plain), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name, grad in g.items():
        torch.testing.assert_close(grad, g_plain[name], rtol=0, atol=0, msg=name)


def test_gelus_handed_back_to_torch_compile_compute_pytorchs_gelu():
    """Unfolded GELUs (a residual reads the GELU's output, and adds to its input's gradient)
    fused by torch.compile give the outputs and gradients of PyTorch's GELU kernels, which te_v2
    runs without a fuser, in float32 to rounding (in bfloat16, torch.compile also skips the
    rounding between the GELU backward and the residual's add). The linear stays out of FP8 (claim
    policy), so no FP8 rounding amplifies a last-bit difference."""

    class Residual(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)

        def forward(self, x):
            a = self.linear(x)
            return torch.nn.functional.gelu(a) + a

    model = Residual()
    x = torch.randn(32, 64)
    results = []
    for fusers in ([], [torch_compile_ex]):
        m = copy.deepcopy(model)
        ex = make_te_v2(backend="reference", claim=ClaimPolicy(min_features=128))
        jitted = thunder.jit(m, executors=[ex, *fusers])
        xx = x.detach().clone().requires_grad_()
        y = jitted(xx)
        y.backward(torch.linspace(-2, 2, y.numel()).reshape(y.shape))
        assert bool(bsyms_of(backward_trace(jitted), GELU_BACKWARD)) is not bool(fusers)
        results.append((y, xx.grad, *grads(m).values()))
    for a, b in zip(*results, strict=True):  # sums of last-bit differences (inductor's erf, exp)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


class GeluThenInPlace(torch.nn.Module):
    """The GELU's input is changed in place after the GELU ran and before the linear reads it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(a)
        a.mul_(3)
        return self.linear(h)


def test_a_gelu_whose_input_is_then_written_in_place_is_not_folded():
    """Folding would move the read of the GELU's input past the write (seen: 2.3 relative error)."""
    model = GeluThenInPlace(64)
    a = torch.randn(64, 64)
    with torch.no_grad():
        expected = model(a.clone())
        jitted = thunder.jit(model, executors=[make_te_v2(backend="reference", claim=CLAIM_ALL)])
        y = jitted(a.clone())
    assert not any(b.kwargs["gelu"] for b in bsyms_of(thunder.last_traces(jitted)[-1], LINEAR_FWD))
    assert sqnr_db(y, expected) > FWD_FLOOR


class TwoDraws(torch.nn.Module):
    """Two dropouts of one tensor and two noise draws like it: four independent random draws."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x)
        dropped = torch.nn.functional.dropout(y, 0.5, training=True) - torch.nn.functional.dropout(y, 0.5)
        return dropped, torch.randn_like(y) - torch.randn_like(y)


@pytest.mark.parametrize("fusers", [[], [torch_compile_ex]], ids=["thunder", "torch.compile"])
def test_random_draws_stay_independent(fusers):
    """te_v2 merges duplicate conversions before fusion; identical random calls are not duplicates."""
    jitted = thunder.jit(TwoDraws(64), executors=[make_te_v2(backend="reference", claim=CLAIM_ALL), *fusers])
    for difference in jitted(torch.randn(32, 64)):
        assert difference.abs().sum() > 0


class ZerosFilledInPlace(torch.nn.Module):
    """Two layers, each adding its linear into a fresh zeros buffer of the same shape in place."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape)
        h.add_(self.first(x))
        out = torch.zeros(x.shape)
        out.add_(self.second(torch.relu(h)))
        return out


def test_fresh_buffers_written_in_place_are_not_merged():
    model = ZerosFilledInPlace(64)
    x = torch.randn(32, 64)

    def run(m, skip=()):
        ex = make_te_v2(backend="reference", claim=CLAIM_ALL, skip_passes=skip)
        jitted = thunder.jit(m, executors=[ex])
        y = jitted(x)
        y.square().sum().backward()
        return y, grads(m)

    twin = copy.deepcopy(model)
    y, g = run(model)
    y_plain, g_plain = run(twin, skip=["merge_casts"])
    torch.testing.assert_close(y, y_plain, rtol=0, atol=0)
    for name, grad in g.items():
        torch.testing.assert_close(grad, g_plain[name], rtol=0, atol=0, msg=name)
