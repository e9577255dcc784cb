"""Triton kernels of the GPU path: the two passes over full-size maps.

``_patch_reduce`` reads a map once for its patch sums (forward, ``x~``) or
patch means with the bias's partial sums (backward, ``g~``), optionally
applying a conv block's activation mask and norm factor as it loads
(:class:`~.gpu.GradPrologue`) and summing a kernel's taps (``W~``) in the
same launch; ``_spread`` writes ``g_x`` once from the patch grid. The
products between them: :mod:`.products_kernels` (docs/gpu.md).

Grids are channel-major (``C x N x ph x pw``) so that the weight gradient
is one GEMM per group; accumulation is float32 (float64 for float64).
Importing this module imports ``triton``; ``TRITON_INTERPRET`` at import
fixes whether CPU tensors run in triton's interpreter (tests).
"""
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import shape_caches
from ..backend.launch_geometry import cdiv, next_power_of_2
from ..backend.triton_launch import (LAUNCH_OPTIONS, Patches, Tuning,
                                     radius_patches, timed_by_default)
from ..backend.triton_launch import acc as tl_acc

# Elements per program tile. Heuristics, not tuned on a GPU: large enough
# for coalesced 128-byte rows, small enough for many programs on small maps.
_REDUCE_TILE = 1024
_SPREAD_TILE = 1024
#: Layer shapes whose launch tiles are kept (``shape_caches.lru``): a
#: model has a few dozen distinct ones per input size.
_SHAPES_CACHED = 512

#: The tensor arguments each kernel writes (the others it reads): the
#: bytes a launch moves, for :mod:`mmseg_gf.accounting.launches`.
KERNEL_OUTPUTS = {'_patch_reduce': ('dst', 'partial', 'tap_sums'),
                  '_spread': ('out', )}


@triton.jit
def _patch_reduce(src, dst, partial, channels, height, width,
                  s_n, s_c, s_h, s_w, d_n, d_c, d_h, d_w,
                  row_start, row_size, row_count,
                  col_start, col_size, col_count, scale,
                  bits, b_n, b_c, b_h, b_w, off_scale, var, norm_w, eps,
                  weight, tap_sums, pairs, taps, reduce_programs,
                  MEAN: tl.constexpr, PARTIAL: tl.constexpr,
                  ACC: tl.constexpr, ROW_SIZE: tl.constexpr,
                  COL_SIZE: tl.constexpr, BLOCK_P: tl.constexpr,
                  CHANNELS_FAST: tl.constexpr, MASKED: tl.constexpr,
                  NORM: tl.constexpr, NORM_WEIGHT: tl.constexpr,
                  TAPS: tl.constexpr):
    """:func:`reduce_patch_row` in the first ``reduce_programs`` programs;
    with ``TAPS`` the rest sum a kernel's taps (:func:`_sum_taps`).
    """
    pid = tl.program_id(0).to(tl.int64)  # int64: offsets of large maps
    if pid < reduce_programs:
        reduce_patch_row(
            pid, src, dst, partial, channels, height, width,
            s_n, s_c, s_h, s_w, d_n, d_c, d_h, d_w, row_start, row_size,
            row_count, col_start, col_size, col_count, scale, bits, b_n, b_c,
            b_h, b_w, off_scale, var, norm_w, eps, MEAN, PARTIAL, ACC,
            ROW_SIZE, COL_SIZE, BLOCK_P, CHANNELS_FAST, MASKED, NORM,
            NORM_WEIGHT)
    else:
        if TAPS:
            _sum_taps(pid - reduce_programs, weight, tap_sums, pairs, taps,
                      ACC)


#: Kernel entries (``W~`` elements) per tap-summing program.
_TAP_BLOCK = tl.constexpr(256)


@triton.jit
def _sum_taps(q, weight, tap_sums, pairs, taps, ACC: tl.constexpr):
    """``W~``: block ``q`` of a kernel's entries, each summed over its taps."""
    j = q * _TAP_BLOCK + tl.arange(0, _TAP_BLOCK)
    ok = j < pairs
    total = tl.zeros([_TAP_BLOCK], ACC)
    for t in range(taps):
        total += tl.load(weight + j * taps + t, mask=ok, other=0.).to(ACC)
    tl.store(tap_sums + j, total, mask=ok)


@triton.jit
def reduce_patch_row(pid, src, dst, partial, channels, height, width,
                      s_n, s_c, s_h, s_w, d_n, d_c, d_h, d_w,
                      row_start, row_size, row_count,
                      col_start, col_size, col_count, scale,
                      bits, b_n, b_c, b_h, b_w, off_scale, var, norm_w, eps,
                      MEAN: tl.constexpr, PARTIAL: tl.constexpr,
                      ACC: tl.constexpr, ROW_SIZE: tl.constexpr,
                      COL_SIZE: tl.constexpr, BLOCK_P: tl.constexpr,
                      CHANNELS_FAST: tl.constexpr, MASKED: tl.constexpr,
                      NORM: tl.constexpr, NORM_WEIGHT: tl.constexpr):
    """Program ``pid`` of one per (image, channel, patch row): the sums (or
    means) of that row's patches, 0 outside the map.

    ``CHANNELS_FAST`` numbers programs channel first for channels-last maps
    (neighbouring programs read the same pixels). ``MASKED`` keeps elements
    whose bit is set and scales the rest by ``off_scale``; ``NORM`` then
    multiplies by ``rsqrt(var_c + eps) * norm_w_c`` in float32, as the norm's
    own backward (:class:`~.gpu.GradPrologue`).
    """
    if CHANNELS_FAST:
        c = pid % channels
        a = (pid // channels) % row_count
        n = pid // (channels * row_count)
    else:
        plane = pid // row_count
        a = pid % row_count
        n = plane // channels
        c = plane % channels
    src_plane = src + n * s_n + c * s_c
    dst_row = dst + n * d_n + c * d_c + a * d_h
    if NORM:
        factor = tl.math.rsqrt(tl.load(var + c).to(tl.float32) + eps)
        if NORM_WEIGHT:
            factor = factor * tl.load(norm_w + c).to(tl.float32)
    top = row_start + a * row_size
    i = tl.arange(0, ROW_SIZE)
    h = top + i
    row_ok = (i < row_size) & (h >= 0) & (h < height)
    # Map rows inside the patch (>= 1 for output patches).
    rows = tl.minimum(top + row_size, height) - tl.maximum(top, 0)
    offs_p = tl.arange(0, BLOCK_P)
    j = tl.arange(0, COL_SIZE)
    total = tl.zeros([BLOCK_P], ACC)  # per-lane raw sums, for the bias
    for b0 in range(0, col_count, BLOCK_P):
        b = b0 + offs_p
        left = col_start + b * col_size
        w = left[:, None] + j[None, :]
        col_ok = ((b[:, None] < col_count) & (j[None, :] < col_size)
                  & (w >= 0) & (w < width))
        inside = row_ok[:, None, None] & col_ok[None, :, :]
        tile = tl.load(src_plane + h[:, None, None] * s_h +
                       w[None, :, :] * s_w, mask=inside, other=0.)
        if MASKED:
            index = (n * b_n + c * b_c + h[:, None, None] * b_h +
                     w[None, :, :] * b_w)
            byte = tl.load(bits + index // 8, mask=inside, other=0)
            on = ((byte.to(tl.int32) >> (index % 8).to(tl.int32)) & 1) != 0
            tile = tile.to(ACC)
            tile = tl.where(on, tile, tile * off_scale)
        if NORM:
            tile = tile.to(ACC) * factor.to(ACC)
        acc = tl.sum(tl.sum(tile.to(ACC), axis=2), axis=0)
        if PARTIAL:
            total += acc
        if MEAN:
            # Partial border patches average over the pixels they have.
            cols = tl.minimum(left + col_size, width) - tl.maximum(left, 0)
            acc = acc * (scale / (tl.maximum(cols, 1) * rows).to(ACC))
        tl.store(dst_row + b * d_w, acc.to(dst.dtype.element_ty),
                 mask=b < col_count)
    if PARTIAL:
        tl.store(partial + (n * channels + c) * row_count + a,
                 tl.sum(total, axis=0))


@triton.jit
def _spread(grid, out, channels, height, width,
            g_n, g_c, g_h, g_w, o_n, o_c, o_h, o_w,
            row_start, row_size, row_count,
            col_start, col_size, col_count,
            BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    """Each pixel takes its patch's grid value, 0 outside every patch."""
    plane = tl.program_id(0).to(tl.int64)
    n = plane // channels
    c = plane % channels
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    w = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    rel_h = h - row_start
    rel_w = w - col_start
    in_h = (rel_h >= 0) & (rel_h < row_count * row_size)
    in_w = (rel_w >= 0) & (rel_w < col_count * col_size)
    # Clamp before dividing: floor division of negatives is never needed.
    a = tl.where(in_h, rel_h, 0) // row_size
    b = tl.where(in_w, rel_w, 0) // col_size
    value = tl.load(grid + n * g_n + c * g_c + a[:, None] * g_h +
                    b[None, :] * g_w,
                    mask=in_h[:, None] & in_w[None, :], other=0.)
    tl.store(out + n * o_n + c * o_c + h[:, None] * o_h + w[None, :] * o_w,
             value.to(out.dtype.element_ty),
             mask=(h[:, None] < height) & (w[None, :] < width))


#: The warps ``triton.autotune`` times for :func:`_patch_reduce`, per
#: :data:`REDUCE_KEY` (its tiles follow from the patches).
REDUCE_WARPS = (2, 4, 8)

#: The arguments a tuned choice of :func:`_patch_reduce` is kept for (with
#: the tensors' dtypes, which triton adds).
REDUCE_KEY = ['channels', 'height', 'width', 'row_count', 'col_count',
              'pairs', 'MEAN', 'PARTIAL', 'MASKED', 'TAPS', 'CHANNELS_FAST']


def tuned_reduce(configs=None, do_bench: Optional[Callable] = None):
    """:func:`_patch_reduce` under ``triton.autotune``; a launch accumulates
    nothing, so timing runs leave the right result.
    """
    return triton.autotune(
        configs=configs or [triton.Config({}, num_warps=w)
                            for w in REDUCE_WARPS],
        key=REDUCE_KEY, do_bench=do_bench or timed_by_default)(
            _patch_reduce)


#: :func:`_patch_reduce`'s tuning.
REDUCE_TUNING = Tuning(tuned_reduce, 'triton_kernels.reduce_tuning')


def reduce_meta(rows: Patches, cols: Patches,
                channels_fast: bool = False) -> Mapping:
    """Tiles and program order of :func:`_patch_reduce`, cached."""
    return _reduce_meta(tuple(rows), tuple(cols), bool(channels_fast))


@shape_caches.lru('triton.reduce_meta', _SHAPES_CACHED)
def _reduce_meta(rows: Patches, cols: Patches,
                 channels_fast: bool) -> Mapping:
    row_size = next_power_of_2(rows[1])
    col_size = next_power_of_2(cols[1])
    block_p = max(1, min(next_power_of_2(cols[2]),
                         _REDUCE_TILE // (row_size * col_size)))
    return MappingProxyType(dict(
        ROW_SIZE=row_size, COL_SIZE=col_size, BLOCK_P=block_p,
        CHANNELS_FAST=bool(channels_fast)))


@shape_caches.lru('triton.spread_meta', _SHAPES_CACHED)
def spread_meta(height: int, width: int) -> Mapping:
    """Tile sizes of :func:`_spread` for a map size, cached."""
    block_w = min(next_power_of_2(width), 128)
    block_h = max(1, min(next_power_of_2(height),
                         _SPREAD_TILE // block_w))
    return MappingProxyType(dict(BLOCK_H=block_h, BLOCK_W=block_w))


def _reduce(src: Tensor, dst_nchw: Tensor, partial: Optional[Tensor],
            rows: Patches, cols: Patches, scale: float, mean: bool,
            acc: torch.dtype, prologue=None, taps=None):
    n, c, height, width = src.shape
    channels_fast = c > 1 and src.stride(1) == 1  # channels-last
    p = prologue
    extra = ((dst_nchw, 0, 0, 0, 0, 0.0, dst_nchw, dst_nchw, 0.0)
             if p is None else
             (p.bits, *p.bit_strides, float(p.off_scale), p.running_var,
              p.running_var if p.weight is None else p.weight, float(p.eps)))
    programs = n * c * rows[2]
    if taps is None:
        tap_args, tap_programs = (src, dst_nchw, 0, 0), 0
    else:
        weight, tap_sums = taps
        pairs = tap_sums.numel()
        tap_args = (weight, tap_sums, pairs, weight.numel() // pairs)
        tap_programs = cdiv(pairs, _TAP_BLOCK.value)
    tuner = REDUCE_TUNING.tuner()
    launcher = _patch_reduce if tuner is None else tuner
    launcher[(programs + tap_programs, )](
        src, dst_nchw, dst_nchw if partial is None else partial, c, height,
        width, *src.stride(), *dst_nchw.stride(), *rows, *cols, scale,
        *extra, *tap_args, programs, MEAN=mean, PARTIAL=partial is not None,
        ACC=tl_acc(acc), MASKED=p is not None, NORM=p is not None,
        NORM_WEIGHT=p is not None and p.weight is not None,
        TAPS=taps is not None, **reduce_meta(rows, cols, channels_fast),
        **LAUNCH_OPTIONS)


def patch_sums(x: Tensor, rows: Patches, cols: Patches) -> Tensor:
    """``x~``: patch sums of ``x``, contiguous ``Ci x N x ph x pw``."""
    n, c = x.shape[:2]
    out = x.new_empty((c, n, rows[2], cols[2]))
    dst = out.permute(1, 0, 2, 3)
    _reduce(x, dst, None, rows, cols, 1.0, False, x.dtype)
    return out


def output_grad_means(grad_output: Tensor, radius: int, scale: float,
                      acc: torch.dtype, prologue=None,
                      taps: Optional[Tuple[Tensor, Tensor]] = None
                      ) -> Tuple[Tensor, Tensor]:
    """One read of ``g_y``: ``scale`` times its patch means (``Co x N x ph x
    pw``) and the bias's partial sums (``N x Co x ph``, summed in a fixed
    order: deterministic), both in ``acc``.

    With a ``prologue`` (:class:`~.gpu.GradPrologue`) ``grad_output`` is the
    gradient after a norm and activation, applied as it is read. With ``taps
    = (weight, tap_sums)`` the same launch writes ``W~`` into ``tap_sums``.
    """
    n, c, height, width = grad_output.shape
    rows, cols = radius_patches(height, radius), radius_patches(width, radius)
    means = grad_output.new_empty((c, n, rows[2], cols[2]), dtype=acc)
    partial = grad_output.new_empty((n, c, rows[2]), dtype=acc)
    # A float scalar reaches a kernel as float32 (1/3 off by 2^-25): a
    # float64 reduction is scaled afterwards, in float64.
    late = acc == torch.float64 and scale != 1.0
    _reduce(grad_output, means.permute(1, 0, 2, 3), partial, rows, cols,
            1.0 if late else scale, True, acc, prologue, taps)
    if late:
        means.mul_(scale)
    return means, partial


def spread(grid_nchw: Tensor, out: Tensor, rows: Patches,
           cols: Patches) -> Tensor:
    """Write each pixel of ``out`` from its patch's grid value; 0 outside."""
    n, c, height, width = out.shape
    meta = spread_meta(height, width)
    launch = (n * c, cdiv(height, meta['BLOCK_H']),
              cdiv(width, meta['BLOCK_W']))
    _spread[launch](grid_nchw, out, c, height, width, *grid_nchw.stride(),
                    *out.stride(), *rows, *cols, **meta, **LAUNCH_OPTIONS)
    return out
