"""The bit masks' GPU path: one Triton pass per pack, apply or masked
activation.

The PyTorch path's pack is about 14 launches, its apply 8; here each is
one, and :func:`activate_and_pack` writes a ReLU / ReLU6 / LeakyReLU's
output in its mask's pass, bit for bit the PyTorch path's bytes and
gradients. Contiguous float32 / float16 / bfloat16 CUDA tensors in eager
mode (float64 would round its bounds to float32); on CPU only under the
interpreter.
"""
from typing import Optional

import torch
from torch import Tensor

from ..backend import availability, dispatch
from ..backend.triton_runtime import is_fake, lazy_module, on_device

__all__ = ['refusal', 'usable', 'takes_dtype', 'empty_bits', 'pack', 'apply',
           'activate_and_pack', 'activation_code', 'FORMULAS',
           'apply_per_sample']

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: What :func:`activate_and_pack` can compute: ``'clamp'`` is
#: ``clamp(x, lo, hi)`` (ReLU: ``lo = 0``, ``hi = None``; Hardtanh, ReLU6),
#: ``'scale'`` is ``x if x > lo else x * off_scale`` (LeakyReLU, ``lo = 0``).
FORMULAS = ('clamp', 'scale')


def takes_dtype(dtype: torch.dtype) -> bool:
    """Whether the kernels take tensors of ``dtype``."""
    return dtype in _DTYPES


def refusal(t: Tensor) -> Optional[str]:
    """Why ``t`` may not take the Triton path, or None."""
    reason = availability.triton_refusal(t)
    if reason is not None:
        return reason
    if not takes_dtype(t.dtype):
        return f'{t.dtype} tensor'
    if t.numel() == 0:
        return 'empty tensor'
    if not t.is_contiguous():
        return 'not contiguous in the mask\'s memory order'
    if torch.compiler.is_compiling():
        return 'compiling'
    if is_fake(t):
        return 'fake tensor'
    return None


def usable(t: Tensor) -> bool:
    """Whether the dispatcher's ``bit_mask`` lets ``t`` take the Triton
    path.
    """
    return dispatch.refusal('bit_mask', 'triton', t) is None


def _import_kernels():
    from . import kernels as triton_bit_mask_kernels  # imports triton: when first used
    return triton_bit_mask_kernels


_kernels = lazy_module(_import_kernels)


def empty_bits(t: Tensor) -> Tensor:
    """The uninitialised packed mask of ``t``, for a kernel that writes it
    all.
    """
    return torch.empty(((t.numel() + 7) // 8, ), dtype=torch.uint8,
                       device=t.device)


def pack(x: Tensor, lo: float, hi: float, nan_bit: bool) -> Tensor:
    """The packed bits of ``lo < x < hi`` (NaN: ``nan_bit``), one launch."""
    bits = empty_bits(x)
    with on_device(x):
        _kernels().pack(x, bits, lo, hi, nan_bit)
    return bits


def apply(grad: Tensor, bits: Tensor, off_scale: float) -> Tensor:
    """``grad`` where the bit is set, ``grad * off_scale`` elsewhere, one
    launch.
    """
    if bits.device != grad.device or not bits.is_contiguous():
        bits = bits.to(grad.device).contiguous()
    out = torch.empty_like(grad)
    with on_device(grad):
        _kernels().apply(grad, bits, off_scale, out)
    return out


def activation_code(formula: str) -> int:
    kernels = _kernels()
    act = {'clamp': kernels.CLAMP, 'scale': kernels.SCALE}.get(formula)
    if act is None:
        raise ValueError(f'formula={formula!r}: expected one of {FORMULAS}')
    return act


def activate_and_pack(x: Tensor, y: Tensor, formula: str, lo: float,
                      hi: float, nan_bit: bool, off_scale: float) -> Tensor:
    """Write ``formula``'s activation of ``x`` into ``y`` (or ``x`` in place)
    and return the bits of ``lo < x < hi``, in one pass.
    """
    kernels = _kernels()
    act = activation_code(formula)
    bits = empty_bits(x)
    with on_device(x):
        kernels.pack(x, bits, lo, hi, nan_bit, act, y, off_scale)
    return bits


def apply_per_sample(grad: Tensor, bits: Tensor, keep_prob: float) -> Tensor:
    """DropPath's backward ``grad.div(keep_prob) * keep``, ``keep`` each
    sample's bit, in one launch.
    """
    if bits.device != grad.device or not bits.is_contiguous():
        bits = bits.to(grad.device).contiguous()
    out = torch.empty_like(grad)
    with on_device(grad):
        _kernels().apply_per_sample(grad, bits, keep_prob, out)
    return out
