"""Triton kernels of the bit masks (:mod:`.bit_mask`): one pass each.

* ``_pack`` reads a tensor once and writes its packed bits (element ``i``
  is bit ``i % 8`` of byte ``i // 8``, unused bits of the last byte 0: the
  PyTorch path's layout) and, for the activations whose output the mask's
  bounds describe (:data:`CLAMP`: ReLU, Hardtanh / ReLU6; :data:`SCALE`:
  LeakyReLU), the activation's output too, in the same pass (in place when
  the output is the input);
* ``_apply`` reads the gradient and the bits once and writes
  ``bit ? g : g * off_scale`` (an exact 0 where ``off_scale`` is 0);
* ``_apply_per_sample`` writes DropPath's backward ``g.div(p) * keep``
  with one bit per sample.

Each program handles ``BLOCK`` bytes of the mask, i.e. ``8 * BLOCK``
consecutive elements in memory order, as a ``BLOCK x 8`` tile. Comparisons
and products are made in float32, as the compiled CPU kernels and the
PyTorch path make them for float32 / float16 / bfloat16 (the only dtypes
sent here: a float scalar reaches a kernel as float32).

Importing this module imports ``triton``: :mod:`.triton_bit_mask` imports
it lazily, where triton is installed.
"""
import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend.launch_geometry import cdiv
from ..backend.triton_launch import LAUNCH_OPTIONS

#: ``act`` of :func:`pack`: no output (the bits only).
NONE = 0
#: ``y = clamp(x, lo, hi)`` (ReLU: ``lo = 0``, no ``hi``), NaN kept, ``x``
#: itself on a bound (``relu(-0.0)`` is ``-0.0``, as torch's).
CLAMP = 1
#: ``y = x`` where ``x > lo``, else ``x * off_scale`` (LeakyReLU).
SCALE = 2

# Mask bytes per program (8x as many elements). A heuristic, not tuned on
# a GPU: 1024 elements, as the conv path's tiles.
PACK_BLOCK = 128


#: The tensor arguments each kernel writes (the others it reads): the
#: bytes a launch moves, for :mod:`mmseg_gf.accounting.launches`.
KERNEL_OUTPUTS = {'_pack': ('y', 'bits'), '_apply': ('out', ),
                  '_apply_per_sample': ('out', )}


@triton.jit
def _pack(x, y, bits, numel, lo, hi, off_scale, BOUNDED: tl.constexpr,
          NAN_BIT: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
    pack_block(tl.program_id(0), x, y, bits, numel, lo, hi, off_scale,
                x, x, x, x, 0.0, 1, 1, BOUNDED, NAN_BIT, ACT, BLOCK, False,
                False, False)


@triton.jit
def pack_block(pid, x, y, bits, numel, lo, hi, off_scale, mean, var,
                norm_w, norm_b, eps, channel_step, channels,
                BOUNDED: tl.constexpr, NAN_BIT: tl.constexpr,
                ACT: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                NORM_WEIGHT: tl.constexpr, NORM_BIAS: tl.constexpr):
    """Block ``pid`` of :func:`_pack`. ``NORM``: ``x`` is first normalized
    as a frozen batch norm does it, ``(x - mean_c) * rsqrt(var_c + eps) *
    w_c + b_c`` in float32 rounded to ``x``'s dtype (the norm's output),
    the channel of element ``i`` being ``(i // channel_step) % channels``
    (``H * W`` for an NCHW map, 1 for a channels-last one)."""
    byte = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, 8)
    idx = byte[:, None] * 8 + k[None, :]
    inside = idx < numel
    v = tl.load(x + idx, mask=inside, other=0.)
    f = v.to(tl.float32)
    if NORM:
        c = (idx // channel_step) % channels
        factor = tl.math.rsqrt(
            tl.load(var + c, mask=inside, other=1.).to(tl.float32) + eps)
        if NORM_WEIGHT:
            factor = factor * tl.load(norm_w + c, mask=inside,
                                      other=0.).to(tl.float32)
        f = (f - tl.load(mean + c, mask=inside, other=0.).to(tl.float32)) \
            * factor
        if NORM_BIAS:
            f = f + tl.load(norm_b + c, mask=inside, other=0.).to(tl.float32)
        v = f.to(v.dtype)
        f = v.to(tl.float32)
    bit = f > lo
    if BOUNDED:
        bit = bit & (f < hi)
    if NAN_BIT:
        bit = bit | (f != f)
    bit = bit & inside
    packed = tl.sum(bit.to(tl.int32) << k[None, :], axis=1)
    tl.store(bits + byte, packed.to(tl.uint8), mask=byte * 8 < numel)
    if ACT == 1:  # CLAMP: NaN and the bounds themselves (-0.0) pass as is
        out = tl.where(f < lo, (tl.zeros_like(f) + lo).to(v.dtype), v)
        if BOUNDED:
            out = tl.where(f > hi, (tl.zeros_like(f) + hi).to(v.dtype), out)
        tl.store(y + idx, out, mask=inside)
    if ACT == 2:  # SCALE: NaN has no bit and stays NaN through the product
        out = tl.where(bit, v, (f * off_scale).to(v.dtype))
        tl.store(y + idx, out, mask=inside)


@triton.jit
def _apply(g, bits, out, numel, off_scale, ZERO_OFF: tl.constexpr,
           BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, 8)
    idx = byte[:, None] * 8 + k[None, :]
    inside = idx < numel
    packed = tl.load(bits + byte, mask=byte * 8 < numel, other=0)
    keep = ((packed.to(tl.int32)[:, None] >> k[None, :]) & 1) != 0
    v = tl.load(g + idx, mask=inside, other=0.)
    if ZERO_OFF:
        off = tl.zeros_like(v)
    else:
        off = (v.to(tl.float32) * off_scale).to(v.dtype)
    tl.store(out + idx, tl.where(keep, v, off), mask=inside)


def pack_programs_of(numel: int) -> tuple:
    """The launch grid of the packing kernels over ``numel`` elements."""
    return (cdiv(cdiv(numel, 8), PACK_BLOCK), )


def pack(x: Tensor, bits: Tensor, lo: float, hi: float, nan_bit: bool,
         act: int = NONE, y: Tensor = None, off_scale: float = 0.0) -> None:
    """Write the bits of ``lo < x < hi`` (``hi`` infinite: unbounded; NaN:
    ``nan_bit``) of the contiguous ``x`` into ``bits``; with ``act``, the
    activation's output into the contiguous ``y`` too (may be ``x``)."""
    numel = x.numel()
    bounded = hi != float('inf')
    _pack[pack_programs_of(numel)](
        x, x if y is None else y, bits, numel, float(lo),
        float(hi) if bounded else 0.0, float(off_scale), BOUNDED=bounded,
        NAN_BIT=bool(nan_bit), ACT=int(act), BLOCK=PACK_BLOCK, **LAUNCH_OPTIONS)


def apply(grad: Tensor, bits: Tensor, off_scale: float, out: Tensor) -> None:
    """Write ``bit ? grad : grad * off_scale`` of the contiguous ``grad``
    into the contiguous ``out``."""
    numel = grad.numel()
    _apply[pack_programs_of(numel)](grad, bits, out, numel, float(off_scale),
                             ZERO_OFF=off_scale == 0, BLOCK=PACK_BLOCK,
                             **LAUNCH_OPTIONS)


@triton.jit
def _apply_per_sample(g, bits, out, numel, per_sample, keep_prob,
                      RECIPROCAL: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < numel
    n = i // per_sample
    packed = tl.load(bits + n // 8, mask=inside, other=0).to(tl.int32)
    keep = ((packed >> (n % 8).to(tl.int32)) & 1).to(tl.float32)
    v = tl.load(g + i, mask=inside, other=0.)
    if RECIPROCAL:  # keep_prob holds 1 / keep_prob, rounded on the host
        scaled = v.to(tl.float32) * keep_prob
    else:
        scaled = v.to(tl.float32) / keep_prob
    scaled = scaled.to(v.dtype).to(tl.float32)  # g.div(p), in g's dtype
    tl.store(out + i, (scaled * keep).to(v.dtype), mask=inside)


def apply_per_sample(grad: Tensor, bits: Tensor, keep_prob: float,
                     out: Tensor) -> None:
    """Write ``grad.div(keep_prob) * keep`` of the contiguous ``grad`` into
    ``out``, ``keep`` sample ``n``'s bit (``grad.shape[0]`` samples). On
    CUDA the division is a product with the float32 reciprocal, as torch's
    CUDA kernel divides by a scalar; on CPU (the interpreter) a division,
    as torch's CPU kernel does."""
    numel = grad.numel()
    reciprocal = grad.is_cuda
    # float32's reciprocal computed on the host without a torch op (which
    # a launch count would see)
    scalar = float(np.float32(1.0) / np.float32(keep_prob)) \
        if reciprocal else float(keep_prob)
    _apply_per_sample[(cdiv(numel, PACK_BLOCK * 8), )](
        grad, bits, out, numel, numel // grad.shape[0], scalar,
        RECIPROCAL=reciprocal, BLOCK=PACK_BLOCK * 8, **LAUNCH_OPTIONS)
