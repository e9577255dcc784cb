"""A candidate layer of the profile: one of the last-``N`` pool.

Its geometry (from its layer kind) gives its backward cost at any radius,
and whether it computes ``g_x`` depends only on the first trained
candidate (:attr:`ConvProfile.upstream`).
"""
from dataclasses import dataclass
from typing import Tuple

import torch
from torch import nn

from ...models.layer_kinds import CONV2D, LayerGeometry, traced_kind_of
from ...ops.conv.cost import ConvBackwardCost


def layer_geometry(module: nn.Module, x: torch.Tensor,
                   out: torch.Tensor) -> LayerGeometry:
    """A traced layer's geometry at one call, from its layer kind (a
    classifier not of a registered kind counts as a conv)."""
    kind = traced_kind_of(module) or CONV2D
    return kind.geometry(module, (x, ), out)


def layer_kind_name(module: nn.Module) -> str:
    """A candidate's layer kind (a module of no registered kind: a conv,
    as :func:`layer_geometry` counts it)."""
    kind = traced_kind_of(module)
    return CONV2D.name if kind is None else kind.name


@dataclass
class ConvProfile:
    """A candidate conv (one of the last-``N`` pool).

    Attributes:
        path: its module path.
        module: the conv.
        geometry: its shapes at the profile's input size.
        index: position in the pool (execution order).
        upstream: index of the last pool conv its input depends on (-1:
            none); it computes ``g_x`` when that conv is trained.
        output_stride: input pixels per output pixel.
        params: its parameter count (weight and bias).
        seq: position of its call among the traced module calls.
        input_shape: its input's shape at the traced call, without the
            batch axis (what its backward's scratch is measured on; the
            geometry's ``in_shape`` is ``(C, H, W)`` on the kind's grid,
            which a 1-D conv's input, ``(C, L)``, is not).
    """

    path: str
    module: nn.Module
    geometry: LayerGeometry
    index: int
    upstream: int
    output_stride: int
    params: int
    seq: int = 0
    input_shape: Tuple[int, ...] = ()

    def cost(self, radius: int, first: int,
             batch: int = 1) -> ConvBackwardCost:
        """Its backward cost when the pool is trained from ``first`` on."""
        return self.geometry.cost(radius, batch=batch,
                                  need_input_grad=self.upstream >= first)
