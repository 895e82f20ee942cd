"""Which te_v2 symbols the compiled traces hold, case by case (reference backend, CPU)."""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
from thunder.core import prims
from thunder.executors.torch_compile import torch_compile_ex
from torch.utils.checkpoint import checkpoint

from te_v2_executor import ClaimPolicy, current_scaling, explain, make_te_v2
from te_v2_executor.config import DEFAULT_MIN_FEATURES
from te_v2_executor.symbols import (
    BACKWARD_SYNC,
    FORWARD_SYNC,
    GELU,
    GELU_BACKWARD,
    LINEAR_DGRAD,
    LINEAR_FWD,
    LINEAR_WGRAD,
    QUANTIZE_GRAD_OUTPUT,
    UNQUANTIZED_DGRAD,
    UNQUANTIZED_FWD,
    UNQUANTIZED_WGRAD,
    arg,
    is_recast,
)
from tests.helpers import CLAIM_ALL, backward_trace, bsyms_of, forward_trace, recast_copies
from tests.models import Checkpointed, LoRALinear, LoRAStack, Stack, TwoOutputs, every_even, grads

DIM = 64
TOKENS = 32
# the policy's adapters on Thunder's default path, as before te_v2 ran them unquantized
THUNDER_ADAPTERS = ClaimPolicy(min_features=DIM, unquantized=False)


def _step(model, executors, x):
    jitted = thunder.jit(model, executors=executors)
    y = jitted(x)
    if y.requires_grad:
        y.sum().backward()
    return jitted


def _weight_names(bsyms) -> set[str]:
    return {b.kwargs["state"].name for b in bsyms}


@pytest.mark.parametrize("input_requires_grad", [False, True], ids=["x-no-grad", "x-grad"])
def test_seed_case_runs_only_consumed_gradients(reference_te_v2, input_requires_grad):
    model = Stack([DIM] * 5, frozen=every_even)
    x = torch.randn(TOKENS, DIM, requires_grad=input_requires_grad)
    jitted = _step(model, [reference_te_v2], x)
    bwd = backward_trace(jitted)

    expected_wgrad = {"t_linears_1_weight", "t_linears_3_weight"}
    assert _weight_names(bsyms_of(bwd, LINEAR_WGRAD)) == expected_wgrad
    # dx of linear i is needed when something before it trains: linear 1's weight, or x
    needs_dgrad = [input_requires_grad or i >= 2 for i in range(4)]
    expected_dgrad = {f"t_linears_{i}_weight" for i in range(4) if needs_dgrad[i]}
    assert _weight_names(bsyms_of(bwd, LINEAR_DGRAD)) == expected_dgrad
    assert _weight_names(bsyms_of(bwd, QUANTIZE_GRAD_OUTPUT)) == expected_dgrad | expected_wgrad

    fwd = {b.kwargs["state"].name: b.kwargs for b in bsyms_of(forward_trace(jitted), LINEAR_FWD)}
    for i in range(4):
        kw = fwd[f"t_linears_{i}_weight"]
        assert kw["save_input"] is (i % 2 == 1), f"x^T of linear {i}"
        assert not kw["save_weight"], f"W^T of linear {i} is cast in the backward"
    assert set(recast_copies(bwd)) == expected_dgrad
    assert all(map(is_recast, bsyms_of(bwd, LINEAR_FWD)))


def test_saved_weight_copies_are_those_dgrads_read():
    """Without ``weight_recasts``, each forward saves W^T exactly where a dgrad reads it."""
    model = Stack([DIM] * 5, frozen=every_even)
    te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL, skip_passes=["weight_recasts"])
    jitted = _step(model, [te_v2], torch.randn(TOKENS, DIM))
    fwd = {b.kwargs["state"].name: b.kwargs for b in bsyms_of(forward_trace(jitted), LINEAR_FWD)}
    assert [fwd[f"t_linears_{i}_weight"]["save_weight"] for i in range(4)] == [False, False, True, True]
    assert not bsyms_of(backward_trace(jitted), LINEAR_FWD)


def test_seed_case_report(reference_te_v2):
    jitted = _step(Stack([DIM] * 5, frozen=every_even), [reference_te_v2], torch.randn(TOKENS, DIM))
    rows = {r.name: r for r in explain(jitted).linears}
    assert [rows[f"linears_{i}_weight"].wgrad for i in range(4)] == [False, True, False, True]
    assert [rows[f"linears_{i}_weight"].dgrad for i in range(4)] == [False, False, True, True]
    assert [rows[f"linears_{i}_weight"].saves_input_t for i in range(4)] == [False, True, False, True]
    assert "saves x^T" in str(explain(jitted))


def test_everything_frozen_has_no_backward_symbols(reference_te_v2):
    model = Stack([DIM] * 5, frozen=lambda i: True)
    jitted = _step(model, [reference_te_v2], torch.randn(TOKENS, DIM))
    assert backward_trace(jitted) is None
    fwd = forward_trace(jitted)
    for sym in (QUANTIZE_GRAD_OUTPUT, LINEAR_DGRAD, LINEAR_WGRAD, BACKWARD_SYNC):
        assert not bsyms_of(fwd, sym)
    # like te.autocast, grad mode on means the forward's delayed-scaling state is updated
    assert len(bsyms_of(fwd, FORWARD_SYNC)) == 1
    assert all(not b.kwargs["save_input"] and not b.kwargs["save_weight"] for b in bsyms_of(fwd, LINEAR_FWD))


@pytest.mark.parametrize("trained", ["bias", "weight"])
def test_bias_gradient_runs_only_when_the_bias_trains(reference_te_v2, trained):
    model = Stack([DIM, DIM], bias=True)
    getattr(model.linears[0], "weight" if trained == "bias" else "bias").requires_grad_(False)
    jitted = _step(model, [reference_te_v2], torch.randn(TOKENS, DIM))
    bwd = backward_trace(jitted)
    (quantize,) = bsyms_of(bwd, QUANTIZE_GRAD_OUTPUT)
    assert quantize.kwargs["bgrad"] is (trained == "bias")
    assert bool(bsyms_of(bwd, LINEAR_WGRAD)) is (trained == "weight")
    # bias grad alone needs no FP8 dy at all
    assert (quantize.kwargs["rowwise"], quantize.kwargs["columnwise"]) == (False, trained == "weight")
    assert (model.linears[0].bias.grad is not None) is (trained == "bias")


def test_inference_runs_the_forward_gemm_only(reference_te_v2):
    model = Stack([DIM] * 3)
    jitted = thunder.jit(model, executors=[reference_te_v2])
    with torch.no_grad():
        jitted(torch.randn(TOKENS, DIM))
    fwd = forward_trace(jitted)
    kwargs = [b.kwargs for b in bsyms_of(fwd, LINEAR_FWD)]
    assert len(kwargs) == 2
    assert all(k["compute_output"] and not k["save_input"] and not k["save_weight"] for k in kwargs)
    assert not bsyms_of(fwd, FORWARD_SYNC) and not bsyms_of(fwd, BACKWARD_SYNC)


def _recomputed(trace, name):
    return [b for b in bsyms_of(trace, LINEAR_FWD) if b.kwargs["state"].name == name]


@pytest.mark.parametrize("act", ["relu", "none"])
def test_checkpoint_recompute_builds_only_what_the_backward_uses(reference_te_v2, act):
    model = Checkpointed(DIM)
    if act == "none":
        model.inner.act = lambda t: t
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    jitted = _step(model, [reference_te_v2], x)
    first_inner = "t_inner_linears_0_weight"

    (original,) = _recomputed(forward_trace(jitted), first_inner)
    assert not original.kwargs["save_input"] and not original.kwargs["save_weight"]
    (recompute,) = _recomputed(backward_trace(jitted), first_inner)
    assert recompute.kwargs["save_input"] and recompute.kwargs["save_weight"]
    # relu's backward reads the recomputed output; without it, only the FP8 copies are needed
    assert recompute.kwargs["compute_output"] is (act == "relu")
    assert next(r for r in explain(jitted).linears if r.name == "inner_linears_0_weight").recomputed


def test_frozen_base_lora_skips_base_wgrad(reference_te_v2):
    model = LoRAStack([DIM, DIM, DIM], rank=16)
    jitted = _step(model, [reference_te_v2], torch.randn(TOKENS, DIM))
    bwd = backward_trace(jitted)
    wgrad_names = _weight_names(bsyms_of(bwd, LINEAR_WGRAD))
    assert wgrad_names == {f"t_layers_{i}_lora_{ab}_weight" for i in range(2) for ab in "ab"}
    rows = explain(jitted).linears
    base = [r for r in rows if "base" in r.name]
    assert [r.dgrad for r in base] == [False, True]
    # each base linear casts its input for its adapter's A too, whose wgrad reads the x^T it saves
    lora_a = [r for r in rows if "lora_a" in r.name]
    assert [(r.saves_input_t, r.shares_input) for r in base] == [(True, False)] * 2
    assert [(r.saves_input_t, r.shares_input) for r in lora_a] == [(False, True)] * 2


def test_delayed_scaling_flushes_once_per_pass_at_the_end(reference_te_v2):
    jitted = _step(Stack([DIM] * 5), [reference_te_v2], torch.randn(TOKENS, DIM, requires_grad=True))
    fwd, bwd = forward_trace(jitted), backward_trace(jitted)
    work = lambda t: [b for b in t.bound_symbols if b.sym not in (prims.python_del, prims.python_return)]  # noqa: E731
    assert len(bsyms_of(fwd, FORWARD_SYNC)) == 1 and work(fwd)[-1].sym is FORWARD_SYNC
    assert len(bsyms_of(bwd, BACKWARD_SYNC)) == 1 and work(bwd)[-1].sym is BACKWARD_SYNC
    assert len(bsyms_of(fwd, FORWARD_SYNC)[0].kwargs["group"].states) == 4


def test_stateless_recipes_have_no_sync():
    ex = make_te_v2(backend="reference", claim=CLAIM_ALL, recipe=current_scaling())
    jitted = _step(Stack([DIM] * 3), [ex], torch.randn(TOKENS, DIM, requires_grad=True))
    for trace in (forward_trace(jitted), backward_trace(jitted)):
        assert not bsyms_of(trace, FORWARD_SYNC) and not bsyms_of(trace, BACKWARD_SYNC)


def test_torch_compile_executor_fuses_the_rest_not_the_linears(reference_te_v2):
    model = Stack([DIM] * 5, frozen=every_even, act=torch.tanh)  # te_v2 takes GELU and SiLU
    jitted = _step(model, [reference_te_v2, torch_compile_ex], torch.randn(TOKENS, DIM, requires_grad=True))
    for trace in (forward_trace(jitted), backward_trace(jitted)):
        fusions = [b for b in trace.bound_symbols if b.sym.is_fusion]
        assert fusions, "torch.compile fused nothing"
        for fusion in fusions:
            assert all(s.sym.executor is not LINEAR_FWD.executor for s in fusion.subsymbols)
    assert len(bsyms_of(backward_trace(jitted), LINEAR_WGRAD)) == 2
    assert all(r.claimed for r in explain(jitted).linears)


def test_default_executors_after_te_v2(reference_te_v2):
    jitted = _step(
        Stack([DIM] * 3), [reference_te_v2, *thunder.get_default_executors()], torch.randn(TOKENS, DIM)
    )
    assert len(bsyms_of(forward_trace(jitted), LINEAR_FWD)) == 2


def test_a_fuser_claiming_linear_first_is_refused(reference_te_v2):
    jitted = thunder.jit(Stack([DIM] * 2), executors=[torch_compile_ex, reference_te_v2])
    with pytest.raises(ValueError, match=r"list 'te_v2_reference_\d+' first"):
        jitted(torch.randn(TOKENS, DIM))


def test_explain_follows_a_cache_hit_back_to_an_older_trace(reference_te_v2):
    model = Stack([DIM] * 3)
    jitted = thunder.jit(model, executors=[reference_te_v2])
    x = torch.randn(TOKENS, DIM)

    def first_wgrad() -> bool:
        jitted(x).sum().backward()
        (row,) = (r for r in explain(jitted).linears if r.name == "linears_0_weight")
        return row.wgrad

    assert first_wgrad()
    model.linears[0].requires_grad_(False)
    assert not first_wgrad()  # a retrace
    model.linears[0].requires_grad_(True)
    assert first_wgrad()  # the first trace again, from the cache
    assert (thunder.cache_misses(jitted), thunder.cache_hits(jitted)) == (2, 1)


@pytest.mark.parametrize("round_trips", ["dropped", "kept"])
def test_a_gradient_converted_once_is_not_converted_twice(round_trips):
    """A bf16 add's backward converts its fp32 gradient to bf16 once per input; te_v2 merges the
    copies, so torch.compile does not write the activation gradient twice (LoRA peak memory).
    Here the fp32 gradient is itself the bf16 cotangent's exact widening, and the round trip is
    dropped: no conversion is left. Kept, the merge alone leaves one."""
    skip = ["round_trips"] if round_trips == "kept" else []
    ex = make_te_v2(backend="reference", claim=THUNDER_ADAPTERS, skip_passes=skip)
    model = LoRAStack([DIM, 2 * DIM, DIM], rank=4).to(torch.bfloat16)
    jitted = _step(model, [ex, torch_compile_ex], torch.randn(TOKENS, DIM, dtype=torch.bfloat16))
    converts = [
        (s.args[0].name, s.args[1])
        for fusion in backward_trace(jitted).bound_symbols
        if fusion.sym.is_fusion
        for s in fusion.subsymbols
        if s.sym.id == prims.PrimIDs.CONVERT_ELEMENT_TYPE
    ]
    if round_trips == "dropped":
        assert not converts
    else:
        assert converts, "the backward has no fused dtype conversions to check"
        assert len(converts) == len(set(converts))


@pytest.mark.parametrize("fusers", [[], [torch_compile_ex]], ids=["thunder", "torch.compile"])
def test_a_base_dgrad_accumulates_into_its_adapters_gradient(fusers):
    ex = make_te_v2(backend="reference", claim=THUNDER_ADAPTERS)
    model = LoRAStack([DIM, 2 * DIM, DIM], rank=16).to(torch.bfloat16)
    jitted = _step(model, [ex, *fusers], torch.randn(TOKENS, DIM, dtype=torch.bfloat16))
    bwd = backward_trace(jitted)
    (dgrad,) = bsyms_of(bwd, LINEAR_DGRAD)
    assert arg(dgrad, "accumulate_into") is not None, (
        "the base dgrad does not accumulate into the adapter's gradient"
    )
    adds = [
        s
        for b in bwd.bound_symbols
        for s in (b.subsymbols if b.sym.is_fusion else [b])
        if s.sym.name == "add"
    ]
    assert all(dgrad.output.name not in {a.name for a in s.flat_proxy_args} for s in adds)


def _non_te_v2_ops(trace) -> list[str]:
    """What in ``trace`` is neither a te_v2 symbol nor bookkeeping (unpacks, deletions, return)."""
    bookkeeping = {"unpack_trivial", "unpack_sequence", "python_del", "python_return"}
    bookkeeping |= {"clear_mutable_collection", "unpack_tuple"}
    return [
        b.sym.name
        for b in trace.bound_symbols
        if not b.sym.name.startswith("te_v2_") and b.sym.name not in bookkeeping
    ]


@pytest.mark.parametrize("fusers", [[], [torch_compile_ex]], ids=["thunder", "torch.compile"])
def test_lora_adapters_run_unquantized_in_te_v2_with_their_sums_folded(fusers):
    """The default policy's adapters, on a bf16 LoRA MLP: te_v2 runs them unquantized, adds each
    adapter's output into its base's, and adds the dgrads of a base and its adapter into one
    another; the backward's cast round trip (a bf16 add's gradient, through float32) is gone. So
    nothing is left for torch.compile: no region, nothing but te_v2 symbols (the GELU included:
    a region holding it alone would run the same kernel)."""
    dim = DEFAULT_MIN_FEATURES
    model = torch.nn.Sequential(
        LoRALinear(dim, 2 * dim, 16), torch.nn.GELU(), LoRALinear(2 * dim, dim, 16)
    ).to(torch.bfloat16)
    jitted = _step(
        model, [make_te_v2(backend="reference"), *fusers], torch.randn(TOKENS, dim, dtype=torch.bfloat16)
    )
    fwd, bwd = forward_trace(jitted), backward_trace(jitted)
    assert not _non_te_v2_ops(fwd) and not _non_te_v2_ops(bwd)
    assert len(bsyms_of(fwd, GELU)) == 1 and len(bsyms_of(bwd, GELU_BACKWARD)) == 1

    base_outputs = {b.output[0].name for b in bsyms_of(fwd, LINEAR_FWD)}
    adapters = {b.kwargs["site"].split("(")[0]: b for b in bsyms_of(fwd, UNQUANTIZED_FWD)}
    for i in range(2):
        a, b = adapters[f"t_{i * 2}_lora_a_weight"], adapters[f"t_{i * 2}_lora_b_weight"]
        assert arg(a, "accumulate_into") is None and arg(b, "accumulate_into").name in base_outputs, (
            f"adapter {i}"
        )
    # x needs no grad: the first adapter's A has no dgrad, and the first base none at all
    dgrads = {b.kwargs["site"].split("(")[0]: b for b in bsyms_of(bwd, UNQUANTIZED_DGRAD)}
    assert set(dgrads) == {"t_0_lora_b_weight", "t_2_lora_a_weight", "t_2_lora_b_weight"}
    (base_dgrad,) = bsyms_of(bwd, LINEAR_DGRAD)
    assert arg(dgrads["t_2_lora_a_weight"], "accumulate_into") is base_dgrad.output
    assert len(bsyms_of(bwd, UNQUANTIZED_WGRAD)) == 4 and not bsyms_of(bwd, LINEAR_WGRAD)


@pytest.mark.parametrize("fusers", [[], [torch_compile_ex]], ids=["thunder", "torch.compile"])
def test_a_peft_scaling_folds_into_the_adapter_gemms(fusers):
    """PEFT's ``result + lora_B(lora_A(x)) * scaling``: B's forward scales its product by the
    scaling and adds it into the base's output; B's dgrad and wgrad read the incoming gradient
    and scale their products. Nothing but te_v2 symbols is left."""
    model = torch.nn.Sequential(
        LoRALinear(DIM, 2 * DIM, 16, scaling=0.5), torch.nn.GELU(), LoRALinear(2 * DIM, DIM, 16, scaling=0.5)
    ).to(torch.bfloat16)
    ex = make_te_v2(backend="reference", claim=ClaimPolicy(min_features=DIM))
    jitted = _step(model, [ex, *fusers], torch.randn(TOKENS, DIM, dtype=torch.bfloat16))
    fwd, bwd = forward_trace(jitted), backward_trace(jitted)
    assert not _non_te_v2_ops(fwd) and not _non_te_v2_ops(bwd)

    def scales(trace, sym) -> dict[str, float]:
        return {b.kwargs["site"].split("(")[0]: b.kwargs["scale"] for b in bsyms_of(trace, sym)}

    lora_b = {"t_0_lora_b_weight", "t_2_lora_b_weight"}
    for trace, sym in ((fwd, UNQUANTIZED_FWD), (bwd, UNQUANTIZED_DGRAD), (bwd, UNQUANTIZED_WGRAD)):
        assert {site for site, s in scales(trace, sym).items() if s != 1.0} == lora_b, sym.name
        assert all(s in (1.0, 0.5) for s in scales(trace, sym).values())
    assert all(
        arg(b, "accumulate_into") is not None
        for b in bsyms_of(fwd, UNQUANTIZED_FWD)
        if b.kwargs["scale"] == 0.5
    )


def test_checkpointed_unquantized_linears_recompute_with_eagers_gradients():
    """A checkpointed PEFT-style LoRA block under the default policy: its unquantized forwards
    are recomputed in the backward, reported so, and every gradient is eager's (float32, a
    power-of-two scaling: bitwise)."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = LoRALinear(DIM, DIM, 16, scaling=0.5)
            self.outer = LoRALinear(DIM, DIM, 16, scaling=0.5)

        def forward(self, x):
            h = checkpoint(lambda t: torch.nn.functional.gelu(self.inner(t)), x, use_reentrant=False)
            return self.outer(h)

    model = Model()
    eager = copy.deepcopy(model)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    jitted = _step(model, [make_te_v2(backend="reference")], x)
    eager(x_eager).sum().backward()
    recomputed = [b for b in bsyms_of(backward_trace(jitted), UNQUANTIZED_FWD)]
    assert len(recomputed) == 3, "the inner base, its A and its B"
    rows = {r.name: r for r in explain(jitted).linears}
    assert {name for name, r in rows.items() if r.recomputed} == {
        f"inner_{p}_weight" for p in ("base", "lora_a", "lora_b")
    }
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=0, atol=0)
    for name, grad in grads(model).items():
        expected = grads(eager)[name]
        assert (grad is None) == (expected is None), name
        if grad is not None:
            torch.testing.assert_close(grad, expected, rtol=0, atol=0, msg=name)


def test_a_summand_read_elsewhere_is_not_overwritten(reference_te_v2):
    """The base's output is also returned: the adapter's output may not be added into it."""

    class AlsoReturnsBase(LoRALinear):
        def forward(self, x):
            y = self.base(x)
            return y + self.lora_b(self.lora_a(x)), y

    ex = make_te_v2(backend="reference", claim=ClaimPolicy(min_features=DIM))
    jitted = thunder.jit(AlsoReturnsBase(DIM, DIM, 16), executors=[ex])
    out, base = jitted(torch.randn(TOKENS, DIM))
    assert all(arg(b, "accumulate_into") is None for b in bsyms_of(forward_trace(jitted), UNQUANTIZED_FWD))
    assert not torch.equal(out, base)


def test_a_round_trip_the_trace_returns_is_kept(reference_te_v2):
    """``x.float().to(x.dtype)`` returned is a new tensor, not ``x`` by another name."""
    ex = make_te_v2(backend="reference", claim=ClaimPolicy(min_features=DIM))
    model = LoRALinear(DIM, DIM, 16).to(torch.bfloat16)
    jitted = thunder.jit(lambda x: (model(x), x.float().to(torch.bfloat16)), executors=[ex])
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16)
    _, same = jitted(x)
    assert torch.equal(same, x) and same.data_ptr() != x.data_ptr()


def test_a_dgrad_never_accumulates_into_a_cotangent(reference_te_v2):
    """A gradient the backward did not compute (here the second output's cotangent) is not the
    backward's to overwrite."""
    jitted = thunder.jit(TwoOutputs(DIM), executors=[reference_te_v2])
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    torch.autograd.backward(jitted(x), [torch.randn(TOKENS, DIM), torch.randn(TOKENS, DIM)])
    (dgrad,) = bsyms_of(backward_trace(jitted), LINEAR_DGRAD)
    assert arg(dgrad, "accumulate_into") is None


@pytest.mark.parametrize("fusers", [[], [torch_compile_ex]], ids=["thunder", "torch.compile"])
def test_gelus_next_to_linears_are_computed_inside_the_quantizations(reference_te_v2, fusers):
    """Full fine-tune, x needs no grad: every GELU is read by the next forward alone, and every
    GELU backward by the dy quantization of the linear before it (the first one's: column-wise
    only, for its wgrad)."""
    model = Stack([DIM] * 4, act=torch.nn.functional.gelu)
    jitted = _step(model, [reference_te_v2, *fusers], torch.randn(TOKENS, DIM))
    fwd, bwd = forward_trace(jitted), backward_trace(jitted)
    assert not bsyms_of(fwd, GELU) and not bsyms_of(bwd, GELU_BACKWARD)
    assert [b.kwargs["gelu"] for b in bsyms_of(fwd, LINEAR_FWD)] == [False, True, True]
    quantized = {b.kwargs["state"].name: b for b in bsyms_of(bwd, QUANTIZE_GRAD_OUTPUT)}
    for i in range(3):
        q = quantized[f"t_linears_{i}_weight"]
        assert (arg(q, "gelu_input") is not None) is (i < 2), f"dy of linear {i}"
    assert quantized["t_linears_0_weight"].kwargs["rowwise"] is False


def _lora_around_gelu() -> torch.nn.Module:
    """A trained linear, then LoRA linears on both sides of a GELU: nothing about it can fold."""
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, DIM),
        LoRALinear(DIM, DIM, 16),
        torch.nn.GELU(),
        LoRALinear(DIM, DIM, 16),
    ).to(torch.bfloat16)


def test_a_gelu_read_by_more_than_a_linear_runs_on_its_own(reference_te_v2):
    """LoRA on both sides: the GELU's output is read by the next base and its adapter, and its
    input's gradient by the previous base's dy quantization and its adapter's GEMMs."""
    model = _lora_around_gelu()
    jitted = _step(model, [reference_te_v2], torch.randn(TOKENS, DIM, dtype=torch.bfloat16))
    assert len(bsyms_of(forward_trace(jitted), GELU)) == 1
    assert len(bsyms_of(backward_trace(jitted), GELU_BACKWARD)) == 1
    assert not any(b.kwargs["gelu"] for b in bsyms_of(forward_trace(jitted), LINEAR_FWD))
    assert all(arg(b, "gelu_input") is None for b in bsyms_of(backward_trace(jitted), QUANTIZE_GRAD_OUTPUT))


def test_with_a_fuser_after_te_v2_unfolded_gelus_go_back_to_it(reference_te_v2):
    """The same LoRA model with torch.compile after te_v2: the GELU it cannot fold is fused by
    torch.compile with its neighbours instead of running PyTorch's kernel on its own."""
    model = _lora_around_gelu()
    jitted = _step(model, [reference_te_v2, torch_compile_ex], torch.randn(TOKENS, DIM, dtype=torch.bfloat16))
    for trace, sym in ((forward_trace(jitted), GELU), (backward_trace(jitted), GELU_BACKWARD)):
        assert not bsyms_of(trace, sym)
        fused = {s.sym.name for b in trace.bound_symbols if b.sym.is_fusion for s in b.subsymbols}
        assert {"gelu"} <= fused if sym is GELU else {"erf", "exp"} <= fused


@pytest.mark.parametrize(
    ("approximate", "claim"),
    [("tanh", CLAIM_ALL), ("none", ClaimPolicy(min_features=0, gelu=False))],
    ids=["tanh-gelu", "gelu-claim-off"],
)
def test_gelus_te_v2_does_not_take_stay_with_thunder(approximate, claim):
    ex = make_te_v2(backend="reference", claim=claim)
    model = Stack([DIM] * 3, act=lambda t: torch.nn.functional.gelu(t, approximate=approximate))
    jitted = _step(model, [ex], torch.randn(TOKENS, DIM))
    assert not bsyms_of(forward_trace(jitted), GELU)
    assert not any(b.kwargs["gelu"] for b in bsyms_of(forward_trace(jitted), LINEAR_FWD))
    assert not bsyms_of(backward_trace(jitted), GELU_BACKWARD)


def test_a_gelu_mlp_with_biases_leaves_no_op_to_a_fuser(reference_te_v2):
    """Linear -> GELU -> Linear with biases (issue 17 saw no nvFusion region for it): the GELU folds
    into the second linear's cast, its backward into the first's dy quantization, each bias grad
    into a dy quantization, so a fusion executor after te_v2 gets no op, whichever it is."""
    model = Stack([DIM, 4 * DIM, DIM], bias=True, act=torch.nn.functional.gelu)
    jitted = _step(model, [reference_te_v2, torch_compile_ex], torch.randn(TOKENS, DIM, requires_grad=True))
    bookkeeping = {
        "python_del",
        "python_return",
        "unpack_trivial",
        "unpack_sequence",
        "clear_mutable_collection",
    }
    for trace in (forward_trace(jitted), backward_trace(jitted)):
        left = {b.sym.name for b in trace.bound_symbols} - bookkeeping
        assert all(name.startswith("te_v2_") for name in left), left
    assert sum(arg(b, "bgrad") for b in bsyms_of(backward_trace(jitted), QUANTIZE_GRAD_OUTPUT)) == 2
