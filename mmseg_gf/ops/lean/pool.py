"""Pooling that keeps what its backward needs, not its input.

Average pooling is linear: its backward (``avg_pool2d_backward``) needs only
the input's geometry, so :class:`ShapeOnlyAvgPoolFunction` keeps that
(LRASPP's image pool, STDC's and CGNet's downsamplers keep their input
under autograd).

Max pooling keeps the window offset of each maximum, not its input.

Autograd's ``max_pool2d`` keeps its input and an int64 index per output
element (a ResNet stem's pool: 8 + 4 bytes per output element plus the
input, four times larger). The backward needs only where each maximum
was: its offset inside the pooling window, ``kh * kW + kw``, fits a uint8
when the window has at most 256 elements. :class:`WindowOffsetMaxPoolFunction`
keeps those offsets and the input's shape; the backward rebuilds torch's
flat indices from them and calls the same kernel as autograd
(``max_pool2d_with_indices_backward``), so the gradient is autograd's bit for
bit, ties included: the offsets are converted from the indices torch's own
forward returned.
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
    """Top-left input row / column of every output's window, shaped to
    broadcast over ``(N, C, Ho, Wo)``."""
    rows = torch.arange(out_hw[0], device=device).view(-1, 1)
    cols = torch.arange(out_hw[1], device=device).view(1, -1)
    return rows * stride[0] - padding[0], cols * stride[1] - padding[1]


def window_offsets(indices: Tensor, width: int, kernel: Pair, stride: Pair,
                   padding: Pair, dilation: Pair) -> Tensor:
    """uint8 ``kh * kW + kw`` of each maximum from torch's flat indices
    (``row * width + col`` in the input plane). ``indices`` is overwritten:
    in place, one int64 temporary of its size is made, not five."""
    top, left = _window_starts(indices.shape[-2:], stride, padding,
                               indices.device)
    rows = torch.div(indices, width, rounding_mode='floor')
    cols = indices.sub_(rows, alpha=width)
    kh = rows.sub_(top).div_(dilation[0], rounding_mode='floor')
    kw = cols.sub_(left).div_(dilation[1], rounding_mode='floor')
    return kh.mul_(kernel[1]).add_(kw).to(torch.uint8)


def flat_indices(offsets: Tensor, width: int, kernel: Pair, stride: Pair,
                 padding: Pair, dilation: Pair) -> Tensor:
    """Inverse of :func:`window_offsets`: torch's int64 flat indices (the
    window coordinates split in uint8, one int64 tensor made)."""
    top, left = _window_starts(offsets.shape[-2:], stride, padding,
                               offsets.device)
    kh = torch.div(offsets, kernel[1], rounding_mode='floor')
    kw = offsets - kh * kernel[1]
    index = kh.long().mul_(dilation[0]).add_(top).mul_(width)
    return index.add_(left).add_(kw, alpha=dilation[1])


def _like(geometry) -> Tensor:
    """A tensor of a recorded input's shape for the pooling backward
    kernels, which read only its geometry: a contiguous input's is a
    broadcast scalar (no memory), any other an uninitialised tensor of its
    strides (the kernels follow its memory format)."""
    shape, strides, dtype, device, contiguous = geometry
    if contiguous:
        return torch.empty((1, ) * len(shape), dtype=dtype,
                           device=device).expand(shape)
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


def _geometry(x: Tensor) -> tuple:
    return (tuple(x.shape), tuple(x.stride()), x.dtype, x.device,
            x.is_contiguous())


class WindowOffsetMaxPoolFunction(Function):
    """``max_pool2d`` of a 4-D input, keeping uint8 window offsets.

    Args (of ``apply``): ``x`` (N, C, H, W), then ``kernel``, ``stride``,
    ``padding``, ``dilation`` as int pairs and ``ceil_mode``; the window
    must have at most :data:`MAX_WINDOW` elements.
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
    """``avg_pool2d`` keeping its input's shape only.

    Args (of ``apply``): ``x``, then ``kernel``, ``stride``, ``padding`` (int
    pairs), ``ceil_mode``, ``count_include_pad``, ``divisor_override``, as
    ``torch.nn.functional.avg_pool2d`` takes them; the backward calls the
    kernel autograd calls, so the gradient is autograd's bit for bit.
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
