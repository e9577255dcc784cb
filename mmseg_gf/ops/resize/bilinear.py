"""Bilinear resizes whose backward reads a channel slice's gradient in place.

Decode heads resize feature maps and concatenate them along the channels
(Segformer's MLP head, LRASPP's branches, ...): the concatenation's backward
hands each resize a channel slice of its gradient, which is not contiguous
when the batch has more than one image, and torch's
``upsample_bilinear2d_backward`` copies it to contiguous memory first: on
MobileNetV3-LRASPP at 512x512, batch 2, a 64 MiB copy (~29 ms on the 2-core
benchmark VM) in front of the resize's own backward. One image of that
slice is contiguous, so :func:`bilinear_resize_backward` reads it in place,
writing into one gradient tensor (recycled memory on CPU,
:func:`~..backend.output_pool.empty_for_writing`): with the compiled kernels one axis at
a time (``csrc/bilinear_backward.cpp``: torch's indices and weights, the
terms summed in another order; ~3x faster than torch's kernel, which
scatters every output pixel's four terms one by one), otherwise torch's
own kernel image by image, the same gradient bit for bit
(``tests/test_ops/test_resize.py``).

:func:`strided_gradient_resizes` routes ``torch.nn.functional.interpolate``
calls (``mode='bilinear'``, 4-d, no antialiasing, on a tensor that needs a
gradient) to :class:`BilinearResizeFunction` for the duration of a block
(a torch function mode, so mmseg's ``resize`` helper is covered without
touching mmseg). Its forward is ``interpolate`` itself; it keeps nothing
but sizes, as autograd's resize does.
"""
import contextlib
import inspect
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
           'strided_gradient_resizes', 'traced_rule_applies',
           'images_contiguous', 'gemm_backward', 'kernel_backward',
           'torch_backward']

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


def images_contiguous(grad: Tensor) -> bool:
    """Each image of ``grad`` is contiguous with its plain strides (a
    channel slice of a contiguous batch is; a tensor with one-pixel axes
    may have other strides for them, and goes to torch's kernel)."""
    _, _, h, w = grad.shape
    return grad.stride()[1:] == (h * w, w, 1)


@torch.library.custom_op('mmseg_gf::native_bilinear_backward',
                         mutates_args=())
def bilinear_backward_op(grad: Tensor, input_size: List[int],
                         align_corners: bool, scale_h: Optional[float],
                         scale_w: Optional[float]) -> Tensor:
    """:func:`~.cpu.bilinear_backward` as a torch operator (what a
    compiled graph calls, where it called torch's
    ``upsample_bilinear2d_backward``, 7x this kernel's time in a
    PSPNet-R18 step on CPU): a new contiguous gradient of ``input_size``
    from a float32 / float64 CPU ``grad`` at any strides (copied where an
    image is not contiguous)."""
    if not images_contiguous(grad):
        grad = grad.contiguous()
    return resize_cpu.bilinear_backward(grad, grad.new_empty(input_size),
                                    align_corners, (scale_h, scale_w))


@bilinear_backward_op.register_fake
def _(grad, input_size, align_corners, scale_h, scale_w):
    return grad.new_empty(input_size)


def traced_rule_applies(x: Tensor) -> bool:
    """Whether, under ``torch.compile``, resizes of tensors on ``x``'s
    device run as :class:`BilinearResizeFunction`: on CPU tensors (its
    backward is the compiled kernel's operator, or torch's kernel as one
    operator: Inductor's C++ backend fails to generate the scatter of its
    decomposition into a 1 x 1 map, PSPNet's pyramid branch of scale 1),
    not on CUDA's path (inside :func:`~.device_path.as_on_cuda` too),
    where the Function's traced backward is torch's own, which the graph
    gets without routing the call: a traced caller there leaves
    :func:`strided_gradient_resizes` out, so no torch function mode runs
    inside the graph."""
    return x.device.type == 'cpu' and not acting_as_cuda()


def bilinear_resize_backward(grad: Tensor, input_size: Sequence[int],
                             align_corners: bool,
                             scales: Tuple[Optional[float], Optional[float]]
                             ) -> Tensor:
    """The gradient of a bilinear resize w.r.t. its input, read in place
    where each image of ``grad`` is contiguous (a channel slice of a batch),
    by the dispatcher's ``resize`` choice: the GEMMs (:mod:`.gemm`), the
    compiled kernels on CPU (float32 / float64) one axis at a time
    (:func:`~.cpu.bilinear_backward`, torch's terms in another order;
    under ``torch.compile`` as its operator), otherwise torch's
    ``upsample_bilinear2d_backward`` (:func:`torch_backward`)."""
    backward = dispatch.choose('resize', grad).implementation.run
    return backward(grad, input_size, align_corners, scales)


def gemm_backward(grad: Tensor, input_size: Sequence[int],
                  align_corners: bool,
                  scales: Tuple[Optional[float], Optional[float]]) -> Tensor:
    """The backward as two matrix products (:func:`.gemm.resize_backward`)."""
    return bilinear_gemm.resize_backward(grad, input_size[2:], align_corners,
                                         scales)


def kernel_backward(grad: Tensor, input_size: Sequence[int],
                    align_corners: bool,
                    scales: Tuple[Optional[float], Optional[float]]) -> Tensor:
    """The compiled CPU backward: its operator while ``torch.compile``
    traces, else the kernel into recycled memory (each image of ``grad``
    contiguous)."""
    if torch.compiler.is_compiling():
        return bilinear_backward_op(grad, list(input_size),
                                    bool(align_corners), *scales)
    return resize_cpu.bilinear_backward(
        grad, empty_for_writing(input_size, grad), align_corners, scales)


def torch_backward(grad: Tensor, input_size: Sequence[int],
                   align_corners: bool,
                   scales: Tuple[Optional[float], Optional[float]]) -> Tensor:
    """torch's ``upsample_bilinear2d_backward``: image by image into one
    gradient where each image of ``grad`` is contiguous (no copy of the
    slice), else (and under ``torch.compile``) on the whole, copied."""
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
    """The output size ``interpolate`` computes: ``size``, or each axis'
    ``floor(in * scale_factor)``."""
    if size is not None:
        return tuple(size) if isinstance(size, (tuple, list)) \
            else (int(size), int(size))
    factors = scale_factor if isinstance(scale_factor, (tuple, list)) \
        else (scale_factor, scale_factor)
    return tuple(int(math.floor(float(n) * float(f)))
                 for n, f in zip(x.shape[2:], factors))


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
