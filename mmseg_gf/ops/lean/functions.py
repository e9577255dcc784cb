"""Autograd functions that keep only what their backward needs.

In a finetuned segmentor most of what a training step keeps for backward is
not the convolutions' inputs (which gradient filtering shrinks) but what the
layers around them save by default:

* a frozen norm layer in eval mode is a per-channel affine map, whose
  backward is ``g * scale``; autograd's batch norm keeps its whole input;
* ReLU / ReLU6 / LeakyReLU need one bit per element (does the gradient pass),
  autograd keeps a float tensor;
* element-wise dropout needs its keep mask, autograd keeps a float noise
  tensor on CPU;
* adaptive average pooling (PSPNet's pyramid) needs only its input's shape,
  autograd keeps the input;
* a frozen conv whose input needs a gradient needs only its weight for
  ``g_x``, autograd keeps its input as well (a frozen linear layer: the
  weight only, which autograd already does in float32; under autocast it
  keeps a cast copy of the weight).

Each function here computes exactly what the plain operation computes in the
forward (the same call, bit for bit) and keeps the small thing instead.
Gradients equal the plain path's (bitwise for the activations and dropout;
to rounding for the norm, whose scale is one product instead of two). The
loss, which upsamples the logits to the label size, has its gradient taken
in the forward instead (:mod:`.loss_gradients`). No mmseg import: the mmseg
modules are wired in by :mod:`mmseg_gf.models.lean`.
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
    """A frozen norm's forward, with ``g_x = g * scale`` as backward.

    ``scale`` is the per-channel factor of the affine map the norm applies
    (``weight / sqrt(running_var + eps)`` for batch norm in eval mode); it is
    the only tensor kept (``C`` elements). With ``factor`` (a second
    per-channel tensor, referenced) the backward is ``g * scale * factor``,
    two products in that order: batch norm's own backward kernel in eval
    mode (``dy * invstd * w``), hence its gradient bit for bit where the
    dtypes match (float64 models, where exactness is checked).
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

    The gradient passes where ``lo < x < hi`` (``hi=None``: no bound; NaN
    gets ``nan_bit``) and is multiplied by ``off_scale`` elsewhere: ReLU is
    ``(0, None, True, 0)``, Hardtanh/ReLU6 ``(min, max, True, 0)``,
    LeakyReLU ``(0, None, False, slope)``, as their autograd formulas read.
    The mask is taken from the input before ``activate`` runs, so in-place
    activations (``inplace=True``, marked dirty) work too.

    ``formula`` (None, ``'clamp'`` or ``'scale'``: see
    :func:`bit_mask.activate_and_pack`) says that ``activate`` computes
    that formula of the mask's bounds; where the Triton path takes ``x``,
    the output and the mask are then written in one pass, without calling
    ``activate``.
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
    """Element-wise dropout keeping its keep mask as bits.

    The noise is drawn by ``torch.nn.functional.dropout`` of a tensor of
    ones (the same draws, on CPU, as dropout of ``x``: one Bernoulli sample
    per element, scaled by ``1/(1-p)``), the output is ``x * noise``, and the
    backward ``g * noise`` is rebuilt from the bits and the scale.
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
    """Adaptive average pooling keeping only its input's shape.

    Pooling is linear: its backward spreads each output gradient evenly over
    the input pixels of its bin, from sizes alone. The backward calls
    autograd's own kernel with an uninitialised tensor of the input's shape
    and strides (the kernel reads only its geometry), so the gradient is
    autograd's, bit for bit. Only for outputs larger than 1x1: a 1x1 output
    is a mean, which keeps nothing anyway.
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
    """Keep a reference to a frozen layer's weight (a live Parameter: no
    byte is kept) and its version, checked as autograd checks a saved
    tensor: an in-place change between forward and backward is an error,
    not a silently different gradient. Under ``torch.compile`` the version
    is not read (a data-dependent value to Dynamo): the compiled graph's
    own autograd node saves the weight its backward reads, and autograd
    checks that saved tensor's version."""
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
    """A 2-d convolution with frozen weight and bias, keeping no tensor.

    ``g_x = conv_transpose(g, W)`` needs the weight and the input's shape
    only; autograd's convolution keeps the input too. The forward is
    ``conv(x)`` itself (the module's own call, bit for bit); the backward
    is autograd's own kernel (``aten.convolution_backward`` with only the
    input gradient asked for), given the input's shape as a zero-stride
    tensor (read for its sizes only, as ``torch.nn.grad.conv2d_input``
    does), so strides, padding, dilation, groups and sizes the stride does
    not divide are handled as autograd handles them. It computes in the
    output's dtype (autocast's) and returns the gradient in ``x``'s.
    Zero padding with integer sizes only (``padding_mode='zeros'``).
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
    """A linear layer with frozen weight and bias, keeping no tensor:
    ``g_x = g W`` (in the output's dtype, returned in ``x``'s). Autograd
    keeps only the weight here too (its transposed view) in float32; under
    autocast it keeps the weight's cast copy, which this does not."""

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
