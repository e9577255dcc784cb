"""Where a Linear's tokens lie on a 2-D grid, and how a call sees them.

:class:`TokenGrid` is declared, never guessed from the token count;
:class:`TokenLayout` resolves it for one call (:func:`token_layout`, kept
per call shape)
(docs/gradient_filter.md#linear-layers-on-token-grids). No mmseg import.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backend import dispatch, shape_caches
from ..patch_grid import AxisGeometry


#: How the grid's tokens are laid out in a Linear's input (last dim: C).
#: ``'tokens'``: one token axis of ``extra_tokens + H*W + trailing_tokens``
#: tokens, the grid's row-major (``(B, N, C)``, or ``(N, B, C)`` with the
#: token axis first); ``'hwc'``: two axes ``H, W`` (``(B, H, W, C)``);
#: ``'windows'``: one token axis of a ``ws_h x ws_w`` window, windows
#: stacked in the batch (``(B*nW, ws*ws, C)``, Swin's ``WindowMSA``).
LAYOUTS = ('tokens', 'hwc', 'windows')


@dataclass(frozen=True)
class TokenGrid:
    """Where the tokens of a Linear's input lie on a 2-D grid.

    Attributes:
        height, width: grid rows and columns (a window's for ``'windows'``).
        extra_tokens: leading tokens on no grid (cls / distillation tokens,
            ``'tokens'`` layout only); their gradients stay exact.
        layout: one of :data:`LAYOUTS`.
        trailing_tokens: tokens on no grid after the grid's (Segmenter's
            class embeddings); exact like ``extra_tokens``.
    """

    height: int
    width: int
    extra_tokens: int = 0
    layout: str = 'tokens'
    trailing_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ('height', 'width'):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) \
                    or value < 1:
                raise ValueError(
                    f'TokenGrid.{name} must be an int >= 1, got {value!r}')
        if self.layout not in LAYOUTS:
            raise ValueError(f'TokenGrid.layout must be one of {LAYOUTS}, '
                             f'got {self.layout!r}')
        for name in ('extra_tokens', 'trailing_tokens'):
            extra = getattr(self, name)
            if isinstance(extra, bool) or not isinstance(extra, int) \
                    or extra < 0:
                raise ValueError(f'TokenGrid.{name} must be an int >= 0, '
                                 f'got {extra!r}')
            if extra and self.layout != 'tokens':
                raise ValueError(
                    f'TokenGrid.{name}={extra} needs layout="tokens" '
                    f'(a {self.layout!r} layout holds grid tokens only)')

    @classmethod
    def windows(cls, window_size: Union[int, Tuple[int, int]]) -> 'TokenGrid':
        """The grid of one ``ws x ws`` window (Swin's ``WindowMSA``)."""
        if isinstance(window_size, int):
            window_size = (window_size, window_size)
        return cls(int(window_size[0]), int(window_size[1]),
                   layout='windows')

    @property
    def num_tokens(self) -> int:
        return (self.extra_tokens + self.height * self.width +
                self.trailing_tokens)

    @property
    def extra_spans(self) -> Tuple[Tuple[int, int], ...]:
        """``(start, count)`` of the tokens on no grid, leading first."""
        spans = []
        if self.extra_tokens:
            spans.append((0, self.extra_tokens))
        if self.trailing_tokens:
            spans.append((self.extra_tokens + self.height * self.width,
                          self.trailing_tokens))
        return tuple(spans)

    @property
    def grid_dims(self) -> int:
        """Input axes the grid occupies: 2 for ``'hwc'``, else 1."""
        return 2 if self.layout == 'hwc' else 1

    def patch_grid(self, radius: int) -> Tuple[int, int]:
        """``(ceil(H/r), ceil(W/r))``: the patches along each axis."""
        return -(-self.height // radius), -(-self.width // radius)

    def token_axis(self, shape: Tuple[int, ...], token_dim: int) -> int:
        """Validate an input's ``shape`` against the grid; return the token
        axis (non-negative).

        Raises:
            ValueError: naming the mismatch.
        """
        ndim = len(shape)
        last_grid_axis = ndim - 2  # the channel axis is the last one
        dim = token_dim + ndim if token_dim < 0 else token_dim
        span = self.grid_dims
        if not 0 <= dim <= last_grid_axis - span + 1:
            raise ValueError(
                f'token_dim={token_dim} does not fit an input of shape '
                f'{tuple(shape)} with a {self.layout!r} grid: the grid '
                f'needs {span} axis(es) before the channel (last) axis')
        if self.layout == 'hwc':
            got = (shape[dim], shape[dim + 1])
            if got != (self.height, self.width):
                raise ValueError(
                    f'input of shape {tuple(shape)} has H, W = {got} at '
                    f'axes {dim}, {dim + 1}; the token grid is '
                    f'{self.height} x {self.width}')
        elif shape[dim] != self.num_tokens:
            raise ValueError(
                f'input of shape {tuple(shape)} has {shape[dim]} tokens on '
                f'axis {dim}; the token grid has extra_tokens + H*W + '
                f'trailing_tokens = {self.extra_tokens} + {self.height}*'
                f'{self.width} + {self.trailing_tokens} = '
                f'{self.num_tokens} ({self.layout!r} layout)')
        return dim


# (start, patches, tokens per patch) of one stretch of equal patches.
_Segment = Tuple[int, int, int]


def _segments(size: int, radius: int) -> List[_Segment]:
    """The patches along one axis as at most two stretches of equal ones: the
    full ``r``-token patches, then a short last one
    (docs/gradient_filter.md#partial-patches).
    """
    geo = AxisGeometry.of(size, size, 1, 1, 0, 1, radius)
    full = size // geo.out_patch
    segments = [(0, full, geo.out_patch)] if full else []
    if size % geo.out_patch:
        segments.append((full * geo.out_patch, 1, size % geo.out_patch))
    return segments


@dataclass(frozen=True)
class TokenLayout:
    """An input's grid, token axis and patch size, resolved for one call.

    Grid tokens are seen as ``(*lead, H, W, C)``; patch sums come back as a
    contiguous ``(L, ceil(H/r), ceil(W/r), C)`` for the backward's GEMMs.
    """

    grid: TokenGrid
    radius: int
    dim: int  # the token axis (the grid's H axis for 'hwc')

    def extra(self, t: Tensor) -> Optional[Tensor]:
        """The tokens of ``t`` on no grid (leading, then trailing), or None."""
        parts = [t.narrow(self.dim, *span) for span in self.grid.extra_spans]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)

    def write_extra(self, out: Tensor, values: Tensor) -> None:
        """Copy ``values`` (as :meth:`extra` returns them) into ``out``."""
        done = 0
        for start, count in self.grid.extra_spans:
            out.narrow(self.dim, start, count).copy_(
                values.narrow(self.dim, done, count))
            done += count

    def grid_view(self, t: Tensor) -> Tensor:
        """``t``'s grid tokens as ``(*lead, H, W, C)`` (a view)."""
        g, dim = self.grid, self.dim
        if g.layout != 'hwc':
            t = t.narrow(dim, g.extra_tokens, g.height * g.width).unflatten(
                dim, (g.height, g.width))
        return t.movedim((dim, dim + 1), (-3, -2))

    def grid_rows(self, t: Tensor) -> Optional[Tensor]:
        """``t``'s grid tokens as an ``(L, H, W, C)`` view; None where the
        leading axes do not merge without a copy.
        """
        view = self.grid_view(t)
        try:
            return view.view(-1, *view.shape[-3:])
        except RuntimeError:
            return None

    def rows_to_read(self, t: Tensor) -> Tensor:
        """:meth:`grid_rows`, or a copy where it gives None."""
        rows = self.grid_rows(t)
        if rows is None:
            view = self.grid_view(t)
            rows = view.reshape(-1, *view.shape[-3:])
        return rows

    def pool_rows(self, rows: Tensor, dtype: torch.dtype,
                  mean: bool = False) -> Tensor:
        """Patch sums (``mean``: means) of ``(l, H, W, C)`` tokens, ``(l,
        Ph, Pw, C)`` contiguous in ``dtype``: one channels-last ``avg_pool2d``,
        exact on clipped border windows
        (docs/benchmarks/design_measurements.md).
        """
        g, r = self.grid, self.radius
        sums = F.avg_pool2d(rows.permute(0, 3, 1, 2),
                            (min(r, g.height), min(r, g.width)), (r, r),
                            ceil_mode=True,
                            divisor_override=None if mean else 1)
        return sums.permute(0, 2, 3, 1).contiguous().to(dtype)

    def patch_sums(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        """:meth:`pool_rows` of ``t``'s grid tokens (``x~``), by the
        compiled CPU kernel where it applies; CUDA keeps the pooling
        (docs/benchmarks/design_measurements.md).
        """
        rows = self.rows_to_read(t)
        choice = dispatch.choose('token_patch_sums', self, rows, dtype)
        return choice.implementation.run(self, rows, dtype)

    def patch_counts(self, sums: Tensor) -> Optional[Tensor]:
        """Tokens per patch, ``(Ph, Pw, 1)``; None when every patch is full."""
        g, r = self.grid, self.radius
        if g.height % r == 0 and g.width % r == 0:
            return None
        ph, pw = g.patch_grid(r)
        count_h = (g.height - torch.arange(ph, device=sums.device) *
                   r).clamp(max=r)
        count_w = (g.width - torch.arange(pw, device=sums.device) *
                   r).clamp(max=r)
        counts = (count_h[:, None] * count_w[None, :]).to(sums.dtype)
        return counts.unsqueeze(-1)

    def spread_rows(self, out: Tensor, pooled: Tensor) -> None:
        """Write each patch's row of ``pooled`` to every token of the patch
        in ``out`` (step 3 of the backward), one copy per stretch of equal
        patches.
        """
        for rows in _segments(self.grid.height, self.radius):
            for cols in _segments(self.grid.width, self.radius):
                block = out.narrow(1, rows[0], rows[1] * rows[2]).narrow(
                    2, cols[0], cols[1] * cols[2]).unflatten(
                        2, cols[1:]).unflatten(1, rows[1:])
                src = pooled.narrow(1, rows[0] // self.radius,
                                    rows[1]).narrow(
                                        2, cols[0] // self.radius, cols[1])
                block.copy_(src.unsqueeze(3).unsqueeze(2))


#: Call shapes whose :class:`TokenLayout` is kept (:func:`token_layout`).
_LAYOUTS_CACHED = 256


@shape_caches.lru('linear.token_layout', _LAYOUTS_CACHED)
def token_layout(grid: TokenGrid, radius: int, shape: Tuple[int, ...],
                 token_dim: int) -> TokenLayout:
    """The :class:`TokenLayout` of a call on an input of ``shape``, its
    shape checked against the grid (:meth:`TokenGrid.token_axis`), kept per
    call shape: every filtered Linear call asks for it.

    Raises:
        ValueError: ``shape`` does not hold the grid on ``token_dim``.
    """
    return TokenLayout(grid, radius, grid.token_axis(shape, token_dim))
