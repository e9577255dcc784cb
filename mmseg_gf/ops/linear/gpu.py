"""The GPU path of the filtered Linear on a token grid: Triton kernels on
token rows.

A Linear's grid tokens, seen as ``(L, H, W, C)`` rows (channel stride 1,
other strides free: what ``TokenLayout.grid_rows`` gives), are a
channels-last ``L x C x H x W`` map: the filtered Linear
(docs/gradient_filter.md#linear-layers-on-token-grids) is the conv's
backward on a ``1 x 1`` kernel, and ``rows.permute(0, 3, 1, 2)`` is a view
the products write ``g_x`` into in place (rows of other strides take the
conv's pass over ``g_y`` on that view). (The forward's patch sums of ``x``
stay on the PyTorch path: on an H100 a Triton pass over ``x`` was slower
than its pooling.)

* backward (:func:`filtered_backward`): one Triton pass over ``g_y`` (patch
  means, partial border patches over the tokens they have, and the bias
  gradient's partial sums; :mod:`.triton_token_kernels`' pass made for
  token rows, whose programs each read ``r x r`` tokens x a block of
  contiguous channels), then the two channel-mixing products on the
  ``L * ph * pw`` patch rows in one launch of :mod:`~..conv.products_kernels`
  (``g_W`` and ``g_b``; ``g_x``'s grid tokens, written from its
  registers), or with ``MMSEG_GF_FUSED_PRODUCTS=0`` as GEMMs, the bias's
  sum and a Triton pass writing ``g_x``.

CUDA tensors take it while :func:`triton_runtime.enabled` (triton installed,
``MMSEG_GF_TRITON`` not ``0``, :func:`triton_runtime.set_enabled`); CPU tensors
only under triton's interpreter (``TRITON_INTERPRET=1`` before import: the
tests). Under ``torch.compile`` and on fake or meta tensors the PyTorch
path runs instead (these kernels are not registered as torch ops).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backend import triton_runtime
from ..backend.triton_runtime import FLOAT_TYPES, on_device
from ..conv import gpu as conv_gpu

__all__ = ['refusal', 'usable', 'filtered_backward', 'backward_calls']

_calls = 0


def refusal(*tensors: Optional[Tensor]) -> Optional[str]:
    """Why these tensors (``None`` skipped; the first not ``None`` and
    non-empty) may not take the Triton path, or None: the path enabled,
    plain float tensors on one CUDA device (CPU only under the
    interpreter), not while ``torch.compile`` traces."""
    first = tensors[0]
    reason = triton_runtime.device_refusal(first)
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
    """Whether these tensors may take the Triton path (:func:`refusal`
    gives no reason)."""
    return refusal(*tensors) is None


def _conv_kernels():
    from ..conv import kernels as conv_kernels  # imports triton: on first use
    return conv_kernels


def _products():
    from ..conv import products_kernels  # imports triton: on first use
    return products_kernels


def _token_kernels():
    from . import kernels as triton_token_kernels  # imports triton: on first use
    return triton_token_kernels


def backward_calls() -> int:
    """How many backward calls of the filtered Linear ran the Triton
    kernels in this process (a diagnostic)."""
    return _calls


def filtered_backward(g_rows: Tensor, x_sums: Optional[Tensor],
                      weight: Tensor, out_rows: Optional[Tensor], radius: int,
                      need_w: bool, need_b: bool, acc: torch.dtype
                      ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Steps 1, 3 and 4 of the filtered Linear on the grid tokens
    (``_filtered_backward_torch``'s contract).

    Args:
        g_rows: ``g_y``'s grid tokens, ``(L, H, W, Co)``, any strides.
        x_sums: the forward's patch sums ``(L, ph, pw, Ci)`` (contiguous),
            or None when ``g_W`` is not needed.
        weight: ``Co x Ci``.
        out_rows: ``g_x``'s grid tokens ``(L, H, W, Ci)`` (a view into
            ``g_x``, written in full), or None.
        radius: the patch size ``r``.
        need_w, need_b: whether ``g_W`` / ``g_b`` are wanted.
        acc: the accumulation dtype (float32, float64 for float64).

    Returns:
        ``(g_W, g_b)`` of the grid tokens in ``acc`` (None where not
        asked).
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
    """:func:`filtered_backward` after the pass over ``g_y``, as the one
    launch of :mod:`~..conv.products_kernels`."""
    sums = x_sums.reshape(-1, x_sums.shape[-1]).t() if need_w else None
    out = None if out_rows is None else out_rows.permute(0, 3, 1, 2)
    grad_w, grad_b = _products().products(
        means, sums, partial, weight, weight, out, rows, cols, need_w,
        need_b, grad_dtype=means.dtype)
    return (grad_w if need_w else None), (grad_b if need_b else None)
