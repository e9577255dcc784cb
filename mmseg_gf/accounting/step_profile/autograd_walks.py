"""Walks of the probe's autograd graph: which candidate a tensor depends
on, which nodes read a node, the nodes of a loss result.

They read the graph only (``next_functions``, ``_sequence_nr``), iterative
so a deep graph does not reach Python's recursion limit.
"""
from typing import Any, Dict, List

import torch


def max_upstream(tensor: torch.Tensor, tags: Dict[Any, int],
                 memo: Dict[Any, int]) -> int:
    """The largest tag among the autograd nodes behind ``tensor`` (the
    candidate convs' nodes are tagged with their index; -1: none)."""
    root = tensor.grad_fn
    if root is None:
        return -1
    if root in memo:
        return memo[root]
    # iterative post-order walk: a node's value is the max of its inputs'
    order, stack, seen = [], [root], {root}
    while stack:
        node = stack.pop()
        order.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in memo and child not in seen:
                seen.add(child)
                stack.append(child)
    for node in reversed(order):
        best = tags.get(node, -1)
        for child, _ in node.next_functions:
            if child is not None:
                best = max(best, memo.get(child, -1))
        memo[node] = best
    return memo[root]


def nodes_reading(root, node) -> List[Any]:
    """The nodes behind ``root`` made after ``node`` (one layer call's,
    when ``node`` is its input's) that take ``node``'s output."""
    after = node._sequence_nr()
    readers, seen, stack = [], set(), [root]
    while stack:
        current = stack.pop()
        if current is None or current is node or current in seen:
            continue
        seen.add(current)
        if current._sequence_nr() <= after:
            continue
        for child, _ in current.next_functions:
            if child is node:
                readers.append(current)
            else:
                stack.append(child)
    return readers


def loss_nodes(losses: Any) -> List[Any]:
    """The autograd nodes of the tensors in a ``model.loss`` result."""
    nodes, stack = [], [losses]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.grad_fn is not None:
                nodes.append(value.grad_fn)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return nodes
