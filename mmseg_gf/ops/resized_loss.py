"""Softmax cross-entropy of bilinearly upsampled logits (or per-class
sigmoid cross-entropies on one-hot labels), with its gradient w.r.t. the
low-resolution logits, without the upsampled logits.

A segmentation head predicts at 1/4 or 1/8 of the label's size and its loss
upsamples the logits to the label first (mmseg's ``loss_by_feat``:
``resize(..., mode='bilinear')``, then a cross-entropy). Upsampled, the
logits of 150 classes at 512x512 are 150 MiB per image, and so is their
log-softmax and the gradient of each; computing them, and the upsampling's
backward, takes most of a small model's training step.

:func:`resized_cross_entropy` computes, image by image and output row by
output row, the same numbers: the upsampled logits of one row, their
softmax, the per-pixel cross-entropy, top-1 hits, and (optionally) the
gradient of ``sum_p w_p * ce_p``, spread back to the low-resolution grid
with the upsampling's adjoint. With the compiled kernel
(``mmseg_gf._resized_loss``, float32 CPU tensors) no full-resolution
tensor of classes exists; otherwise the PyTorch path below computes the
same per image with ``F.interpolate`` and ``F.cross_entropy``.

With ``sigmoid=True`` a pixel's loss is instead ``sum_c BCE(z_c, [c ==
label])``, mmseg's ``binary_cross_entropy`` of multi-channel logits.

Weights ``w_p`` are a per-pixel map (class weights of the label, an OHEM
selection, ...); pixels labelled ``ignore_index`` weigh 0. The caller
normalises (``mean`` over pixels, ``avg_non_ignore``, ``loss_weight``): the
loss here is a plain weighted sum, in float64.

No mmseg import.
"""
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .device_path import host_checks
from .fused_loss import forward_graph

try:
    from .. import _resized_loss as _kernel
except ImportError:  # not built: the PyTorch path
    _kernel = None

__all__ = ['ResizedCrossEntropy', 'resized_cross_entropy', 'kernel_usable',
           'check_labels', 'LabelRangeError']


class LabelRangeError(ValueError):
    """A label outside ``[0, classes)`` that is not ``ignore_index``: bad
    data of one batch, not a property of the loss (a caller falls back to
    its plain loss for that batch only)."""


@dataclass
class ResizedCrossEntropy:
    """What :func:`resized_cross_entropy` returns, per image.

    Attributes:
        loss: ``N`` float64, ``sum_p w_p * ce_p`` over each image's pixels.
        hits: ``N`` int64, labelled pixels whose top-1 class is the label.
        grad: the logits' shape and dtype, ``d loss.sum() / d logits``
            (None unless asked for).
        pixel_loss: ``N x H x W``, the unweighted ``ce_p`` (0 where
            ignored; None unless asked for).
        target_prob: ``N x H x W``, the softmax probability of each pixel's
            label (0 where ignored; None unless asked for, or sigmoid).
    """

    loss: Tensor
    hits: Tensor
    grad: Optional[Tensor] = None
    pixel_loss: Optional[Tensor] = None
    target_prob: Optional[Tensor] = None


def kernel_usable(logits: Tensor) -> bool:
    """Whether the compiled kernel takes ``logits``: built, not switched
    off (``MMSEG_GF_NATIVE=0``), float32 on the CPU, eager mode, no
    autocast (under autocast the PyTorch path runs, as mmseg's loss does)."""
    return (_kernel is not None
            and os.environ.get('MMSEG_GF_NATIVE', '1') != '0'
            and logits.device.type == 'cpu'
            and logits.dtype == torch.float32
            and not torch.is_autocast_enabled('cpu')
            and not torch.compiler.is_compiling())


def _check(logits: Tensor, label: Tensor, weight: Optional[Tensor]) -> None:
    if logits.dim() != 4:
        raise ValueError(f'logits must be N x C x h x w, got shape '
                         f'{tuple(logits.shape)}')
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
    """Cross-entropy of ``logits`` (N x C x h x w) bilinearly resized to
    ``label`` (N x H x W, int64), as ``F.interpolate(..., mode='bilinear',
    align_corners=align_corners)`` then ``F.cross_entropy(...,
    reduction='none', ignore_index=ignore_index)``.

    Args:
        weight: per-pixel weights ``w_p`` (the label's shape; default 1);
            ignored pixels weigh 0 whatever their weight.
        want_grad: also return ``d sum_p w_p ce_p / d logits``.
        want_pixels: also return the per-pixel loss and (softmax) label
            probability.
        sigmoid: per-class binary cross-entropies on one-hot labels,
            summed per pixel, instead of the softmax cross-entropy.
        use_kernel: force the compiled kernel (True; raises if it cannot
            run) or the PyTorch path (False); default: the kernel where
            :func:`kernel_usable`.

    Top-1 hits follow mmseg's ``accuracy`` (``topk(1)`` over the classes of
    the upsampled logits) also where CPU logits are not finite: a NaN counts
    as the largest value and, among equals, ``topk`` picks the index it
    picks (:func:`_topk_hits`).

    Raises:
        ValueError: shapes that do not fit.
        LabelRangeError: a label outside ``[0, C)`` that is not
            ``ignore_index``.
    """
    _check(logits, label, weight)
    logits = logits.detach()
    if use_kernel is None:
        use_kernel = kernel_usable(logits)
    elif use_kernel and not kernel_usable(logits):
        raise RuntimeError('the compiled resized cross-entropy kernel cannot '
                           'run here: it needs mmseg_gf._resized_loss built '
                           'and float32 CPU logits without autocast')
    if use_kernel:
        out = _compiled(logits, label, ignore_index, align_corners, weight,
                        want_grad, want_pixels, sigmoid)
    else:
        out = _reference(logits, label, ignore_index, align_corners, weight,
                         want_grad, want_pixels, sigmoid)
    # One pass, no copy; on the CPU only: reading the flag on the host would
    # wait for another device every step (there, the PyTorch path's argmax
    # also ranks NaN first; only ties among equal values may differ).
    if host_checks(logits) and not bool(torch.isfinite(logits.sum())):
        _topk_hits(logits, label, ignore_index, align_corners, out.hits)
    return out


def _topk_hits(logits: Tensor, label: Tensor, ignore_index: int,
               align_corners: bool, hits: Tensor) -> None:
    """Recount, in place, the hits of every image whose logits are not all
    finite as mmseg's ``accuracy`` counts them: ``topk(1)`` over the classes
    of ``F.interpolate``'s upsampled logits. With NaN or equal infinities
    ``topk`` and ``argmax`` (or the kernel's running maximum) pick
    different classes; finite logits keep the fast count (the two agree
    but for exact ties). One image's upsampled logits at a time."""
    for i in range(logits.shape[0]):
        if bool(torch.isfinite(logits[i]).all()):
            continue
        target = label[i:i + 1]
        with torch.no_grad():
            up = F.interpolate(logits[i:i + 1], size=target.shape[-2:],
                               mode='bilinear', align_corners=align_corners)
            top = up.topk(1, dim=1).indices[:, 0]
        hits[i] = (top.eq(target) & (target != ignore_index)).sum()


def _compiled(logits: Tensor, label: Tensor, ignore_index: int,
              align_corners: bool, weight: Optional[Tensor], want_grad: bool,
              want_pixels: bool, sigmoid: bool) -> ResizedCrossEntropy:
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
    """Raise :class:`LabelRangeError` on a label outside ``[0, classes)``
    that is not ``ignore_index``.

    On the CPU at once, image by image (small temporaries). On other
    devices (and CPU tensors inside :func:`.device_path.as_on_cuda`)
    without waiting for them (reading a tensor's value on the host
    would stall every step): a device-side
    assertion with the same message, as torch's own ``cross_entropy``
    asserts on CUDA for a target out of range; it surfaces at the next
    synchronisation, and a CUDA context does not survive it.
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


def _pixel_losses(up: Tensor, target: Tensor, ignore_index: int,
                  sigmoid: bool) -> Tensor:
    """Per-pixel loss of upsampled logits (1 x C x H x W), 0 where
    ignored."""
    if not sigmoid:
        return F.cross_entropy(up, target, reduction='none',
                               ignore_index=ignore_index)
    valid = target != ignore_index
    onehot = F.one_hot(torch.where(valid, target, 0), up.shape[1])
    bce = F.binary_cross_entropy_with_logits(
        up, onehot.permute(0, 3, 1, 2).to(up.dtype), reduction='none')
    return torch.where(valid, bce.sum(1), 0.0)


def _reference(logits: Tensor, label: Tensor, ignore_index: int,
               align_corners: bool, weight: Optional[Tensor], want_grad: bool,
               want_pixels: bool, sigmoid: bool) -> ResizedCrossEntropy:
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
            ce = _pixel_losses(up, target, ignore_index, sigmoid)
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
