"""``grouped_attention.fold``: an attention over keys and values repeated to every query head as
Hugging Face's ``repeat_kv`` repeats them reads the unrepeated ones, with the same outputs and
gradients; a repeat of another layout, and any graph that may write in place, is left."""

from __future__ import annotations

import operator

import pytest
import thunder
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from te_v2_executor import grouped_attention, make_te_v2, thunderfx
from te_v2_executor.inductor import inductor_ex
from tests.helpers import CLAIM_ALL
from tests.models import tiny_llama

B, H, KV, S, D = 2, 6, 2, 16, 8


def _repeat_kv(t: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``repeat_kv``, as Llama's attention calls it."""
    b, h, s, d = t.shape
    return t[:, :, None, :, :].expand(b, h, H // h, s, d).reshape(b, H, s, d)


def _tiled(t: torch.Tensor) -> torch.Tensor:
    """Each key/value head repeated to every query head in turn (head i reads i % KV), not in
    groups: the other layout a repeat may have."""
    b, h, s, d = t.shape
    return t[:, None].expand(b, H // h, h, s, d).reshape(b, H, s, d)


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = ((B, H, S, D), (B, KV, S, D), (B, KV, S, D))
    return [torch.randn(shape, generator=g, requires_grad=True) for shape in shapes]


def _check(fn, *, folds: int) -> None:
    """``fn`` through Dynamo, each graph folded and run eagerly, folds ``folds`` attentions and
    computes what ``fn`` computes eagerly: output and gradients."""
    folded: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        folded.append(grouped_attention.fold(gm))
        return gm.forward

    torch._dynamo.reset()
    inputs, eager_inputs = _inputs(), _inputs()
    out, expected = torch.compile(fn, backend=backend)(*inputs), fn(*eager_inputs)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    for t, e in zip(inputs, eager_inputs, strict=True):
        torch.testing.assert_close(t.grad, e.grad)
    assert sum(folded) == folds, folded


@pytest.mark.parametrize("unsqueeze", ["getitem", "method"])
def test_keys_and_values_repeated_as_hugging_face_does_are_read_unrepeated(unsqueeze):
    def attend(q, k, v):
        if unsqueeze == "method":
            k, v = (t.unsqueeze(2).expand(B, KV, H // KV, S, D).reshape(B, H, S, D) for t in (k, v))
        else:
            k, v = _repeat_kv(k), _repeat_kv(v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)

    _check(attend, folds=1)


def test_keys_repeated_in_another_layout_are_left():
    """A tiled repeat gives query head i key head i % KV, not i // (H // KV)."""

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, _tiled(k), _tiled(v))

    _check(attend, folds=0)


def test_a_key_repeated_and_a_value_not_is_left():
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, _repeat_kv(k), v.repeat_interleave(H // KV, dim=1))

    _check(attend, folds=0)


@pytest.mark.parametrize(
    "write",
    [
        lambda k: k.mul_(2),
        lambda k: k.__setitem__((0, 0), 0.0),
        lambda k: torch.mul(k.detach(), 2, out=k.detach()),
        lambda k: torch._foreach_mul_([k], 2),
    ],
    ids=["method", "setitem", "out-argument", "foreach"],
)
def test_a_graph_that_writes_in_place_is_left(write):
    """The repeat copies the key before the write; the rewritten attention would read it after."""

    def attend(q, k, v):
        k = k * 1
        repeated = _repeat_kv(k)
        write(k)
        return F.scaled_dot_product_attention(q, repeated, _repeat_kv(v)) + k.sum()

    _check(attend, folds=0)


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q, _repeat_kv(k), _repeat_kv(v), is_causal=True)


def test_a_checkpointed_functions_attention_is_read_unrepeated_too():
    def attend(q, k, v):
        return checkpoint(_attention, q, k, v, use_reentrant=False) + _attention(q, k, v)

    _check(attend, folds=2)


def test_a_write_in_place_inside_a_checkpointed_function_leaves_the_whole_graph():
    def written(q, k, v):
        k = k * 1
        repeated = _repeat_kv(k)
        k.add_(1)
        return F.scaled_dot_product_attention(q, repeated, _repeat_kv(v)) + k.mean()

    def attend(q, k, v):
        return checkpoint(written, q, k, v, use_reentrant=False) + _attention(q, k, v)

    _check(attend, folds=0)


_NODES = {
    "Tensor.__setitem__": (True, "call_function", torch.Tensor.__setitem__, (0, 1.0), {}),
    "Tensor.add_": (True, "call_function", torch.Tensor.add_, (1,), {}),
    "operator.setitem": (True, "call_function", operator.setitem, (0, 1.0), {}),
    "operator.iadd": (True, "call_function", operator.iadd, (1,), {}),
    "__iand__": (True, "call_method", "__iand__", ("x",), {}),
    "mul_": (True, "call_method", "mul_", (2,), {}),
    "aten.add_": (True, "call_function", torch.ops.aten.add_.Tensor, ("x",), {}),
    "foreach": (True, "call_function", torch._foreach_add_, (1,), {}),
    "out=": (True, "call_function", torch.relu, (), {"out": "x"}),
    "inplace=True": (True, "call_function", F.relu, (), {"inplace": True}),
    "operator.and_": (False, "call_function", operator.and_, ("x",), {}),
    "operator.getitem": (False, "call_function", operator.getitem, (0,), {}),
    "mul": (False, "call_method", "mul", (2,), {}),
    "aten.add": (False, "call_function", torch.ops.aten.add.Tensor, ("x",), {}),
    "sdpa": (False, "call_function", F.scaled_dot_product_attention, ("x", "x"), {}),
}


@pytest.mark.parametrize("case", _NODES)
def test_which_nodes_may_write_in_place(case):
    writes, op, target, args, kwargs = _NODES[case]
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    args = [x if a == "x" else a for a in args]
    kwargs = {k: x if v == "x" else v for k, v in kwargs.items()}
    first = [x] if target is not torch._foreach_add_ else [[x]]
    node = graph.create_node(op, target, (*first, *args), kwargs)
    assert grouped_attention._may_write(node) is writes


def test_the_repeats_other_readers_keep_them():
    """A repeated key another op also reads stays in the graph for it."""

    def attend(q, k, v):
        repeated = _repeat_kv(k)
        return F.scaled_dot_product_attention(q, repeated, _repeat_kv(v)) + repeated.mean()

    _check(attend, folds=1)


def test_thunders_symbol_computes_the_repeat_and_the_attention():
    """Where no executor claims ``te_v2_grouped_sdpa`` (here, on the CPU) Thunder runs its
    definition."""
    q, k, v = _inputs()
    jitted = thunder.jit(grouped_attention.grouped_scaled_dot_product_attention)
    torch.testing.assert_close(
        jitted(q, k, v, None, 0.0, True),
        F.scaled_dot_product_attention(q, _repeat_kv(k), _repeat_kv(v), is_causal=True),
    )
    assert any(b.sym.id == "te_v2_grouped_sdpa" for b in thunder.last_traces(jitted)[0].bound_symbols)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "thunder"])
def test_heads_that_do_not_group_raise_a_clear_error(jit):
    q, k, v = _inputs()
    fn = grouped_attention.grouped_scaled_dot_product_attention
    with pytest.raises(ValueError, match="query's heads a multiple of the key's"):
        (thunder.jit(fn) if jit else fn)(q[:, :5], k, v)


def test_a_hugging_face_llama_computes_what_it_computes_unfolded(dynamo_reset_after):
    """Both attentions of a 2-layer Llama with 4 query and 2 key/value heads read their keys and
    values unrepeated, through ``te_v2_executor.thunderfx``: the same loss and gradients, bitwise,
    as with the fold off."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    runs, counts = [], []
    for fold in (False, True):
        torch._dynamo.reset()
        model = tiny_llama(32, torch.float32)
        te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL)
        compiled = thunderfx(model, executors=[te_v2, inductor_ex], fold_grouped_attentions=fold)
        loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        counts.append(compiled._backend.grouped_attentions)
        runs.append([loss.detach(), *(p.grad for p in model.parameters())])
    assert counts == [0, 2]
    for without, folded in zip(*runs, strict=True):
        assert torch.equal(folded, without)


class _CheckpointedAttention(torch.nn.Module):
    """Query, key and value projections and an attention over repeated keys and values, the
    whole under ``checkpoint``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(H * D, n * D) for n in (H, KV, KV))

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).view(B, S, -1, D).transpose(1, 2) for p in (self.q, self.k, self.v))
        return _attention(q, k, v).transpose(1, 2).reshape(B, S, H * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.attend, x, use_reentrant=False)


def test_a_checkpointed_attention_through_thunder_computes_what_it_computes_unfolded(dynamo_reset_after):
    """Thunder maps the rewritten call inside a checkpointed function to its symbol too, and
    recomputes it in the backward: the same output and gradients, bitwise, as with the fold off."""
    torch.manual_seed(0)
    model = _CheckpointedAttention()
    x = torch.randn(B, S, H * D, requires_grad=True)
    runs, counts = [], []
    for fold in (False, True):
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        x.grad = None
        te_v2 = make_te_v2(backend="reference", claim=CLAIM_ALL)
        compiled = thunderfx(model, executors=[te_v2, inductor_ex], fold_grouped_attentions=fold)
        out = compiled(x)
        out.square().sum().backward()
        counts.append(compiled._backend.grouped_attentions)
        runs.append([out.detach(), x.grad, *(p.grad for p in model.parameters())])
    assert counts == [0, 1]
    for without, folded in zip(*runs, strict=True):
        assert torch.equal(folded, without)
