"""A conv block on the GPU path: a filtered conv, the frozen batch norm and
the bit-masked activation after it as one autograd node.

Forward: cuDNN's conv, then one Triton launch that normalizes and
activates the conv's output, writes the mask and sums the conv input's
patches; backward: one pass applying the mask and the norm's factor as it
reads the gradient, then both products (2 launches each way where the
three nodes take 4). Exact to float32 rounding, keeping what the three
nodes keep; docs/lean_region.md, "Conv blocks on the GPU path". Eager mode
only; :mod:`mmseg_gf.models.conv_block` decides which calls take it.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from ..bit_mask import masks as bit_mask, gpu as triton_bit_mask
from ..frozen_norm import gpu as triton_norm
from ..backend.triton_runtime import lazy_module, on_device
from ..conv import gpu as conv_gpu
from ..conv.gpu import Patches

__all__ = ['refusal', 'usable', 'FilteredConvBlockFunction', 'block_calls']

_calls = 0


def block_calls() -> int:
    """Forward calls that took the fused block (a diagnostic)."""
    return _calls


def _import_kernels():
    from . import kernels as triton_conv_block_kernels  # imports triton: when used
    return triton_conv_block_kernels


_kernels = lazy_module(_import_kernels)


def refusal(x: Tensor, weight: Tensor,
            bias: Optional[Tensor]) -> Optional[str]:
    """Why a block with conv input ``x`` may not run fused, or None (the caller
    checks the conv's geometry and the modules).
    """
    reason = conv_gpu.refusal(x, weight, bias) or triton_norm.refusal(x)
    if reason is None and not triton_bit_mask.takes_dtype(x.dtype):
        reason = f'no bit-mask kernel for {x.dtype}'
    return reason


def usable(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether a block with conv input ``x`` may run fused."""
    return refusal(x, weight, bias) is None


def _bit_strides(out: Tensor) -> Tuple[int, int, int, int]:
    """Strides (N, C, H, W) of element indices in the mask."""
    n, c, h, w = out.shape
    if bit_mask.layout_of(out) is torch.channels_last:
        return h * w * c, 1, w * c, c
    return c * h * w, h * w, w, 1


class FilteredConvBlockFunction(Function):
    """``activation(normalize(conv2d(x, weight, bias)))`` with the three
    backwards in one pass.

    ``rows`` / ``cols``: the conv's input patches; ``norm``: ``(running_mean,
    running_var, weight, bias, eps)``; ``activation``: ``(formula, lo, hi,
    nan_bit, off_scale)`` (:func:`bit_mask.activate_and_pack`).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                stride: Tuple[int, int], padding: Tuple[int, int],
                dilation: Tuple[int, int], groups: int, radius: int,
                rows: Patches, cols: Patches, norm: Tuple,
                activation: Tuple) -> Tensor:
        global _calls
        _calls += 1
        y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        layout = bit_mask.layout_of(y)
        if not y.is_contiguous(memory_format=layout):
            y = y.contiguous(memory_format=layout)
        out = torch.empty_like(y, memory_format=layout)
        bits = triton_bit_mask.empty_bits(y)
        pooled = (x.new_empty((x.shape[1], x.shape[0], rows[2], cols[2]))
                  if ctx.needs_input_grad[1] else None)
        formula, lo, hi, nan_bit, off_scale = activation
        with on_device(x):
            _kernels().block_forward(
                y, out, bits, norm,
                (triton_bit_mask.activation_code(formula), lo,
                 math.inf if hi is None else hi, nan_bit, off_scale),
                layout is torch.channels_last, x, pooled, rows, cols)
        _, running_var, norm_weight, _, eps = norm
        ctx.save_for_backward(pooled, weight, bits)
        triton_norm.reference_norm(ctx, running_var, norm_weight)
        ctx.prologue = (_bit_strides(out), float(off_scale), float(eps))
        ctx.conv = conv_gpu.conv_context(x, stride, groups, radius, rows,
                                            cols)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        pooled, weight, bits = ctx.saved_tensors
        strides, off_scale, eps = ctx.prologue
        prologue = conv_gpu.GradPrologue(
            bits, strides, off_scale, *triton_norm.unchanged_norm(ctx), eps)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        groups, scale, height, width, rows, cols, radius, x_dtype = ctx.conv
        grad_x, grad_w, grad_b = conv_gpu.collapsed_backward_from(
            grad, prologue, pooled, weight, groups, scale, height, width,
            list(rows), list(cols), radius, x_dtype, need_x, need_w, need_b)
        return ((grad_x if need_x else None, grad_w if need_w else None,
                 grad_b.to(ctx.bias_dtype) if need_b else None)
                + (None, ) * 9)
