"""Gradient-filtered linear layer on a token grid: exact forward, filtered
backward.

A transformer's ``nn.Linear`` applied to the tokens of a feature map is a
``1 x 1`` convolution whose pixels are stored as tokens. This module applies
the conv's gradient filter to it, with the rules of
docs/gradient_filter.md for a ``1 x 1`` kernel, stride 1
(docs/gradient_filter.md#linear-layers-on-token-grids):

* ``g_y`` is replaced by its means over ``r x r`` patches of the token grid
  (a partial border patch averages over the tokens it has);
* ``g_W`` is the product of those patch means with the patch *sums* of
  ``x``, which are all the forward keeps of ``x``;
* ``g_x`` is the patch-mean gradient times ``W``, broadcast to every token of
  the patch;
* ``g_b`` is exact, and so is everything of the extra tokens (a ViT's cls /
  distillation tokens, Segmenter's class embeddings), which lie on no grid.

Where the tokens lie on the grid is described by :class:`TokenGrid` and a
token axis; it is never guessed from the token count. The backward runs its
two GEMMs on ``N / r^2`` rows. Pure PyTorch, no mmseg import.
"""

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .gradient_filter import AxisGeometry, check_radius

#: How the grid's tokens are laid out in a Linear's input (last dim: C).
#: ``'tokens'``: one token axis of ``extra_tokens + H*W + trailing_tokens``
#: tokens, the grid's row-major (``(B, N, C)``, or ``(N, B, C)`` with the token axis first);
#: ``'hwc'``: two axes ``H, W`` (``(B, H, W, C)``); ``'windows'``: one token
#: axis of a ``ws_h x ws_w`` window, windows stacked in the batch
#: (``(B*nW, ws*ws, C)``, Swin's ``WindowMSA``).
LAYOUTS = ('tokens', 'hwc', 'windows')


@dataclass(frozen=True)
class TokenGrid:
    """Where the tokens of a Linear's input lie on a 2-D grid.

    Attributes:
        height: grid rows ``H`` (a window's rows for ``layout='windows'``;
            the reduced grid for a spatially reduced key/value).
        width: grid columns ``W``.
        extra_tokens: leading tokens on no grid (cls / distillation tokens),
            before the ``H*W`` grid tokens; their gradients stay exact.
            ``'tokens'`` layout only.
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
        """Tokens along the token axis (``'tokens'`` / ``'windows'``)."""
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
        """Validate ``shape`` (an input's) against the grid; return the
        token axis as a non-negative index.

        Raises:
            ValueError: naming the mismatch (token count, grid sides, an
                axis out of range or the channel axis).
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


def _autocast_off(device_type: str):
    """Disable autocast in the backward (accumulation stays float32)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


# (start, patches, tokens per patch) of one stretch of equal patches.
_Segment = Tuple[int, int, int]


def _segments(size: int, radius: int) -> List[_Segment]:
    """The patches along one axis as at most two stretches of equal ones:
    the full ``r``-token patches, then the short last patch, if any
    (docs/gradient_filter.md#partial-patches; patch ``P`` covers tokens
    ``[P*r, (P+1)*r)``, the conv's ``Q(P)`` for a ``1 x 1`` kernel)."""
    geo = AxisGeometry.of(size, size, 1, 1, 0, 1, radius)
    full = size // geo.out_patch
    segments = [(0, full, geo.out_patch)] if full else []
    if size % geo.out_patch:
        segments.append((full * geo.out_patch, 1, size % geo.out_patch))
    return segments


@dataclass(frozen=True)
class _Layout:
    """An input's grid, token axis and patch size, resolved for one call.

    Every tensor of the call is seen through :meth:`grid_view`: its grid
    tokens as ``(*lead, H, W, C)``, all other axes (batch, windows, the
    batch of an ``(N, B, C)`` input) leading. Patch sums come back as one
    contiguous ``(L, ceil(H/r), ceil(W/r), C)`` tensor, ``L`` the product of
    the leading axes in their order, so that the backward's GEMMs run on its
    rows.
    """

    grid: TokenGrid
    radius: int
    dim: int  # the token axis (the grid's H axis for 'hwc')

    def extra(self, t: Tensor) -> Optional[Tensor]:
        """The tokens of ``t`` on no grid (leading, then trailing), or
        None."""
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

    def patch_sums(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        """Sums of ``t`` over each ``r x r`` patch, ``(L, Ph, Pw, C)``,
        contiguous, in ``dtype`` (partial patches: over their tokens).

        One channels-last ``avg_pool2d`` with a divisor of 1: a single
        vectorised pass over ``t`` (a strided ``sum`` over the two in-patch
        axes was 3-8x slower on CPU), exact for the clipped border windows
        as in ``filter_output_grad`` of the conv.
        """
        g, r = self.grid, self.radius
        view = self.grid_view(t)
        nchw = view.reshape(-1, g.height, g.width,
                            view.shape[-1]).permute(0, 3, 1, 2)
        sums = F.avg_pool2d(nchw, (min(r, g.height), min(r, g.width)),
                            (r, r), ceil_mode=True, divisor_override=1)
        return sums.permute(0, 2, 3, 1).contiguous().to(dtype)

    def patch_counts(self, sums: Tensor) -> Optional[Tensor]:
        """Tokens per patch, ``(Ph, Pw, 1)`` to divide ``sums``; None when
        every patch is full (divide by ``r^2``)."""
        g, r = self.grid, self.radius
        if g.height % r == 0 and g.width % r == 0:
            return None
        ph, pw = g.patch_grid(r)
        count_h = (g.height - torch.arange(ph) * r).clamp(max=r)
        count_w = (g.width - torch.arange(pw) * r).clamp(max=r)
        counts = (count_h[:, None] * count_w[None, :]).to(sums.device,
                                                          sums.dtype)
        return counts.unsqueeze(-1)

    def spread_into(self, out: Tensor, pooled: Tensor) -> None:
        """Write each patch's row of ``pooled`` (``(L, Ph, Pw, C)``) to
        every grid token of the patch in ``out``
        (docs/gradient_filter.md#backward, step 3): one broadcasting copy
        per stretch of equal patches, straight into ``out``."""
        view = self.grid_view(out)
        lead = view.shape[:-3]
        pooled = pooled.reshape(*lead, *pooled.shape[1:])
        h, w = view.dim() - 3, view.dim() - 2
        for rows in _segments(self.grid.height, self.radius):
            for cols in _segments(self.grid.width, self.radius):
                block = view.narrow(h, rows[0], rows[1] * rows[2]).narrow(
                    w, cols[0], cols[1] * cols[2]).unflatten(
                        w, cols[1:]).unflatten(h, rows[1:])
                src = pooled.narrow(h, rows[0] // self.radius,
                                    rows[1]).narrow(
                                        w, cols[0] // self.radius, cols[1])
                block.copy_(src.unsqueeze(w + 1).unsqueeze(h + 1))


def _rows(t: Tensor) -> Tensor:
    """``t`` as a matrix of rows (last axis kept)."""
    return t.reshape(-1, t.shape[-1])


class GradientFilterLinearFunction(torch.autograd.Function):
    """Autograd Function: ``F.linear`` forward, gradient-filter backward on
    a token grid (docs/gradient_filter.md#linear-layers-on-token-grids)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                grid: TokenGrid, radius: int, token_dim: int) -> Tensor:
        out = F.linear(x, weight, bias)
        layout = _Layout(grid, radius, grid.token_axis(x.shape, token_dim))
        x_sums = x_extra = None
        if ctx.needs_input_grad[1]:
            # Never save x: its patch sums (accumulated in float32 for
            # reduced precision) and its extra tokens only.
            x_sums = layout.patch_sums(
                x, torch.promote_types(x.dtype, torch.float32)).to(x.dtype)
            extra = layout.extra(x)
            x_extra = None if extra is None else extra.contiguous()
        ctx.save_for_backward(x_sums, x_extra, weight)
        ctx.layout = layout
        ctx.input_shape = x.shape
        ctx.input_dtype = x.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor):
        x_sums, x_extra, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        layout = ctx.layout
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_x = grad_w = grad_b = None
        with _autocast_off(grad_output.device.type):
            sums = layout.patch_sums(grad_output, acc)  # step 1
            g_extra = layout.extra(grad_output)
            g_extra = None if g_extra is None else g_extra.to(acc)
            if need_b:  # exact: the sum of the patch sums
                grad_b = _rows(sums).sum(0)
                if g_extra is not None:
                    grad_b += _rows(g_extra).sum(0)
                grad_b = grad_b.to(weight.dtype)
            # Patch means: full patches fold 1/r^2 into the small products
            # below (no pass over the patch grid); partial ones divide the
            # sums (ours, in place) by their token counts.
            counts = layout.patch_counts(sums)
            if counts is not None:
                means, scale = sums.div_(counts), 1.0
            else:
                means, scale = sums, 1.0 / layout.radius**2
            w_acc = weight.to(acc)
            if need_x:  # step 3: W^T g~ per patch, broadcast
                grad_x = grad_output.new_empty(ctx.input_shape,
                                               dtype=ctx.input_dtype)
                w_scaled = w_acc * scale if scale != 1.0 else w_acc
                layout.spread_into(grad_x,
                                   (means @ w_scaled).to(ctx.input_dtype))
                if g_extra is not None:
                    layout.write_extra(grad_x, g_extra @ w_acc)
            if need_w:  # step 4: sum over patches of g~ x~^T
                grad_w = _rows(means).t() @ _rows(x_sums).to(acc)
                if scale != 1.0:
                    grad_w *= scale
                if g_extra is not None:
                    grad_w += _rows(g_extra).t() @ _rows(x_extra).to(acc)
                grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None


def gradient_filtered_linear(x: Tensor,
                             weight: Tensor,
                             bias: Optional[Tensor],
                             grid: TokenGrid,
                             radius: int = 4,
                             token_dim: int = 1) -> Tensor:
    """``F.linear`` whose backward is the gradient filter on a token grid.

    Args:
        x: input ``(..., C_in)`` holding the grid's tokens on ``token_dim``
            (``(B, N, C)``: 1; ``nn.MultiheadAttention``'s ``(N, B, C)``: 0;
            ``'hwc'``: the ``H`` axis, ``W`` after it).
        weight: ``C_out x C_in``.
        bias: optional ``C_out``; its gradient is exact.
        grid: where the tokens lie (:class:`TokenGrid`).
        radius: patch size ``r >= 1``; ``r = 1`` is the exact backward.
        token_dim: the token axis of ``x`` (negative counts from the end).

    Returns:
        Exactly ``F.linear(x, weight, bias)``.

    Raises:
        ValueError: for a bad radius, or an ``x`` that does not hold the
            grid on ``token_dim``.
    """
    radius = check_radius(radius)
    if not isinstance(grid, TokenGrid):
        raise TypeError(f'grid must be a TokenGrid, got {type(grid).__name__}')
    grid.token_axis(x.shape, token_dim)
    return GradientFilterLinearFunction.apply(x, weight, bias, grid, radius,
                                              token_dim)
