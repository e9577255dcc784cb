"""Bilinear resizes on a GPU as two matrix products.

A bilinear resize is separable: ``y = A x B^T`` for every image and
channel plane ``x`` (``H_in x W_in``), where ``A`` (``H_out x H_in``) and
``B`` (``W_out x W_in``) hold each output row's (column's) two
interpolation weights at the two source rows (columns) torch's kernel
reads. Its input gradient is the transpose, ``g_x = A^T g_y B``. Both are
two batched GEMMs (cuBLAS), the width contracted first; a small source
(at most 64 pixels: a pyramid pooling branch's 1x1 to 6x6 maps) takes one,
with the Kronecker product ``A (x) B`` (:func:`one_product`). The matrices
enter the batched GEMMs with a batch stride of 0 and a channel slice of a
gradient is read in place: no operand is copied.

Why: torch's CUDA kernels for a contiguous NCHW map parallelise over
output pixels only and its backward adds four atomic terms per output
pixel; they took up to half of a lean step's device time on an H200
(docs/benchmarks/README.md, "Where the time goes"). The products read and
write each map once and have ``~4 (H_in + W_out)`` flops per output pixel.

Rounding: the same weighted sums as torch's (weights computed as its
kernel computes them), summed in another order: equal within float32
rounding, tested against ``F.interpolate`` and its autograd gradient. A
non-finite value spreads to its whole image-channel plane
(docs/reliability.md, "Precision").

Taken by :mod:`.resize` and :mod:`.resized_loss` on CUDA tensors of float32
or float64 while ``MMSEG_GF_RESIZE_GEMM`` is on (:mod:`.switches`);
:func:`refusal` says why not (the dispatcher's ``resize`` asks it)."""
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
    """Why a bilinear resize of (or gradient) ``t`` may not take the GEMMs,
    or None: a float32 / float64 CUDA tensor (or a CPU one inside
    :func:`~.device_path.as_on_cuda`, for the launch count), the switch
    on, not while ``torch.compile`` traces (Inductor writes its own
    resize)."""
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
    """torch's ``area_pixel_compute_scale``: source pixels per output
    pixel."""
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
    """The ``out_size x in_size`` matrix of one axis' bilinear weights
    (torch's source indices and weights; ``scale``: the scale factor a
    resize was given, as torch's kernel receives it, or None). Cached per
    shape, dtype and device (:data:`MATRIX_CACHE_SIZE` of them, least
    recently used first out)."""
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
    """Whether a resize between these sizes runs as one product with the
    ``(H_out W_out) x (H_in W_in)`` matrix ``A (x) B`` (the two axes'
    matrices' Kronecker product): for a source of at most
    :data:`ONE_PRODUCT_PIXELS` pixels (a pyramid pooling branch's 1x1 to
    6x6 maps), whose products cost that many multiply-adds per output
    pixel, one launch where the separable form takes two."""
    return (in_hw[0] * in_hw[1] <= ONE_PRODUCT_PIXELS
            and out_hw[0] * out_hw[1] * in_hw[0] * in_hw[1]
            <= ONE_PRODUCT_ELEMENTS)



def _kron_for(out_hw, in_hw, align_corners, scales, like) -> Tensor:
    return _kronecker(tuple(int(v) for v in out_hw),
                      tuple(int(v) for v in in_hw), bool(align_corners),
                      tuple(None if v is None else float(v) for v in scales),
                      like.dtype, like.device)


def _batched(matrix: Tensor, count: int) -> Tensor:
    """``matrix`` repeated ``count`` times as a batch, without a copy (a
    batch stride of 0, which batched GEMMs read as is)."""
    return matrix.expand(count, *matrix.shape)


def resize(x: Tensor, out_hw: Sequence[int], align_corners: bool,
           scales=(None, None)) -> Tensor:
    """``F.interpolate(x, out_hw, mode='bilinear', align_corners)`` of an
    ``N x C x H x W`` tensor as ``A x B^T`` per plane (contiguous NCHW
    out): one batched GEMM for a small source (:func:`one_product`), else
    two."""
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
    """The input gradient of :func:`resize` for ``grad`` (``N x C x H_out x
    W_out``; a channel slice of a larger gradient is read in place):
    ``A^T grad B`` per plane, written into ``out`` (contiguous, ``N x C x
    H_in x W_in``) when given."""
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
