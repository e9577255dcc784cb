"""Which implementation a filtered or lean layer runs, as the dispatcher
explains it.

:func:`layer_path` builds the operator call a layer makes on an input and
returns :func:`~mmseg_gf.ops.backend.dispatch.explain`'s label for it
(``triton``, ``c++``, ``torch: <first refusal>``): what the training log's
layer table prints in its ``path`` column. :func:`representative_input`
gives an input of a traced shape for layers that have not run yet.
"""
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from ..ops.backend import dispatch
from ..ops.bit_mask.masks import layout_of
from ..ops.conv.function import as_pair, resolve_padding
from .gf_conv import GFConv2d
from .gf_linear import GFLinear

__all__ = ['layer_path', 'representative_input']


def representative_input(module: nn.Module, shape: Sequence[int],
                         requires_grad: bool = True) -> Tensor:
    """An uninitialised contiguous input of ``shape`` (one image, no batch
    axis) on the device and in the dtype of ``module``'s first parameter:
    what decides a path is its metadata, not its values."""
    param = next(module.parameters(), None)
    kwargs = {} if param is None else dict(device=param.device,
                                           dtype=param.dtype)
    return torch.empty((1, *shape), **kwargs).requires_grad_(requires_grad)


def _padded(x: Tensor, pads: Sequence[int]) -> Tensor:
    """An input of the shape ``F.pad(x, pads)`` has (left, right, top,
    bottom), without the copy."""
    h = x.shape[-2] + pads[2] + pads[3]
    w = x.shape[-1] + pads[0] + pads[1]
    return x.new_empty((*x.shape[:-2], h, w))


def _conv_path(conv: GFConv2d, x: Tensor) -> str:
    if not conv._filter_active(x, conv.weight, conv.bias) or x.numel() == 0:
        return 'exact'
    padding = conv.padding
    if conv.padding_mode != 'zeros':
        x = _padded(x, conv._reversed_padding_repeated_twice)
        padding = (0, 0)
    pad, extra = resolve_padding(padding, conv.kernel_size, conv.dilation)
    if extra is not None:
        x = _padded(x, extra)
    if x.dim() == 3:
        x = x.unsqueeze(0)
    return dispatch.explain('conv', x, conv.weight, conv.bias,
                            as_pair(conv.stride), pad, as_pair(conv.dilation),
                            conv.groups, conv.radius).label()


def _linear_path(linear: GFLinear, x: Tensor) -> str:
    if not linear._filter_active(x, linear.weight, linear.bias):
        return 'exact'
    weight = linear.weight
    acc = torch.promote_types(weight.dtype, torch.float32)
    r = linear.radius
    # token rows of one patch row: the backward's refusals read dtypes,
    # devices and the channel stride, not the grid's size
    g_rows = x.new_empty((1, 1, r, weight.shape[0]))
    sums = x.new_empty((1, 1, 1, weight.shape[1]))
    out_rows = x.new_empty((1, 1, r, weight.shape[1])) \
        if x.requires_grad else None
    return dispatch.explain('linear_backward', None, g_rows, sums, weight,
                            out_rows, weight.requires_grad,
                            linear.bias is not None, acc).label()


def layer_path(module: nn.Module, x: Tensor) -> Optional[str]:
    """The path ``module`` takes on input ``x``: the dispatcher's label of
    its operator's call (``'exact'`` for a filtered layer that runs its
    exact backward on ``x``), or None where no operator of the dispatcher
    decides the module's path (a plain layer, an attention, a lean layer
    without a choice of kernel).

    Covered: :class:`GFConv2d` (``conv``), :class:`GFLinear`
    (``linear_backward``), the lean frozen batch norm (``frozen_norm``)
    and the lean masked activations (``bit_mask``).
    """
    if isinstance(module, GFConv2d):
        return _conv_path(module, x)
    if isinstance(module, GFLinear):
        return _linear_path(module, x)
    if hasattr(module, 'frozen_affine'):  # models.lean's frozen norm
        return dispatch.explain('frozen_norm', x).label()
    if hasattr(module, 'mask_arguments'):  # models.lean's activations
        flat = x.permute(0, 2, 3, 1) if layout_of(x) is \
            torch.channels_last else x
        return dispatch.explain('bit_mask', flat).label()
    return None
