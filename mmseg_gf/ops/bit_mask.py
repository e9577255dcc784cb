"""One bit per element: what an activation's backward needs of its input.

ReLU, ReLU6 and LeakyReLU pass the output gradient where their input lies in
an interval and zero (or scale) it elsewhere, so their backward needs one bit
per element, not the float tensor autograd keeps by default. :func:`pack`
stores that bit (1/32 of a float32 map) and :func:`apply` applies it.

Layout: element ``i`` of the tensor in memory order is bit ``i % 8`` of byte
``i // 8``; unused bits of the last byte are 0. The compiled kernels
(``mmseg_gf._bit_mask``, built with the package) serve contiguous CPU
tensors; everything else (other devices, strided tensors, ``MMSEG_GF_NATIVE
=0``, ``torch.compile``) runs the PyTorch fallback, which writes the same
bytes and the same gradients.
"""
import math
import os
from typing import Optional

import torch
from torch import Tensor

try:
    from .. import _bit_mask as _kernels
except ImportError:  # not built: PyTorch fallback
    _kernels = None

__all__ = ['pack', 'apply', 'unpack', 'packed_bytes', 'native_available']

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def native_available() -> bool:
    """True if the compiled kernels are built and not switched off."""
    return _kernels is not None and os.environ.get('MMSEG_GF_NATIVE',
                                                   '1') != '0'


def _native(t: Tensor) -> bool:
    return (native_available() and t.device.type == 'cpu'
            and t.is_contiguous() and t.is_floating_point()
            and not torch.compiler.is_compiling())


def packed_bytes(numel: int) -> int:
    """Bytes of the mask of a tensor with ``numel`` elements."""
    return (int(numel) + 7) // 8


def pack(x: Tensor, lo: float = 0.0, hi: Optional[float] = None,
         nan_bit: bool = True) -> Tensor:
    """Bits of ``lo < x < hi`` (``hi=None``: no upper bound) in memory
    order; a NaN gets ``nan_bit``. Returns a flat uint8 tensor of
    :func:`packed_bytes` bytes.
    """
    upper = math.inf if hi is None else float(hi)
    if _native(x):
        return _kernels.pack_mask(x, float(lo), upper, bool(nan_bit))
    flat = x.detach().reshape(-1) if x.is_contiguous() else \
        x.detach().contiguous().reshape(-1)
    if flat.element_size() < 4:  # compare as the kernels do, in float32
        flat = flat.float()
    bits = flat > lo
    if hi is not None:
        bits &= flat < upper
    if nan_bit:
        bits |= flat.isnan()
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=x.device)
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(
        1, dtype=torch.uint8)


def apply(grad: Tensor, bits: Tensor, off_scale: float = 0.0) -> Tensor:
    """``grad`` where the bit is set, ``grad * off_scale`` elsewhere (an
    exact 0 when ``off_scale`` is 0). ``bits`` come from :func:`pack` of a
    tensor of ``grad``'s shape; the result is contiguous.
    """
    grad = grad.contiguous()
    if _native(grad):
        return _kernels.apply_mask(grad, bits, float(off_scale))
    keep = unpack(bits, grad.shape)
    off = torch.zeros((), dtype=grad.dtype, device=grad.device) \
        if off_scale == 0 else grad * off_scale
    return torch.where(keep, grad, off)


def unpack(bits: Tensor, shape) -> Tensor:
    """The bool tensor of ``shape`` (contiguous) whose bits :func:`pack`
    wrote: for backward formulas that need more than :func:`apply`'s one
    off-scale (PReLU's per-channel slopes)."""
    numel = math.prod(shape)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    keep = ((bits.unsqueeze(1) >> shifts) & 1).view(-1)[:numel]
    return keep.view(shape).bool()
