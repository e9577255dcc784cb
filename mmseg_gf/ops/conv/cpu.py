"""The filtered conv's compiled CPU kernels (``csrc/patch_kernels.cpp``,
``collapsed_backward.cpp``, ``filtered_conv_node.cpp``): the two full-size
passes, and the usual conv's whole backward in one call.

Where :func:`refusal` gives a reason the PyTorch path computes the same
numbers. Under ``torch.compile`` the kernels run as registered operators
with fake implementations; in eager mode they are called directly.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..backend import availability, extension

__all__ = ['refusal', 'usable', 'patch_sums', 'spread', 'collapsed_backward',
           'filtered_conv2d', 'fused_backward_calls']

Patches = Tuple[int, int, int]  # (start, size, count) along one axis

_kernels = extension.module('patch_ops')


def refusal(t: Tensor, layout: bool = True) -> Optional[str]:
    """Why the kernels may not take ``t``, or None: they take non-empty
    contiguous NCHW float32 / float64 CPU tensors (``layout=False``: any
    strides, for a caller that makes ``t`` contiguous itself).
    """
    reason = availability.native_refusal('patch_ops')
    if reason is not None:
        return reason
    if t.device.type != 'cpu':
        return f'{t.device.type} tensor'
    if t.dtype not in (torch.float32, torch.float64):
        return f'{t.dtype} tensor'
    if t.dim() != 4 or t.numel() == 0:
        return 'empty or not 4-D'
    if layout and not t.is_contiguous():
        return 'not contiguous NCHW'
    return None


def usable(t: Tensor) -> bool:
    """Whether the kernels take ``t``."""
    return refusal(t) is None


@torch.library.custom_op('mmseg_gf::native_patch_sums', mutates_args=())
def _patch_sums_op(t: Tensor, rows: List[int], cols: List[int],
                   channel_major: bool) -> Tensor:
    return _kernels.patch_sums(t, *rows, *cols, channel_major)


@_patch_sums_op.register_fake
def _(t, rows, cols, channel_major):
    n, c = t.shape[:2]
    if channel_major:
        return t.new_empty((c, n, rows[2], cols[2])).permute(1, 0, 2, 3)
    return t.new_empty((n, c, rows[2], cols[2]))


@torch.library.custom_op('mmseg_gf::native_spread', mutates_args=())
def _spread_op(grid: Tensor, height: int, width: int, rows: List[int],
               cols: List[int]) -> Tensor:
    return _kernels.spread(grid, height, width, rows[0], rows[1], cols[0],
                           cols[1])


@_spread_op.register_fake
def _(grid, height, width, rows, cols):
    return grid.new_empty((grid.shape[0], grid.shape[1], height, width))


@torch.library.custom_op('mmseg_gf::native_collapsed_backward',
                         mutates_args=())
def _collapsed_backward_op(grad_output: Tensor, input_pooled: Optional[Tensor],
                           weight: Tensor, groups: int, scale: float,
                           input_size: List[int], rows: List[int],
                           cols: List[int], radius: int, need_input: bool,
                           need_weight: bool, need_bias: bool
                           ) -> Tuple[Tensor, Tensor, Tensor]:
    # an operator returns no None: an empty tensor stands for each
    # gradient not asked for
    return tuple(grad_output.new_empty(0) if g is None else g
                 for g in _kernels.collapsed_backward(
                     grad_output, input_pooled, weight, groups, scale,
                     *input_size, rows[0], rows[1], cols[0], cols[1],
                     radius, need_input, need_weight, need_bias))


@_collapsed_backward_op.register_fake
def _(grad_output, input_pooled, weight, groups, scale, input_size, rows,
      cols, radius, need_input, need_weight, need_bias):
    co, ci_g = weight.shape[:2]
    n = grad_output.shape[0]
    shapes = ((n, ci_g * groups, *input_size), (co, ci_g, 1, 1), (co, ))
    return tuple(grad_output.new_empty(shape if need else (0, ))
                 for shape, need in zip(shapes, (need_input, need_weight,
                                                 need_bias)))


def patch_sums(t: Tensor, rows: Patches, cols: Patches,
               channel_major: bool = False) -> Tensor:
    """``N x C x rows.count x cols.count`` patch sums of ``t``; with
    ``channel_major`` stored ``C x N x ...`` (a permuted view), the layout
    :func:`collapsed_backward` multiplies without a copy.
    """
    if torch.compiler.is_compiling():
        return _patch_sums_op(t, list(rows), list(cols), channel_major)
    return _kernels.patch_sums(t, *rows, *cols, channel_major)


def spread(grid: Tensor, height: int, width: int, rows: Patches,
           cols: Patches) -> Tensor:
    """Each cell of ``grid`` broadcast over its patch; zeros outside."""
    if torch.compiler.is_compiling():
        return _spread_op(grid, height, width, list(rows), list(cols))
    return _kernels.spread(grid, height, width, rows[0], rows[1], cols[0],
                           cols[1])


def collapsed_backward(grad_output: Tensor, input_pooled: Optional[Tensor],
                       weight: Tensor, groups: int, scale: float,
                       input_size: Tuple[int, int], rows: Patches,
                       cols: Patches, radius: int, need_input: bool,
                       need_weight: bool, need_bias: bool
                       ) -> Tuple[Optional[Tensor], Optional[Tensor],
                                  Optional[Tensor]]:
    """The whole backward of a conv whose kernel collapses on both axes:
    ``(g_x, g_W, g_b)``, None where not asked for; ``g_W`` on the pooled
    ``Co x Ci/groups x 1 x 1`` kernel.
    """
    if torch.compiler.is_compiling():
        # The kernel reads the weight only for its taps' sum W~ (its g_W
        # is on the 1 x 1 pooled kernel): W~ summed in the graph, where it
        # reads the weight at the strides the graph keeps it in (Inductor
        # lays out conv weights channels-last; the operator would take a
        # contiguous copy of the whole weight first)
        kernel = (weight if weight.shape[2] * weight.shape[3] == 1 else
                  weight.sum(dim=(2, 3), keepdim=True))
        grads = _collapsed_backward_op(
            grad_output, input_pooled, kernel, groups, scale,
            list(input_size), list(rows), list(cols), radius, need_input,
            need_weight, need_bias)
        return tuple(g if need else None for g, need in
                     zip(grads, (need_input, need_weight, need_bias)))
    return tuple(
        _kernels.collapsed_backward(grad_output, input_pooled, weight, groups,
                                    scale, *input_size, rows[0], rows[1],
                                    cols[0], cols[1], radius, need_input,
                                    need_weight, need_bias))


def filtered_conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                    stride: Tuple[int, int], padding: Tuple[int, int],
                    dilation: Tuple[int, int], groups: int, radius: int,
                    rows: Patches, cols: Patches) -> Tensor:
    """``F.conv2d`` whose backward is :func:`collapsed_backward`, as one C++
    autograd node (no Python in its backward); ``rows`` / ``cols``: the input
    patches ``Q(P)``.
    """
    return _kernels.filtered_conv2d(x, weight, bias, list(stride),
                                    list(padding), list(dilation), groups,
                                    radius, rows[0], rows[1], cols[0],
                                    cols[1])


def fused_backward_calls() -> int:
    """Backward calls that ran :func:`collapsed_backward` (a diagnostic)."""
    return _kernels.fused_backward_calls()
