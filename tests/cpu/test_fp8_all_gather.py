"""te_v2's FP8 all-gather under FSDP2 (``te_v2_executor.fsdp``), on one CPU rank (gloo): which
weights it wraps, the refusal of any recipe but current scaling, and te_v2's steps bitwise those
of a BF16 all-gather, since te_v2's cast of the gathered weight is its cast of the weight. Two
ranks, where the all-gather moves a byte a value: ``tests/distributed``."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
import torch.distributed as dist

from benchmarks import hf, scaling
from te_v2_executor import (
    ClaimPolicy,
    current_scaling,
    delayed_scaling,
    gathered_weights,
    make_te_v2,
    thunderfx,
)
from te_v2_executor.backends import reference
from te_v2_executor.fsdp import FP8GatheredWeight, fp8_all_gather
from tests.helpers import (
    counted_weight_reads,
    file_store_process_group,
    forward_and_dgrad_through_gathered_weight,
    gathered_on_one_rank,
)
from tests.models import tiny_llama

pytest.importorskip("transformers")

HIDDEN, SEQUENCE, STEPS, LR = 64, 16, 3, 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    """A gloo process group of this process alone."""
    if dist.is_initialized():
        yield
        return
    with file_store_process_group("gloo", str(tmp_path_factory.mktemp("store") / "store")):
        yield


def _executor(recipe=None):
    return make_te_v2(
        backend="reference", recipe=recipe or current_scaling(), claim=ClaimPolicy(min_features=16)
    )


def _sharded(fp8: bool, recipe=None, *, mixed: bool = False, lora: bool = False):
    """A tiny Llama (with peft's rank-16 adapters on its projections where ``lora``), its weights
    gathered in FP8 where ``fp8``, sharded per layer (computing in bfloat16 on float32 weights
    where ``mixed``), through thunderfx."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch._dynamo.reset()
    model = tiny_llama(HIDDEN, torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, target_modules=list(hf.FAMILIES)))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    executor = _executor(recipe)
    wrapped = fp8_all_gather(model, executor) if fp8 else []
    mesh = init_device_mesh("cpu", (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed else MixedPrecisionPolicy()
    for layer in scaling.decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, thunderfx(model, executors=[executor]), wrapped


def _train(model, fn):
    """STEPS SGD steps on fixed token ids: the losses and the weights after."""
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 2 * HIDDEN, (2, SEQUENCE), generator=gen)
        loss = fn(input_ids=ids, use_cache=False).logits.square().sum()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
                    p.grad = None
        losses.append(loss.detach())
    weights = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    return losses, {n: w._tensor if isinstance(w, FP8GatheredWeight) else w for n, w in weights.items()}


def test_it_wraps_the_weights_te_v2_runs_in_fp8_and_no_tied_one():
    model = tiny_llama(HIDDEN, torch.float32)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: the embedding reads it too
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(2 * HIDDEN, 8, bias=False)  # below 16
    wrapped = fp8_all_gather(model, _executor(), world_size=1)
    expected = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qkvo"}
    expected |= {f"model.layers.{i}.mlp.{p}_proj.weight" for i in (0, 1) for p in ("gate", "up", "down")}
    assert set(wrapped) == expected - {"model.layers.0.mlp.down_proj.weight"}
    assert not isinstance(model.lm_head.weight, FP8GatheredWeight)
    assert isinstance(model.model.layers[1].mlp.down_proj.weight, FP8GatheredWeight)
    # attention's output projection, a subclass of nn.Linear its module reads directly
    assert fp8_all_gather(torch.nn.MultiheadAttention(64, 4), _executor(), world_size=1) == []
    # the TE backend's: a model still on the CPU (or the meta device) moves to CUDA before it runs
    te_backend = make_te_v2(recipe=current_scaling(), claim=ClaimPolicy(min_features=16))
    assert len(fp8_all_gather(tiny_llama(HIDDEN, torch.float32), te_backend, world_size=1)) == 15
    # rows of 32 to 128: none divides evenly among 3 ranks
    assert fp8_all_gather(tiny_llama(HIDDEN, torch.float32), _executor(), world_size=3) == []


@pytest.fixture
def weight_reads(monkeypatch):
    """How te_v2 got the FP8 weights it read: counts of "cast" (the reference backend cast the
    weight) and "gathered" (it read the bytes FSDP2 gathered)."""
    counts = collections.Counter()
    cast, find = reference._quantize, gathered_weights.find

    def counted_cast(t, state, index, *, weight, **usages):
        counts["cast"] += weight
        return cast(t, state, index, weight=weight, **usages)

    def counted_find(w, recipe):
        found = find(w, recipe)
        counts["gathered"] += found is not None
        return found

    monkeypatch.setattr(reference, "_quantize", counted_cast)
    monkeypatch.setattr(gathered_weights, "find", counted_find)
    return counts


@pytest.mark.parametrize(("mixed", "lora"), [(False, False), (True, False), (False, True)])
def test_steps_are_bitwise_those_of_a_bf16_gather(mixed, lora, weight_reads):
    """And the FP8 gather's forwards and dgrads read the gathered bytes, casting no weight but
    the head, which the root keeps gathered from its forward through the backward (FSDP2's
    default for the root): its forward and its dgrad's recast cast it, a step."""
    model, fn, wrapped = _sharded(fp8=False, mixed=mixed, lora=lora)
    losses, weights = _train(model, fn)
    casts, weight_reads["cast"] = weight_reads["cast"], 0
    model_fp8, fn_fp8, wrapped = _sharded(fp8=True, mixed=mixed, lora=lora)
    losses_fp8, weights_fp8 = _train(model_fp8, fn_fp8)
    # 7 projections a layer and the head; under LoRA also each projection's two adapters
    assert len(wrapped) == 15 + (2 * 14 if lora else 0)
    head = 2 * STEPS
    assert casts > head and weight_reads == {"cast": head, "gathered": casts - head}, (casts, weight_reads)
    assert all(torch.equal(a, b) for a, b in zip(losses, losses_fp8, strict=True)), (losses, losses_fp8)
    assert weights.keys() == weights_fp8.keys()
    assert all(torch.equal(weights[n], weights_fp8[n]) for n in weights)


class _Block(torch.nn.Module):
    """A residual block of two linears (a module of its own: Dynamo runs a sharded
    ``nn.Sequential`` eagerly)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _Block(), _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _unseen_write(program: str) -> torch.Tensor:
    """``program``, a write into a gathered weight that moves no version counter, run on _Blocks
    gathered in FP8 and sharded per block: what it computes after the write."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Blocks()
    if program == "peft's merge_adapter after an explicit unshard":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=16, target_modules=["up", "down"], init_lora_weights=False)
        )
    executor = _executor()
    fp8_all_gather(model, executor)
    mesh = init_device_mesh("cpu", (1,))
    kept = program == "a write through .data between the forward and the backward"
    modules = [m for m in model.modules() if isinstance(m, _Block)]
    for module in (*modules, model):
        fully_shard(module, mesh=mesh, reshard_after_forward=not kept)
    fn = thunderfx(model, executors=[executor])
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    if kept:  # the module keeps its weights gathered from the forward through the backward
        loss = fn(x).square().sum()
        modules[1].up.weight.data.mul_(2)
        loss.backward()
        return modules[0].up.weight.grad.to_local()
    with torch.no_grad():
        for module in (*modules, model):
            module.unshard()
        if hasattr(model, "merge_adapter"):
            model.merge_adapter()  # adds each adapter's product into its base weight's .data
        else:
            modules[0].up.weight.data.mul_(2)
        return fn(x)


@pytest.mark.parametrize(
    "program",
    [
        "a write through .data between the forward and the backward",
        "a write through .data after an explicit unshard",
        "peft's merge_adapter after an explicit unshard",
    ],
)
def test_a_write_no_version_counter_sees_reaches_what_te_v2_computes(program):
    """te_v2 reads gathered FP8 bytes only within the pass FSDP2 gathered them for and frees them
    after, so such a write is computed with as where te_v2 casts every weight."""
    with counted_weight_reads() as reads:
        from_bytes = _unseen_write(program)
    with counted_weight_reads(cast_all=True) as casts:
        assert torch.equal(from_bytes, _unseen_write(program))
    assert reads.total() > 0 and casts["cast"] > 0  # te_v2 ran the linears in FP8


def test_a_weight_written_between_the_forward_and_the_backward_is_gathered_as_it_now_is():
    """The backward's gather casts with the weight's amax as it is then, as te_v2's recast of a
    BF16 gather does: a weight grown since the forward is not clipped to the forward's amax."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    grads = []
    for fp8 in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, executor = _Blocks(), _executor()
        if fp8:
            fp8_all_gather(model, executor)
        mesh = init_device_mesh("cpu", (1,))
        for module in (model.first, model.second, model):
            fully_shard(module, mesh=mesh)
        fn = thunderfx(model, executors=[executor])
        loss = fn(torch.randn(32, 32, generator=torch.Generator().manual_seed(1))).square().sum()
        with torch.no_grad():
            model.second.up.weight.mul_(1.5)  # the sharded weight, gathered again for the backward
        loss.backward()
        grads.append(model.first.up.weight.grad.to_local())
    assert torch.equal(*grads)


def test_a_weight_sharded_by_columns_is_refused_with_the_fix():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model = _Blocks()
    fp8_all_gather(model, _executor())
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), shard_placement_fn=lambda p: Shard(p.ndim - 1))
    with pytest.raises(
        ValueError, match=r"shard_placement_fn=\.\.\.\) sharding a wrapped weight along dim 1"
    ):
        model(torch.randn(16, 32))


def test_any_recipe_but_current_scaling_is_refused_with_the_fix():
    refusal = r"needs per-tensor current scaling, got delayed scaling.*recipe=current_scaling"
    with pytest.raises(ValueError, match=refusal):  # pinned: at once
        _sharded(fp8=True, recipe=delayed_scaling())
    # from te.autocast, at the gather: here a weight wrapped with a pinned delayed recipe
    from torch.distributed.device_mesh import init_device_mesh

    shard = FP8GatheredWeight(torch.randn(32, 16), delayed_scaling())
    with pytest.raises(ValueError, match=refusal):
        shard.fsdp_pre_all_gather(init_device_mesh("cpu", (1,)), shard.shape, shard.stride(), None, None)


def test_a_sharded_model_is_refused_with_the_fix():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Linear(64, 64), mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(
        ValueError, match=r"weight is sharded already; call fp8_all_gather.*before fully_shard"
    ):
        fp8_all_gather(model, _executor())


def test_a_wrapped_model_left_unsharded_is_refused_with_the_fix():
    """thunderfx failed in Thunder's tree_flatten of the wrapper; eagerly it ran unrounded."""
    from te_v2_executor import thunderfx

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    executor = _executor()
    assert fp8_all_gather(model, executor) == ["0.weight", "2.weight"]
    fix = r"0.weight was wrapped by fp8_all_gather but is not sharded: call fully_shard"
    for fn in (model, thunderfx(model, executors=[executor])):
        with pytest.raises(ValueError, match=fix):
            fn(torch.randn(16, 64))


def _reshard_onto_fewer_ranks(rank: int, store_path: str, world: int) -> None:
    """One of ``world`` gloo ranks: two wrapped layers that reshard onto half the ranks after
    the forward; the first gather must raise te_v2's error, not FSDP2's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with file_store_process_group("gloo", store_path, rank=rank, world_size=world):
        model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64)) for _ in range(2)))
        assert len(fp8_all_gather(model, _executor())) == 2
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=world // 2)
        fully_shard(model, mesh=mesh)
        with warnings.catch_warnings(), pytest.raises(ValueError, match=r"reshard_after_forward=<int>"):
            warnings.simplefilter("ignore")  # the layers run eagerly here, which warns
            model(torch.randn(16, 64))


def test_resharding_onto_fewer_ranks_after_the_forward_is_refused_with_the_fix(tmp_path):
    """FSDP2 keeps no all-gather extension's output sharded onto fewer ranks (it failed with
    "only Tensors of floating point dtype can require gradients" after the forward)."""
    world = 4
    torch.multiprocessing.spawn(
        _reshard_onto_fewer_ranks, args=(str(tmp_path / "store"), world), nprocs=world, join=True
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [0.0, 1e-6, 1.0, 3e4])
def test_te_v2s_cast_of_a_gathered_weight_is_the_cast_of_the_weight(dtype, magnitude):
    """What the bitwise steps rest on, over a wide range of values: te_v2's current-scaling cast
    of what the hooks gather (on one rank) has the FP8 values and the scale, to the bit, of its
    cast of the weight itself."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 128, generator=g) * magnitude * torch.logspace(-3, 0, 128)).to(dtype)
    w[0, :7] = 0.0
    fp8, gathered = gathered_on_one_rank(w, current_scaling())
    data = fp8.data.view(torch.uint8)

    def cast(t):
        scale = reference.scale_from_amax(t.abs().amax().float(), 448.0, current_scaling())
        return (t.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8), scale

    (q, scale), (q_gathered, scale_gathered) = cast(w), cast(gathered)
    assert gathered.dtype == dtype and torch.equal(scale_gathered, scale)
    assert torch.equal(q_gathered, q) and torch.equal(data, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gathered_fp8_bytes_make_the_forward_and_dgrad_the_cast_would(dtype):
    """The reference backend's forward GEMM and dgrad from the gathered FP8 bytes are, to the bit,
    those from its cast of the gathered weight (the GPU twin checks TE's)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 128, generator=g) * torch.logspace(-3, 0, 128)).to(dtype)
    x, dy = torch.randn(64, 128, generator=g).to(dtype), torch.randn(64, 256, generator=g).to(dtype)
    from_bytes, from_cast = forward_and_dgrad_through_gathered_weight(reference, x, w, dy, current_scaling())
    assert all(torch.equal(a, b) for a, b in zip(from_bytes, from_cast, strict=True))
    assert from_bytes[1].abs().sum() > 0


def _two_linears(seed: int, *, wrapped: bool = True) -> torch.nn.Module:
    """Two linears, gathered in FP8 and sharded where ``wrapped``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    if wrapped:
        fp8_all_gather(model, _executor())
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model


def _unwrapped_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        p.unwrap() if isinstance(p, FP8GatheredWeight) else p
        for p in (getattr(p, "_local_tensor", p) for p in model.parameters())
    ]


def test_a_distributed_checkpoint_of_wrapped_weights_loads_back(tmp_path):
    """torch.distributed.checkpoint saves the sharded, wrapped weights and loads them into another
    such model (weights_only, as DCP loads): the same values, still gathered in FP8."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    saved, loaded = _two_linears(0), _two_linears(1)
    dcp.save({"model": get_model_state_dict(saved)}, checkpoint_id=tmp_path)
    state = {"model": get_model_state_dict(loaded)}
    dcp.load(state, checkpoint_id=tmp_path)
    set_model_state_dict(loaded, state["model"])
    assert sum(isinstance(p.to_local(), FP8GatheredWeight) for p in loaded.parameters()) == 2
    for a, b in zip(_unwrapped_parameters(saved), _unwrapped_parameters(loaded), strict=True):
        assert torch.equal(a, b)


def test_a_full_state_dict_holds_plain_tensors_that_load_anywhere(tmp_path):
    """One rank's full state dict held the wrappers, which safetensors could not save; it holds
    the weights' own tensors now, which a model without the FP8 all-gather loads, and a wrapped
    model loads into its wrappers."""
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    saved = _two_linears(0)
    full = get_model_state_dict(saved, options=StateDictOptions(full_state_dict=True))
    assert {type(v) for v in full.values()} == {torch.Tensor}
    save_file(full, tmp_path / "model.safetensors")
    plain, wrapped = _two_linears(1, wrapped=False), _two_linears(2)
    plain.load_state_dict(load_file(tmp_path / "model.safetensors"))
    set_model_state_dict(wrapped, full, options=StateDictOptions(full_state_dict=True))
    assert sum(isinstance(p.to_local(), FP8GatheredWeight) for p in wrapped.parameters()) == 2
    for a, b, c in zip(*map(_unwrapped_parameters, (saved, plain, wrapped)), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_wrapped_linear_run_outside_the_compiled_model_warns_once():
    from te_v2_executor import TEv2FallbackWarning

    model, fn, _ = _sharded(fp8=True)
    ids = torch.zeros(2, SEQUENCE, dtype=torch.long)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(input_ids=ids, use_cache=False)
        assert not [w for w in caught if "outside a compiled function" in str(w.message)]
        model(input_ids=ids, use_cache=False)
    eager = [w for w in caught if "outside a compiled function" in str(w.message)]
    assert eager and all(w.category is TEv2FallbackWarning for w in eager)
    assert "call the compiled model, or leave this linear out of fp8_all_gather" in str(eager[0].message)


class _LoopOverLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32, bias=False) for _ in range(2))
        self.head = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def test_wrapped_linears_dynamo_runs_eagerly_warn():
    """A forward looping over sharded linears: Dynamo gives up on its frame and runs the linears
    eagerly, where te_v2 never sees them; the hook, which Dynamo then compiled as a frame of its
    own, tracing its check of ``is_compiling()`` as true, warned nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    model, executor = _LoopOverLinears(), _executor()
    fp8_all_gather(model, executor)
    mesh = init_device_mesh("cpu", (1,))
    for module in (*model.blocks, model):
        fully_shard(module, mesh=mesh)
    with warnings.catch_warnings(record=True) as caught, counted_weight_reads() as reads:
        warnings.simplefilter("always")
        thunderfx(model, executors=[executor])(torch.randn(32, 32))
    eager = {str(w.message).split(",")[0] for w in caught if "outside a compiled function" in str(w.message)}
    assert not reads and eager == {f"te_v2: {n}.weight" for n in ("blocks.0", "blocks.1", "head")}


def test_torch_autocast_is_refused_with_the_fix():
    """thunderfx leaves the linears of a torch.autocast region to PyTorch (seen: the second of two
    linears ran outside Thunder), which would compute with the FP8-rounded weights, silently."""
    _, fn, _ = _sharded(fp8=True)
    refusal = r"does not run under torch.autocast.*MixedPrecisionPolicy"
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=refusal):
        fn(input_ids=torch.zeros(2, SEQUENCE, dtype=torch.long), use_cache=False)


def test_each_gathered_weights_scale_inverse_starts_storage_of_its_own(monkeypatch):
    """The scales' inverses te_v2's GEMMs read with the gathered bytes, made for a whole FSDP2
    group at once, each start 256 bytes of their own: TE hands them to cuBLAS as scale pointers,
    and 4 bytes apart the GEMM of a group's second weight failed on an H100."""
    recorded, record = [], gathered_weights.record

    def recording(weight, fp8, recipe):
        recorded.append(fp8.scale_inv)
        return record(weight, fp8, recipe)

    monkeypatch.setattr(gathered_weights, "record", recording)
    model, fn, wrapped = _sharded(fp8=True)
    _train(model, fn)
    assert len(recorded) > len(wrapped)
    assert all(t.storage_offset() * t.element_size() % 256 == 0 for t in recorded)
    assert len({t.data_ptr() for t in recorded[: len(wrapped) - 1]}) == len(wrapped) - 1
