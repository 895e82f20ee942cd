"""Attention masks proved causal when Dynamo compiles, and the attentions that read them run
causal instead.

Hugging Face models traced by Dynamo build an explicit boolean mask for every attention (their
switch to ``is_causal=True`` is off while tracing), and without an ``attention_mask`` or
``position_ids`` argument that mask is a function of the shapes alone: ``arange``s compared with
one another, a packed-sequence check of positions that are themselves an ``arange``. A masked
attention computes every query-key tile and reads the mask; a causal one skips the tiles above the
diagonal, about half the work, and thunderfx sends the ops the mask is made of that Thunder
lacks (``torch.diff``, ``Tensor.new_ones``) to TorchInductor, which splits the model into regions
the host crosses in turn.

``fold`` evaluates, once, each attention mask whose value depends on no input of the graph (only
deterministic ops of ``_CONSTANT_FUNCTIONS`` and ``_CONSTANT_METHODS`` on constants), and where
it equals PyTorch's causal mask for that attention (``ones(L, S).tril()``, as ``is_causal=True``
means) broadcast over batch and heads, rewrites the attention to ``attn_mask=None,
is_causal=True`` and removes what only the mask needed. The two attentions are the same function
of query, key and value. Anything it cannot prove leaves the graph as it is: a mask that depends
on an input (padding, packed sequences given as ``position_ids``), symbolic shapes, a
non-boolean mask, and a mask any of whose tensors (or their views) has a use not known to only
read it (``_only_read``): an in-place method, an ``out=`` or ``inplace=True`` argument, a
``_foreach_`` or custom op.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from te_v2_executor.fx_nodes import SDPA, argument, static_shape

# SDPA's positional parameters this pass reads or rewrites, by position and name.
_ATTN_MASK, _IS_CAUSAL = (3, "attn_mask"), (5, "is_causal")


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


def _named(namespaces: Iterable[Any], names: Iterable[str]) -> frozenset[Callable]:
    """The functions of ``names`` found in ``namespaces``."""
    return frozenset(getattr(ns, n) for n in names for ns in namespaces if hasattr(ns, n))


_COMPARISONS = "eq ne le lt ge gt"
_LOGICAL = "logical_and logical_or logical_not bitwise_and bitwise_or bitwise_not"
_DUNDERS = "__eq__ __ne__ __le__ __lt__ __ge__ __gt__ __and__ __or__ __xor__ __invert__ __add__ __sub__"
# Deterministic ops whose result is a function of their arguments alone: what a constant mask may
# be made of (no random, uninitialized or in-place op).
_CONSTANT_FUNCTIONS = _named(
    (torch, operator),
    _words(
        f"arange ones zeros full tril triu diff cumsum cat stack broadcast_to add sub mul floordiv mod neg "
        f"invert and_ or_ xor getitem {_COMPARISONS} {_LOGICAL}"
    ),
)
_CONSTANT_METHODS = _words(
    f"unsqueeze squeeze expand expand_as view reshape to bool long int cumsum diff new_ones new_zeros "
    f"new_full tril triu transpose permute contiguous clone add sub {_COMPARISONS} {_LOGICAL} "
    f"{_DUNDERS} __getitem__"
)
# Ops that read their tensor arguments and write none of them (given no ``out=`` and no
# ``inplace=True``): the uses the tensors a mask is made of may have. The ops of ``_ALIASING_*``
# may return an argument or a view of it, so their own uses are held to the same rule.
_READ_FUNCTIONS = (
    _CONSTANT_FUNCTIONS
    | _named(
        (torch, operator, torch.nn.functional),
        _words(
            "truediv div pow matmul linear softmax log_softmax cross_entropy sigmoid tanh exp "
            "log rsqrt sqrt mean sum cos sin where"
        ),
    )
    | {SDPA}
)
_READ_METHODS = _CONSTANT_METHODS | _words(
    "float double half bfloat16 type_as mul div pow sum mean cos sin exp matmul __mul__ __truediv__ "
    "__neg__ __matmul__ __pow__ __radd__ __rsub__ __rmul__ __floordiv__ __mod__"
)
_ALIASING_FUNCTIONS = frozenset({operator.getitem, torch.broadcast_to})
_ALIASING_METHODS = _words(
    "unsqueeze squeeze expand expand_as view reshape to bool long int float double half bfloat16 "
    "type_as transpose permute contiguous __getitem__"
)


def fold(gm: torch.fx.GraphModule) -> int:
    """Run causal every attention of ``gm`` whose mask is proved causal (module docstring);
    return how many."""
    graph = gm.graph
    constant = _constant_nodes(graph)
    if not constant:
        return 0
    values: dict[torch.fx.Node, Any] = {}
    folded: list[torch.fx.Node] = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = argument(node, *_ATTN_MASK, None)
        if mask not in constant or argument(node, *_IS_CAUSAL, False) is not False:
            continue
        made_of = _ancestry(mask, constant)
        if not _only_read(made_of):
            continue
        value = _evaluate(mask, made_of, values)
        if _exact(made_of, values) and _is_causal_for(node, value):
            _rewrite(node, {_ATTN_MASK: None, _IS_CAUSAL: True})
            folded.append(node)
    if folded:
        for node in reversed(graph.nodes):
            if node in constant and not node.users:
                graph.erase_node(node)
        gm.recompile()
    return len(folded)


def _constant_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose value depends on no input of the graph: ops of the constant lists whose
    arguments are all constants (graph order is topological)."""
    constant: set[torch.fx.Node] = set()
    for node in graph.nodes:
        known = (node.op == "call_function" and node.target in _CONSTANT_FUNCTIONS) or (
            node.op == "call_method" and node.target in _CONSTANT_METHODS
        )
        if known and "out" not in node.kwargs and all(n in constant for n in node.all_input_nodes):
            constant.add(node)
    return constant


def _ancestry(node: torch.fx.Node, constant: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """``node`` and the constant nodes it is computed from, in graph order."""
    seen, stack = {node}, [node]
    while stack:
        for n in stack.pop().all_input_nodes:
            if n in constant and n not in seen:
                seen.add(n)
                stack.append(n)
    return [n for n in node.graph.nodes if n in seen]


def _only_read(made_of: list[torch.fx.Node]) -> bool:
    """Whether every use of the tensors ``made_of``, and of every view or alias of them, only
    reads them: an op of the read lists with no ``out=`` and no ``inplace=True``, or the graph's
    output. An op outside the lists (an in-place method, ``setitem``, a ``_foreach_`` op, a
    custom op, a submodule) might write, so the mask's value could differ from the one computed
    here."""
    stack, seen = list(made_of), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user.op == "output":
                continue
            if "out" in user.kwargs or user.kwargs.get("inplace"):
                return False
            if user.op == "call_function" and user.target in _READ_FUNCTIONS:
                aliasing = user.target in _ALIASING_FUNCTIONS
            elif user.op == "call_method" and user.target in _READ_METHODS:
                aliasing = user.target in _ALIASING_METHODS
            else:
                return False
            if aliasing:
                stack.append(user)
    return True


def _evaluate(node: torch.fx.Node, made_of: list[torch.fx.Node], values: dict[torch.fx.Node, Any]) -> Any:
    """The value of ``node``, computing ``made_of`` in order into ``values`` (shared between the
    attentions that read one mask), on real tensors even while Dynamo traces with fake ones."""
    with unset_fake_temporarily(), torch.no_grad():
        for n in made_of:
            if n in values:
                continue
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), values.__getitem__)
            if n.op == "call_method":
                values[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
            else:
                values[n] = n.target(*args, **kwargs)
    return values[node]


def _exact(made_of: list[torch.fx.Node], values: dict[torch.fx.Node, Any]) -> bool:
    """Whether every tensor the mask was computed through is of an integer or boolean dtype, on
    which no autocast casts and no reduction order rounds: a floating-point step could compute
    otherwise at run time (autocast runs ``cumsum`` in float32 on CUDA) than here."""
    tensors = [values[n] for n in made_of if isinstance(values[n], torch.Tensor)]
    return all(not (t.is_floating_point() or t.is_complex()) for t in tensors)


def _is_causal_for(attention: torch.fx.Node, mask: Any) -> bool:
    """Whether boolean ``mask`` is what ``is_causal=True`` means for ``attention``: for query
    length L and key length S, ``ones(L, S).tril()`` in its last two dims, and leading dims that
    broadcast to the query's without enlarging them (eager refuses a mask that would widen the
    output, and Dynamo's run with fake tensors lets some through)."""
    query = static_shape(argument(attention, 0, "query", None))
    key = static_shape(argument(attention, 1, "key", None))
    if query is None or key is None or len(query) < 2 or len(key) < 2:
        return False
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or not 2 <= mask.dim() <= len(query):
        return False
    q_len, kv_len = query[-2], key[-2]
    leading = mask.shape[:-2]
    if tuple(mask.shape[-2:]) != (q_len, kv_len):
        return False
    if any(m not in (1, q) for m, q in zip(reversed(leading), reversed(query[:-2]), strict=False)):
        return False
    with unset_fake_temporarily():
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril()
        # one query-by-key slice at a time, each broadcast dim once: no mask-sized temporary
        slices = itertools.product(
            *(range(1 if st == 0 else n) for n, st in zip(leading, mask.stride()[:-2], strict=True))
        )
        return all(torch.equal(mask[index], causal) for index in slices)


def _rewrite(node: torch.fx.Node, values: dict[tuple[int, str], Any]) -> None:
    """Set arguments of ``node``, each where the call passes it (by position or by name)."""
    args, kwargs = list(node.args), dict(node.kwargs)
    for (index, name), value in values.items():
        if len(args) > index:
            args[index] = value
        else:
            kwargs[name] = value
    node.args, node.kwargs = tuple(args), kwargs
