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
two GEMMs on ``N / r^2`` rows. On CPU with the compiled kernels
(``native``: float32 / float64, channels with stride 1) the patch sums of
``x`` and the whole backward of the grid tokens run in C++
(``csrc/token_grid_backward.cpp``: one read of ``g_y``, one write of
``g_x``, into recycled memory); on CUDA the conv's Triton kernels do the
same on the token rows seen as a channels-last map (``triton_linear``;
off with ``MMSEG_GF_TRITON=0`` or ``triton_runtime.set_enabled(False)``); the
pure-PyTorch path here is the reference and the fallback
(``MMSEG_GF_NATIVE=0``). No mmseg import.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..backend import dispatch, output_pool
from ..patch_grid import AxisGeometry, autocast_off, check_radius
from ..function_output import owned_output

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
class TokenLayout:
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

    def grid_rows(self, t: Tensor) -> Optional[Tensor]:
        """``t``'s grid tokens as ``(L, H, W, C)``, a view of ``t``; None
        where the leading axes do not merge without a copy."""
        view = self.grid_view(t)
        try:
            return view.view(-1, *view.shape[-3:])
        except RuntimeError:
            return None

    def rows_to_read(self, t: Tensor) -> Tensor:
        """``t``'s grid tokens as ``(L, H, W, C)`` to read: the view of
        :meth:`grid_rows`, or a copy where the leading axes do not merge."""
        rows = self.grid_rows(t)
        if rows is None:
            view = self.grid_view(t)
            rows = view.reshape(-1, *view.shape[-3:])
        return rows

    def pool_rows(self, rows: Tensor, dtype: torch.dtype,
                  mean: bool = False) -> Tensor:
        """Sums (``mean``: means) of ``(l, H, W, C)`` tokens over each ``r
        x r`` patch, ``(l, Ph, Pw, C)``, contiguous, in ``dtype`` (partial
        patches: over their tokens).

        One channels-last ``avg_pool2d`` with a divisor of 1: a single
        vectorised pass (a strided ``sum`` over the two in-patch axes was
        3-8x slower on CPU), exact for the clipped border windows as in
        ``filter_output_grad`` of the conv. The means divide the same sums
        by each window's token count in the same pass (the clipped windows
        of ``ceil_mode`` without padding count their tokens only).
        """
        g, r = self.grid, self.radius
        sums = F.avg_pool2d(rows.permute(0, 3, 1, 2),
                            (min(r, g.height), min(r, g.width)), (r, r),
                            ceil_mode=True,
                            divisor_override=None if mean else 1)
        return sums.permute(0, 2, 3, 1).contiguous().to(dtype)

    def patch_sums(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        """:meth:`pool_rows` of ``t``'s grid tokens, ``(L, Ph, Pw, C)``
        (the forward's ``x~``); one read of ``t`` where the compiled CPU
        kernel applies, the same sums in another order. (On CUDA the
        PyTorch pooling is kept: on an H100 a Triton pass made the filtered
        Linear's forward 1.2-4.6x slower than it, docs/benchmarks.)"""
        rows = self.rows_to_read(t)
        choice = dispatch.choose('token_patch_sums', self, rows, dtype)
        return choice.implementation.run(self, rows, dtype)

    def patch_counts(self, sums: Tensor) -> Optional[Tensor]:
        """Tokens per patch, ``(Ph, Pw, 1)`` to divide ``sums``; None when
        every patch is full (divide by ``r^2``)."""
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
        """Write each patch's row of ``pooled`` (``(l, Ph, Pw, C)``) to
        every token of the patch in ``out`` (``(l, H, W, C)``, a view into
        ``g_x``; docs/gradient_filter.md#backward, step 3): one
        broadcasting copy per stretch of equal patches."""
        for rows in _segments(self.grid.height, self.radius):
            for cols in _segments(self.grid.width, self.radius):
                block = out.narrow(1, rows[0], rows[1] * rows[2]).narrow(
                    2, cols[0], cols[1] * cols[2]).unflatten(
                        2, cols[1:]).unflatten(1, rows[1:])
                src = pooled.narrow(1, rows[0] // self.radius,
                                    rows[1]).narrow(
                                        2, cols[0] // self.radius, cols[1])
                block.copy_(src.unsqueeze(3).unsqueeze(2))


def _rows(t: Tensor) -> Tensor:
    """``t`` as a matrix of rows (last axis kept)."""
    return t.reshape(-1, t.shape[-1])


#: Bytes of ``g_y`` the backward filters at a time (whole leading rows: an
#: image, or a group of windows). Each chunk's temporaries (patch sums, the
#: pooled ``g_x``) are then a few MiB that the allocator reuses from chunk to
#: chunk; one whole-tensor pass allocated them afresh at every step, and on
#: CPU the page faults of that fresh memory cost as much as the pooling.
CHUNK_BYTES = 8 << 20


def _filtered_backward(layout: TokenLayout, grad_output: Tensor,
                       x_sums: Optional[Tensor], weight: Tensor,
                       grad_x: Optional[Tensor], need_w: bool, need_b: bool,
                       acc: torch.dtype
                       ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Steps 1, 3 and 4 on the grid tokens
    (docs/gradient_filter.md#linear-layers-on-token-grids): the Triton
    kernels on CUDA (:func:`triton_linear.filtered_backward`), the compiled
    kernel on CPU, else PyTorch ops chunk by chunk of leading rows.

    Writes ``g_x``'s grid tokens into ``grad_x`` (when given); returns
    ``(g_W, g_b)`` of the grid tokens in ``acc`` (None where not asked).
    """
    g_rows = layout.rows_to_read(grad_output)
    sums = x_sums if need_w else None
    out_rows = staging = None
    if grad_x is not None:
        out_rows = layout.grid_rows(grad_x)
        if out_rows is None:  # leading axes that do not merge: stage
            staging = grad_x.new_empty(*g_rows.shape[:-1], grad_x.shape[-1])
            out_rows = staging
    backward = dispatch.choose('linear_backward', layout, g_rows, sums, weight,
                               out_rows, need_w, need_b, acc)
    grad_w, grad_b = backward.implementation.run(
        layout, g_rows, x_sums, weight, out_rows, need_w, need_b, acc)
    if staging is not None:
        layout.grid_view(grad_x).copy_(
            staging.view(layout.grid_view(grad_x).shape))
    return grad_w, grad_b


def filtered_backward_torch(layout: TokenLayout, g_rows: Tensor,
                             x_sums: Optional[Tensor], weight: Tensor,
                             out_rows: Optional[Tensor], need_w: bool,
                             need_b: bool, acc: torch.dtype
                             ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """:func:`_filtered_backward` in PyTorch ops (the reference), on the
    ``(L, H, W, C)`` rows of ``g_y`` and ``g_x``, chunk by chunk."""
    grid, r = layout.grid, layout.radius
    full = grid.height % r == 0 and grid.width % r == 0
    counts = None
    # Full patches fold 1/r^2 into the small products (no pass over the
    # patch grid); partial ones divide the sums (ours, in place).
    w_acc = weight.to(acc)
    scale = 1.0 / r**2 if full else 1.0
    w_mix = w_acc * scale if full and out_rows is not None else w_acc
    x_rows = None if x_sums is None else x_sums.to(acc)
    grad_w = w_acc.new_zeros(w_acc.shape) if need_w else None
    grad_b = w_acc.new_zeros(w_acc.shape[0]) if need_b else None
    per_row = max(1, g_rows[0].numel() * g_rows.element_size())
    step = max(1, CHUNK_BYTES // per_row)
    for start in range(0, g_rows.shape[0], step):
        sums = layout.pool_rows(g_rows[start:start + step], acc)  # step 1
        if need_b:
            grad_b += _rows(sums).sum(0)
        if not full:  # partial patches: means by their token counts
            if counts is None:
                counts = layout.patch_counts(sums)
            sums.div_(counts)
        if out_rows is not None:  # step 3, broadcast
            pooled = (sums @ w_mix).to(out_rows.dtype)
            layout.spread_rows(out_rows[start:start + step], pooled)
        if need_w:  # step 4
            grad_w.addmm_(_rows(sums).t(), _rows(x_rows[start:start + step]))
    if need_w and full:
        grad_w.mul_(scale)
    return grad_w, grad_b


def _empty_grad_input(grad_output: Tensor, shape: torch.Size,
                      dtype: torch.dtype) -> Tensor:
    """Memory for ``g_x``, which the backward writes in full (grid tokens
    and extra tokens): a recycled block of its byte size where the compiled
    kernels keep one (:func:`output_pool.empty_for_writing`, as the filtered
    conv's ``g_x``), so that a step does not pay the page faults of fresh
    memory again; else ``torch.empty``."""
    if grad_output.dtype == dtype:
        return output_pool.empty_for_writing(shape, grad_output)
    return grad_output.new_empty(shape, dtype=dtype)


def _own_copy(part: Tensor, x: Tensor) -> Tensor:
    """``part`` of ``x`` (its extra tokens) as a contiguous tensor of its
    own: a contiguous narrow (the token axis first, or one image) is a view
    of ``x``, and saving it would keep all of ``x``'s storage. Under
    ``torch.compile`` (no storage to compare) always a copy: these are a
    few tokens per image."""
    if torch.compiler.is_compiling():
        return part.clone(memory_format=torch.contiguous_format)
    part = part.contiguous()
    if part.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        part = part.clone()
    return part


class GradientFilterLinearFunction(torch.autograd.Function):
    """Autograd Function: ``F.linear`` forward, gradient-filter backward on
    a token grid (docs/gradient_filter.md#linear-layers-on-token-grids)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                grid: TokenGrid, radius: int, token_dim: int) -> Tensor:
        out = F.linear(x, weight, bias)
        layout = TokenLayout(grid, radius, grid.token_axis(x.shape, token_dim))
        x_sums = x_extra = None
        if ctx.needs_input_grad[1]:
            # Never save x: its patch sums (accumulated in float32 for
            # reduced precision) and its extra tokens only.
            x_sums = layout.patch_sums(
                x, torch.promote_types(x.dtype, torch.float32)).to(x.dtype)
            extra = layout.extra(x)
            x_extra = None if extra is None else _own_copy(extra, x)
        ctx.save_for_backward(x_sums, x_extra, weight)
        ctx.layout = layout
        ctx.input_shape = x.shape
        ctx.input_dtype = x.dtype
        return owned_output(out, x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor):
        x_sums, x_extra, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        layout = ctx.layout
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_x = grad_w = grad_b = None
        with autocast_off(grad_output.device.type):
            if need_x:
                grad_x = _empty_grad_input(grad_output, ctx.input_shape,
                                           ctx.input_dtype)
            grad_w, grad_b = _filtered_backward(layout, grad_output, x_sums,
                                                weight, grad_x, need_w,
                                                need_b, acc)
            # tokens on no grid: the exact rules
            g_extra = layout.extra(grad_output)
            if g_extra is not None:
                g_extra = g_extra.to(acc)
                if need_x:
                    layout.write_extra(grad_x, g_extra @ weight.to(acc))
                if need_w:
                    grad_w += _rows(g_extra).t() @ _rows(x_extra).to(acc)
                if need_b:
                    grad_b += _rows(g_extra).sum(0)
            if need_w:
                grad_w = grad_w.to(weight.dtype)
            if need_b:
                grad_b = grad_b.to(weight.dtype)
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
    if x.numel() == 0 or weight.numel() == 0:
        # no token or no channel: nothing to filter, the exact (empty or
        # zero) gradients
        return F.linear(x, weight, bias)
    return GradientFilterLinearFunction.apply(x, weight, bias, grid, radius,
                                              token_dim)
