"""The bit masks' GPU path: one Triton pass per pack, apply or masked
activation (:mod:`.triton_bit_mask_kernels`).

On the PyTorch path a pack is about 14 ATen operators (compare, bound,
NaN test, pad, cast, shift, sum), an apply about 8 (unpack, where), each a
kernel launch and a full pass over memory on a GPU. Here each is one launch
that reads the tensor once; a ReLU, Hardtanh / ReLU6 or LeakyReLU writes its
output in the same pass as its mask (:func:`activate_and_pack`), so the
lean activation's forward and backward are one launch each, as the plain
activation's. The bytes written and the gradients are the PyTorch path's,
bit for bit.

Taken by contiguous float32 / float16 / bfloat16 tensors (in the mask's
memory order) on CUDA, in eager mode, where the Triton path is switched on
(:func:`triton_runtime.takes_device`: ``MMSEG_GF_TRITON``,
:func:`triton_runtime.set_enabled`); on CPU only under triton's interpreter,
for the tests. Anything else takes the PyTorch path (float64: a float
scalar reaches a kernel as float32, so its bounds would be rounded).
"""
from typing import Optional

import torch
from torch import Tensor

from ..backend import dispatch, triton_runtime
from ..backend.triton_runtime import is_fake, on_device

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
    """Why ``t`` (the mask's tensor in its memory order) may not take the
    Triton path, or None."""
    reason = triton_runtime.device_refusal(t)
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
    path."""
    return dispatch.refusal('bit_mask', 'triton', t) is None


def _kernels():
    from . import kernels as triton_bit_mask_kernels  # imports triton: when first used
    return triton_bit_mask_kernels


def empty_bits(t: Tensor) -> Tensor:
    """The uninitialised packed mask of ``t`` (a byte per 8 elements), for
    a kernel that writes it in full."""
    return torch.empty(((t.numel() + 7) // 8, ), dtype=torch.uint8,
                       device=t.device)


def pack(x: Tensor, lo: float, hi: float, nan_bit: bool) -> Tensor:
    """The packed bits of ``lo < x < hi`` (``hi = inf``: no upper bound;
    NaN: ``nan_bit``) of a :func:`usable` ``x``, in one launch."""
    bits = empty_bits(x)
    with on_device(x):
        _kernels().pack(x, bits, lo, hi, nan_bit)
    return bits


def apply(grad: Tensor, bits: Tensor, off_scale: float) -> Tensor:
    """``grad`` where the bit is set, ``grad * off_scale`` elsewhere (0 when
    ``off_scale`` is 0) of a :func:`usable` ``grad``, in one launch."""
    if bits.device != grad.device or not bits.is_contiguous():
        bits = bits.to(grad.device).contiguous()
    out = torch.empty_like(grad)
    with on_device(grad):
        _kernels().apply(grad, bits, off_scale, out)
    return out


def activation_code(formula: str) -> int:
    """The kernels' ``act`` for an activation ``formula``
    (:data:`FORMULAS`)."""
    kernels = _kernels()
    act = {'clamp': kernels.CLAMP, 'scale': kernels.SCALE}.get(formula)
    if act is None:
        raise ValueError(f'formula={formula!r}: expected one of {FORMULAS}')
    return act


def activate_and_pack(x: Tensor, y: Tensor, formula: str, lo: float,
                      hi: float, nan_bit: bool, off_scale: float) -> Tensor:
    """Write the activation ``formula`` (:data:`FORMULAS`) of the
    :func:`usable` ``x`` into ``y`` (contiguous, ``x``'s shape and dtype,
    or ``x`` itself: in place) and return the bits of ``lo < x < hi`` (NaN:
    ``nan_bit``), both in one pass over ``x``."""
    kernels = _kernels()
    act = activation_code(formula)
    bits = empty_bits(x)
    with on_device(x):
        kernels.pack(x, bits, lo, hi, nan_bit, act, y, off_scale)
    return bits


def apply_per_sample(grad: Tensor, bits: Tensor, keep_prob: float) -> Tensor:
    """``grad.div(keep_prob) * keep`` of a :func:`usable` ``grad``, ``keep``
    each sample's bit (dim 0) of ``bits``: DropPath's backward, the same
    numbers as those torch ops on ``grad``'s device, in one launch."""
    if bits.device != grad.device or not bits.is_contiguous():
        bits = bits.to(grad.device).contiguous()
    out = torch.empty_like(grad)
    with on_device(grad):
        _kernels().apply_per_sample(grad, bits, keep_prob, out)
    return out
