"""``causal_masks.fold``: an attention mask made of no input of the graph and equal to the causal
one makes its attention causal; anything it cannot prove leaves the graph as it was."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from te_v2_executor import causal_masks

B, H, S, D = 2, 3, 16, 8


def _compiled(fn, **compile_kwargs):
    """``fn`` through Dynamo with a backend that folds each graph and runs it eagerly; and the
    attentions made causal, per graph."""
    folded: list[int] = []
    sdpa_calls: list[dict] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        folded.append(causal_masks.fold(gm))
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
                sdpa_calls.append(dict(node.kwargs, positional=len(node.args)))
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, **compile_kwargs), folded, sdpa_calls


def _qkv(seq: int = S) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, seq, D, generator=g, requires_grad=True) for _ in range(3)]


def _hf_like_mask(seq: int, shift: int = 0) -> torch.Tensor:
    """A mask built as Hugging Face's ``sdpa_mask`` builds one under Dynamo: aranges compared, a
    packed-sequence check of arange positions, ``new_ones`` and ``&``."""
    positions = (torch.arange(seq) + 0).unsqueeze(0).expand(B, -1)
    first = positions[:, :1] - 1
    packed = (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)
    b = torch.arange(B)[:, None, None, None]
    q = torch.arange(seq)[None, None, :, None]
    kv = torch.arange(seq)[None, None, None, :]
    mask = q.new_ones((), dtype=torch.bool) & (kv <= q + shift)
    mask = mask & packed[b, q].__eq__(packed[b, kv])
    return mask.expand(B, -1, seq, seq)


def _check(fn, *inputs, folds: int):
    """``fn`` compiled folds ``folds`` attentions, and computes what it computes eagerly, output and
    gradients."""
    compiled, folded, calls = _compiled(fn)
    eager_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out, expected = compiled(*inputs), fn(*eager_inputs)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for t, e in zip(inputs, eager_inputs, strict=True):
        if t.requires_grad:
            torch.testing.assert_close(t.grad, e.grad)
    assert sum(folded) == folds, (folded, calls)
    causal = [c for c in calls if c.get("is_causal") is True and c.get("attn_mask", "absent") is None]
    assert len(causal) == folds, calls
    return calls


def test_a_hugging_face_causal_mask_makes_the_attention_causal():
    def attend(q, k, v):
        mask = _hf_like_mask(S)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2

    _check(attend, *_qkv(), folds=1)


def test_one_mask_read_by_two_attentions_folds_both_and_its_ops_leave_the_graph():
    """The ops only the mask needed are removed: ``torch.diff`` and ``new_ones``, which thunderfx
    sends to TorchInductor, are gone."""

    def attend(q, k, v):
        mask = _hf_like_mask(S)
        h = F.scaled_dot_product_attention(q, k, v, mask)
        return F.scaled_dot_product_attention(h, k, v, mask)

    graphs: list[str] = []

    def backend(gm, example_inputs):
        assert causal_masks.fold(gm) == 2
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    q, k, v = _qkv()
    torch.testing.assert_close(torch.compile(attend, backend=backend)(q, k, v), attend(q, k, v))
    assert "diff" not in graphs[0] and "new_ones" not in graphs[0], graphs[0]


def test_a_mask_that_is_not_causal_is_left():
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_hf_like_mask(S, shift=1))

    _check(attend, *_qkv(), folds=0)


def test_a_mask_causal_for_one_batch_row_only_is_left():
    def attend(q, k, v):
        causal = torch.arange(S)[None, :] <= torch.arange(S)[:, None]
        wider = torch.arange(S)[None, :] <= torch.arange(S)[:, None] + 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.stack([causal, wider])[:, None])

    _check(attend, *_qkv(), folds=0)


def test_a_mask_that_depends_on_an_input_is_left():
    """Padding comes from the batch: the mask is causal for this batch, but not provably so."""

    def attend(q, k, v, padding):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_hf_like_mask(S) & padding[:, None, None, :])

    _check(attend, *_qkv(), torch.ones(B, S, dtype=torch.bool), folds=0)


@pytest.mark.parametrize(
    "write",
    [
        lambda m: m.__setitem__((0, 0, 0, S - 1), True),
        lambda m: m[1].logical_not_(),
        lambda m: m.narrow(2, 0, 1).fill_(True),
        lambda m: m.__iand__(m.new_zeros(())),
        lambda m: F.relu(m.view(torch.uint8), inplace=True),
        lambda m: torch.logical_not(torch.zeros(B, H, S, S, dtype=torch.bool), out=m),
        lambda m: torch._foreach_zero_([m.view(torch.uint8)]),
    ],
    ids=["setitem", "view-method", "narrowed-fill", "iand", "inplace-argument", "out-argument", "foreach"],
)
def test_a_mask_written_in_place_is_left(write):
    def attend(q, k, v):
        mask = (torch.arange(S)[None, :] <= torch.arange(S)[:, None]).expand(B, H, S, S).clone()
        write(mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _check(attend, *_qkv(), folds=0)


@torch.library.custom_op("te_v2_tests::fill_true", mutates_args=("x",))
def _fill_true(x: torch.Tensor) -> None:
    x.fill_(True)


@_fill_true.register_fake
def _(x: torch.Tensor) -> None:
    return None


def test_a_mask_a_custom_op_may_write_is_left():
    def attend(q, k, v):
        mask = (torch.arange(S)[None, :] <= torch.arange(S)[:, None]).clone()
        torch.ops.te_v2_tests.fill_true(mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    _check(attend, *_qkv(), folds=0)


def test_query_and_key_by_keyword_fold():
    def attend(q, k, v):
        mask = torch.arange(S)[None, :] <= torch.arange(S)[:, None]
        return F.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=mask)

    _check(attend, *_qkv(), folds=1)


def test_a_mask_that_widens_the_output_is_left_and_still_refused():
    """Eager refuses a mask whose leading dims would widen the output; Dynamo's run with fake
    tensors lets it through for a 3-D query, and without the mask the attention would run."""

    def attend(q, k, v):
        mask = torch.arange(S)[None, :] <= torch.arange(S)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(2, H, S, S))

    q = torch.randn(H, S, D)
    compiled, folded, _ = _compiled(attend)
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        attend(q, q, q)
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        compiled(q, q, q)
    assert folded == [0]


def test_a_write_into_an_unrelated_tensor_does_not_stop_the_fold():
    def attend(q, k, v):
        mask = torch.arange(S)[None, :] <= torch.arange(S)[:, None]
        h = q * 2
        h.add_(1)
        return F.scaled_dot_product_attention(h, k, v, attn_mask=mask)

    _check(attend, *_qkv(), folds=1)


@pytest.mark.parametrize(
    "mask",
    [
        lambda: torch.zeros(S, S).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")),
        lambda: (torch.arange(S)[None, :] <= torch.arange(S)[:, None])[None].expand(1, S, S)[:, :1],
        lambda: (
            torch.arange(S, dtype=torch.float32)[None, :] <= torch.arange(S, dtype=torch.float32)[:, None]
        ),
    ],
    ids=["additive", "one-query-row", "float-steps"],
)
def test_masks_is_causal_cannot_stand_for_are_left(mask):
    """An additive mask (a float one), a mask of another shape than the attention's, and a causal
    mask computed through floating-point steps, which autocast or another reduction order could
    compute otherwise at run time."""

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask())

    q, k, v = _qkv()
    compiled, folded, _ = _compiled(attend)
    torch.testing.assert_close(compiled(q, k, v), attend(q, k, v))
    assert folded == [0]


def test_an_attention_already_causal_is_left():
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    _check(attend, *_qkv(), folds=0)


def test_symbolic_shapes_are_left():
    def attend(q, k, v):
        s = q.shape[-2]
        mask = torch.arange(s, device=q.device)[None, :] <= torch.arange(s, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    compiled, folded, _ = _compiled(attend, dynamic=True)
    q, k, v = _qkv()
    torch.testing.assert_close(compiled(q, k, v), attend(q, k, v))
    assert folded == [0]


def test_a_hugging_face_llama_through_te_v2s_thunderfx_is_one_thunder_region():
    """Through ``te_v2_executor.thunderfx``, a Llama's masks fold, its attentions run causal, and
    the model is one Thunder region (Thunder's thunderfx splits it in five: the mask's
    ``torch.diff`` and ``new_ones`` go to TorchInductor); loss and gradients are those of the
    split model, to rounding."""
    pytest.importorskip("transformers", reason="needs transformers (the [bench] extra)")
    import copy

    from thunder.dynamo import thunderfx as thunders_thunderfx

    import te_v2_executor
    from te_v2_executor import executors, make_te_v2
    from tests.models import tiny_llama

    model = tiny_llama(64, torch.bfloat16)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))

    def run(entry, m):
        # the default claim policy keeps these narrow linears out of FP8, whose rounding would
        # magnify the two attentions' different rounding
        te_v2 = make_te_v2(backend="reference")
        torch._dynamo.reset()
        compiled = entry(m, executors=executors(te_v2))
        loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return compiled, loss

    ours, loss = run(te_v2_executor.thunderfx, model)
    theirs, expected = run(thunders_thunderfx, twin)
    assert ours._backend.causal_attentions == 2
    (info,) = ours._backend.subgraph_infos
    assert [name for name, _ in info.split_graph_module.named_children()] == ["thunder_0"]
    assert not info.split_reasons
    assert len(theirs._backend.subgraph_infos[0].split_reasons) > 0
    # the causal attention is another kernel than the masked one: equal up to rounding
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=0)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        cosine = F.cosine_similarity(p.grad.double().flatten(), q.grad.double().flatten(), dim=0)
        assert cosine > 0.9999, (name, float(cosine))
