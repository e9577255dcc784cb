"""Gradient-filtered Linear on a token grid: exact forward, filtered
backward.

A Linear on a feature map's tokens is a ``1 x 1`` conv and gets the conv's
filter (docs/gradient_filter.md, "Linear layers on token grids"); ``g_b``
and tokens on no grid stay exact. The backward runs in C++ on CPU, with
Triton on CUDA, or in the PyTorch reference here. No mmseg import.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..backend import dispatch, output_pool
from ..patch_grid import autocast_off, check_radius
from ..function_output import owned_output
from .token_grid import TokenGrid, TokenLayout, token_layout


def _rows(t: Tensor) -> Tensor:
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
    """Steps 1, 3 and 4 on the grid tokens by the dispatcher's choice,
    writing ``g_x``'s grid tokens into ``grad_x``; returns ``(g_W, g_b)`` in
    ``acc``.
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
    """:func:`_filtered_backward` in PyTorch ops (the reference)."""
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
    """Memory for ``g_x``: recycled where the compiled kernels keep a pool (no
    page faults of fresh memory each step), else ``torch.empty``.
    """
    if grad_output.dtype == dtype:
        return output_pool.empty_for_writing(shape, grad_output)
    return grad_output.new_empty(shape, dtype=dtype)


def _own_copy(part: Tensor, x: Tensor) -> Tensor:
    """``part`` of ``x`` as a contiguous tensor of its own: a view would
    keep all of ``x``'s storage when saved (always a copy under
    ``torch.compile``).
    """
    if torch.compiler.is_compiling():
        return part.clone(memory_format=torch.contiguous_format)
    part = part.contiguous()
    if part.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        part = part.clone()
    return part


class GradientFilterLinearFunction(torch.autograd.Function):
    """``F.linear`` forward, gradient-filter backward on a token grid."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                grid: TokenGrid, radius: int, token_dim: int) -> Tensor:
        out = F.linear(x, weight, bias)
        layout = token_layout(grid, radius, tuple(x.shape), token_dim)
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
        x: ``(..., C_in)`` holding the grid's tokens on ``token_dim`` (1 for
            ``(B, N, C)``, 0 for ``(N, B, C)``, the ``H`` axis for ``'hwc'``).
        weight, bias: as in ``F.linear``; the bias gradient is exact.
        grid: where the tokens lie (:class:`TokenGrid`).
        radius: patch size ``r >= 1``; ``r = 1`` is the exact backward.
        token_dim: the token axis of ``x`` (negative counts from the end).

    Returns:
        Exactly ``F.linear(x, weight, bias)``.

    Raises:
        ValueError: for a bad radius, or an ``x`` without the grid on
            ``token_dim``.
    """
    radius = check_radius(radius)
    if not isinstance(grid, TokenGrid):
        raise TypeError(f'grid must be a TokenGrid, got {type(grid).__name__}')
    token_layout(grid, radius, tuple(x.shape), token_dim)  # checks the shape
    if x.numel() == 0 or weight.numel() == 0:
        # no token or no channel: nothing to filter, the exact (empty or
        # zero) gradients
        return F.linear(x, weight, bias)
    return GradientFilterLinearFunction.apply(x, weight, bias, grid, radius,
                                              token_dim)
