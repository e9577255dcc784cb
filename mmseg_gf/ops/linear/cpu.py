"""The filtered Linear's compiled CPU kernels
(``csrc/token_grid_backward.cpp``): the patch sums of token rows and the
whole filtered backward of the grid tokens in one call."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backend import availability, extension

__all__ = ['TOKEN_CHUNK_BYTES', 'TOKEN_STREAM_BYTES', 'token_rows_refusal',
           'token_rows_usable', 'token_patch_sums', 'token_filtered_backward']

_kernels = extension.module('patch_ops')


#: Bytes of patch means and ``g_x~`` that :func:`token_filtered_backward`
#: holds per chunk of patch rows: both stay in the L2 cache (1-2 MiB per
#: core on current x86 CPUs) between the pooling, the GEMMs and the spread.
TOKEN_CHUNK_BYTES = 1 << 20

#: A ``g_x`` of this many bytes or more is written with non-temporal
#: stores: it does not fit the caches anyway, and streaming stores skip the
#: read of every cache line before its write.
TOKEN_STREAM_BYTES = 16 << 20


def token_rows_refusal(*tensors: Optional[Tensor]) -> Optional[str]:
    """Why the token-grid kernels may not take these tensors, or None: they
    take ``L x H x W x C`` token rows (any strides but a channel stride of
    1) and matrices: CPU tensors of one dtype, float32 or float64, in eager
    mode; ``None`` entries are skipped."""
    reason = availability.native_refusal('patch_ops')
    if reason is not None:
        return reason
    if not hasattr(_kernels, 'token_filtered_backward'):
        return 'extension built without the token-grid kernels'
    if torch.compiler.is_compiling():
        return 'compiling'
    given = [t for t in tensors if t is not None]
    dtype = given[0].dtype
    if dtype not in (torch.float32, torch.float64):
        return f'{dtype} tensor'
    if not all(t.device.type == 'cpu' and t.dtype == dtype and
               (t.shape[-1] <= 1 or t.stride(-1) == 1) for t in given):
        return 'not CPU token rows of one dtype with contiguous channels'
    return None


def token_rows_usable(*tensors: Optional[Tensor]) -> bool:
    """Whether the token-grid kernels take these tensors
    (:func:`token_rows_refusal` gives no reason)."""
    return token_rows_refusal(*tensors) is None


def token_patch_sums(rows: Tensor, radius: int) -> Tensor:
    """Sums of ``rows`` (``L x H x W x C`` token rows) over every ``r x r``
    patch, ``L x ceil(H/r) x ceil(W/r) x C``, contiguous (partial border
    patches: over their tokens); one read of ``rows``
    (``csrc/token_grid_backward.cpp``)."""
    return _kernels.token_patch_sums(rows, int(radius))


def token_filtered_backward(grad_rows: Tensor, x_sums: Optional[Tensor],
                            weight: Tensor, grad_x_rows: Optional[Tensor],
                            radius: int, need_weight: bool, need_bias: bool
                            ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The filtered backward of a Linear's grid tokens in one call.

    ``grad_rows``: ``g_y``'s grid tokens as ``L x H x W x Co`` token rows;
    ``x_sums``: the forward's patch sums of ``x``, contiguous ``L x Ph x Pw
    x Ci`` (for ``g_W``); ``grad_x_rows``: where ``g_x``'s grid tokens are
    written (``L x H x W x Ci`` token rows), or None. Returns ``(g_W,
    g_b)``, None where not asked for; every tensor of one dtype.
    """
    grad_w, grad_b = _kernels.token_filtered_backward(
        grad_rows, x_sums, weight, grad_x_rows, int(radius),
        bool(need_weight), bool(need_bias), int(TOKEN_CHUNK_BYTES),
        int(TOKEN_STREAM_BYTES))
    return grad_w, grad_b
