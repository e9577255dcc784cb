"""The gradient-filtered conv and its implementations, fastest first.

``conv``: the whole filtered conv (forward and backward), one autograd
node: the Triton one (:mod:`.gpu`), the compiled C++ one (:mod:`.cpu`),
or :class:`~.function.GradientFilterConv2dFunction`, the reference.
``conv_backward``: the reference Function's backward, where the compiled
one-call backward applies (its input, ``g_y``, exists only then).
``patch_grid``: the reference's patch sums and spreads of one NCHW map
(:mod:`..patch_grid`): the compiled kernels, else PyTorch's pooling and
broadcasts.
``grid_products``: the Triton backward's patch-grid products: one fused
launch (:mod:`.products_kernels`, while ``MMSEG_GF_FUSED_PRODUCTS`` is on),
else batched GEMMs, a tap sum and a spread.
"""
from typing import Optional

import torch

from .. import patch_grid
from ..backend import dispatch, switches
from . import cpu, gpu
from .function import (GradientFilterConv2dFunction, fused_backward,
                       stepwise_backward)


def _patches(x, weight, bias, stride, padding, dilation, groups, radius):
    return patch_grid.collapsed_patches(x, weight, stride, padding, dilation,
                                        radius)


def _dilated(*call):
    if _patches(*call) is None:
        return 'dilated taps reach other patches'
    return None


def _triton_refusal(x, weight, bias, *rest):
    return gpu.refusal(x, weight, bias) or _dilated(x, weight, bias, *rest)


def _cpp_refusal(x, weight, bias, *rest):
    reason = cpu.refusal(x)
    if reason is not None:
        return reason
    if weight.dtype != x.dtype or (bias is not None
                                   and bias.dtype != x.dtype):
        return 'weight or bias not of the input dtype'
    if torch.is_autocast_enabled('cpu'):
        return 'CPU autocast'
    if torch.compiler.is_compiling():
        return 'compiling (the reference calls the kernels as operators)'
    return _dilated(x, weight, bias, *rest)


dispatch.register('conv', [
    dispatch.Implementation('triton', _triton_refusal, gpu.filtered_conv2d,
                            _patches),
    dispatch.Implementation('c++', _cpp_refusal, cpu.filtered_conv2d,
                            _patches),
    dispatch.Implementation('torch', lambda *call: None,
                            GradientFilterConv2dFunction.apply),
])


def _backward_cpp_refusal(grad_output, x_pooled, weight, input_dtype,
                          collapsed):
    if not collapsed:
        return 'dilated taps reach other patches'
    reason = cpu.refusal(grad_output)
    if reason is not None:
        return reason
    dtype = grad_output.dtype
    if weight.dtype != dtype or input_dtype != dtype or (
            x_pooled is not None and x_pooled.dtype != dtype):
        return 'tensors of more than one dtype'
    return None


dispatch.register('conv_backward', [
    dispatch.Implementation('c++', _backward_cpp_refusal, fused_backward),
    dispatch.Implementation('torch', lambda *call: None, stepwise_backward),
])

dispatch.register('patch_grid', [
    dispatch.Implementation('c++', cpu.refusal),
    dispatch.Implementation('torch', lambda t: None),
])
# the spread of a patch grid: the kernel takes a contiguous copy (a small
# grid), so the grid's own strides do not refuse it
dispatch.register('patch_spread', [
    dispatch.Implementation('c++', lambda t: cpu.refusal(t, layout=False)),
    dispatch.Implementation('torch', lambda t: None),
])


def _fused_products_refusal() -> Optional[str]:
    if not switches.value('MMSEG_GF_FUSED_PRODUCTS'):
        return 'MMSEG_GF_FUSED_PRODUCTS off'
    return None


dispatch.register('grid_products', [
    dispatch.Implementation('fused', _fused_products_refusal),
    dispatch.Implementation('torch', lambda: None),
])
