"""Activations with a piecewise-constant derivative, keeping one bit each.

Hardsigmoid, mmcv's ``HSigmoid`` and PReLU with a frozen slope need one
bit per element in their backward, not the float input autograd keeps.
:class:`PiecewiseLinearActivationFunction` keeps the bit and rebuilds the
gradient with autograd's floating-point operations: equal bit for bit
(``tests/test_ops/lean/test_lean_kinds.py``).
"""
import math
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.autograd import Function

from ..bit_mask import masks as bit_mask
from ..function_output import owned_output

__all__ = ['PiecewiseLinearActivationFunction', 'hardsigmoid_bits',
           'clamp_bits', 'HARDSIGMOID_SLOPE']

#: torch's Hardsigmoid backward multiplies the passing gradient by this
#: float (``1.0f / 6.0f`` in its kernel, a float32 constant in every
#: dtype: in float64 the gradient is ``g * 0.1666666716337204``).
HARDSIGMOID_SLOPE = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()


def hardsigmoid_bits(x: Tensor) -> Tensor:
    """Bits of ``-3 < x < 3`` (NaN: 0), where ``hardsigmoid_backward``
    passes.
    """
    return bit_mask.pack(x, -3.0, 3.0, False)


def _adjacent(value: float, toward: float, dtype: torch.dtype) -> float:
    """The float of ``dtype`` (float32 for reduced types) next to ``value``."""
    if dtype not in (torch.float64, ):
        dtype = torch.float32
    v = torch.tensor(value, dtype=dtype)
    return float(torch.nextafter(v, torch.tensor(toward, dtype=dtype)))


def clamp_bits(t: Tensor, lo: float, hi: float) -> Tensor:
    """Bits of ``lo <= t <= hi`` (NaN: 0), ``clamp``'s inclusive bounds
    moved by one float for :func:`bit_mask.pack`'s strict ones.
    """
    return bit_mask.pack(t, _adjacent(lo, -math.inf, t.dtype),
                         _adjacent(hi, math.inf, t.dtype), False)


class PiecewiseLinearActivationFunction(Function):
    """``activate(x)`` keeping ``bits_of(x)``.

    Backward: the gradient where the bit is set, else 0 or ``grad * slope``
    (a float or per-channel), then ``finish``, in the plain formula's order.
    The bits are taken before ``activate`` runs (in-place safe).
    """

    @staticmethod
    def forward(ctx, x: Tensor, activate: Callable[[Tensor], Tensor],
                bits_of: Callable[[Tensor], Tensor], slope: Optional[Tensor],
                finish: Optional[Callable[[Tensor], Tensor]],
                inplace: bool) -> Tensor:
        bits = bits_of(x)
        y = activate(x)
        if inplace:
            # x itself is returned (activate returned it): Dynamo traces
            # mark_dirty only on an input the forward returns
            ctx.mark_dirty(x)
            y = x
        if slope is None:
            ctx.save_for_backward(bits)
        else:
            ctx.save_for_backward(bits, slope)
        ctx.finish = finish
        return y if inplace else owned_output(y, x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        bits, *slope = ctx.saved_tensors
        if not slope:
            g = bit_mask.apply(grad, bits, 0.0)
        elif slope[0].numel() == 1:
            g = bit_mask.apply(grad, bits, float(slope[0]))
        else:
            shape = [1, -1] + [1] * (grad.dim() - 2)
            keep = bit_mask.unpack(bits, grad.shape)
            grad = grad.contiguous()
            g = torch.where(keep, grad, slope[0].view(shape) * grad)
        if ctx.finish is not None:
            g = ctx.finish(g)
        return g, None, None, None, None, None
