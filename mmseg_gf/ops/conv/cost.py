"""The single cost model of a convolution's backward: FLOPs and saved bytes.

Every printed figure comes from :func:`conv_backward_cost`; the
conventions are in docs/cost.md. A reduction's additions count 1 FLOP
each; the broadcast back over patches is a copy, not counted.
"""
from dataclasses import dataclass
from math import ceil, sqrt
from typing import Sequence, Tuple

from torch import nn

from ..patch_grid import as_pair

__all__ = ['ConvBackwardCost', 'conv_backward_cost', 'ConvGeometry',
           'output_stride', 'map_output_stride']


@dataclass(frozen=True)
class ConvBackwardCost:
    """Backward FLOPs and saved bytes, exact vs gradient filter (a gradient not
    computed counts 0); ``gf_forward_overhead_flops`` (the forward's patch
    sums) is not part of :attr:`gf_flops`.
    """

    vanilla_grad_input_flops: int
    vanilla_grad_weight_flops: int
    gf_grad_input_flops: int
    gf_grad_weight_flops: int
    gf_overhead_flops: int
    vanilla_saved_bytes: int
    gf_saved_bytes: int
    gf_forward_overhead_flops: int = 0

    @property
    def vanilla_flops(self) -> int:
        return self.vanilla_grad_input_flops + self.vanilla_grad_weight_flops

    @property
    def gf_flops(self) -> int:
        """Total filtered backward FLOPs, overheads included."""
        return (self.gf_grad_input_flops + self.gf_grad_weight_flops +
                self.gf_overhead_flops)


def conv_backward_cost(cin: int,
                       cout: int,
                       kh: int,
                       kw: int,
                       stride,
                       dilation,
                       groups: int,
                       in_hw: Sequence[int],
                       out_hw: Sequence[int],
                       batch: int,
                       radius: int,
                       need_input_grad: bool,
                       need_weight_grad: bool = True,
                       elem_bytes: int = 4) -> ConvBackwardCost:
    """Cost of one conv's backward, exact and gradient-filtered.

    Args:
        stride, dilation: int or (h, w) pair.
        in_hw, out_hw: input and output ``(H, W)``.
        radius: patch size ``r >= 1``.
        need_input_grad: whether ``g_x`` is computed.
        need_weight_grad: whether ``g_W`` is computed (and anything saved).
        elem_bytes: bytes per activation element.
    """
    sh, sw = as_pair(stride)
    dh, dw = as_pair(dilation)
    h, w = (int(v) for v in in_hw)
    ho, wo = (int(v) for v in out_hw)
    cin_g = cin // groups
    dense = 2 * batch * cout * ho * wo * cin_g * kh * kw
    cells = ceil(ho / radius) * ceil(wo / radius)
    taps_h = kh if (kh > 1 and dh // (radius * sh) >= 1) else 1
    taps_w = kw if (kw > 1 and dw // (radius * sw) >= 1) else 1
    collapsed = taps_h == 1 and taps_w == 1
    pooled = 2 * batch * cout * cin_g * cells * taps_h * taps_w
    any_grad = need_input_grad or need_weight_grad
    overhead = 0
    if any_grad:
        overhead += batch * cout * ho * wo
        if need_input_grad or not collapsed:
            overhead += cout * cin_g * kh * kw
    return ConvBackwardCost(
        vanilla_grad_input_flops=dense if need_input_grad else 0,
        vanilla_grad_weight_flops=dense if need_weight_grad else 0,
        gf_grad_input_flops=pooled if need_input_grad else 0,
        gf_grad_weight_flops=pooled if need_weight_grad else 0,
        gf_overhead_flops=overhead,
        vanilla_saved_bytes=(batch * cin * h * w * elem_bytes
                             if need_weight_grad else 0),
        gf_saved_bytes=(batch * cin * cells * elem_bytes
                        if need_weight_grad else 0),
        gf_forward_overhead_flops=(
            batch * cin * ceil(ho / radius) * radius * sh *
            ceil(wo / radius) * radius * sw if need_weight_grad else 0))


def output_stride(input_h: int, out_h: int) -> int:
    """Input-image pixels per output pixel of a layer (1, 2, 4, ...): what
    the ``'auto'`` radius and the budget's refinement order go by."""
    return max(1, round(int(input_h) / max(int(out_h), 1)))


def map_output_stride(input_hw: Sequence[int], map_area: int) -> int:
    """:func:`output_stride` from areas; a windowed layer (Swin's) goes by its
    map's area, not one window's.
    """
    area = int(input_hw[0]) * int(input_hw[1])
    return max(1, round(sqrt(area / max(int(map_area), 1))))


@dataclass(frozen=True)
class ConvGeometry:
    """A conv's hyper-parameters and the ``(C, H, W)`` shapes it ran at:
    what its backward cost depends on.
    """

    in_shape: Tuple[int, int, int]
    out_shape: Tuple[int, int, int]
    kernel_size: Tuple[int, int]
    stride: Tuple[int, int]
    dilation: Tuple[int, int]
    groups: int

    @classmethod
    def of(cls, conv: nn.Module, in_shape: Sequence[int],
           out_shape: Sequence[int]) -> 'ConvGeometry':
        """A conv module's geometry at one call (shapes without batch)."""
        return cls(tuple(int(v) for v in in_shape),
                   tuple(int(v) for v in out_shape),
                   as_pair(conv.kernel_size), as_pair(conv.stride),
                   as_pair(conv.dilation), int(conv.groups))

    @property
    def map_area(self) -> int:
        """Positions of the output map (:func:`map_output_stride`)."""
        return self.out_shape[1] * self.out_shape[2]

    def describe(self) -> str:
        """``k/s/d/g`` along H, the layer tables' cell."""
        return (f'{self.kernel_size[0]}/{self.stride[0]}/{self.dilation[0]}'
                f'/{self.groups}')

    def cost(self, radius: int, batch: int = 1,
             need_input_grad: bool = True, need_weight_grad: bool = True,
             elem_bytes: int = 4,
             collapse_dilated: bool = False) -> ConvBackwardCost:
        """:func:`conv_backward_cost` of this conv; ``collapse_dilated``
        counts the kernel summed to one tap, as the paper's reference operator
        does.
        """
        return conv_backward_cost(
            cin=self.in_shape[0], cout=self.out_shape[0],
            kh=self.kernel_size[0], kw=self.kernel_size[1],
            stride=self.stride,
            dilation=(1, 1) if collapse_dilated else self.dilation,
            groups=self.groups, in_hw=self.in_shape[1:],
            out_hw=self.out_shape[1:], batch=batch, radius=radius,
            need_input_grad=need_input_grad,
            need_weight_grad=need_weight_grad, elem_bytes=elem_bytes)
