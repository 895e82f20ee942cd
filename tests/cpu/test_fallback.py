"""What te_v2 does not run goes to Thunder's default path, once-warned, with right numbers."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import thunder
import torch

from te_v2_executor import ClaimPolicy, TEv2FallbackWarning, backends, explain, make_te_v2, te_v2
from te_v2_executor.config import DEFAULT_MIN_FEATURES
from te_v2_executor.symbols import LINEAR_FWD
from tests.helpers import bsyms_of, forward_trace
from tests.models import LoRAStack, Stack, grads


def _train_step(model, executors, x):
    jitted = thunder.jit(model, executors=executors)
    jitted(x).sum().backward()
    return jitted


@pytest.mark.parametrize(
    ("dims", "tokens", "rule"),
    [
        ([64, 40], 32, "divisible by 16 (out_features=40)"),
        ([40, 64], 32, "divisible by 16 (in_features=40)"),
        ([64, 64], 24, "divisible by 16 (tokens=24)"),
    ],
    ids=["out-features", "in-features", "tokens"],
)
def test_shapes_fp8_cannot_run_fall_back_once_with_the_rule(reference_te_v2, dims, tokens, rule):
    model = Stack(dims)
    x = torch.randn(tokens, dims[0], requires_grad=True)
    eager = copy.deepcopy(model)
    eager_x = x.detach().clone().requires_grad_()
    eager(eager_x).sum().backward()

    with pytest.warns(
        TEv2FallbackWarning, match=rf"x\[{tokens}, {dims[0]}\] @ W\[{dims[1]}, {dims[0]}\].*{re.escape(rule)}"
    ):
        jitted = _train_step(model, [reference_te_v2], x)
    assert not bsyms_of(forward_trace(jitted), LINEAR_FWD)
    # Thunder's default linear: the same float32 numbers as eager PyTorch
    torch.testing.assert_close(x.grad, eager_x.grad)
    torch.testing.assert_close(grads(model)["linears.0.weight"], grads(eager)["linears.0.weight"])
    (row,) = explain(jitted).linears
    assert not row.claimed and rule in row.fallback

    with warnings.catch_warnings():
        warnings.simplefilter("error", TEv2FallbackWarning)
        _train_step(model, [reference_te_v2], x)  # a new trace, the same fallback: no second warning


def test_unsupported_dtype_falls_back(reference_te_v2):
    model = Stack([64, 64]).double()
    with pytest.warns(TEv2FallbackWarning, match="float32, bfloat16 or float16 inputs"):
        _train_step(model, [reference_te_v2], torch.randn(32, 64, dtype=torch.float64))


@pytest.mark.parametrize("unquantized", [True, False], ids=["te_v2-unquantized", "thunder"])
def test_default_claim_policy_keeps_rank_16_adapters_out_of_fp8_without_a_warning(unquantized):
    """The adapters run unquantized as te_v2 symbols, or with ``unquantized=False`` on Thunder's
    default path; either way their gradients are the eager float32 ones, to GEMM rounding."""
    dim = max(64, DEFAULT_MIN_FEATURES)
    model = LoRAStack([dim, dim], rank=16)
    eager = copy.deepcopy(model)
    x = torch.randn(32, dim)
    eager(x).sum().backward()
    ex = make_te_v2(backend="reference", claim=ClaimPolicy(unquantized=unquantized))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TEv2FallbackWarning)  # a choice, not a limitation
        jitted = _train_step(model, [ex], x)
    rows = {r.name: r for r in explain(jitted).linears}
    adapters = ("layers_0_lora_a_weight", "layers_0_lora_b_weight")
    assert {name: r.claimed for name, r in rows.items()} == {
        "layers_0_base_weight": True,
        **{name: unquantized for name in adapters},
    }
    rule = "claim policy: min(in_features, out_features)=16"
    for name in adapters:
        r = rows[name]
        assert (r.unquantized if unquantized else r.fallback).startswith(rule), name
        assert r.recipe == ("unquantized" if unquantized else "")
    path = "runs unquantized: claim policy" if unquantized else "runs on Thunder's default path: claim policy"
    assert path in str(explain(jitted))
    assert rows["layers_0_base_weight"].recipe == "delayed"
    # the base is frozen; the adapters train, in float32 as eager does
    assert grads(model)["layers.0.base.weight"] is None
    for name in ("layers.0.lora_a.weight", "layers.0.lora_b.weight"):
        torch.testing.assert_close(grads(model)[name], grads(eager)[name], rtol=1e-5, atol=1e-6)


def test_claim_policy_is_configurable():
    def recipes(claim: ClaimPolicy) -> list[str]:
        ex = make_te_v2(backend="reference", claim=claim)
        jitted = _train_step(LoRAStack([64, 64], rank=16), [ex], torch.randn(32, 64))
        return [r.recipe for r in explain(jitted).linears]

    assert recipes(ClaimPolicy(min_features=128)) == ["unquantized"] * 3
    assert recipes(ClaimPolicy(min_features=128, unquantized=False)) == [""] * 3
    assert recipes(ClaimPolicy(min_features=0)) == ["delayed"] * 3


@pytest.mark.skipif(backends.te_available(), reason="TransformerEngine is installed here")
def test_te_backend_without_transformer_engine_says_what_to_install():
    jitted = thunder.jit(Stack([64, 64]), executors=[te_v2])
    with pytest.raises(ImportError, match=r"te-v2-executor\[te\].*backend='reference'"):
        jitted(torch.randn(32, 64))


@pytest.mark.parametrize("checkpointed", [True, False], ids=["hf-gradient-checkpointing", "plain"])
def test_linears_dynamo_runs_eagerly_warn_through_te_v2s_thunderfx(monkeypatch, checkpointed):
    """Hugging Face gradient checkpointing makes Dynamo break the graph at each checkpointed layer
    and run it eagerly, so its linears never reach te_v2: ``te_v2_executor.thunderfx`` warns,
    naming a layer's linear. Without it the whole model is compiled and nothing warns."""
    pytest.importorskip("transformers", reason="needs transformers (the [bench] extra)")
    import te_v2_executor
    from te_v2_executor import executor, executors
    from tests.models import tiny_llama

    monkeypatch.setattr(executor, "_warned", set())
    model = tiny_llama(64, torch.float32).train()
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = te_v2_executor.thunderfx(model, executors=executors(make_te_v2(backend="reference")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    outside = [str(w.message) for w in caught if "ran outside the compiled function" in str(w.message)]
    if checkpointed:
        assert len(outside) == 1
        assert re.match(r"te_v2: model\.layers\.0\.\w+\.\w+_proj \(an nn.Linear\)", outside[0]), outside
        assert all(issubclass(w.category, TEv2FallbackWarning) for w in caught if str(w.message) in outside)
    else:
        assert outside == []
    torch._dynamo.reset()


class _PrintingLinear(torch.nn.Linear):
    """An ``nn.Linear`` subclass whose forward Dynamo breaks the graph in (``print``): Dynamo runs
    the module's call eagerly, yet compiles its ``forward``, which te_v2 then runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("forward")
        return super().forward(x)


def _hooks(model: torch.nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_a_hooked_model_compiled_again_copied_or_pickled_keeps_one_warning_hook_per_linear(monkeypatch):
    """Compiled again, through a submodule first, or as a deep copy or a pickle of a compiled
    model, each plain linear keeps one hook, and a model run eagerly warns once; subclasses of
    ``nn.Linear`` and a model compiled with ``warn_eager_linears=False`` get none."""
    import pickle

    import te_v2_executor
    from te_v2_executor import executor, executors

    def compile_(m, **options):
        return te_v2_executor.thunderfx(m, executors=executors(make_te_v2(backend="reference")), **options)

    def model():
        inner = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())
        return torch.nn.Sequential(inner, torch.nn.Linear(32, 32), _PrintingLinear(32, 32))

    hooked = model()
    compile_(hooked[0])
    for _ in range(2):
        compile_(hooked)
    assert _hooks(hooked) == [1, 1, 0]
    for twin in (hooked, copy.deepcopy(hooked), pickle.loads(pickle.dumps(hooked))):
        compile_(twin)
        assert _hooks(twin) == [1, 1, 0]
        monkeypatch.setattr(executor, "_warned", set())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            twin(torch.randn(4, 32))
            twin(torch.randn(4, 32))
        assert [w.category for w in caught] == [TEv2FallbackWarning]
        assert str(caught[0].message).startswith("te_v2: 0 (an nn.Linear) ran outside the compiled function")
    unhooked = model()
    compile_(unhooked, warn_eager_linears=False)
    assert _hooks(unhooked) == [0, 0, 0]


class _ThreeLinears(torch.nn.Module):
    """Linear, ``_PrintingLinear``, linear: Dynamo compiles the first, breaks the graph at the
    second's call and compiles its ``forward`` as a frame of its own, then the third in the frame
    it resumes in. (Under ``nn.Sequential``, whose loop it cannot resume inside, it runs the first
    and third eagerly.)"""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(32, 32), _PrintingLinear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


@pytest.mark.parametrize("container", ["module", "sequential"])
def test_only_linears_dynamo_runs_eagerly_warn(monkeypatch, capsys, container):
    """A subclass of ``nn.Linear`` whose call Dynamo runs eagerly while it compiles its
    ``forward`` is not hooked, so no warning where te_v2 runs all three linears; in an
    ``nn.Sequential`` the plain linears run eagerly, and the first warns."""
    import te_v2_executor
    from te_v2_executor import executor, executors

    monkeypatch.setattr(executor, "_warned", set())
    torch._dynamo.reset()
    model = _ThreeLinears()
    if container == "sequential":
        model = torch.nn.Sequential(model.a, model.b, model.c)
    compiled = te_v2_executor.thunderfx(model, executors=executors(make_te_v2(backend="reference")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(32, 32, requires_grad=True)).sum().backward()
    assert capsys.readouterr().out == "forward\n"
    outside = [str(w.message) for w in caught if "ran outside the compiled function" in str(w.message)]
    claimed = len(explain(compiled).linears)
    if container == "module":
        assert (outside, claimed) == ([], 3)
    else:
        assert [m.split(" (")[0] for m in outside] == ["te_v2: 0"]
        assert claimed == 1
    torch._dynamo.reset()
