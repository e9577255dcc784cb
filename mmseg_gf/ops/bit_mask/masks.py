"""One bit per element: what an activation's backward needs of its input.

ReLU, ReLU6 and LeakyReLU pass the gradient where their input lies in an
interval and zero (or scale) it elsewhere, so :func:`pack` keeps one bit
(1/32 of a float32 map) and :func:`apply` applies it. Element ``i`` in
``layout``'s memory order (NCHW or, for channels-last tensors, NHWC, so
that nothing is copied) is bit ``i % 8`` of byte ``i // 8``. Compiled
kernels serve contiguous CPU tensors (also as ``mmseg_gf::`` operators
under ``torch.compile``), Triton kernels CUDA tensors in eager mode; the
PyTorch fallback writes the same bytes and gradients everywhere else.
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backend import availability, dispatch, extension
from ..backend.output_pool import empty_for_writing
from . import gpu as triton_bit_mask

_kernels = extension.module('bit_mask')  # None when not built

__all__ = ['pack', 'apply', 'unpack', 'packed_bytes', 'native_available',
           'kernel_refusal', 'layout_of', 'activate_and_pack']


def native_available() -> bool:
    return availability.native_available('bit_mask')


def kernel_refusal(t: Tensor) -> Optional[str]:
    """Why the compiled kernels may not take ``t``, or None."""
    reason = availability.native_refusal('bit_mask')
    if reason is not None:
        return reason
    if t.device.type != 'cpu':
        return f'{t.device.type} tensor'
    if not t.is_contiguous():
        return 'not contiguous in the mask\'s memory order'
    if not t.is_floating_point():
        return f'{t.dtype} tensor'
    return None


def _path(t: Tensor) -> str:
    return dispatch.choose('bit_mask', t).implementation.name


@torch.library.custom_op('mmseg_gf::pack_mask', mutates_args=())
def _pack_op(x: Tensor, lo: float, hi: float, nan_bit: bool) -> Tensor:
    # contiguous where traced; a real input may be stored otherwise (a CPU
    # convolution of one image returns NCHW where the trace said NHWC)
    return _kernels.pack_mask(x.contiguous(), lo, hi, nan_bit)


@_pack_op.register_fake
def _(x, lo, hi, nan_bit):
    return x.new_empty(((x.numel() + 7) // 8, ), dtype=torch.uint8)


def _apply_native(grad: Tensor, bits: Tensor, off_scale: float) -> Tensor:
    return _kernels.apply_mask(grad, bits, off_scale,
                               empty_for_writing(grad.shape, grad))


@torch.library.custom_op('mmseg_gf::apply_mask', mutates_args=())
def _apply_op(grad: Tensor, bits: Tensor, off_scale: float) -> Tensor:
    return _apply_native(grad.contiguous(), bits, off_scale)


@_apply_op.register_fake
def _(grad, bits, off_scale):
    return grad.new_empty(grad.shape)


def layout_of(x: Tensor) -> torch.memory_format:
    """The memory order :func:`pack` reads ``x`` in without a copy:
    channels-last for a channels-last (not contiguous) 4-d tensor.
    """
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _in_memory_order(t: Tensor, layout: torch.memory_format) -> Tensor:
    """``t`` contiguous in ``layout``'s memory order (a view when stored
    so).
    """
    if layout is torch.channels_last:
        return t.contiguous(memory_format=torch.channels_last).permute(
            0, 2, 3, 1)
    return t.contiguous()


def packed_bytes(numel: int) -> int:
    return (int(numel) + 7) // 8


def pack(x: Tensor, lo: float = 0.0, hi: Optional[float] = None,
         nan_bit: bool = True,
         layout: torch.memory_format = torch.contiguous_format) -> Tensor:
    """Bits of ``lo < x < hi`` (``hi=None``: unbounded; NaN gets
    ``nan_bit``) in ``layout``'s memory order, as a flat uint8 tensor.
    """
    upper = math.inf if hi is None else float(hi)
    x = _in_memory_order(x, layout)
    path = _path(x)
    if path == 'triton':
        return triton_bit_mask.pack(x, float(lo), upper, bool(nan_bit))
    if path == 'c++':
        if torch.compiler.is_compiling():  # the operator: no autograd
            return _pack_op(x.detach(), float(lo), upper, bool(nan_bit))
        return _kernels.pack_mask(x, float(lo), upper, bool(nan_bit))
    if torch.compiler.is_compiling():
        # a copy in the graph: a traced reshape would be a view wherever
        # the traced strides say contiguous, and an operator's real output
        # may be stored otherwise (a CPU convolution of one image)
        flat = x.detach().clone(memory_format=torch.contiguous_format)
        flat = flat.view(-1)
    else:
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
    # Bit j of a byte from element j, shifts made on the device: a weight
    # tensor copied from the host would wait for the device's queue on
    # every call (a CUDA copy from pageable memory synchronises).
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
    return (bits.view(-1, 8).to(torch.uint8) << shifts).sum(
        1, dtype=torch.uint8)


def apply(grad: Tensor, bits: Tensor, off_scale: float = 0.0,
          layout: torch.memory_format = torch.contiguous_format) -> Tensor:
    """``grad`` where the bit is set, ``grad * off_scale`` elsewhere (exactly 0
    for 0), stored in ``layout``; ``bits`` from :func:`pack` of ``grad``'s
    shape.
    """
    flat = _in_memory_order(grad, layout)
    path = _path(flat)
    if path == 'triton':
        out = triton_bit_mask.apply(flat, bits, float(off_scale))
    elif path == 'c++':
        apply_mask = _apply_op if torch.compiler.is_compiling() else \
            _apply_native
        out = apply_mask(flat, bits, float(off_scale))
    else:
        keep = _unpack_flat(bits, flat.shape)
        off = torch.zeros((), dtype=flat.dtype, device=flat.device) \
            if off_scale == 0 else flat * off_scale
        out = torch.where(keep, flat, off)
    return out.permute(0, 3, 1, 2) if layout is torch.channels_last else out


def activate_and_pack(x: Tensor, formula: str, lo: float,
                      hi: Optional[float], nan_bit: bool, off_scale: float,
                      inplace: bool,
                      layout: torch.memory_format = torch.contiguous_format
                      ) -> Optional[Tuple[Tensor, Tensor]]:
    """``(activation of x, pack(x, ...))`` in one Triton pass where it takes
    ``x``, else None (the caller does both).

    ``formula``: ``'clamp'`` (``clamp(x, lo, hi)``: ReLU, ReLU6) or
    ``'scale'`` (``x if x > lo else x * off_scale``: LeakyReLU); ``inplace``
    writes into ``x``.
    """
    if not x.is_contiguous(memory_format=layout):
        return None  # (the plain activation's output keeps x's strides)
    flat = _in_memory_order(x, layout)
    if _path(flat) != 'triton':
        return None
    y = x if inplace else torch.empty_like(x, memory_format=layout)
    upper = math.inf if hi is None else float(hi)
    bits = triton_bit_mask.activate_and_pack(
        flat, _in_memory_order(y, layout), formula, float(lo), upper,
        bool(nan_bit), float(off_scale))
    if inplace:  # written outside autograd's view: as an in-place op does
        torch.autograd.graph.increment_version(x)
    return y, bits


def _unpack_flat(bits: Tensor, shape) -> Tensor:
    numel = math.prod(shape)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    keep = ((bits.unsqueeze(1) >> shifts) & 1).view(-1).narrow(0, 0, numel)
    return keep.view(shape).bool()


def unpack(bits: Tensor, shape,
           layout: torch.memory_format = torch.contiguous_format) -> Tensor:
    """The bool tensor of ``shape`` from :func:`pack`'s bits, for backwards
    that need more than one off-scale (PReLU).
    """
    if layout is torch.channels_last:
        n, c, h, w = shape
        return _unpack_flat(bits, (n, h, w, c)).permute(0, 3, 1, 2)
    return _unpack_flat(bits, shape)
