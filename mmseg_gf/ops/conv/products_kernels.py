"""Triton kernel of the GPU path: the patch grid's two products in one launch.

After :func:`~.conv.kernels.output_grad_means` (``g~``, the bias's partial
sums, ``W~``), :func:`products` computes ``g_W~ = g~ x~^T`` (to every tap,
with the bias gradient) and ``g_x~ = W~^T g~``, spread over each patch from
registers (docs/gradient_filter.md, "Backward"): a filtered layer's
backward is two launches. ``tl.dot`` runs in the accumulation dtype (no
TF32); tiles come from ``triton.autotune`` over :data:`TUNING_TILES`, or
:func:`fixed_tiles` under the interpreter or ``MMSEG_GF_AUTOTUNE=0``.
Importing this module imports ``triton``.
"""
import math
from types import MappingProxyType
from typing import Callable, List, Mapping, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import shape_caches
from ..backend.launch_geometry import cdiv, next_power_of_2
from ..backend.triton_launch import (LAUNCH_OPTIONS, Patches, Tuning,
                                     timed_by_default)
from ..backend.triton_launch import acc as tl_acc

#: The tensor arguments each kernel writes (the others it reads): the
#: bytes a launch moves, for :mod:`mmseg_gf.accounting.launches`.
KERNEL_OUTPUTS = {'_products': ('grad_w', 'grad_b', 'out')}

#: ``tl.dot`` needs tiles of at least 16 on each side.
_MIN_TILE = 16


@triton.jit
def _products(means, pooled, partial, grad_w, grad_b, kernel, out,
              out_channels, in_channels, groups, cells, taps, batch,
              patch_rows, p_c, p_k, height, width, m_c, m_n, m_h, k_o, k_i,
              o_n, o_c, o_h, o_w, row_start, row_size, row_count,
              col_start, col_size, col_count, image_rows,
              HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_X: tl.constexpr,
              DEPTHWISE: tl.constexpr, ACC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
              BLOCK_O: tl.constexpr, BLOCK_P: tl.constexpr,
              COL_SIZE: tl.constexpr):
    """Both products in one launch: the first :func:`program_count` programs
    take the weight side, the others the input side.
    """
    pid = tl.program_id(0)
    weight_rows = tl.cdiv(out_channels, BLOCK_M)
    weight_cols = 1
    if not DEPTHWISE:
        weight_cols = tl.cdiv(in_channels, BLOCK_N)
    weight_programs = 0
    if HAS_W or HAS_B:
        weight_programs = groups * weight_rows * weight_cols
    channel_blocks = tl.cdiv(in_channels, BLOCK_C)
    patch_blocks = tl.cdiv(col_count, BLOCK_P)
    if pid < weight_programs:
        if HAS_W or HAS_B:
            if DEPTHWISE:
                _depthwise_weight_tile(
                    pid, means, pooled, partial, grad_w, grad_b,
                    out_channels, cells, taps, batch, patch_rows, p_c, p_k,
                    HAS_W, HAS_B, ACC, BLOCK_M, BLOCK_K)
            else:
                per_group = weight_rows * weight_cols
                g = pid // per_group
                tile = pid % per_group
                _weight_tile(
                    tile // weight_cols, tile % weight_cols,
                    g * out_channels, g * in_channels, means, pooled,
                    partial, grad_w, grad_b, out_channels, in_channels,
                    out_channels * groups, cells, taps, batch, patch_rows,
                    p_c, p_k, HAS_W, HAS_B, ACC, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        if HAS_X:
            q = pid - weight_programs
            per_row = channel_blocks * patch_blocks
            row = q // per_row  # (group, image, patch row)
            g = row // image_rows
            _input_tile(
                row % image_rows, (q // patch_blocks) % channel_blocks,
                q % patch_blocks, g * out_channels, g * in_channels, means,
                kernel, out, out_channels,
                in_channels, height, width, m_c, m_n, m_h, k_o, k_i, o_n,
                o_c, o_h, o_w, row_start, row_size, row_count, col_start,
                col_size, col_count, ACC, BLOCK_C, BLOCK_O, BLOCK_P,
                COL_SIZE, DEPTHWISE)


@triton.jit
def _weight_tile(pid_m, pid_n, o_base, c_base, means, pooled, partial,
                 grad_w, grad_b, out_channels, in_channels, all_out, cells,
                 taps, batch, patch_rows, p_c, p_k, HAS_W: tl.constexpr,
                 HAS_B: tl.constexpr, ACC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """One tile of a group's ``g_W~ = means x pooled^T``, stored to every tap;
    the first column of tiles also sums ``partial`` into ``grad_b``.
    """
    o = o_base + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_ok = o < o_base + out_channels
    c_ok = c < in_channels
    tile_ok = o_ok[:, None] & c_ok[None, :]
    if HAS_W:
        acc = tl.zeros([BLOCK_M, BLOCK_N], ACC)
        k = tl.arange(0, BLOCK_K)
        for k0 in range(0, cells, BLOCK_K):
            kk = k0 + k
            k_ok = kk < cells
            a = tl.load(means + o[:, None].to(tl.int64) * cells + kk[None, :],
                        mask=o_ok[:, None] & k_ok[None, :], other=0.)
            b = tl.load(pooled + (c_base + c)[None, :].to(tl.int64) * p_c +
                        kk[:, None].to(tl.int64) * p_k,
                        mask=k_ok[:, None] & c_ok[None, :], other=0.)
            acc += tl.dot(a, b.to(ACC), input_precision='ieee',
                          out_dtype=ACC)
        dst = grad_w + (o[:, None] * in_channels + c[None, :]) * taps
        value = acc.to(grad_w.dtype.element_ty)
        for t in range(taps):
            tl.store(dst + t, value, mask=tile_ok)
    if HAS_B:
        if pid_n == 0:
            total = tl.zeros([BLOCK_M], ACC)
            for n in range(0, batch):  # partial: N x Co x ph
                row = partial + (n * all_out + o) * patch_rows
                for a in range(0, patch_rows):
                    total += tl.load(row + a, mask=o_ok, other=0.)
            tl.store(grad_b + o, total.to(grad_b.dtype.element_ty),
                     mask=o_ok)


@triton.jit
def _depthwise_weight_tile(pid, means, pooled, partial, grad_w, grad_b,
                           channels, cells, taps, batch, patch_rows, p_c,
                           p_k, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                           ACC: tl.constexpr, BLOCK_C: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    """:func:`_weight_tile` of a depthwise layer: per-channel dot products."""
    c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    if HAS_W:
        acc = tl.zeros([BLOCK_C], ACC)
        k = tl.arange(0, BLOCK_K)
        for k0 in range(0, cells, BLOCK_K):
            kk = k0 + k
            ok = c_ok[:, None] & (kk < cells)[None, :]
            a = tl.load(means + c[:, None].to(tl.int64) * cells + kk[None, :],
                        mask=ok, other=0.)
            b = tl.load(pooled + c[:, None].to(tl.int64) * p_c +
                        kk[None, :].to(tl.int64) * p_k, mask=ok, other=0.)
            acc += tl.sum(a * b.to(ACC), axis=1)
        value = acc.to(grad_w.dtype.element_ty)
        for t in range(taps):
            tl.store(grad_w + c * taps + t, value, mask=c_ok)
    if HAS_B:
        total = tl.zeros([BLOCK_C], ACC)
        for n in range(0, batch):  # partial: N x C x ph
            row = partial + (n * channels + c) * patch_rows
            for a in range(0, patch_rows):
                total += tl.load(row + a, mask=c_ok, other=0.)
        tl.store(grad_b + c, total.to(grad_b.dtype.element_ty), mask=c_ok)


@triton.jit
def _input_tile(pid_row, pid_c, pid_p, o_base, c_base, means, kernel, out,
                out_channels, in_channels, height, width, m_c, m_n, m_h,
                k_o, k_i,
                o_n, o_c, o_h, o_w, row_start, row_size, row_count,
                col_start, col_size, col_count,
                ACC: tl.constexpr, BLOCK_C: tl.constexpr,
                BLOCK_O: tl.constexpr, BLOCK_P: tl.constexpr,
                COL_SIZE: tl.constexpr, DEPTHWISE: tl.constexpr):
    """``g_x~ = W~^T g~`` for a block of channels and patches of one patch row,
    stored to each patch's pixels.
    """
    n = pid_row // row_count
    a = pid_row % row_count
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    b = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    c_ok = c < in_channels
    b_ok = b < col_count
    if DEPTHWISE:
        w = tl.load(kernel + c * k_o, mask=c_ok, other=0.).to(ACC)
        g = tl.load(means + c[:, None].to(tl.int64) * m_c + n * m_n +
                    a * m_h + b[None, :],
                    mask=c_ok[:, None] & b_ok[None, :], other=0.)
        acc = w[:, None] * g
    else:
        acc = tl.zeros([BLOCK_C, BLOCK_P], ACC)
        o = tl.arange(0, BLOCK_O)
        for o0 in range(0, out_channels, BLOCK_O):
            oo = o_base + o0 + o
            o_ok = oo < o_base + out_channels
            w = tl.load(kernel + oo[None, :] * k_o + c[:, None] * k_i,
                        mask=c_ok[:, None] & o_ok[None, :], other=0.)
            g = tl.load(means + oo[:, None].to(tl.int64) * m_c + n * m_n +
                        a * m_h + b[None, :],
                        mask=o_ok[:, None] & b_ok[None, :], other=0.)
            acc += tl.dot(w.to(ACC), g, input_precision='ieee',
                          out_dtype=ACC)
    j = tl.arange(0, COL_SIZE)
    col = col_start + b[:, None] * col_size + j[None, :]  # BLOCK_P x COL
    col_ok = (b_ok[:, None] & (j[None, :] < col_size) & (col >= 0)
              & (col < width))
    value = tl.broadcast_to(acc[:, :, None], [BLOCK_C, BLOCK_P, COL_SIZE])
    value = value.to(out.dtype.element_ty)
    base = (out + n.to(tl.int64) * o_n +
            (c_base + c)[:, None, None].to(tl.int64) * o_c
            + col[None, :, :] * o_w)
    mask = c_ok[:, None, None] & col_ok[None, :, :]
    top = row_start + a * row_size
    for i in range(0, row_size):
        h = top + i
        if (h >= 0) & (h < height):
            tl.store(base + h.to(tl.int64) * o_h, value, mask=mask)


def _tile(size: int, cap: int) -> int:
    return max(_MIN_TILE, min(next_power_of_2(max(size, 1)), cap))


class Shape(NamedTuple):
    """What a :func:`_products` launch's program count and tiles depend on."""
    groups: int
    out_channels: int
    in_channels: int
    image_rows: int
    col_count: int
    weight_side: bool
    input_side: bool
    depthwise: bool


def program_count(shape: Shape, tiles: dict) -> int:
    """The programs of one :func:`_products` launch with these tiles."""
    weight = 0
    if shape.weight_side:
        cols = (1 if shape.depthwise else
                cdiv(shape.in_channels, tiles['BLOCK_N']))
        weight = (shape.groups * cdiv(shape.out_channels,
                                             tiles['BLOCK_M']) * cols)
    inputs = 0
    if shape.input_side:
        inputs = (shape.groups * shape.image_rows *
                  cdiv(shape.in_channels, tiles['BLOCK_C']) *
                  cdiv(shape.col_count, tiles['BLOCK_P']))
    return weight + inputs


@shape_caches.lru('triton.fixed_tiles', 512)
def fixed_tiles(shape: Shape) -> Mapping:
    """Untuned tiles: each side's channels up to 64, ``pw`` up to 32, at least
    the 16 ``tl.dot`` needs; cached per shape.
    """
    return MappingProxyType(dict(
        BLOCK_M=_tile(shape.out_channels, 64),
        BLOCK_N=1 if shape.depthwise else _tile(shape.in_channels, 64),
        BLOCK_K=32, BLOCK_C=_tile(shape.in_channels, 64), BLOCK_O=32,
        BLOCK_P=_tile(shape.col_count, 32)))


#: The tiles ``triton.autotune`` times on a GPU, per shape
#: (:data:`TUNING_KEY`): ``(BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_C, BLOCK_O,
#: BLOCK_P, num_warps)``: the weight side's GEMM tile and its step along
#: the cells, the input side's channels x patches tile and its step along
#: the output channels. :func:`fits` drops those much larger than the
#: layer.
TUNING_TILES = (
    (32, 32, 32, 32, 32, 16, 4),
    (64, 64, 32, 64, 32, 32, 4),
    (64, 64, 64, 64, 64, 32, 8),
    (128, 64, 32, 64, 32, 32, 8),
    (64, 128, 32, 128, 32, 16, 8),
)

#: The kernel arguments a tuned choice is kept for (with the tensors'
#: dtypes, which triton adds).
TUNING_KEY = ['out_channels', 'in_channels', 'groups', 'cells', 'taps',
              'image_rows', 'col_count', 'HAS_W', 'HAS_B', 'HAS_X',
              'DEPTHWISE']


def tuning_configs(tiles=TUNING_TILES) -> List['triton.Config']:
    """``triton.Config`` of each row of ``tiles``."""
    names = ('BLOCK_M', 'BLOCK_N', 'BLOCK_K', 'BLOCK_C', 'BLOCK_O',
             'BLOCK_P')
    return [triton.Config(dict(zip(names, row[:6])), num_warps=row[6])
            for row in tiles]


def fits(configs, named_args: dict, **kwargs) -> list:
    """``early_config_prune``: configs whose tiles exceed no size by more than
    the smallest tile; at least the first.
    """
    def bound(size: int, least: int) -> int:
        return max(least, next_power_of_2(max(int(size), 1)))

    co, ci = named_args['out_channels'], named_args['in_channels']
    cols = named_args['col_count']
    depthwise = kwargs.get('DEPTHWISE')
    kept = [c for c in configs
            if c.kwargs['BLOCK_M'] <= bound(co, 32)
            and (depthwise or c.kwargs['BLOCK_N'] <= bound(ci, 32))
            and c.kwargs['BLOCK_C'] <= bound(ci, 32)
            and c.kwargs['BLOCK_P'] <= bound(cols, 16)]
    return kept or list(configs[:1])


def tuned(configs=None, do_bench: Optional[Callable] = None):
    """:func:`_products` under ``triton.autotune``, pruned by :func:`fits`; a
    launch accumulates nothing, so timing runs leave the right result.
    """
    return triton.autotune(
        configs=configs or tuning_configs(), key=TUNING_KEY,
        prune_configs_by={'early_config_prune': fits},
        do_bench=do_bench or timed_by_default)(_products)


#: :func:`_products`' tuning.
PRODUCTS_TUNING = Tuning(tuned, 'triton_products.products_tuning')


def products(means: Tensor, pooled: Optional[Tensor],
             partial: Optional[Tensor], weight: Tensor,
             tap_sums: Optional[Tensor], out: Optional[Tensor],
             rows: Optional[Patches], cols: Optional[Patches],
             need_w: bool, need_b: bool,
             grad_dtype: Optional[torch.dtype] = None,
             groups: int = 1) -> Tuple[Tensor, Tensor]:
    """One launch for both products of the patch grid.

    Args:
        means: ``g~``, ``Co x N x ph x pw``, contiguous, accumulation dtype.
        pooled: ``x~`` as ``Ci x cells``; None unless ``need_w``.
        partial: the bias's partial sums ``N x Co x ph``; None unless
            ``need_b``.
        weight: gives ``g_W``'s shape.
        tap_sums: ``W~`` (``Co x Ci/g``) when ``out`` is given.
        out: ``g_x``, zeroed by the caller where patches do not cover it
            (:func:`covers`), or None.
        need_w, need_b: whether ``g_W`` / ``g_b`` are written.
        grad_dtype: ``g_W``'s dtype (default: the weight's).
        groups: the conv's groups.

    Returns:
        ``(g_W, g_b)``, contiguous; empty where not asked for.
    """
    acc = means.dtype
    co = weight.shape[0]
    depthwise = groups > 1 and groups == co and weight.shape[1] == 1
    taps = math.prod(weight.shape[2:])
    cells = math.prod(means.shape[1:])
    grad_w = (torch.empty_like(weight, dtype=grad_dtype,
                               memory_format=torch.contiguous_format)
              if need_w else means.new_empty((0, )))
    grad_b = means.new_empty((co, ) if need_b else (0, ))
    p = pooled if need_w else means
    if depthwise:  # one group of all channels, elementwise
        groups, co_g, ci_g = 1, co, co
    else:
        co_g, ci_g = co // groups, weight.shape[1]
    if out is None:
        geometry = (0, ) * 16 + (1, )
        image_rows, col_count, col_size = 1, 1, 16
        # placeholders: a tensor read anyway, one written anyway (or empty)
        kernel, dst = means, grad_b
    else:
        n, _, height, width = out.shape
        image_rows, col_count = n * rows[2], cols[2]
        col_size = next_power_of_2(cols[1])
        kernel, dst = tap_sums, out
        geometry = (height, width, *means.stride()[:3],
                    *tap_sums.stride()[:2], *out.stride(), *rows, *cols)
    if not (need_w or need_b or out is not None):
        return grad_w, grad_b
    shape = Shape(groups, co_g, ci_g, image_rows, col_count,
                  need_w or need_b, out is not None, bool(depthwise))
    tuner = PRODUCTS_TUNING.tuner()
    # the tuner's configs name the tiles; without one, fixed_tiles'
    launcher, tiles = ((tuner, {}) if tuner is not None else
                       (_products, fixed_tiles(shape)))
    launcher[lambda meta: (program_count(shape, meta), )](
        means, p, partial if need_b else means, grad_w, grad_b, kernel, dst,
        co_g, ci_g, groups, cells, taps, partial.shape[0] if need_b else 0,
        partial.shape[2] if need_b else 0, p.stride(0) if need_w else 0,
        p.stride(1) if need_w else 0, *geometry, image_rows,
        HAS_W=bool(need_w), HAS_B=bool(need_b), HAS_X=out is not None,
        DEPTHWISE=bool(depthwise), ACC=tl_acc(acc), COL_SIZE=col_size,
        **tiles, **LAUNCH_OPTIONS)
    return grad_w, grad_b


def covers(patches: Patches, size: int) -> bool:
    """Whether patches ``(start, size, count)`` cover ``size`` pixels."""
    start, step, count = patches
    return start <= 0 and start + step * count >= size
