"""The autograd-graph premises of the patch-mean GELU rule
(docs/gradient_filter.md#elementwise-ops-between-filtered-layers), shared by
the detection on a trained model and the budget's profile.

A GELU keeps only the patch means of ``f'`` when its input is a filtered
layer's output on a partition and every consumer of its output is a
filtered layer's call on that very tensor, on the same partition."""
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

from torch import nn

from ..ops.linear.patch_mean_activation import PatchPartition
from .layer_kinds import layer_kinds
from .patch_mean_gelu import is_patch_mean_gelu

__all__ = ['LayerCall', 'graph_consumers', 'filtered_users',
           'is_counted_partition', 'is_plain_gelu', 'is_filtered_layer']


@dataclass
class LayerCall:
    """A filtered layer's call: its input's autograd node, the patches its
    ``g_x`` is constant on (None: none usable), and the profile's candidate
    index (None for the detection)."""

    input_node: object
    partition: Optional[PatchPartition]
    layer: Any = None


def is_plain_gelu(module: nn.Module) -> bool:
    """An ``nn.GELU`` running torch's forward (or already swapped to the
    rule, :mod:`.patch_mean_gelu`): one the rule may take."""
    return isinstance(module, nn.GELU) and (
        is_patch_mean_gelu(module) or type(module).forward is nn.GELU.forward)


def is_filtered_layer(module: nn.Module) -> bool:
    """A layer whose filtered call tags its output and whose ``g_x`` is
    patch-constant (:attr:`LayerKind.patch_partitioned`)."""
    return any(kind.patch_partitioned and kind.is_filtered(module)
               for kind in layer_kinds())


def graph_consumers(roots: Iterable) -> Dict[object, List[object]]:
    """node -> the nodes that take its output, over the graph behind the
    autograd nodes ``roots``."""
    consumers: Dict[object, List[object]] = {}
    seen = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None:
                consumers.setdefault(child, []).append(node)
                stack.append(child)
    return consumers


def filtered_users(node, graph: Dict[object, List[object]],
                   calls: Dict[object, LayerCall]
                   ) -> Optional[List[LayerCall]]:
    """The filtered layer calls consuming ``node``'s output when every
    consumer is one of them on that very tensor; else None (anything in
    between, a dropout with ``p > 0`` included, or no consumer).

    Args:
        node: the GELU output's autograd node.
        graph: :func:`graph_consumers` of the step.
        calls: node -> the filtered layer call it belongs to."""
    users = graph.get(node, [])
    if not users or not all(user in calls
                            and calls[user].input_node is node
                            for user in users):
        return None
    return [calls[user] for user in users]


def is_counted_partition(part: PatchPartition) -> bool:
    """A partition with the images first: the ones the rule is installed on
    and the accounting counts."""
    return part.grid is None or (part.grid.layout in ('tokens', 'hwc')
                                 and part.token_dim != 0)
