"""The bilinear resize's compiled CPU backward
(``csrc/bilinear_backward.cpp``)."""
from typing import Optional, Tuple

from torch import Tensor

from ..backend import availability, extension

__all__ = ['refusal', 'bilinear_backward']

_kernels = extension.module('patch_ops')


def refusal() -> Optional[str]:
    """Why the compiled backward may not run now, or None."""
    return availability.native_refusal('patch_ops')


def bilinear_backward(grad: Tensor, out: Tensor, align_corners: bool,
                      scales: Tuple[Optional[float], Optional[float]]
                      ) -> Tensor:
    """torch's ``upsample_bilinear2d_backward`` of ``grad`` (each image
    contiguous, float32 / float64 CPU) into ``out`` (contiguous, the
    input's shape), one axis at a time (``csrc/bilinear_backward.cpp``: the
    same terms summed in another order); returns ``out``. Under
    ``torch.compile`` :func:`~.bilinear.bilinear_backward_op` calls it."""
    _kernels.bilinear_backward(grad, out, bool(align_corners),
                               *(-1.0 if s is None else float(s)
                                 for s in scales))
    return out
