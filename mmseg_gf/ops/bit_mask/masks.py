"""One bit per element: what an activation's backward needs of its input.

ReLU, ReLU6 and LeakyReLU pass the output gradient where their input lies in
an interval and zero (or scale) it elsewhere, so their backward needs one bit
per element, not the float tensor autograd keeps by default. :func:`pack`
stores that bit (1/32 of a float32 map) and :func:`apply` applies it.

Layout: element ``i`` of the tensor in memory order is bit ``i % 8`` of byte
``i // 8``; unused bits of the last byte are 0. The memory order is the
``layout`` argument's: ``torch.contiguous_format`` (NCHW, the default) or,
for a channels-last 4-d tensor (:func:`layout_of`), ``torch.channels_last``
(NHWC), so that packing and applying the mask of such a tensor copies
nothing. The compiled kernels
(``mmseg_gf._bit_mask``, built with the package) serve contiguous CPU
tensors (under ``torch.compile`` as registered operators,
``mmseg_gf::pack_mask`` / ``apply_mask``, with fake implementations), the
Triton kernels (:mod:`.triton_bit_mask`: one launch each, and
:func:`activate_and_pack`'s activation in the same pass) float32 / float16
/ bfloat16 CUDA tensors in eager mode; everything else (float64 CUDA
tensors, strided tensors, ``MMSEG_GF_NATIVE=0`` on CPU,
``MMSEG_GF_TRITON=0`` on CUDA, CUDA under ``torch.compile``) runs the
PyTorch fallback, which writes the same bytes and the same gradients.
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backend import dispatch, extension
from ..backend.output_pool import empty_for_writing
from . import gpu as triton_bit_mask

_kernels = extension.module('bit_mask')  # None when not built

__all__ = ['pack', 'apply', 'unpack', 'packed_bytes', 'native_available',
           'kernel_refusal', 'layout_of', 'activate_and_pack']


def native_available() -> bool:
    """True if the compiled kernels are built and not switched off."""
    return extension.available('bit_mask')


def kernel_refusal(t: Tensor) -> Optional[str]:
    """Why the compiled kernels may not take ``t`` (the mask's tensor in
    its memory order), or None: contiguous floating CPU tensors."""
    reason = extension.refusal('bit_mask')
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
    """``torch.channels_last`` for a 4-d tensor stored channels-last (and
    not also contiguous), else ``torch.contiguous_format``: the memory
    order in which :func:`pack` reads ``x`` without a copy."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _in_memory_order(t: Tensor, layout: torch.memory_format) -> Tensor:
    """``t`` as a contiguous tensor in ``layout``'s memory order (NHWC
    for channels-last): a view when ``t`` is stored that way."""
    if layout is torch.channels_last:
        return t.contiguous(memory_format=torch.channels_last).permute(
            0, 2, 3, 1)
    return t.contiguous()


def packed_bytes(numel: int) -> int:
    """Bytes of the mask of a tensor with ``numel`` elements."""
    return (int(numel) + 7) // 8


def pack(x: Tensor, lo: float = 0.0, hi: Optional[float] = None,
         nan_bit: bool = True,
         layout: torch.memory_format = torch.contiguous_format) -> Tensor:
    """Bits of ``lo < x < hi`` (``hi=None``: no upper bound) in
    ``layout``'s memory order; a NaN gets ``nan_bit``. Returns a flat uint8
    tensor of :func:`packed_bytes` bytes.
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
    """``grad`` where the bit is set, ``grad * off_scale`` elsewhere (an
    exact 0 when ``off_scale`` is 0). ``bits`` come from :func:`pack` of a
    tensor of ``grad``'s shape, in ``layout``; the result is stored in
    ``layout`` too.
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
    """``(activation of x, pack(x, lo, hi, nan_bit, layout))`` in one pass
    over ``x`` where the Triton path takes ``x`` (stored contiguous in
    ``layout``), else None (the caller packs and activates itself).

    ``formula`` names the activation (``triton_bit_mask.FORMULAS``:
    ``'clamp'``, ``clamp(x, lo, hi)``, for ReLU and Hardtanh / ReLU6;
    ``'scale'``, ``x if x > lo else x * off_scale``, for LeakyReLU); with
    ``inplace`` the output is written into ``x``, which is returned.
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
    """The bool tensor of ``shape`` whose bits :func:`pack` wrote in
    ``layout`` (stored in it): for backward formulas that need more than
    :func:`apply`'s one off-scale (PReLU's per-channel slopes)."""
    if layout is torch.channels_last:
        n, c, h, w = shape
        return _unpack_flat(bits, (n, h, w, c)).permute(0, 3, 1, 2)
    return _unpack_flat(bits, shape)
