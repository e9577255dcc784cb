"""Bilinear resizes whose backward reads a channel slice's gradient in place.

Decode heads resize feature maps and concatenate them along the channels
(Segformer's MLP head, LRASPP's branches, ...): the concatenation's backward
hands each resize a channel slice of its gradient, which is not contiguous
when the batch has more than one image, and torch's
``upsample_bilinear2d_backward`` copies it to contiguous memory first: on
MobileNetV3-LRASPP at 512x512, batch 2, a 64 MiB copy (~29 ms on the 2-core
benchmark VM) in front of the resize's own backward. One image of that
slice is contiguous, so :func:`bilinear_resize_backward` runs torch's own
kernel image by image on it, writing into one gradient tensor (recycled
memory on CPU, :func:`~.native.empty_for_writing`): the same
kernel on the same numbers, hence the same gradient bit for bit
(``tests/test_ops/test_resize.py``), without the copy.

:func:`strided_gradient_resizes` routes ``torch.nn.functional.interpolate``
calls (``mode='bilinear'``, 4-d, no antialiasing, on a tensor that needs a
gradient) to :class:`BilinearResizeFunction` for the duration of a block
(a torch function mode, so mmseg's ``resize`` helper is covered without
touching mmseg). Its forward is ``interpolate`` itself; it keeps nothing
but sizes, as autograd's resize does.
"""
import contextlib
import inspect
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function
from torch.overrides import TorchFunctionMode

from .native import empty_for_writing

__all__ = ['BilinearResizeFunction', 'bilinear_resize_backward',
           'strided_gradient_resizes']

_INTERPOLATE = inspect.signature(F.interpolate)


def _scales(scale_factor, recompute_scale_factor
            ) -> Tuple[Optional[float], Optional[float]]:
    """The scales ``interpolate`` hands torch's bilinear kernel (and its
    autograd formula): the scale factor as given, unless the output size
    is given or recomputed from it."""
    if scale_factor is None or recompute_scale_factor:
        return None, None
    if isinstance(scale_factor, (tuple, list)):
        return float(scale_factor[0]), float(scale_factor[1])
    return float(scale_factor), float(scale_factor)


def bilinear_resize_backward(grad: Tensor, input_size: Sequence[int],
                             align_corners: bool,
                             scales: Tuple[Optional[float], Optional[float]]
                             ) -> Tensor:
    """torch's ``upsample_bilinear2d_backward`` of ``grad``; for a gradient
    that is not contiguous but whose every image is (a channel slice of a
    batch), image by image into one contiguous result, without copying
    ``grad`` first."""
    out_size = list(grad.shape[2:])
    backward = torch.ops.aten.upsample_bilinear2d_backward
    if grad.is_contiguous() or grad.is_contiguous(
            memory_format=torch.channels_last) or not all(
            grad[i:i + 1].is_contiguous() for i in range(grad.shape[0])):
        return backward(grad, out_size, list(input_size), align_corners,
                        *scales)
    result = empty_for_writing(input_size, grad)
    for i in range(grad.shape[0]):
        backward.grad_input(grad[i:i + 1], out_size,
                            [1] + list(input_size[1:]), align_corners,
                            *scales, grad_input=result[i:i + 1])
    return result


class BilinearResizeFunction(Function):
    """``F.interpolate(x, size, scale_factor, mode='bilinear',
    align_corners, recompute_scale_factor)`` whose backward is
    :func:`bilinear_resize_backward`."""

    @staticmethod
    def forward(ctx, x: Tensor, size, scale_factor, align_corners,
                recompute_scale_factor):
        ctx.input_size = tuple(x.shape)
        ctx.align_corners = bool(align_corners)
        ctx.scales = _scales(scale_factor, recompute_scale_factor)
        return F.interpolate(x, size, scale_factor, 'bilinear', align_corners,
                             recompute_scale_factor)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (bilinear_resize_backward(grad, ctx.input_size,
                                         ctx.align_corners, ctx.scales),
                None, None, None, None)


class _StridedGradientResizes(TorchFunctionMode):
    """Routes bilinear ``interpolate`` calls that autograd records to
    :class:`BilinearResizeFunction`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.interpolate:
            call = _INTERPOLATE.bind(*args, **kwargs)
            call.apply_defaults()
            a = call.arguments
            x = a['input']
            if (a['mode'] == 'bilinear' and not a['antialias']
                    and isinstance(x, Tensor) and x.dim() == 4
                    and x.requires_grad and torch.is_grad_enabled()):
                return BilinearResizeFunction.apply(
                    x, a['size'], a['scale_factor'], a['align_corners'],
                    a['recompute_scale_factor'])
        return func(*args, **kwargs)


@contextlib.contextmanager
def strided_gradient_resizes():
    """Inside the block, bilinear resizes that need a gradient run as
    :class:`BilinearResizeFunction` (the same outputs and gradients)."""
    with _StridedGradientResizes():
        yield
