"""The loss on upsampled logits and its implementations, fastest first.

``resized_loss``: eager :func:`~.loss.resized_cross_entropy` of the
logits: the Triton kernel (:func:`~.loss.triton_loss`), the compiled C++
kernel (:func:`~.loss.kernel_loss`), or PyTorch
(:func:`~.loss.reference_loss`).
``resized_loss_traced``: the form ``torch.compile`` traces: a kernel as
the opaque operator :func:`~.traced.traced_resized_cross_entropy`, else
PyTorch's operators (:func:`~.traced.traced_pytorch_cross_entropy`).
"""
from typing import Optional

import torch
from torch import Tensor

from ..backend import availability, dispatch, triton_runtime
from . import loss, traced


def _triton_takes(logits: Tensor) -> Optional[str]:
    reason = availability.triton_refusal(logits)
    if reason is not None:
        return reason
    if logits.dtype not in loss.TRITON_DTYPES:
        return f'{logits.dtype} logits'
    if not 0 < logits.shape[1] <= loss.MAX_CLASSES:
        return (f'{logits.shape[1]} classes (the kernel takes 1 to '
                f'{loss.MAX_CLASSES})')
    return None


def _cpp_takes(logits: Tensor) -> Optional[str]:
    reason = availability.native_refusal('resized_loss')
    if reason is not None:
        return reason
    if logits.device.type != 'cpu':
        return f'{logits.device.type} tensor'
    if logits.dtype != torch.float32:
        return f'{logits.dtype} logits (the kernel takes float32)'
    if torch.is_autocast_enabled('cpu'):
        return 'CPU autocast'
    return None


def _triton_refusal(logits: Tensor) -> Optional[str]:
    reason = _triton_takes(logits)
    if reason is None and torch.compiler.is_compiling():
        return 'compiling (the traced form calls the kernel as an operator)'
    if reason is None and triton_runtime.is_fake(logits):
        return 'fake tensor'
    return reason


def _cpp_refusal(logits: Tensor) -> Optional[str]:
    reason = _cpp_takes(logits)
    if reason is None and torch.compiler.is_compiling():
        return 'compiling (the traced form calls the kernel as an operator)'
    return reason


dispatch.register('resized_loss', [
    dispatch.Implementation('triton', _triton_refusal, loss.triton_loss),
    dispatch.Implementation('c++', _cpp_refusal, loss.kernel_loss),
    dispatch.Implementation('torch', lambda logits: None,
                            loss.reference_loss),
])

dispatch.register('resized_loss_traced', [
    dispatch.Implementation('triton', _triton_takes,
                            traced.traced_resized_cross_entropy),
    dispatch.Implementation('c++', _cpp_takes,
                            traced.traced_resized_cross_entropy),
    dispatch.Implementation('torch', lambda logits: None,
                            traced.traced_pytorch_cross_entropy),
])
