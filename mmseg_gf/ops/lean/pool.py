"""Pooling that keeps what its backward needs, not its input.

Average pooling is linear: :class:`ShapeOnlyAvgPoolFunction` keeps the
input's geometry. Autograd's ``max_pool2d`` keeps its input and an int64
index per output; :class:`WindowOffsetMaxPoolFunction` keeps each
maximum's uint8 offset in its window (windows of at most 256 elements) and
rebuilds torch's indices for autograd's own backward kernel: the gradient
is autograd's bit for bit, ties included.
"""
from typing import Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd import Function

__all__ = ['WindowOffsetMaxPoolFunction', 'ShapeOnlyAvgPoolFunction',
           'MAX_WINDOW', 'window_offsets', 'flat_indices']

#: Largest window (``kernel_h * kernel_w``) whose offsets fit a uint8.
MAX_WINDOW = 256

Pair = Tuple[int, int]


def _window_starts(out_hw: Sequence[int], stride: Pair, padding: Pair,
                   device) -> Tuple[Tensor, Tensor]:
    """Top-left input row / column of every output's window, broadcastable."""
    rows = torch.arange(out_hw[0], device=device).view(-1, 1)
    cols = torch.arange(out_hw[1], device=device).view(1, -1)
    return rows * stride[0] - padding[0], cols * stride[1] - padding[1]


def window_offsets(indices: Tensor, width: int, kernel: Pair, stride: Pair,
                   padding: Pair, dilation: Pair) -> Tensor:
    """uint8 ``kh * kW + kw`` of each maximum from torch's flat indices;
    overwrites ``indices`` (one int64 temporary, not five).
    """
    top, left = _window_starts(indices.shape[-2:], stride, padding,
                               indices.device)
    rows = torch.div(indices, width, rounding_mode='floor')
    cols = indices.sub_(rows, alpha=width)
    kh = rows.sub_(top).div_(dilation[0], rounding_mode='floor')
    kw = cols.sub_(left).div_(dilation[1], rounding_mode='floor')
    return kh.mul_(kernel[1]).add_(kw).to(torch.uint8)


def flat_indices(offsets: Tensor, width: int, kernel: Pair, stride: Pair,
                 padding: Pair, dilation: Pair) -> Tensor:
    """Inverse of :func:`window_offsets`: torch's int64 flat indices."""
    top, left = _window_starts(offsets.shape[-2:], stride, padding,
                               offsets.device)
    kh = torch.div(offsets, kernel[1], rounding_mode='floor')
    kw = offsets - kh * kernel[1]
    index = kh.long().mul_(dilation[0]).add_(top).mul_(width)
    return index.add_(left).add_(kw, alpha=dilation[1])


def _like(geometry) -> Tensor:
    """A stand-in of a recorded input's geometry for the backward kernels
    (which read no values): a broadcast scalar when contiguous, else
    uninitialised.
    """
    shape, strides, dtype, device, contiguous = geometry
    if contiguous:
        return torch.empty((1, ) * len(shape), dtype=dtype,
                           device=device).expand(shape)
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


def _geometry(x: Tensor) -> tuple:
    return (tuple(x.shape), tuple(x.stride()), x.dtype, x.device,
            x.is_contiguous())


class WindowOffsetMaxPoolFunction(Function):
    """``max_pool2d`` of a 4-D input keeping uint8 window offsets; ``apply(x,
    kernel, stride, padding, dilation, ceil_mode)``, a window of at most
    :data:`MAX_WINDOW` elements.
    """

    @staticmethod
    def forward(ctx, x: Tensor, kernel: Pair, stride: Pair, padding: Pair,
                dilation: Pair, ceil_mode: bool) -> Tensor:
        if kernel[0] * kernel[1] > MAX_WINDOW:
            raise ValueError(f'max-pool window {kernel} has more than '
                             f'{MAX_WINDOW} elements')
        out, indices = torch.ops.aten.max_pool2d_with_indices(
            x, kernel, stride, padding, dilation, ceil_mode)
        geometry = (kernel, stride, padding, dilation)
        ctx.save_for_backward(window_offsets(indices, x.shape[-1],
                                             *geometry))
        ctx.geometry = geometry
        ctx.ceil_mode = ceil_mode
        ctx.like = _geometry(x)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        offsets, = ctx.saved_tensors
        indices = flat_indices(offsets, ctx.like[0][-1], *ctx.geometry)
        kernel, stride, padding, dilation = ctx.geometry
        g = torch.ops.aten.max_pool2d_with_indices_backward(
            grad, _like(ctx.like), kernel, stride, padding, dilation,
            ctx.ceil_mode, indices)
        return g, None, None, None, None, None


class ShapeOnlyAvgPoolFunction(Function):
    """``avg_pool2d`` keeping its input's shape only; ``apply`` takes
    ``F.avg_pool2d``'s arguments, the backward autograd's kernel.
    """

    @staticmethod
    def forward(ctx, x: Tensor, kernel: Pair, stride: Pair, padding: Pair,
                ceil_mode: bool, count_include_pad: bool,
                divisor_override) -> Tensor:
        ctx.args = (kernel, stride, padding, ceil_mode, count_include_pad,
                    divisor_override)
        ctx.like = _geometry(x)
        return torch.ops.aten.avg_pool2d(x, *ctx.args)

    @staticmethod
    def backward(ctx, grad: Tensor):
        g = torch.ops.aten.avg_pool2d_backward(grad, _like(ctx.like),
                                               *ctx.args)
        return (g, ) + (None, ) * 6
