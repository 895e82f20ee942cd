"""Attentions over keys and values repeated to every query head, run over the unrepeated ones.

A grouped-query attention model (Llama 3: 32 query heads, 8 key/value heads) shares each key and
value head between consecutive query heads. Hugging Face repeats them to every query head
(``repeat_kv``: an unsqueeze, an expand and a reshape, which copies) before
``F.scaled_dot_product_attention`` whenever it passes a mask, which under Dynamo is always. The
copies are as large as the query, and the attention's backward saves them: at the Llama-3.2-1B
dims, 48 MiB a layer more than the unrepeated keys and values, the backward then sums each
repeated gradient back over its group, and every step writes the copies. cuDNN's attention
kernels read grouped keys and values themselves and give their gradients per key/value head.

``fold`` rewrites, in a graph Dynamo captured, each attention whose key and value are such
repeats into ``grouped_scaled_dot_product_attention`` over the unrepeated ones: the same function
of them (each query head ``i`` reads key/value head ``i // groups``, as after ``repeat_kv``).
Thunder traces it as the ``te_v2_grouped_sdpa`` symbol, which te_v2's attention executor runs on
cuDNN's grouped kernels (``attention.py``) and every other executor as its definition, the repeat
and the attention. A graph that may write into a tensor in place is left as it is: the rewritten
attention reads the key and value where the repeat did, later, and saves them, not copies.
"""

from __future__ import annotations

import operator
from typing import Any

import thunder.core.jit_ext as jit_ext
import thunder.torch as ltorch
import torch
import torch.fx

from te_v2_executor.fx_nodes import SDPA, argument, checkpointed, static_shape

# SDPA's positional parameters after query, key and value, by name: the rewrite passes them on.
_PARAMETERS = ("attn_mask", "dropout_p", "is_causal")


def grouped_scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with each key and value head shared by ``groups``
    consecutive query heads (``groups`` = query heads / key heads), as after Hugging Face's
    ``repeat_kv``."""
    groups = _groups(query, key, value)
    key, value = (t.repeat_interleave(groups, dim=-3) for t in (key, value))
    return SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)


def _groups(query: Any, key: Any, value: Any) -> int:
    """How many query heads share each key and value head; raises where that is not a whole
    number or key and value differ in heads."""
    heads = [t.shape[-3] if t.ndim >= 3 else 0 for t in (query, key, value)]
    if not heads[1] or heads[1] != heads[2] or heads[0] % heads[1]:
        raise ValueError(
            "te_v2: grouped_scaled_dot_product_attention needs query, key and value of at least 3 dims "
            f"(..., heads, sequence, dim), the query's heads a multiple of the key's and the value's, "
            f"which are equal; got {heads[0]}, {heads[1]} and {heads[2]} heads"
        )
    return heads[0] // heads[1]


def _repeated(t: Any, groups: int) -> Any:
    """Thunder's ``repeat_kv``: each head of ``t`` (..., heads, sequence, dim) ``groups`` times in a
    row."""
    *leading, h, s, d = t.shape
    expanded = ltorch.expand(ltorch.unsqueeze(t, -3), (*leading, h, groups, s, d))
    return ltorch.reshape(expanded, (*leading, h * groups, s, d))


@ltorch.torchsymbol(grouped_scaled_dot_product_attention, id="te_v2_grouped_sdpa")
def grouped_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    """Thunder's symbol for ``grouped_scaled_dot_product_attention``: the repeat and Thunder's
    attention, which executors that do not claim it run."""
    groups = _groups(query, key, value)
    return ltorch.scaled_dot_product_attention(
        query, _repeated(key, groups), _repeated(value, groups), attn_mask, dropout_p, is_causal, scale=scale
    )


# Thunder's interpreter builds its lookasides from ``torchsymbol``'s map once, when it is
# imported; a symbol registered later is added as Thunder adds its own.
jit_ext._general_jit_lookaside_map[grouped_scaled_dot_product_attention] = jit_ext.ensure_recursive_proxies(
    jit_ext.interpreter_needs_wrap(jit_ext.record_source_loc_in_symbol_header(grouped_sdpa))
)


def fold(gm: torch.fx.GraphModule) -> int:
    """Rewrite each attention of ``gm`` over repeated keys and values, and of each function it
    checkpoints, into ``grouped_scaled_dot_product_attention`` over the unrepeated ones (module
    docstring); return how many. Nothing is rewritten in a graph that may write in place."""
    if any(_may_write(n) for n in gm.graph.nodes):
        return 0
    return _fold(gm)


def _fold(gm: torch.fx.GraphModule) -> int:
    """``fold`` of a graph that writes nothing in place: its checkpointed functions', then its own."""
    folded = sum(_fold(body) for body in map(checkpointed, gm.graph.nodes) if body is not None)
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not SDPA or node.kwargs.get("enable_gqa"):
            continue
        query = argument(node, 0, "query")
        query_shape = static_shape(query)
        repeats = [argument(node, i, name) for i, name in ((1, "key"), (2, "value"))]
        sources = [_unrepeated(r, query_shape) for r in repeats]
        if None in sources or len(node.args) > 3 + len(_PARAMETERS):
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("key", "value", "query", "enable_gqa")}
        kwargs.update(zip(_PARAMETERS, node.args[3:], strict=False))
        with graph.inserting_before(node):
            grouped = graph.call_function(grouped_scaled_dot_product_attention, (query, *sources), kwargs)
        grouped.meta = dict(node.meta)
        node.replace_all_uses_with(grouped)
        graph.erase_node(node)
        for repeat in dict.fromkeys(repeats):
            _erase_unused(repeat, stop=sources)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return folded + rewritten


def _unrepeated(node: Any, query: tuple[int, ...] | None) -> torch.fx.Node | None:
    """The tensor ``node`` repeats to ``query``'s heads as ``repeat_kv`` does (``reshape`` of an
    ``expand`` of the tensor with a unit dim put at 2), with fewer heads than the query; or None."""
    if query is None or len(query) != 4 or not _is(node, "reshape", "view", torch.reshape):
        return None
    expanded = argument(node, 0, "input")
    if not _is(expanded, "expand", None, torch.broadcast_to):
        return None
    unsqueezed = argument(expanded, 0, "input")
    if not (
        _is(unsqueezed, "unsqueeze", None, torch.unsqueeze) and argument(unsqueezed, 1, "dim") == 2
    ) and not (
        _is(unsqueezed, "__getitem__", None, operator.getitem) and _is_unsqueeze_at_2(unsqueezed.args[1])
    ):
        return None
    source = argument(unsqueezed, 0, "input")
    shapes = [static_shape(n) for n in (source, unsqueezed, expanded, node)]
    if None in shapes or len(shapes[0]) != 4:
        return None
    (b, h, s, d), inserted, repeated, result = shapes
    groups = query[1] // h if h else 0
    if not (
        groups > 1
        and query[1] == groups * h
        and inserted == (b, h, 1, s, d)
        and repeated == (b, h, groups, s, d)
        and result == (b, h * groups, s, d)
        and (query[0], query[3]) == (b, d)
    ):
        return None
    return source


def _erase_unused(node: torch.fx.Node, stop: list[torch.fx.Node]) -> None:
    """Erase ``node`` where it is an op nothing uses, then each input that leaves unused, up to
    ``stop``."""
    if node in stop or node.users or node.op not in ("call_function", "call_method"):
        return
    inputs = node.all_input_nodes
    node.graph.erase_node(node)
    for n in inputs:
        _erase_unused(n, stop)


def _is_unsqueeze_at_2(index: Any) -> bool:
    """Whether a ``__getitem__`` index is ``[:, :, None]`` (then only full slices or an ellipsis)."""
    if not isinstance(index, tuple) or len(index) < 3:
        return False
    whole = slice(None, None, None)
    return index[:3] == (whole, whole, None) and all(i == whole or i is Ellipsis for i in index[3:])


def _is(node: Any, method: str | None, alias: str | None, function: Any) -> bool:
    """Whether ``node`` calls the tensor method ``method`` (or ``alias``) or ``function``, with no
    ``out=``."""
    if not isinstance(node, torch.fx.Node) or "out" in node.kwargs:
        return False
    if node.op == "call_method":
        return node.target in (method, alias)
    return node.op == "call_function" and node.target is function


def _may_write(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write into a tensor in place: an in-place method, function or operator
    (``add_``, ``+=``, ``setitem``, a ``_foreach_`` op), an ``out=`` or ``inplace=True`` argument,
    an operator overload whose schema writes, a submodule or a higher-order op (whose body the
    node does not show), but for a checkpointed function, whose graph is read."""
    if node.op == "call_module":
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    if "out" in node.kwargs or node.kwargs.get("inplace"):
        return True
    target = node.target
    if node.op == "call_method":
        return target in _IN_PLACE_DUNDERS or _in_place_name(target)
    if (body := checkpointed(node)) is not None:
        return any(_may_write(n) for n in body.graph.nodes)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if getattr(target, "__module__", None) in ("operator", "_operator"):
        return target in _IN_PLACE_OPERATORS
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    name = getattr(target, "__name__", "")
    return name in _IN_PLACE_DUNDERS or _in_place_name(name)


def _in_place_name(name: str) -> bool:
    """Whether ``name`` is PyTorch's name of an in-place op (``add_``, ``_foreach_add_``)."""
    return name.endswith("_") and not name.endswith("__")


_IN_PLACE = "iadd iand iconcat ifloordiv ilshift imatmul imod imul ior ipow irshift isub itruediv ixor"
_IN_PLACE_OPERATORS = frozenset(
    [*(getattr(operator, n) for n in _IN_PLACE.split()), operator.setitem, operator.delitem]
)
_IN_PLACE_DUNDERS = frozenset([*(f"__{n}__" for n in _IN_PLACE.split()), "__setitem__", "__delitem__"])
