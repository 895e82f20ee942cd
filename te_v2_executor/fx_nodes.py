"""What the rewrites of Dynamo's graphs (``causal_masks``, ``grouped_attention``,
``gradless_checkpoints``) read off a node: an argument wherever the call passes it, the static
shape Dynamo traced a value with, and the graph of a function the node checkpoints."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

SDPA = torch.nn.functional.scaled_dot_product_attention


def argument(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """The argument of ``node`` at position ``index`` or named ``name``, whichever the call passes;
    ``default`` where it passes neither."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def static_shape(node: Any) -> tuple[int, ...] | None:
    """The shape of the tensor Dynamo traced ``node`` with, where ``node`` is a node with one and
    every dim of it is an int; else None."""
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or not all(isinstance(d, int) for d in value.shape):
        return None
    return tuple(value.shape)


def checkpointed(node: torch.fx.Node) -> torch.fx.GraphModule | None:
    """The graph of the function ``node`` checkpoints (``torch.utils.checkpoint`` under Dynamo), if
    it is such a call."""
    if node.op != "call_function" or node.target is not torch.ops.higher_order.tag_activation_checkpoint:
        return None
    body = node.args[0]
    if not isinstance(body, torch.fx.Node) or body.op != "get_attr":
        return None
    module = getattr(node.graph.owning_module, body.target, None)
    return module if isinstance(module, torch.fx.GraphModule) else None
