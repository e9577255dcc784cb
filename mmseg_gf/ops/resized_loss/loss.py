"""Softmax (or one-hot sigmoid) cross-entropy of bilinearly upsampled logits,
with its gradient w.r.t. the low-resolution logits, without holding the
upsampled logits (150 MiB per image for 150 classes at 512x512).

The loss is a plain weighted sum ``sum_p w_p * ce_p`` in float64; ignored
pixels weigh 0 and the caller normalises. The compiled kernel and the
PyTorch and Triton paths: docs/lean_region.md, "The cross-entropy of
upsampled logits". Traced forms: :mod:`.traced`. No mmseg import.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..resize import gemm as bilinear_gemm
from ..backend import dispatch, extension, triton_runtime
from ..backend.device_path import host_checks
from ..loss.gradients import forward_graph

_kernel = extension.module('resized_loss')  # None when not built

__all__ = ['ResizedCrossEntropy', 'BatchTotals', 'accuracy',
           'resized_cross_entropy', 'kernel_usable',
           'triton_usable', 'check_labels', 'LabelRangeError',
           'operator_usable', 'triton_loss', 'kernel_loss',
           'reference_loss', 'check_arguments', 'pixel_losses',
           'MAX_CLASSES', 'TRITON_DTYPES']

#: ``kernels.MAX_CLASSES`` (not imported: it imports triton).
MAX_CLASSES = 2048
_EPS = torch.finfo(torch.float32).eps
#: The logits' dtypes the Triton kernel takes.
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LabelRangeError(ValueError):
    """A label outside ``[0, classes)`` that is not ``ignore_index``.

    Bad data of one batch, not of the loss: a caller falls back to its plain
    loss for that batch only (docs/reliability.md, "Bad data fails per batch").
    """


@dataclass
class ResizedCrossEntropy:
    """What :func:`resized_cross_entropy` returns, per image.

    Attributes:
        loss: ``N`` float64, ``sum_p w_p * ce_p`` over each image's pixels.
        hits: ``N`` int64, labelled pixels whose top-1 class is the label.
        grad: ``d loss.sum() / d logits`` (None unless asked for).
        pixel_loss: ``N x H x W`` unweighted ``ce_p``, 0 where ignored.
        target_prob: ``N x H x W`` softmax probability of the label, 0 where
            ignored (None for sigmoid).
        totals: the batch's totals where the path computes them (Triton).
    """

    loss: Tensor
    hits: Tensor
    grad: Optional[Tensor] = None
    pixel_loss: Optional[Tensor] = None
    target_prob: Optional[Tensor] = None
    totals: Optional['BatchTotals'] = None


@dataclass
class BatchTotals:
    """A batch's totals of :class:`ResizedCrossEntropy`, on the device.

    Attributes:
        loss: 0-d, ``loss.sum()`` in at least float32.
        hits: 0-d float32, ``hits.sum()``.
        labelled: 0-d int64, the pixels not labelled ``ignore_index``.
        accuracy: ``(1,)`` float32, mmseg's top-1 accuracy (:func:`accuracy`).
    """

    loss: Tensor
    hits: Tensor
    labelled: Tensor
    accuracy: Tensor


def accuracy(hits: Tensor, labelled: Tensor) -> Tensor:
    """mmseg's top-1 accuracy, ``(1,)`` float32.

    Its factor ``100 / pixels`` is taken in float64, as mmseg's Python float.
    """
    return (hits.reshape(1) + _EPS).mul_(
        100.0 / (labelled.to(torch.float64) + _EPS))


def kernel_usable(logits: Tensor) -> bool:
    """Whether the compiled CPU kernel takes ``logits``."""
    return dispatch.refusal('resized_loss', 'c++', logits) is None


def operator_usable(logits: Tensor) -> bool:
    """Whether a kernel (not PyTorch) runs the traced operator."""
    return dispatch.choose('resized_loss_traced',
                           logits).implementation.name != 'torch'


def triton_usable(logits: Tensor) -> bool:
    """Whether the Triton kernel takes ``logits``."""
    return dispatch.refusal('resized_loss', 'triton', logits) is None


def check_arguments(logits: Tensor, label: Tensor,
                    weight: Optional[Tensor]) -> None:
    """Raise ValueError, naming the argument, on logits, labels or a class
    weight the loss cannot take."""
    if logits.dim() != 4:
        raise ValueError(f'logits must be N x C x h x w, got shape '
                         f'{tuple(logits.shape)}')
    if label.dtype != torch.int64:
        raise ValueError(
            'label must hold int64 class indices (what mmseg\'s '
            'PackSegInputs gives and F.cross_entropy takes), got '
            f'{label.dtype} of shape {tuple(label.shape)}')
    if label.dim() != 3 or label.shape[0] != logits.shape[0]:
        raise ValueError(f'label must be N x H x W with N = '
                         f'{logits.shape[0]}, got shape {tuple(label.shape)}')
    if weight is not None and weight.shape != label.shape:
        raise ValueError(f'weight must have the label\'s shape '
                         f'{tuple(label.shape)}, got {tuple(weight.shape)}')


def resized_cross_entropy(logits: Tensor, label: Tensor, *,
                          ignore_index: int = 255,
                          align_corners: bool = False,
                          weight: Optional[Tensor] = None,
                          want_grad: bool = True,
                          want_pixels: bool = False,
                          sigmoid: bool = False,
                          use_kernel: Optional[bool] = None
                          ) -> ResizedCrossEntropy:
    """Cross-entropy of ``logits`` bilinearly resized to ``label``.

    Equals ``F.interpolate(..., mode='bilinear')`` then
    ``F.cross_entropy(..., reduction='none', ignore_index=...)``; top-1 hits
    follow mmseg's ``accuracy`` (``topk``) also for non-finite CPU logits.

    Args:
        logits: ``N x C x h x w``.
        label: ``N x H x W`` int64 class indices.
        ignore_index: label of pixels that weigh 0.
        align_corners: as in ``F.interpolate``.
        weight: per-pixel weights ``w_p`` (the label's shape; default 1).
        want_grad: also return ``d sum_p w_p ce_p / d logits``.
        want_pixels: also return per-pixel loss and label probability.
        sigmoid: per-class binary cross-entropies on one-hot labels, summed
            per pixel, instead of the softmax cross-entropy.
        use_kernel: True forces the compiled kernel (raises if it cannot
            run), False the PyTorch path; None lets the dispatcher choose.

    Returns:
        ResizedCrossEntropy: per-image loss, hits and what was asked for.

    Raises:
        ValueError: shapes or dtypes that do not fit.
        LabelRangeError: a label outside ``[0, C)`` that is not
            ``ignore_index``.
        RuntimeError: ``use_kernel=True`` where the kernel cannot run.
    """
    check_arguments(logits, label, weight)
    logits = logits.detach()
    path = _path(logits, use_kernel)
    out = path(logits, label, ignore_index, align_corners, weight, want_grad,
               want_pixels, sigmoid)
    # One pass, no copy; on the CPU only: reading the flag on the host would
    # wait for another device every step (there, the PyTorch path's argmax
    # also ranks NaN first; only ties among equal values may differ).
    if host_checks(logits) and not bool(torch.isfinite(logits.sum())):
        _topk_hits(logits, label, ignore_index, align_corners, out.hits)
        out.totals = None  # taken from the hits before the recount
    return out


def _path(logits: Tensor, use_kernel: Optional[bool]):
    """The implementation that runs for ``use_kernel``."""
    if use_kernel is None:
        return dispatch.choose('resized_loss', logits).implementation.run
    if not use_kernel:
        return reference_loss
    reason = dispatch.refusal('resized_loss', 'c++', logits)
    if reason is not None:
        raise RuntimeError('the compiled resized cross-entropy kernel cannot '
                           f'run here ({reason}): it needs '
                           'mmseg_gf._resized_loss built and float32 CPU '
                           'logits without autocast')
    return kernel_loss


def _topk_hits(logits: Tensor, label: Tensor, ignore_index: int,
               align_corners: bool, hits: Tensor) -> None:
    """Recount in place, as mmseg's ``topk(1)``, the hits of images whose
    logits are not all finite (there ``argmax`` picks differently).
    """
    for i in range(logits.shape[0]):
        if bool(torch.isfinite(logits[i]).all()):
            continue
        target = label[i:i + 1]
        with torch.no_grad():
            up = F.interpolate(logits[i:i + 1], size=target.shape[-2:],
                               mode='bilinear', align_corners=align_corners)
            top = up.topk(1, dim=1).indices[:, 0]
        hits[i] = (top.eq(target) & (target != ignore_index)).sum()


def kernel_loss(logits: Tensor, label: Tensor, ignore_index: int,
                align_corners: bool, weight: Optional[Tensor],
                want_grad: bool, want_pixels: bool,
                sigmoid: bool) -> ResizedCrossEntropy:
    """The compiled CPU kernel's path (float32 CPU logits)."""
    try:
        loss, hits, grad, pixel_loss, target_prob = \
            _kernel.resized_cross_entropy(
                logits.contiguous(), label.contiguous(),
                None if weight is None else weight.float().contiguous(),
                int(ignore_index), bool(align_corners), bool(want_grad),
                bool(want_pixels), bool(sigmoid))
    except RuntimeError as error:
        if 'labels must lie' in str(error):
            raise LabelRangeError(str(error).splitlines()[0]) from None
        raise
    return ResizedCrossEntropy(
        loss, hits, grad if want_grad else None,
        pixel_loss if want_pixels else None,
        target_prob if want_pixels and not sigmoid else None)


def check_labels(target: Tensor, classes: int, ignore_index: int) -> None:
    """Raise :class:`LabelRangeError` on a label outside ``[0, classes)``.

    On the host at once; on a device as an asynchronous assertion (as
    torch's ``cross_entropy`` on CUDA), so that no step waits for the device.
    """
    if not host_checks(target):
        ok = ((target >= 0) & (target < classes)) | (target == ignore_index)
        torch._assert_async(ok.all(), f'labels must lie in [0, {classes}) '
                            f'or be ignore_index={ignore_index}')
        return
    for image in (target if target.dim() > 2 else [target]):
        _check_image_labels(image, classes, ignore_index)


def _check_image_labels(target: Tensor, classes: int,
                        ignore_index: int) -> None:
    valid = target[target != ignore_index]
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= classes):
        raise LabelRangeError(f'labels must lie in [0, {classes}) or be '
                              f'ignore_index={ignore_index}; found '
                              f'{int(valid.min())}..{int(valid.max())}')


def pixel_losses(up: Tensor, target: Tensor, ignore_index: int,
                 sigmoid: bool) -> Tensor:
    """Per-pixel loss of ``1 x C x H x W`` logits, 0 where ignored."""
    if not sigmoid:
        return F.cross_entropy(up, target, reduction='none',
                               ignore_index=ignore_index)
    valid = target != ignore_index
    onehot = F.one_hot(torch.where(valid, target, 0), up.shape[1])
    bce = F.binary_cross_entropy_with_logits(
        up, onehot.permute(0, 3, 1, 2).to(up.dtype), reduction='none')
    return torch.where(valid, bce.sum(1), 0.0)


def reference_loss(logits: Tensor, label: Tensor, ignore_index: int,
                   align_corners: bool, weight: Optional[Tensor],
                   want_grad: bool, want_pixels: bool,
                   sigmoid: bool) -> ResizedCrossEntropy:
    """The PyTorch path: one image's upsampled logits at a time."""
    n, classes = logits.shape[:2]
    check_labels(label, classes, ignore_index)
    loss = torch.zeros(n, dtype=torch.float64, device=logits.device)
    hits = torch.zeros(n, dtype=torch.int64, device=logits.device)
    grad = torch.zeros_like(logits) if want_grad else None
    pixel_loss = target_prob = None
    if want_pixels:
        pixel_loss = label.new_zeros(label.shape, dtype=logits.dtype)
        target_prob = None if sigmoid else torch.zeros_like(pixel_loss)
    for i in range(n):
        target = label[i:i + 1]
        valid = target != ignore_index
        w = valid.to(logits.dtype)
        if weight is not None:
            w = w * weight[i:i + 1].to(logits.dtype)
        leaf = logits[i:i + 1].requires_grad_(want_grad)
        # forward_graph: the graph is differentiated and freed here, its
        # saved tensors kept from hooks around the step (measurements).
        with forward_graph() if want_grad else torch.no_grad():
            up = F.interpolate(leaf, size=target.shape[-2:], mode='bilinear',
                               align_corners=align_corners)
            ce = pixel_losses(up, target, ignore_index, sigmoid)
            total = (ce * w).sum()
            if want_grad:
                grad[i:i + 1], = torch.autograd.grad(total, leaf)
        up = up.detach()
        loss[i] = total.detach().double()
        hits[i] = (up.argmax(1).eq(target) & valid).sum()
        if want_pixels:
            pixel_loss[i] = ce.detach()[0]
        if target_prob is not None:
            safe = target.clamp(0, classes - 1).unsqueeze(1)
            prob = up.softmax(1).gather(1, safe)[:, 0]
            target_prob[i] = torch.where(valid, prob, 0.0)[0]
    return ResizedCrossEntropy(loss, hits, grad, pixel_loss, target_prob)


def triton_loss(logits: Tensor, label: Tensor, ignore_index: int,
                align_corners: bool, weight: Optional[Tensor],
                want_grad: bool, want_pixels: bool,
                sigmoid: bool) -> ResizedCrossEntropy:
    """The Triton path: per image, ``F.interpolate``'s upsampled logits, one
    kernel for every per-pixel quantity and the upsampling's backward.

    3 launches per image and one for the batch totals, where the PyTorch path
    takes ~20 per image; labels out of range are counted by the kernels and
    asserted on the device.
    """
    from . import kernels as kernels  # imports triton
    n, classes, h, w = logits.shape
    on_host = host_checks(logits)
    if on_host:
        check_labels(label, classes, ignore_index)
    size = [int(v) for v in label.shape[-2:]]
    parts = kernels.programs(classes, size[0] * size[1])
    loss_part = logits.new_empty((n, parts), dtype=torch.float32)
    hits_part = logits.new_empty((n, parts), dtype=torch.int32)
    bad_part = torch.empty_like(hits_part)
    valid_part = torch.empty_like(hits_part)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format) \
        if want_grad else None
    pixel_loss = target_prob = None
    if want_pixels:
        pixel_loss = logits.new_empty(label.shape)
        target_prob = None if sigmoid else torch.empty_like(pixel_loss)
    label = label.contiguous()
    weight = None if weight is None else weight.contiguous()
    with triton_runtime.on_device(logits):
        for i in range(n):
            up = F.interpolate(logits[i:i + 1], size=size, mode='bilinear',
                               align_corners=align_corners)
            if up.stride(2) != size[1] * up.stride(3):
                up = up.contiguous()
            grad_up = torch.empty_like(up) if want_grad else None
            kernels.pixel_cross_entropy(
                up, label[i], None if weight is None else weight[i], grad_up,
                loss_part[i], hits_part[i], bad_part[i], valid_part[i],
                None if pixel_loss is None else pixel_loss[i],
                None if target_prob is None else target_prob[i],
                ignore_index, sigmoid)
            if want_grad and dispatch.choose(
                    'resize', grad_up).implementation.name == 'gemm':
                bilinear_gemm.resize_backward(grad_up, (h, w), align_corners,
                                              out=grad[i:i + 1])
            elif want_grad:
                torch.ops.aten.upsample_bilinear2d_backward.grad_input(
                    grad_up, size, [1, classes, h, w], align_corners, None,
                    None, grad_input=grad[i:i + 1])
        loss, hits, totals, labels_bad = _triton_totals(
            kernels, loss_part, hits_part, bad_part, valid_part,
            torch.promote_types(logits.dtype, torch.float32))
    if not on_host:
        torch._assert_async(labels_bad == 0, 'labels must lie in '
                            f'[0, {classes}) or be '
                            f'ignore_index={ignore_index}')
    return ResizedCrossEntropy(loss, hits, grad, pixel_loss, target_prob,
                               totals)


def _triton_totals(kernels, loss_part: Tensor, hits_part: Tensor,
                   bad_part: Tensor, valid_part: Tensor, dtype: torch.dtype
                   ) -> Tuple[Tensor, Tensor, BatchTotals, Tensor]:
    """Per-image and batch totals and the bad-label count, one launch."""
    n = loss_part.shape[0]
    loss = loss_part.new_empty(n, dtype=torch.float64)
    hits = loss_part.new_empty(n, dtype=torch.int64)
    totals = BatchTotals(loss_part.new_empty((), dtype=dtype),
                         loss_part.new_empty((), dtype=torch.float32),
                         loss_part.new_empty((), dtype=torch.int64),
                         loss_part.new_empty(1, dtype=torch.float32))
    labels_bad = loss_part.new_empty((), dtype=torch.int32)
    kernels.batch_totals(loss_part, hits_part, bad_part, valid_part, loss,
                         hits, totals.loss, totals.hits, totals.labelled,
                         totals.accuracy, labels_bad)
    return loss, hits, totals, labels_bad
