"""Bilinear resizes whose backward reads a channel slice's gradient in
place.

Heads that concatenate resized maps (Segformer's MLP head, LRASPP) hand
each resize a non-contiguous channel slice of the gradient, which torch's
``upsample_bilinear2d_backward`` copies first. Each image of that slice is
contiguous, so :func:`bilinear_resize_backward` reads it in place (the
compiled kernel one axis at a time, or torch's kernel image by image, bit
for bit). :func:`strided_gradient_resizes` routes bilinear ``interpolate``
calls that need a gradient to :class:`BilinearResizeFunction` inside a
block (a torch function mode: mmseg's ``resize`` is covered untouched);
:func:`strided_gradient_resize` is the rule for one call.
Details: docs/lean_region.md; figures:
docs/benchmarks/design_measurements.md.
"""
import contextlib
import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function
from torch.overrides import TorchFunctionMode

from . import gemm as bilinear_gemm
from ..backend import dispatch
from ..backend.device_path import acting_as_cuda
from ..backend.output_pool import empty_for_writing
from . import cpu as resize_cpu

__all__ = ['BilinearResizeFunction', 'bilinear_resize_backward',
           'strided_gradient_resize', 'strided_gradient_resizes', 'traced_rule_applies',
           'images_contiguous', 'gemm_backward', 'kernel_backward',
           'torch_backward']

def _scales(scale_factor, recompute_scale_factor
            ) -> Tuple[Optional[float], Optional[float]]:
    """The scales ``interpolate`` hands torch's bilinear kernel: the factor as
    given, unless the size is given or recomputed.
    """
    if scale_factor is None or recompute_scale_factor:
        return None, None
    if isinstance(scale_factor, (tuple, list)):
        return float(scale_factor[0]), float(scale_factor[1])
    return float(scale_factor), float(scale_factor)


def images_contiguous(grad: Tensor) -> bool:
    """Each image of ``grad`` is contiguous with its plain strides (else
    torch's kernel runs).
    """
    _, _, h, w = grad.shape
    return grad.stride()[1:] == (h * w, w, 1)


@torch.library.custom_op('mmseg_gf::native_bilinear_backward',
                         mutates_args=())
def bilinear_backward_op(grad: Tensor, input_size: List[int],
                         align_corners: bool, scale_h: Optional[float],
                         scale_w: Optional[float]) -> Tensor:
    """:func:`~.cpu.bilinear_backward` as a torch operator for compiled graphs
    (torch's kernel took 7x its time in a PSPNet-R18 step on CPU); copies an
    image that is not contiguous.
    """
    if not images_contiguous(grad):
        grad = grad.contiguous()
    return resize_cpu.bilinear_backward(grad, grad.new_empty(input_size),
                                    align_corners, (scale_h, scale_w))


@bilinear_backward_op.register_fake
def _(grad, input_size, align_corners, scale_h, scale_w):
    return grad.new_empty(input_size)


def traced_rule_applies(x: Tensor) -> bool:
    """Whether, under ``torch.compile``, resizes on ``x``'s device run as
    :class:`BilinearResizeFunction`: on CPU tensors (Inductor's C++ backend
    fails on the decomposed backward into a 1 x 1 map), not on the CUDA path,
    where the traced backward is torch's own anyway.
    """
    return x.device.type == 'cpu' and not acting_as_cuda()


def bilinear_resize_backward(grad: Tensor, input_size: Sequence[int],
                             align_corners: bool,
                             scales: Tuple[Optional[float], Optional[float]]
                             ) -> Tensor:
    """The gradient of a bilinear resize w.r.t. its input, by the dispatcher's
    ``resize`` choice: GEMMs (:mod:`.gemm`), the compiled CPU kernel, or
    torch's kernel (:func:`torch_backward`); reads ``grad`` in place where
    each image is contiguous.
    """
    backward = dispatch.choose('resize', grad).implementation.run
    return backward(grad, input_size, align_corners, scales)


def gemm_backward(grad: Tensor, input_size: Sequence[int],
                  align_corners: bool,
                  scales: Tuple[Optional[float], Optional[float]]) -> Tensor:
    return bilinear_gemm.resize_backward(grad, input_size[2:], align_corners,
                                         scales)


def kernel_backward(grad: Tensor, input_size: Sequence[int],
                    align_corners: bool,
                    scales: Tuple[Optional[float], Optional[float]]) -> Tensor:
    """The compiled CPU backward: its operator while tracing, else the kernel
    into recycled memory.
    """
    if torch.compiler.is_compiling():
        return bilinear_backward_op(grad, list(input_size),
                                    bool(align_corners), *scales)
    return resize_cpu.bilinear_backward(
        grad, empty_for_writing(input_size, grad), align_corners, scales)


def torch_backward(grad: Tensor, input_size: Sequence[int],
                   align_corners: bool,
                   scales: Tuple[Optional[float], Optional[float]]) -> Tensor:
    """torch's ``upsample_bilinear2d_backward``, image by image where each
    image of ``grad`` is contiguous, else (and under ``torch.compile``) whole.
    """
    out_size = list(grad.shape[2:])
    if not images_contiguous(grad) or torch.compiler.is_compiling():
        return torch.ops.aten.upsample_bilinear2d_backward(
            grad, out_size, list(input_size), align_corners, *scales)
    result = empty_for_writing(input_size, grad)
    backward = torch.ops.aten.upsample_bilinear2d_backward
    for i in range(grad.shape[0]):
        backward.grad_input(grad.narrow(0, i, 1), out_size,
                            [1] + list(input_size[1:]), align_corners,
                            *scales, grad_input=result.narrow(0, i, 1))
    return result


def _output_size(x: Tensor, size, scale_factor, recompute_scale_factor
                 ) -> Tuple[int, int]:
    """The output size ``interpolate`` computes."""
    if size is not None:
        return tuple(size) if isinstance(size, (tuple, list)) \
            else (int(size), int(size))
    factors = scale_factor if isinstance(scale_factor, (tuple, list)) \
        else (scale_factor, scale_factor)
    return tuple(int(math.floor(float(n) * float(f)))
                 for n, f in zip(x.shape[2:], factors))


class BilinearResizeFunction(Function):
    """Bilinear ``F.interpolate`` whose backward is
    :func:`bilinear_resize_backward`.
    """

    @staticmethod
    def forward(ctx, x: Tensor, size, scale_factor, align_corners,
                recompute_scale_factor):
        ctx.input_size = tuple(x.shape)
        ctx.align_corners = bool(align_corners)
        ctx.scales = _scales(scale_factor, recompute_scale_factor)
        if dispatch.choose('resize', x).implementation.name == 'gemm':
            out_hw = _output_size(x, size, scale_factor,
                                  recompute_scale_factor)
            return bilinear_gemm.resize(x, out_hw, ctx.align_corners,
                                        ctx.scales)
        return F.interpolate(x, size, scale_factor, 'bilinear', align_corners,
                             recompute_scale_factor)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (bilinear_resize_backward(grad, ctx.input_size,
                                         ctx.align_corners, ctx.scales),
                None, None, None, None)


def _interpolate_arguments(input, size=None, scale_factor=None,
                           mode='nearest', align_corners=None,
                           recompute_scale_factor=None, antialias=False):
    """``F.interpolate``'s arguments, bound as it binds them."""
    return (input, size, scale_factor, mode, align_corners,
            recompute_scale_factor, antialias)


def strided_gradient_resize(*args, **kwargs) -> Optional[Tensor]:
    """``F.interpolate(*args, **kwargs)`` as :class:`BilinearResizeFunction`
    where it is a bilinear resize of a 4-D map that autograd records (no
    antialias), else None (the caller runs ``F.interpolate``)."""
    (x, size, scale_factor, mode, align_corners, recompute_scale_factor,
     antialias) = _interpolate_arguments(*args, **kwargs)
    if (mode == 'bilinear' and not antialias and isinstance(x, Tensor)
            and x.dim() == 4 and x.requires_grad and torch.is_grad_enabled()):
        return BilinearResizeFunction.apply(x, size, scale_factor,
                                            align_corners,
                                            recompute_scale_factor)
    return None


class _StridedGradientResizes(TorchFunctionMode):

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.interpolate:
            out = strided_gradient_resize(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def strided_gradient_resizes():
    """Inside the block, bilinear resizes that need a gradient run as
    :class:`BilinearResizeFunction` (same outputs and gradients).

    A torch function mode, which sees every torch call of the block: for a
    traced region, where it costs nothing at run time; eager lean heads
    route ``F.interpolate`` alone (:mod:`mmseg_gf.models.head_resizes`).
    """
    with _StridedGradientResizes():
        yield
