"""The GPU path of the filtered Linear on a token grid: Triton kernels on
token rows.

Grid tokens as ``(L, H, W, C)`` rows are a channels-last ``L x C x H x W``
map, so the filtered Linear is the conv's backward on a ``1 x 1`` kernel
(docs/gradient_filter.md#linear-layers-on-token-grids):
:func:`filtered_backward` is one pass over ``g_y`` made for token rows,
then one launch of :mod:`~..conv.products_kernels` writing ``g_W``,
``g_b`` and ``g_x`` (``MMSEG_GF_FUSED_PRODUCTS=0``: GEMMs and a spread).
The forward's patch sums stay on PyTorch's pooling
(docs/benchmarks/design_measurements.md). Not under ``torch.compile`` nor
on fake tensors (these kernels are not torch ops).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backend import availability
from ..backend.triton_runtime import FLOAT_TYPES, lazy_module, on_device
from ..conv import gpu as conv_gpu

__all__ = ['refusal', 'usable', 'filtered_backward', 'backward_calls']

_calls = 0


def refusal(*tensors: Optional[Tensor]) -> Optional[str]:
    """Why these tensors (the first non-empty one) may not take the Triton
    path, or None.
    """
    first = tensors[0]
    reason = availability.triton_refusal(first)
    if reason is not None:
        return reason
    if first.numel() == 0:
        return 'empty'
    if torch.compiler.is_compiling():
        return 'compiling'
    if not all(t is None or (type(t) in (Tensor, torch.nn.Parameter)
                             and t.device == first.device
                             and t.dtype in FLOAT_TYPES) for t in tensors):
        return 'not plain float tensors on one device'
    return None


def usable(*tensors: Optional[Tensor]) -> bool:
    """Whether these tensors may take the Triton path."""
    return refusal(*tensors) is None


def _import_conv_kernels():
    from ..conv import kernels as conv_kernels  # imports triton: on first use
    return conv_kernels


def _import_products():
    from ..conv import products_kernels  # imports triton: on first use
    return products_kernels


def _import_token_kernels():
    from . import kernels as triton_token_kernels  # imports triton: on first use
    return triton_token_kernels


_conv_kernels = lazy_module(_import_conv_kernels)
_products = lazy_module(_import_products)
_token_kernels = lazy_module(_import_token_kernels)


def backward_calls() -> int:
    """Backward calls that ran the Triton kernels (a diagnostic)."""
    return _calls


def filtered_backward(g_rows: Tensor, x_sums: Optional[Tensor],
                      weight: Tensor, out_rows: Optional[Tensor], radius: int,
                      need_w: bool, need_b: bool, acc: torch.dtype
                      ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Steps 1, 3 and 4 of the filtered Linear on the grid tokens.

    Args:
        g_rows: ``g_y``'s grid tokens, ``(L, H, W, Co)``, any strides.
        x_sums: the forward's patch sums ``(L, ph, pw, Ci)``, or None when
            ``g_W`` is not needed.
        weight: ``Co x Ci``.
        out_rows: ``g_x``'s grid tokens (a view, written in full), or None.
        radius: the patch size ``r``.
        need_w, need_b: whether ``g_W`` / ``g_b`` are wanted.
        acc: the accumulation dtype.

    Returns:
        ``(g_W, g_b)`` in ``acc`` (None where not asked).
    """
    global _calls
    _calls += 1
    kernels = _conv_kernels()
    n, height, width, _ = g_rows.shape
    rows = kernels.radius_patches(height, radius)
    cols = kernels.radius_patches(width, radius)
    grad_w = grad_b = None
    with on_device(g_rows):
        # scale 1: plain patch means; token rows with contiguous channels
        # (what TokenLayout gives) take the pass made for them
        if g_rows.stride(3) == 1:
            means, partial = _token_kernels().token_patch_means(
                g_rows, radius, 1.0, acc)
        else:
            means, partial = kernels.output_grad_means(
                g_rows.permute(0, 3, 1, 2), radius, 1.0, acc)
        if conv_gpu.fused_products():
            return _fused(means, partial, x_sums, weight, out_rows, rows,
                          cols, need_w, need_b)
        flat = means.view(means.shape[0], -1)  # Co x (L ph pw)
        if need_b:
            grad_b = partial.sum(dim=(0, 2))
        if need_w:
            grad_w = flat @ x_sums.reshape(-1, x_sums.shape[-1]).to(acc)
        if out_rows is not None:
            grid = (flat.t() @ weight.to(acc)).view(n, rows[2], cols[2], -1)
            kernels.spread(grid.permute(0, 3, 1, 2),
                           out_rows.permute(0, 3, 1, 2), rows, cols)
    return grad_w, grad_b


def _fused(means: Tensor, partial: Tensor, x_sums: Optional[Tensor],
           weight: Tensor, out_rows: Optional[Tensor], rows, cols,
           need_w: bool, need_b: bool
           ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The products after the pass over ``g_y``, in one launch."""
    sums = x_sums.reshape(-1, x_sums.shape[-1]).t() if need_w else None
    out = None if out_rows is None else out_rows.permute(0, 3, 1, 2)
    grad_w, grad_b = _products().products(
        means, sums, partial, weight, weight, out, rows, cols, need_w,
        need_b, grad_dtype=means.dtype)
    return (grad_w if need_w else None), (grad_b if need_b else None)
