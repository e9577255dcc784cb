"""Bilinear resizes on a GPU as two matrix products.

A bilinear resize is ``y = A x B^T`` per plane (``A``, ``B``: each axis'
interpolation weights, torch's), its input gradient ``g_x = A^T g_y B``:
two batched GEMMs, or one with ``A (x) B`` for a source of at most 64
pixels. The matrices have batch stride 0 and channel slices are read in
place: no operand is copied. Why (torch's CUDA resize kernels took up to
half of a lean step's device time) and rounding: docs/lean_region.md and
docs/reliability.md, "Precision". Switch: ``MMSEG_GF_RESIZE_GEMM``.
"""
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..backend import dispatch, shape_caches, switches
from ..backend.device_path import acting_as_cuda

__all__ = ['refusal', 'usable', 'interpolation_matrix', 'one_product', 'resize',
           'resize_backward']

_DTYPES = (torch.float32, torch.float64)

#: Source pixels up to which a resize is one product (:func:`one_product`).
ONE_PRODUCT_PIXELS = 64
#: The most elements that product's matrix may have (16 MiB in float32).
ONE_PRODUCT_ELEMENTS = 1 << 22


def refusal(t: Tensor) -> Optional[str]:
    """Why a resize of (or gradient) ``t`` may not take the GEMMs, or None: it
    needs a float32 / float64 CUDA tensor, the switch on, and no tracing.
    """
    if not (t.device.type == 'cuda' or acting_as_cuda()):
        return f'{t.device.type} tensor'
    if t.dtype not in _DTYPES:
        return f'{t.dtype} tensor'
    if not switches.value('MMSEG_GF_RESIZE_GEMM'):
        return 'MMSEG_GF_RESIZE_GEMM off'
    if torch.compiler.is_compiling():
        return 'compiling (Inductor writes its own resize)'
    return None


def usable(t: Tensor) -> bool:
    """Whether the dispatcher's ``resize`` takes the GEMMs for ``t``."""
    return dispatch.refusal('resize', 'gemm', t) is None


def _source_scale(in_size: int, out_size: int, align_corners: bool,
                  scale: Optional[float]) -> float:
    """torch's ``area_pixel_compute_scale``."""
    if align_corners:
        return (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    if scale is not None and scale > 0:
        return 1.0 / scale
    return in_size / out_size


#: Interpolation matrices kept (per size pair, dtype and device): a network
#: resizes to a few sizes, a random-resize pipeline to a few per batch.
MATRIX_CACHE_SIZE = 64
#: Kronecker products kept (small sources only, at most 16 MiB each).
KRONECKER_CACHE_SIZE = 32


@shape_caches.lru('bilinear_gemm.matrix', MATRIX_CACHE_SIZE)
def _matrix(out_size: int, in_size: int, align_corners: bool,
            scale: Optional[float], dtype: torch.dtype,
            device: torch.device) -> Tensor:
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    ratio = torch.tensor(_source_scale(in_size, out_size, align_corners,
                                       scale), dtype=acc)
    index = torch.arange(out_size, dtype=acc)
    if align_corners:
        source = ratio * index
    else:  # pixel centres; clamped at 0 (torch's linear modes do)
        source = (ratio * (index + 0.5) - 0.5).clamp_min(0)
    low = source.long().clamp_max(in_size - 1)  # floor: source >= 0
    high = torch.where(low < in_size - 1, low + 1, low)
    frac = source - low.to(acc)
    matrix = torch.zeros(out_size, in_size, dtype=acc)
    rows = torch.arange(out_size)
    matrix.index_put_((rows, low), 1 - frac, accumulate=True)
    matrix.index_put_((rows, high), frac, accumulate=True)
    return matrix.to(dtype=dtype, device=device)


def interpolation_matrix(out_size: int, in_size: int, align_corners: bool,
                         scale: Optional[float], dtype: torch.dtype,
                         device) -> Tensor:
    """The ``out_size x in_size`` bilinear weights of one axis, as torch's
    kernel computes them; LRU-cached per shape, dtype and device.
    """
    return _matrix(int(out_size), int(in_size), bool(align_corners),
                   None if scale is None else float(scale), dtype,
                   torch.device(device))


def _matrices(out_hw: Sequence[int], in_hw: Sequence[int],
              align_corners: bool, scales, like: Tensor
              ) -> Tuple[Tensor, Tensor]:
    rows = interpolation_matrix(out_hw[0], in_hw[0], align_corners,
                                scales[0], like.dtype, like.device)
    cols = interpolation_matrix(out_hw[1], in_hw[1], align_corners,
                                scales[1], like.dtype, like.device)
    return rows, cols


@shape_caches.lru('bilinear_gemm.kronecker', KRONECKER_CACHE_SIZE)
def _kronecker(out_hw: Tuple[int, int], in_hw: Tuple[int, int],
               align_corners: bool, scales, dtype: torch.dtype,
               device: torch.device) -> Tensor:
    rows = interpolation_matrix(out_hw[0], in_hw[0], align_corners,
                                scales[0], dtype, device)
    cols = interpolation_matrix(out_hw[1], in_hw[1], align_corners,
                                scales[1], dtype, device)
    return torch.kron(rows, cols)


def one_product(out_hw: Sequence[int], in_hw: Sequence[int]) -> bool:
    """Whether a resize runs as one product with ``A (x) B``: a source of at
    most :data:`ONE_PRODUCT_PIXELS` pixels (one launch where two would run).
    """
    return (in_hw[0] * in_hw[1] <= ONE_PRODUCT_PIXELS
            and out_hw[0] * out_hw[1] * in_hw[0] * in_hw[1]
            <= ONE_PRODUCT_ELEMENTS)



def _kron_for(out_hw, in_hw, align_corners, scales, like) -> Tensor:
    return _kronecker(tuple(int(v) for v in out_hw),
                      tuple(int(v) for v in in_hw), bool(align_corners),
                      tuple(None if v is None else float(v) for v in scales),
                      like.dtype, like.device)


def _batched(matrix: Tensor, count: int) -> Tensor:
    """``matrix`` as a batch of ``count`` with batch stride 0 (no copy)."""
    return matrix.expand(count, *matrix.shape)


def resize(x: Tensor, out_hw: Sequence[int], align_corners: bool,
           scales=(None, None)) -> Tensor:
    """``F.interpolate(x, out_hw, mode='bilinear', align_corners)`` as ``A x
    B^T`` per plane, contiguous NCHW.
    """
    n, c, h, w = x.shape
    if one_product(out_hw, (h, w)):
        kron = _kron_for(out_hw, (h, w), align_corners, scales, x)
        y = torch.bmm(x.reshape(n, c, h * w), _batched(kron.t(), n))
        return y.view(n, c, *out_hw)
    rows, cols = _matrices(out_hw, (h, w), align_corners, scales, x)
    partial = torch.bmm(x.reshape(n, c * h, w), _batched(cols.t(), n))
    y = torch.bmm(_batched(rows, n * c), partial.view(n * c, h, -1))
    return y.view(n, c, *out_hw)


def resize_backward(grad: Tensor, in_hw: Sequence[int], align_corners: bool,
                    scales=(None, None), out: Optional[Tensor] = None
                    ) -> Tensor:
    """The input gradient of :func:`resize`, ``A^T grad B`` per plane (a
    channel slice read in place), into ``out`` when given.
    """
    n, c, h_out, w_out = grad.shape
    h, w = int(in_hw[0]), int(in_hw[1])
    if out is None:
        out = grad.new_empty((n, c, h, w))
    if one_product(grad.shape[2:], (h, w)):
        kron = _kron_for(grad.shape[2:], (h, w), align_corners, scales, grad)
        torch.bmm(grad.reshape(n, c, h_out * w_out), _batched(kron, n),
                  out=out.view(n, c, h * w))
        return out
    rows, cols = _matrices(grad.shape[2:], (h, w), align_corners, scales,
                           grad)
    partial = torch.bmm(grad.reshape(n, c * h_out, w_out),
                        _batched(cols, n))
    torch.bmm(_batched(rows.t(), n * c), partial.view(n * c, h_out, w),
              out=out.view(n * c, h, w))
    return out
