"""Triton kernel of a conv block's forward (:mod:`.triton_conv_block`):
everything after the conv in one launch.

After cuDNN's conv has written ``y``, a filtered conv block still has three
passes to make: the frozen norm's (``z``), the activation's with its mask
(the output and the bits), and the patch sums of the conv's input ``x``
that its backward keeps. ``_block_forward`` makes them in one launch: its
first programs normalize ``y`` as they load it and write the activation's
output and the packed bits (:func:`~.bit_mask.kernels.pack_block`
with ``NORM``: ``z`` never reaches memory), the programs after them sum
``x`` over its input patches
(:func:`~.conv.kernels.reduce_patch_row`), independent work that needs
no second launch.

Importing this module imports ``triton``: :mod:`.triton_conv_block`
imports it lazily.
"""
import triton
import triton.language as tl
from torch import Tensor

from ..bit_mask.kernels import PACK_BLOCK, pack_block, pack_programs_of
from ..backend.triton_launch import LAUNCH_OPTIONS, Patches
from ..backend.triton_launch import acc as tl_acc
from ..conv.kernels import reduce_meta, reduce_patch_row

#: The tensor arguments each kernel writes (the others it reads): the
#: bytes a launch moves, for :mod:`mmseg_gf.accounting.launches`.
KERNEL_OUTPUTS = {'_block_forward': ('out', 'bits', 'sums')}


@triton.jit
def _block_forward(y, out, bits, numel, lo, hi, off_scale, mean, var,
                   norm_w, norm_b, eps, channel_step, channels,
                   x, sums, in_channels, height, width, s_n, s_c, s_h, s_w,
                   d_n, d_c, d_h, d_w, row_start, row_size, row_count,
                   col_start, col_size, col_count, pack_programs,
                   BOUNDED: tl.constexpr, NAN_BIT: tl.constexpr,
                   ACT: tl.constexpr, BLOCK: tl.constexpr,
                   NORM_WEIGHT: tl.constexpr, NORM_BIAS: tl.constexpr,
                   SUMS: tl.constexpr, ACC: tl.constexpr,
                   ROW_SIZE: tl.constexpr, COL_SIZE: tl.constexpr,
                   BLOCK_P: tl.constexpr, CHANNELS_FAST: tl.constexpr):
    """Programs below ``pack_programs``: norm, activation and mask of
    ``y`` into ``out`` and ``bits``; with ``SUMS``, the others: the patch
    sums of ``x`` into ``sums`` (one program per image, channel and patch
    row)."""
    pid = tl.program_id(0)
    if pid < pack_programs:
        pack_block(pid, y, out, bits, numel, lo, hi, off_scale, mean, var,
                    norm_w, norm_b, eps, channel_step, channels, BOUNDED,
                    NAN_BIT, ACT, BLOCK, True, NORM_WEIGHT, NORM_BIAS)
    else:
        if SUMS:
            reduce_patch_row(
                (pid - pack_programs).to(tl.int64), x, sums, sums,
                in_channels, height, width, s_n, s_c, s_h, s_w, d_n, d_c,
                d_h, d_w, row_start, row_size, row_count, col_start,
                col_size, col_count, 1.0, sums, 0, 0, 0, 0, 0.0, sums, sums,
                0.0, False, False, ACC, ROW_SIZE, COL_SIZE, BLOCK_P,
                CHANNELS_FAST, False, False, False)


def block_forward(y: Tensor, out: Tensor, bits: Tensor, norm: tuple,
                  activation: tuple, channels_last: bool, x: Tensor,
                  sums, rows: Patches, cols: Patches) -> None:
    """One launch: ``out`` (``y``'s shape, contiguous in its layout) the
    activation of the frozen norm of ``y``, ``bits`` its mask (in memory
    order) and, unless ``sums`` is None, ``sums`` (``Ci x N x ph x pw``)
    the patch sums of ``x`` over ``rows`` x ``cols``.

    ``norm`` is ``(running_mean, running_var, weight, bias, eps)`` (weight
    and bias may be None), ``activation`` the kernel's
    ``(act, lo, hi, nan_bit, off_scale)`` (``hi`` infinite: unbounded).
    """
    mean, var, weight, bias, eps = norm
    act, lo, hi, nan_bit, off_scale = activation
    n, c, height, width = y.shape
    numel = y.numel()
    pack_programs = pack_programs_of(numel)[0]
    bounded = hi != float('inf')
    if sums is None:  # placeholders: tensors read and written anyway
        sum_args, sum_programs = (y, out, 0, 0, 0) + (0, ) * 14, 0
        meta = reduce_meta((0, 1, 1), (0, 1, 1))
    else:
        ci, xh, xw = x.shape[1:]
        dst = sums.permute(1, 0, 2, 3)
        sum_args = (x, dst, ci, xh, xw, *x.stride(), *dst.stride(), *rows,
                    *cols)
        sum_programs = x.shape[0] * ci * rows[2]
        meta = reduce_meta(rows, cols, ci > 1 and x.stride(1) == 1)
    _block_forward[(pack_programs + sum_programs, )](
        y, out, bits, numel, float(lo), float(hi) if bounded else 0.0,
        float(off_scale), mean, var, var if weight is None else weight,
        var if bias is None else bias, float(eps),
        1 if channels_last else height * width, c, *sum_args, pack_programs,
        BOUNDED=bounded, NAN_BIT=bool(nan_bit), ACT=int(act), BLOCK=PACK_BLOCK,
        NORM_WEIGHT=weight is not None, NORM_BIAS=bias is not None,
        SUMS=sums is not None, ACC=tl_acc(x.dtype), **meta, **LAUNCH_OPTIONS)
