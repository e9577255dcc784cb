"""Gradient-filtered 2-D convolution: exact forward, filtered backward.

The single implementation of docs/gradient_filter.md (Yang et al., CVPR
2023, Eq. 2, 3, 5, Supplement A.5-A.6): ``g_y`` becomes its ``r x r`` patch
means, so the backward runs on the patch grid and the forward keeps only
patch sums of ``x``. Pure PyTorch, no mmseg / mmcv import.
"""

from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..backend import dispatch
from . import cpu as conv_cpu
# The patch grid's helpers (shared with other filtered layer kinds) live in
# .patch_grid; importable from here as well.
from ..patch_grid import (AxisGeometry, IntPair, as_pair, autocast_off,
                          check_radius, collapsed_patches, conv_geometry,
                          filter_output_grad, pool_input_patches,
                          resolve_padding, spread_to_input)


def pooled_kernel(weight: Tensor, geo_h: AxisGeometry,
                  geo_w: AxisGeometry) -> Tensor:
    """The kernel on the pooled grid, summed over collapsed axes (step 2) as a
    matrix-vector product (docs/benchmarks/design_measurements.md).
    """
    if geo_h.collapsed and geo_w.collapsed:
        co, ci_g, kh, kw = weight.shape
        taps = weight.new_ones(kh * kw)
        return (weight.reshape(co * ci_g, kh * kw) @ taps).reshape(
            co, ci_g, 1, 1)
    dims = [dim for dim, geo in ((2, geo_h), (3, geo_w)) if geo.collapsed]
    return weight.sum(dim=dims, keepdim=True) if dims else weight




def _pad_pooled(t: Tensor, geo_h: AxisGeometry, geo_w: AxisGeometry) -> Tensor:
    top, bottom = geo_h.pooled_pads
    left, right = geo_w.pooled_pads
    if top == bottom == left == right == 0:
        return t
    return F.pad(t, (left, right, top, bottom))


def _channel_mixing_backward(
    grad_pooled: Tensor,
    input_pooled: Optional[Tensor],
    kernel: Tensor,
    groups: int,
    need_input: bool,
    need_weight: bool,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Backward of a grouped ``1 x 1`` conv as one GEMM per group (depthwise:
    elementwise), cheaper than a general conv backward on the patch grid.
    """
    n, co, ph, pw = grad_pooled.shape
    co_g, ci_g = co // groups, kernel.shape[1]
    grad_input = grad_kernel = None
    if co_g == 1 and ci_g == 1:  # depthwise
        if need_input:
            grad_input = grad_pooled * kernel.reshape(1, co, 1, 1)
        if need_weight:
            grad_kernel = (grad_pooled * input_pooled).sum(
                dim=(0, 2, 3)).reshape(co, 1, 1, 1)
        return grad_input, grad_kernel

    cells = ph * pw
    if need_input:
        # (g, ci_g, co_g) @ (n, g, co_g, cells) -> (n, g, ci_g, cells):
        # broadcast over the batch, output already in NCHW order.
        mixing = kernel.reshape(groups, co_g, ci_g).transpose(1, 2)
        grad_input = torch.matmul(
            mixing, grad_pooled.reshape(n, groups, co_g, cells)).reshape(
                n, groups * ci_g, ph, pw)
    if need_weight:
        grad_kernel = _pooled_weight_grad(grad_pooled, input_pooled,
                                          groups).reshape(
                                              groups * co_g, ci_g, 1, 1)
    return grad_input, grad_kernel


def _pooled_weight_grad(grad_pooled: Tensor, input_pooled: Tensor,
                        groups: int) -> Tensor:
    """``g_W~ = sum_n g~_n x~_n^T`` per group: per-image GEMMs or one GEMM on a
    gathered copy, whichever the size rule in
    docs/benchmarks/design_measurements.md picks.
    """
    n, co, ph, pw = grad_pooled.shape
    ci = input_pooled.shape[1]
    co_g, ci_g, cells = co // groups, ci // groups, ph * pw
    if 4 * co_g * ci <= (co + ci) * cells:
        return torch.matmul(
            grad_pooled.reshape(n, groups, co_g, cells),
            input_pooled.reshape(n, groups, ci_g, cells).transpose(
                2, 3)).sum(dim=0)

    def by_group(t: Tensor, per_group: int) -> Tensor:
        return t.reshape(n, groups, per_group, cells).permute(
            1, 2, 0, 3).reshape(groups, per_group, n * cells)

    return torch.bmm(
        by_group(grad_pooled, co_g),
        by_group(input_pooled, ci_g).transpose(1, 2))


def pooled_conv_backward(
    grad_pooled: Tensor,
    input_pooled: Optional[Tensor],
    kernel: Tensor,
    geo_h: AxisGeometry,
    geo_w: AxisGeometry,
    groups: int,
    need_input: bool,
    need_weight: bool,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Exact backward of ``y~ = conv2d(pad(x~), kernel, dilation)`` on the
    patch grid: ``(g_x~, g_kernel)``.
    """
    if geo_h.collapsed and geo_w.collapsed:
        return _channel_mixing_backward(grad_pooled, input_pooled, kernel,
                                        groups, need_input, need_weight)
    n = grad_pooled.shape[0]
    ci = kernel.shape[1] * groups
    top, bottom = geo_h.pooled_pads
    left, right = geo_w.pooled_pads
    padded_shape = (n, ci, geo_h.num_patches + top + bottom,
                    geo_w.num_patches + left + right)
    if input_pooled is None:
        # Only the shape is used when the weight gradient is not asked for.
        padded_input = grad_pooled.new_empty(padded_shape)
    else:
        padded_input = _pad_pooled(input_pooled, geo_h, geo_w)
    dilation = [max(geo_h.pooled_dilation, 1), max(geo_w.pooled_dilation, 1)]
    if torch.compiler.is_compiling():
        grad_input, grad_kernel = pooled_conv_backward_op(
            grad_pooled, padded_input, kernel, dilation, groups, need_input,
            need_weight)
        grad_input = grad_input if need_input else None
        grad_kernel = grad_kernel if need_weight else None
    else:
        grad_input, grad_kernel, _ = torch.ops.aten.convolution_backward(
            grad_pooled, padded_input, kernel, None, [1, 1], [0, 0],
            dilation, False, [0, 0], groups,
            [need_input, need_weight, False])
    if grad_input is not None and (top or bottom or left or right):
        grad_input = grad_input.narrow(2, top, geo_h.num_patches).narrow(
            3, left, geo_w.num_patches)
    return grad_input, grad_kernel


@torch.library.custom_op('mmseg_gf::pooled_conv_backward', mutates_args=())
def pooled_conv_backward_op(grad_pooled: Tensor, padded_input: Tensor,
                            kernel: Tensor, dilation: List[int], groups: int,
                            need_input: bool, need_weight: bool
                            ) -> Tuple[Tensor, Tensor]:
    """The pooled grid's dilated conv backward as a torch operator on
    contiguous tensors (docs/benchmarks/design_measurements.md); ``(g_x~
    padded, g_W)``, empty where not asked for.
    """
    grad_input, grad_kernel, _ = torch.ops.aten.convolution_backward(
        grad_pooled.contiguous(), padded_input.contiguous(),
        kernel.contiguous(), None, [1, 1], [0, 0], dilation, False, [0, 0],
        groups, [need_input, need_weight, False])
    return (grad_input.contiguous() if need_input else
            grad_pooled.new_empty((0, )),
            grad_kernel.contiguous() if need_weight else
            kernel.new_empty((0, )))


@pooled_conv_backward_op.register_fake
def _(grad_pooled, padded_input, kernel, dilation, groups, need_input,
      need_weight):
    return (padded_input.new_empty(padded_input.shape) if need_input else
            grad_pooled.new_empty((0, )),
            kernel.new_empty(kernel.shape) if need_weight else
            kernel.new_empty((0, )))


class GradientFilterConv2dFunction(torch.autograd.Function):
    """Autograd Function: ``F.conv2d`` forward, gradient-filter backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                stride: Tuple[int, int], padding: Tuple[int, int],
                dilation: Tuple[int, int], groups: int,
                radius: int) -> Tensor:
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        geo_h, geo_w = conv_geometry(x, weight, stride, padding, dilation,
                                     radius)
        # Never save x: only its patch sums, and only if g_W will be needed.
        x_pooled = (
            pool_input_patches(x, geo_h, geo_w)
            if ctx.needs_input_grad[1] else None)
        ctx.save_for_backward(x_pooled, weight)
        ctx.geometry = (geo_h, geo_w)
        ctx.groups = groups
        ctx.stride_area = stride[0] * stride[1]
        ctx.input_dtype = x.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor):
        x_pooled, weight = ctx.saved_tensors
        need_w = ctx.needs_input_grad[1]
        geo_h, geo_w = ctx.geometry
        backward = dispatch.choose(
            'conv_backward', grad_output, x_pooled, weight, ctx.input_dtype,
            geo_h.collapsed and geo_w.collapsed).implementation.run
        grad_x, grad_w, grad_b = backward(ctx, grad_output, x_pooled, weight)
        if need_w:
            grad_w = grad_w.expand_as(weight).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


def fused_backward(ctx, grad_output: Tensor, x_pooled: Optional[Tensor],
                   weight: Tensor):
    """Steps 1-4 of the backward in one compiled call."""
    geo_h, geo_w = ctx.geometry
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    return conv_cpu.collapsed_backward(
        grad_output, x_pooled, weight, ctx.groups, 1.0 / ctx.stride_area,
        (geo_h.in_size, geo_w.in_size), geo_h.input_patches,
        geo_w.input_patches, geo_h.out_patch, need_x, need_w, need_b)


def stepwise_backward(ctx, grad_output: Tensor, x_pooled: Optional[Tensor],
                       weight: Tensor):
    """Steps 1-4 of the backward as PyTorch ops, for every device, dtype and
    conv kind; returns ``(g_x, g_W~, g_b)``.
    """
    geo_h, geo_w = ctx.geometry
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    acc_dtype = torch.promote_types(weight.dtype, torch.float32)
    with autocast_off(grad_output.device.type):
        # 1/s^2 keeps the filtered gradients unbiased for strided convs
        # (docs/gradient_filter.md#stride-normalisation).
        sums, means = filter_output_grad(grad_output, geo_h, geo_w,
                                         acc_dtype, 1.0 / ctx.stride_area)
        # For the weight gradient alone only the kernel's shape matters:
        # skip reading (and summing) a possibly large weight.
        kernel = (
            pooled_kernel(weight.to(acc_dtype), geo_h, geo_w)
            if need_x or not (geo_h.collapsed and geo_w.collapsed) else
            weight.new_empty(()).expand(weight.shape[0], weight.shape[1], 1,
                                        1))
        grad_x_pooled, grad_kernel = pooled_conv_backward(
            means, None if x_pooled is None else x_pooled.to(acc_dtype),
            kernel, geo_h, geo_w, ctx.groups, need_x, need_w)
    grad_x = grad_b = None
    if need_x:
        grad_x = spread_to_input(
            grad_x_pooled.to(ctx.input_dtype), geo_h, geo_w)
    if need_b:
        grad_b = sums.sum(dim=(0, 2, 3)).to(weight.dtype)
    return grad_x, grad_kernel, grad_b




def gradient_filtered_conv2d(x: Tensor,
                             weight: Tensor,
                             bias: Optional[Tensor] = None,
                             stride: IntPair = 1,
                             padding: Union[str, IntPair] = 0,
                             dilation: IntPair = 1,
                             groups: int = 1,
                             radius: int = 4) -> Tensor:
    """``F.conv2d`` whose backward is the gradient filter of patch size ``r``.

    Args:
        x, weight, bias, stride, padding, dilation, groups: as in
            ``F.conv2d`` (``'same'`` / ``'valid'`` included); the bias
            gradient is exact.
        radius: patch size ``r >= 1`` of the output-gradient patches.

    Returns:
        Exactly ``F.conv2d(x, weight, bias, stride, padding, dilation, groups)``.
    """
    radius = check_radius(radius)
    dilation = as_pair(dilation)
    pad, extra = resolve_padding(padding, weight.shape[2:], dilation)
    if extra is not None:
        x = F.pad(x, extra)
    return filtered_conv(x, weight, bias, as_pair(stride), pad, dilation,
                         groups, radius)


def filtered_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                  stride: Tuple[int, int], padding: Tuple[int, int],
                  dilation: Tuple[int, int], groups: int,
                  radius: int) -> Tensor:
    """``F.conv2d`` with the gradient-filter backward (numeric padding): a
    fused node (Triton on CUDA, C++ on CPU) where both axes collapse, else
    :class:`GradientFilterConv2dFunction`
    (docs/benchmarks/design_measurements.md).
    """
    choice = dispatch.choose('conv', x, weight, bias, stride, padding,
                             dilation, groups, radius)
    return choice.implementation.run(x, weight, bias, stride, padding,
                                     dilation, groups, radius, *choice.launch)
