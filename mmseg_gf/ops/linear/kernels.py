"""Triton kernel of the GPU path: the filtered Linear's pass over ``g_y``
on its grid tokens.

A Linear on a token grid sees ``g_y`` as ``(L, H, W, Co)`` rows, the
channels contiguous (``TokenLayout.grid_rows``: a Swin window's tokens,
a Segformer stage's map). The conv's pass (:func:`~.conv.kernels.
output_grad_means`) reads that as a channels-last map, one program per
(image, channel, patch row): each program's loads are strided by the
channel count, and coalescing rests on neighbouring programs running
side by side. Here a program owns a (grid, patch row, block of channels)
tile and walks the patches of its row: each load is ``r x r`` tokens x
``BLOCK_CH`` contiguous channels, one stretch of memory per token; the
programs are ``1/BLOCK_CH`` as many.

It writes what the conv's pass writes, for :mod:`.triton_products`:
``g~``, the patch means (``Co x L x ph x pw``, contiguous, the
accumulation dtype; a border patch averages the tokens it has), and the
bias's partial sums (``L x Co x ph``, in a fixed order: deterministic).

Importing this module imports ``triton`` (:mod:`.triton_linear` does so
lazily).
"""
from typing import Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend.launch_geometry import cdiv, next_power_of_2
from ..backend.triton_launch import LAUNCH_OPTIONS, radius_patches
from ..backend.triton_launch import acc as tl_acc

#: The tensor arguments each kernel writes (the others it reads): the
#: bytes a launch moves, for :mod:`mmseg_gf.accounting.launches`.
KERNEL_OUTPUTS = {'_token_patch_means': ('means', 'partial')}

#: Elements per loaded tile (tokens x channels): the channel block is as
#: wide as the patch leaves room for, up to 128 channels.
_TILE = 4096
_MAX_CHANNELS = 128


@triton.jit
def _token_patch_means(src, means, partial, height, width, channels,
                       s_l, s_h, s_w, patch, row_count, col_count,
                       grids, scale, ACC: tl.constexpr,
                       ROW_SIZE: tl.constexpr, COL_SIZE: tl.constexpr,
                       BLOCK_CH: tl.constexpr):
    """Program ``pid``: grid ``l``, patch row ``a``, channels ``c`` (the
    channel block fastest, then the patch row). For each patch of the
    row, its ``patch x patch`` tokens (those on the grid) summed per
    channel: times ``scale`` over their count into ``means`` (``C x L x
    ph x pw``), and the raw sums of the row into ``partial`` (``L x C x
    ph``)."""
    pid = tl.program_id(0).to(tl.int64)
    blocks = tl.cdiv(channels, BLOCK_CH)
    c = (pid % blocks) * BLOCK_CH + tl.arange(0, BLOCK_CH)
    a = (pid // blocks) % row_count
    grid = pid // (blocks * row_count)
    c_ok = c < channels
    k = tl.arange(0, ROW_SIZE * COL_SIZE)
    i = k // COL_SIZE
    j = k % COL_SIZE
    h = a * patch + i
    h_ok = (i < patch) & (h < height)
    rows = tl.minimum(patch, height - a * patch)
    base = src + grid * s_l + h[:, None] * s_h + c[None, :]
    dst = means + c * (grids * row_count * col_count) + \
        (grid * row_count + a) * col_count
    total = tl.zeros([BLOCK_CH], ACC)
    for b in range(0, col_count):
        w = b * patch + j
        ok = h_ok & (j < patch) & (w < width)
        tile = tl.load(base + w[:, None] * s_w,
                       mask=ok[:, None] & c_ok[None, :], other=0.)
        sums = tl.sum(tile.to(ACC), axis=0)
        total += sums
        cols = tl.minimum(patch, width - b * patch)
        tl.store(dst + b, sums * (scale / (rows * cols).to(ACC)),
                 mask=c_ok)
    tl.store(partial + (grid * channels + c) * row_count + a, total,
             mask=c_ok)


def token_meta(radius: int, channels: int) -> dict:
    """Tile sizes of :func:`_token_patch_means` for patches of ``radius``
    tokens and ``channels`` channels."""
    side = next_power_of_2(radius)
    block = min(next_power_of_2(channels), _MAX_CHANNELS,
                max(1, _TILE // (side * side)))
    return dict(ROW_SIZE=side, COL_SIZE=side, BLOCK_CH=block)


def token_patch_means(rows: Tensor, radius: int, scale: float,
                      acc: torch.dtype) -> Tuple[Tensor, Tensor]:
    """One read of ``g_y``'s grid tokens ``rows`` (``(L, H, W, C)``,
    channel stride 1, other strides free): ``(scale * patch means as a C x
    L x ph x pw tensor, partial sums L x C x ph)``, both in ``acc``; the
    partial sums add up to the bias gradient over dims 0 and 2."""
    if rows.stride(3) != 1:
        raise ValueError('token rows need channel stride 1, got strides '
                         f'{tuple(rows.stride())}')
    grids, height, width, channels = rows.shape
    row_count = radius_patches(height, radius)[2]
    col_count = radius_patches(width, radius)[2]
    means = rows.new_empty((channels, grids, row_count, col_count),
                           dtype=acc)
    partial = rows.new_empty((grids, channels, row_count), dtype=acc)
    # A float scalar reaches a kernel as float32: a float64 reduction is
    # scaled afterwards, in float64 (as the conv's pass does).
    late = acc == torch.float64 and scale != 1.0
    meta = token_meta(radius, channels)
    programs = grids * row_count * cdiv(channels, meta['BLOCK_CH'])
    _token_patch_means[(programs, )](
        rows, means, partial, height, width, channels, rows.stride(0),
        rows.stride(1), rows.stride(2), radius, row_count, col_count, grids,
        1.0 if late else scale, ACC=tl_acc(acc), **meta, **LAUNCH_OPTIONS)
    if late:
        means.mul_(scale)
    return means, partial
