"""The forms of :func:`~.loss.resized_cross_entropy` that ``torch.compile``
traces: a kernel as the opaque operator ``mmseg_gf::resized_cross_entropy``
(:func:`traced_resized_cross_entropy`), else PyTorch's differentiable
operators (:func:`traced_pytorch_cross_entropy`). No mmseg import.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backend import dispatch
from .loss import check_arguments, pixel_losses, resized_cross_entropy

__all__ = ['traced_resized_cross_entropy', 'traced_pytorch_cross_entropy']


@torch.library.custom_op('mmseg_gf::resized_cross_entropy', mutates_args=())
def _resized_cross_entropy_op(logits: Tensor, label: Tensor,
                              weight: Optional[Tensor], ignore_index: int,
                              align_corners: bool,
                              sigmoid: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """A kernel's ``(loss, hits, grad)`` as one operator, opaque to
    ``torch.compile``: the compiled step calls the kernel eager mode
    calls (the dispatcher's ``resized_loss`` kernel), so no upsampled logits outlive one image there
    either, and the step syncs with the host no more than eager's. The
    kernels only (an operator's kernel runs with autograd's dispatch keys
    excluded, so the PyTorch path's ``autograd.grad`` cannot run inside
    it): callers check :func:`operator_usable` first."""
    out = resized_cross_entropy(
        logits, label, ignore_index=ignore_index,
        align_corners=align_corners, weight=weight, sigmoid=sigmoid,
        use_kernel=None if dispatch.choose(
            'resized_loss', logits).implementation.name != 'torch' else True)
    return out.loss, out.hits, out.grad


@_resized_cross_entropy_op.register_fake
def _(logits, label, weight, ignore_index, align_corners, sigmoid):
    check_arguments(logits, label, weight)
    n = logits.shape[0]
    return (logits.new_empty(n, dtype=torch.float64),
            logits.new_empty(n, dtype=torch.int64),
            logits.new_empty(logits.shape))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[2])


def _backward(ctx, grad_loss, grad_hits, grad_grad):
    # Image i's loss depends on image i's logits only: its gradient is
    # image i of the kept gradient, times the incoming one.
    kept, = ctx.saved_tensors
    scale = grad_loss.to(kept.dtype).reshape(-1, *([1] * (kept.dim() - 1)))
    return kept * scale, None, None, None, None, None


_resized_cross_entropy_op.register_autograd(_backward,
                                            setup_context=_setup_context)


def traced_resized_cross_entropy(logits: Tensor, label: Tensor, *,
                                 ignore_index: int = 255,
                                 align_corners: bool = False,
                                 weight: Optional[Tensor] = None,
                                 sigmoid: bool = False
                                 ) -> Tuple[Tensor, Tensor]:
    """``(loss, hits)`` of :func:`resized_cross_entropy` by the compiled
    kernel (:func:`operator_usable` must hold), ``loss`` differentiable
    w.r.t. ``logits``: its backward scales the gradient the forward kept
    (the logits' size). The form ``torch.compile`` traces
    (``mmseg_gf::resized_cross_entropy``); the same numbers."""
    loss, hits, _ = _resized_cross_entropy_op(logits, label, weight,
                                              int(ignore_index),
                                              bool(align_corners),
                                              bool(sigmoid))
    return loss, hits


def traced_pytorch_cross_entropy(logits: Tensor, label: Tensor, *,
                                 ignore_index: int = 255,
                                 align_corners: bool = False,
                                 weight: Optional[Tensor] = None,
                                 sigmoid: bool = False
                                 ) -> Tuple[Tensor, Tensor]:
    """``(loss, hits)`` of :func:`resized_cross_entropy` by PyTorch
    operators that autograd differentiates (``F.interpolate``, then the
    per-pixel loss): the form ``torch.compile`` traces where no kernel's
    operator takes ``logits`` (:func:`operator_usable` is False: CUDA
    without the Triton path, CPU without the compiled kernels). The
    whole batch at once (the graph's memory is the compiler's to plan);
    the hits by ``argmax``, a count of a boolean map: no data-dependent
    shape, no value read on the host (mmseg's accuracy indexes by a
    mask, a host sync and a graph break)."""
    check_arguments(logits, label, weight)
    up = F.interpolate(logits, size=label.shape[-2:], mode='bilinear',
                       align_corners=align_corners)
    valid = label != ignore_index
    w = valid.to(up.dtype)
    if weight is not None:
        w = w * weight.to(up.dtype)
    ce = pixel_losses(up, label, ignore_index, sigmoid)
    loss = (ce * w).flatten(1).sum(1).to(torch.float64)
    hits = (up.detach().argmax(1).eq(label) & valid).flatten(1).sum(1)
    return loss, hits
