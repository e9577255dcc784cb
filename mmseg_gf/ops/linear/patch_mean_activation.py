"""GELU between two filtered layers: keep the patch means of its derivative.

Where ``y = f(x)`` is read only by filtered layers on the patch partition
of the filtered layer that made ``x``, ``g_y * mean_P f'(x)`` gives the same
gradients (docs/gradient_filter.md, "Elementwise ops between filtered
layers"), so :class:`PatchMeanGeluFunction` keeps ``1/r^2`` of the
elements. The premise is checked outside (the traced training step); a
filtered layer tags its output (:func:`tag_output`). No mmseg import.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..backend import dispatch, output_pool
from . import cpu as linear_cpu
from .token_grid import TokenGrid, TokenLayout
from ..patch_grid import AxisGeometry, check_radius, filter_output_grad

__all__ = ['PatchPartition', 'PatchMeanGeluFunction', 'patch_mean_gelu',
           'gelu_derivative', 'patch_mean_kept_elements', 'tag_output',
           'tagged_partition', 'TAG_ATTR']

#: The attribute a filtered layer's output carries: ``(partition, version)``.
TAG_ATTR = '_gf_patch_partition'


@dataclass(frozen=True)
class PatchPartition:
    """The ``r x r`` patches, tiled from 0, of a filtered layer's map (``grid``
    None) or token grid.
    """

    radius: int
    height: int
    width: int
    grid: Optional[TokenGrid] = None
    token_dim: int = 1

    @classmethod
    def conv_map(cls, radius: int, height: int,
                 width: int) -> 'PatchPartition':
        return cls(check_radius(radius), int(height), int(width))

    @classmethod
    def tokens(cls, grid: TokenGrid, radius: int,
               token_dim: int) -> 'PatchPartition':
        return cls(check_radius(radius), grid.height, grid.width, grid,
                   int(token_dim))

    def fits(self, x: Tensor) -> bool:
        """Whether ``x``'s shape holds this partition's map or grid."""
        if self.grid is None:
            return x.dim() == 4 and tuple(x.shape[2:]) == (self.height,
                                                          self.width)
        try:
            return self.grid.token_axis(x.shape, self.token_dim) == \
                self.token_dim
        except ValueError:
            return False

    def axes(self) -> Tuple[AxisGeometry, AxisGeometry]:
        """The patch geometry of a ``1 x 1``, stride-1 layer on the map."""
        return tuple(AxisGeometry.of(s, s, 1, 1, 0, 1, self.radius)
                     for s in (self.height, self.width))


def tag_output(out: Tensor, partition: PatchPartition) -> Tensor:
    """Mark ``out`` as a filtered layer's output on ``partition``; an in-place
    change voids the mark. Not under ``torch.compile`` (the exact rule runs,
    which gives the same gradient).
    """
    if not torch.compiler.is_compiling():
        setattr(out, TAG_ATTR, (partition, out._version))
    return out


def tagged_partition(x: Tensor) -> Optional[PatchPartition]:
    """The partition ``x`` was tagged with, if unchanged since."""
    if torch.compiler.is_compiling():
        return None
    tag = getattr(x, TAG_ATTR, None)
    if tag is None or tag[1] != x._version:
        return None
    return tag[0]


def gelu_derivative(x: Tensor, approximate: str = 'none') -> Tensor:
    """``f'(x)`` of ``F.gelu`` by autograd's own ``gelu_backward``."""
    return torch.ops.aten.gelu_backward(torch.ones_like(x), x,
                                        approximate=approximate)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


_ONES = {}


def _one(dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 0-d one cached per dtype and device (a fresh one is a fill launch on a
    GPU); never written, not cached while tracing.
    """
    if torch.compiler.is_compiling():
        return torch.ones((), dtype=dtype, device=device)
    key = (dtype, device)
    if key not in _ONES:
        _ONES[key] = torch.ones((), dtype=dtype, device=device)
    return _ONES[key]


def _slope(x: Tensor, approximate: str) -> Tensor:
    """``f'(x)`` in the accumulation dtype, in recycled memory where
    possible.
    """
    acc = _acc(x.dtype)
    if x.dtype != acc:
        return gelu_derivative(x.to(acc), approximate)
    one = _one(x.dtype, x.device).expand_as(x)
    out = output_pool.empty_for_writing(x.shape, x)
    return torch.ops.aten.gelu_backward.grad_input(
        one, x, approximate=approximate, grad_input=out)


def _token_layout(partition: PatchPartition) -> TokenLayout:
    return TokenLayout(partition.grid, partition.radius, partition.token_dim)


def patch_mean_kept_elements(shape: Tuple[int, ...],
                             partition: PatchPartition) -> int:
    """Elements :class:`PatchMeanGeluFunction` keeps for ``shape``: one per
    patch and channel, plus the tokens on no grid.
    """
    ph = -(-partition.height // partition.radius)
    pw = -(-partition.width // partition.radius)
    if partition.grid is None:
        n, c = shape[:2]
        return n * c * ph * pw
    dim, grid = partition.token_dim, partition.grid
    span = grid.grid_dims
    lead = 1
    for i, s in enumerate(shape[:-1]):
        if not dim <= i < dim + span:
            lead *= s
    extra = grid.extra_tokens + grid.trailing_tokens
    return lead * shape[-1] * (ph * pw + extra)


class PatchMeanGeluFunction(torch.autograd.Function):
    """``F.gelu`` forward; backward ``g_y * mean_P f'(x)`` on the grid's
    patches, ``g_y * f'(x)`` on tokens on no grid."""

    @staticmethod
    def forward(ctx, x: Tensor, approximate: str,
                partition: PatchPartition) -> Tensor:
        out = F.gelu(x, approximate=approximate)
        acc = _acc(x.dtype)
        slope = _slope(x, approximate)
        extra = None
        if partition.grid is None:
            means = _map_means(slope, partition, acc)
        else:
            layout = _token_layout(partition)
            means = _token_means(slope, layout, acc)
            extra = layout.extra(slope)
            if extra is not None:  # its own storage, never a view of slope
                extra = extra.to(x.dtype, copy=True,
                                 memory_format=torch.contiguous_format)
        del slope
        ctx.save_for_backward(means.to(x.dtype).contiguous(), extra)
        ctx.partition = partition
        ctx.input_dtype = x.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        means, extra = ctx.saved_tensors
        partition = ctx.partition
        if partition.grid is None:
            g_x = _map_backward(grad, means, partition)
        else:
            g_x = _token_backward(grad, means, extra, partition)
        return g_x.to(ctx.input_dtype), None, None


def _map_means(slope: Tensor, partition: PatchPartition,
               acc: torch.dtype) -> Tensor:
    """``mean_P f'(x)`` of an ``(N, C, H, W)`` map in ``acc``: the compiled
    kernel's sums over ``|P|``, else one ``avg_pool2d`` counting only valid
    pixels (equal to rounding).
    """
    geo_h, geo_w = partition.axes()
    if dispatch.choose('patch_grid', slope).implementation.name == 'c++':
        return filter_output_grad(slope, geo_h, geo_w, acc)[1]
    r = partition.radius
    return F.avg_pool2d(slope, (min(r, partition.height),
                                min(r, partition.width)), (r, r),
                        ceil_mode=True).to(acc)


def _token_means(slope: Tensor, layout: TokenLayout,
                 acc: torch.dtype) -> Tensor:
    """``mean_P f'(x)`` of the grid tokens, ``(L, Ph, Pw, C)`` in ``acc``."""
    rows = layout.rows_to_read(slope)
    if dispatch.choose('token_patch_sums', layout, rows,
                       acc).implementation.name != 'c++':
        return layout.pool_rows(rows, acc, mean=True)
    sums = linear_cpu.token_patch_sums(rows, layout.radius)
    counts = layout.patch_counts(sums)
    return sums.div_(layout.radius ** 2 if counts is None else counts)


def _map_backward(grad: Tensor, means: Tensor,
                  partition: PatchPartition) -> Tensor:
    """``g_y`` times the broadcast patch means, into recycled memory: means
    repeated along the width, then one product per band of ``r`` rows (about
    twice as fast on CPU as broadcasting over the columns too).
    """
    r, h, w = partition.radius, partition.height, partition.width
    n, c = grad.shape[:2]
    rows = means.to(grad.dtype).repeat_interleave(r, dim=-1)[..., :w]
    out = output_pool.empty_for_writing(grad.shape, grad)
    full = h // r
    if full:
        torch.mul(grad[:, :, :full * r].reshape(n, c, full, r, w),
                  rows[:, :, :full, None, :],
                  out=out[:, :, :full * r].view(n, c, full, r, w))
    if h > full * r:
        torch.mul(grad[:, :, full * r:], rows[:, :, full:full + 1],
                  out=out[:, :, full * r:])
    return out


def _tile_product(layout: TokenLayout, out: Tensor, grad: Tensor,
                  means: Tensor) -> bool:
    """The grid tokens' product in one broadcast where every patch is full;
    returns whether it applied.
    """
    grid, r = layout.grid, layout.radius
    if grid.height % r or grid.width % r:
        return False
    tiles = (-1, grid.height // r, r, grid.width // r, r, grad.shape[-1])
    try:
        target = layout.grid_view(out).view(tiles)
    except RuntimeError:
        return False
    torch.mul(layout.grid_view(grad).reshape(tiles),
              means[:, :, None, :, None, :], out=target)
    return True


def _token_backward(grad: Tensor, means: Tensor, extra: Optional[Tensor],
                    partition: PatchPartition) -> Tensor:
    """The grid tokens' ``g_y`` times their patch's mean; the other tokens'
    times their own ``f'``."""
    layout = _token_layout(partition)
    out = output_pool.empty_for_writing(grad.shape, grad)
    means = means.to(grad.dtype)
    if not _tile_product(layout, out, grad, means):
        target = layout.grid_view(out)
        rows = layout.grid_rows(out)
        if rows is not None:
            layout.spread_rows(rows, means)
        else:  # leading axes that do not merge: stage
            staging = out.new_empty(means.shape[0], *target.shape[-3:])
            layout.spread_rows(staging, means)
            target.copy_(staging.view(target.shape))
        target.mul_(layout.grid_view(grad))
    if extra is not None:
        layout.write_extra(out, layout.extra(grad) * extra)
    return out


def patch_mean_gelu(x: Tensor, approximate: str,
                    partition: PatchPartition) -> Tensor:
    """``F.gelu(x, approximate=approximate)`` keeping ``mean_P f'(x)``, exact
    where the caller has checked this module's premise.

    Raises:
        ValueError: ``x`` does not hold ``partition``'s map or grid.
    """
    if not partition.fits(x):
        raise ValueError(f'input of shape {tuple(x.shape)} does not hold '
                         f'the patch partition {partition}')
    return PatchMeanGeluFunction.apply(x, approximate, partition)
