"""Autograd functions that keep only what their backward needs.

Autograd's defaults keep a frozen norm's input (the backward needs
``scale``), a float tensor per ReLU-like activation or dropout (one bit
per element does), adaptive pooling's input (its shape does) and a frozen
conv's input (its weight does). Each function here runs the plain forward
bit for bit and keeps the small thing; gradients equal the plain path's
(bitwise, or to rounding for the norm). No mmseg import:
:mod:`mmseg_gf.models.lean` wires the modules in.
"""
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.autograd import Function

from ..bit_mask import masks as bit_mask
from ..backend.output_pool import empty_for_writing
from ..function_output import owned_output

__all__ = [
    'FrozenAffineNormFunction', 'MaskedActivationFunction',
    'MaskedDropoutFunction', 'ShapeOnlyAdaptiveAvgPoolFunction',
    'FrozenConvFunction',
    'FrozenLinearFunction'
]


class FrozenAffineNormFunction(Function):
    """A frozen norm's forward with ``g_x = g * scale`` as backward, keeping
    ``scale``; with ``factor``, ``g * scale * factor``, batch norm's own
    eval-mode order (bitwise equal where dtypes match).
    """

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor,
                normalize: Callable[[Tensor], Tensor],
                factor: Optional[Tensor] = None) -> Tensor:
        ctx.save_for_backward(scale, factor)
        return owned_output(normalize(x), x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        scale, factor = ctx.saved_tensors
        shape = [1, -1] + [1] * (grad.dim() - 2)
        scale = scale.view(shape)
        if factor is not None:
            g_x = grad.to(scale.dtype) * scale * factor.view(shape)
            return g_x.to(grad.dtype), None, None, None
        if grad.dtype != scale.dtype:
            return (grad.to(scale.dtype) * scale).to(grad.dtype), None, None, \
                None
        if grad.is_contiguous() and not torch.is_grad_enabled():
            # written into recycled memory (no page faults of a fresh map)
            out = empty_for_writing(grad.shape, grad)
            return torch.mul(grad, scale, out=out), None, None, None
        return grad * scale, None, None, None


class MaskedActivationFunction(Function):
    """A piecewise-linear activation keeping one bit per element.

    The gradient passes where ``lo < x < hi`` (``hi=None``: unbounded; NaN
    gets ``nan_bit``) and is scaled by ``off_scale`` elsewhere: ReLU is ``(0,
    None, True, 0)``, ReLU6 ``(0, 6, True, 0)``, LeakyReLU ``(0, None, False,
    slope)``. The mask is taken before ``activate`` runs (in-place safe);
    ``formula`` lets the Triton path write output and mask in one pass.
    """

    @staticmethod
    def forward(ctx, x: Tensor, activate: Callable[[Tensor], Tensor],
                lo: float, hi: Optional[float], nan_bit: bool,
                off_scale: float, inplace: bool,
                formula: Optional[str] = None) -> Tensor:
        # The mask in x's memory order: no copy of a channels-last x, and
        # the gradient comes back in x's layout.
        ctx.layout = bit_mask.layout_of(x)
        fused = None if formula is None else bit_mask.activate_and_pack(
            x, formula, lo, hi, nan_bit, off_scale, inplace, ctx.layout)
        if fused is None:
            bits = bit_mask.pack(x, lo, hi, nan_bit, ctx.layout)
            y = activate(x)
        else:
            y, bits = fused
        if inplace:
            # x itself is returned (activate returned it): Dynamo traces
            # mark_dirty only on an input the forward returns
            ctx.mark_dirty(x)
            y = x
        ctx.save_for_backward(bits)
        ctx.off_scale = off_scale
        return y if inplace else owned_output(y, x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        bits, = ctx.saved_tensors
        return (bit_mask.apply(grad, bits, ctx.off_scale, ctx.layout), None,
                None, None, None, None, None, None)


class MaskedDropoutFunction(Function):
    """Dropout keeping its keep mask as bits: the noise is ``F.dropout`` of
    ones (dropout's own draws), the backward rebuilt from bits and ``1/(1-p)``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        noise = torch.nn.functional.dropout(torch.ones_like(x), p, True)
        bits = bit_mask.pack(noise, 0.0)
        ctx.save_for_backward(bits)
        ctx.scale = 1.0 / (1.0 - p)
        return x * noise

    @staticmethod
    def backward(ctx, grad: Tensor):
        bits, = ctx.saved_tensors
        kept = bit_mask.apply(grad, bits, 0.0)
        return kept * ctx.scale, None


class ShapeOnlyAdaptiveAvgPoolFunction(Function):
    """Adaptive average pooling keeping only its input's geometry: the
    backward runs autograd's kernel on an uninitialised tensor of it (sizes
    only read), bit for bit autograd's gradient. Outputs larger than 1x1 only.
    """

    @staticmethod
    def forward(ctx, x: Tensor, pool: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.geometry = (tuple(x.shape), tuple(x.stride()), x.dtype,
                        x.device)
        return owned_output(pool(x), x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, stride, dtype, device = ctx.geometry
        like = torch.empty_strided(shape, stride, dtype=dtype,
                                   device=device)
        return torch.ops.aten._adaptive_avg_pool2d_backward(grad, like), None




def _frozen_weight(ctx, weight: Tensor) -> None:
    """Reference a frozen weight and its version, checked in the backward as a
    saved tensor's would be (not under ``torch.compile``, which checks it).
    """
    ctx.weight = weight
    ctx.weight_version = None if torch.compiler.is_compiling() else \
        weight._version


def _weight_for_backward(ctx, dtype: torch.dtype) -> Tensor:
    weight = ctx.weight
    if ctx.weight_version is not None and \
            weight._version != ctx.weight_version:
        raise RuntimeError(
            'the weight of a frozen layer was modified in place between its '
            'forward and backward (version '
            f'{ctx.weight_version} -> {weight._version}); its input '
            'gradient would not be the one of the forward that ran')
    return weight.to(dtype)


class FrozenConvFunction(Function):
    """A conv with frozen weight and bias keeping no tensor: the backward is
    ``aten.convolution_backward`` on a zero-stride stand-in for the input, so
    every conv setting is handled as autograd handles it. Zero padding, integer
    sizes only.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor,
                conv: Callable[[Tensor], Tensor], stride, padding, dilation,
                groups: int) -> Tensor:
        _frozen_weight(ctx, weight)
        out = conv(x)
        ctx.geometry = (tuple(x.shape), x.dtype, out.dtype, tuple(stride),
                        tuple(padding), tuple(dilation), int(groups))
        return owned_output(out, x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, in_dtype, dtype, stride, padding, dilation, groups = \
            ctx.geometry
        weight = _weight_for_backward(ctx, dtype)
        grad = grad.to(dtype)
        shape_only = grad.new_empty(1).expand(shape)
        g_x = torch.ops.aten.convolution_backward(
            grad, shape_only, weight, None, stride, padding, dilation, False,
            [0], groups, (True, False, False))[0]
        return g_x.to(in_dtype), None, None, None, None, None, None


class FrozenLinearFunction(Function):
    """A linear layer with frozen weight and bias keeping no tensor: ``g_x = g
    W`` (under autocast autograd keeps a cast weight copy; this does not).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor,
                linear: Callable[[Tensor], Tensor]) -> Tensor:
        _frozen_weight(ctx, weight)
        out = linear(x)
        ctx.dtypes = (x.dtype, out.dtype)
        return owned_output(out, x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        in_dtype, dtype = ctx.dtypes
        weight = _weight_for_backward(ctx, dtype)
        return grad.to(dtype).matmul(weight).to(in_dtype), None, None
