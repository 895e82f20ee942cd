"""Checkpointed functions no gradient flows through, called inline in Dynamo's graph, so that te_v2
runs their linears.

Where nothing a ``torch.utils.checkpoint.checkpoint`` call returns requires grad (under
``torch.no_grad()``, or with every input and weight frozen), Thunder 0.2.6 keeps the call whole:
no backward decomposes it, and the fuser after te_v2 claims it with the linears inside, which then
run unquantized, in the model's dtype. Such a call computes what its function computes, as no
backward will ever recompute it, so ``inline`` replaces it with the function's nodes, where te_v2
claims each linear as anywhere else. A call it cannot inline stays, and te_v2 warns that its
linears run unquantized (``executor.TEv2Executor.fusion_pass``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.utils._pytree import tree_leaves

from te_v2_executor.fx_nodes import checkpointed


def inline(gm: torch.fx.GraphModule) -> int:
    """Replace each call of ``gm`` that checkpoints a function whose outputs require no grad with
    that function's nodes, nested checkpoints included; return how many calls were replaced."""
    inlined = 0
    while (node := next(filter(_inlinable, gm.graph.nodes), None)) is not None:
        _inline(gm, node, checkpointed(node))
        inlined += 1
    if inlined:
        gm.graph.lint()
        gm.recompile()
    return inlined


def _inlinable(node: torch.fx.Node) -> bool:
    """A checkpoint call whose outputs Dynamo traced as requiring no grad, read only by index, of a
    function that returns a tuple of its nodes and reads no attribute but submodules (a nested
    checkpoint's function)."""
    body = checkpointed(node)
    if body is None:
        return False
    value = node.meta.get("example_value")
    leaves = tree_leaves(value)
    if value is None or any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        return False
    if any(u.target is not operator.getitem or not isinstance(u.args[1], int) for u in node.users):
        return False
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    attributes = [n for n in body.graph.nodes if n.op == "get_attr"]
    returned = body.graph.output_node().args[0]
    return (
        len(placeholders) == len(node.args) - 1
        and isinstance(returned, (tuple, list))
        and all(isinstance(r, torch.fx.Node) for r in returned)
        and all(isinstance(getattr(body, n.target, None), torch.nn.Module) for n in attributes)
    )


def _inline(gm: torch.fx.GraphModule, node: torch.fx.Node, body: torch.fx.GraphModule) -> None:
    """``node``'s function's nodes in its place, its submodules moved into ``gm``."""
    graph = gm.graph
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    values: dict[torch.fx.Node, torch.fx.Node] = dict(zip(placeholders, node.args[1:], strict=True))
    with graph.inserting_before(node):
        for attribute in (n for n in body.graph.nodes if n.op == "get_attr"):
            name = _free_name(gm, f"{node.args[0].target}_{attribute.target}")
            gm.add_submodule(name, getattr(body, attribute.target))
            values[attribute] = graph.get_attr(name)
            values[attribute].meta = dict(attribute.meta)
        outputs = graph.graph_copy(body.graph, values)
    for user in list(node.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    function = node.args[0]
    graph.erase_node(node)
    if not function.users:
        graph.erase_node(function)
        if not any(n.op == "get_attr" and n.target == function.target for n in graph.nodes):
            gm.delete_submodule(function.target)


def _free_name(gm: torch.fx.GraphModule, name: str) -> str:
    """``name``, or ``name`` with the first numeric suffix that ``gm`` has no attribute of."""
    candidate, index = name, 0
    while hasattr(gm, candidate):
        index += 1
        candidate = f"{name}_{index}"
    return candidate
