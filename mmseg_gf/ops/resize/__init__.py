"""The bilinear resize's backward and its implementations, fastest first.

``resize``: the resized tensor, or its gradient: two matrix products on
the GPU (:mod:`.gemm`, also the forward), the compiled CPU kernel
(:mod:`.cpu`), or torch's ``upsample_bilinear2d_backward``
(:func:`~.bilinear.torch_backward`). The forward is ``F.interpolate``
unless the GEMMs take it.
"""
from typing import Optional

import torch
from torch import Tensor

from ..backend import dispatch
from . import bilinear, cpu, gemm

#: The dtypes the compiled backward takes.
KERNEL_DTYPES = (torch.float32, torch.float64)


def _cpp_refusal(grad: Tensor) -> Optional[str]:
    reason = cpu.refusal()
    if reason is not None:
        return reason
    if grad.device.type != 'cpu':
        return f'{grad.device.type} tensor'
    if grad.dtype not in KERNEL_DTYPES:
        return f'{grad.dtype} tensor'
    if not torch.compiler.is_compiling() and (
            grad.dim() != 4 or not bilinear.images_contiguous(grad)):
        return 'an image of the gradient not contiguous'
    return None


dispatch.register('resize', [
    dispatch.Implementation('gemm', gemm.refusal, bilinear.gemm_backward),
    dispatch.Implementation('c++', _cpp_refusal, bilinear.kernel_backward),
    dispatch.Implementation('torch', lambda t: None, bilinear.torch_backward),
])
