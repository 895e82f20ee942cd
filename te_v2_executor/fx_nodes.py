"""What the rewrites of Dynamo's graphs (``causal_masks``, ``grouped_attention``) read off a node:
an argument wherever the call passes it, and the static shape Dynamo traced a value with."""

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
