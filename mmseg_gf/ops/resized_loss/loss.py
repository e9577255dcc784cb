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

The forms ``torch.compile`` traces: :mod:`.traced`. No mmseg import.
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
           'reference_loss', 'MAX_CLASSES', 'TRITON_DTYPES']

#: ``kernels.MAX_CLASSES`` (not imported: it imports triton).
MAX_CLASSES = 2048
_EPS = torch.finfo(torch.float32).eps
#: The logits' dtypes the Triton kernel takes.
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
        totals: the batch's totals where the path computed them with the
            per-image ones (the Triton path: one launch), else None.
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
        loss: 0-d, ``loss.sum()`` in the logits' dtype promoted to float32.
        hits: 0-d float32, ``hits.sum()``.
        labelled: 0-d int64, the pixels not labelled ``ignore_index``.
        accuracy: ``(1,)`` float32, mmseg's top-1 accuracy of the batch
            (``(hits + eps) * (100 / (labelled + eps))``, the factor in
            float64: :func:`accuracy`).
    """

    loss: Tensor
    hits: Tensor
    labelled: Tensor
    accuracy: Tensor


def accuracy(hits: Tensor, labelled: Tensor) -> Tensor:
    """mmseg's top-1 accuracy, ``(1,)`` float32, from the hits (0-d
    float32) and labelled pixels (0-d): its factor ``100 / pixels`` is a
    Python float (float64), so it is divided in float64 on the device and
    the float32 hits are scaled by it (what :class:`BatchTotals` holds)."""
    return (hits.reshape(1) + _EPS).mul_(
        100.0 / (labelled.to(torch.float64) + _EPS))


def kernel_usable(logits: Tensor) -> bool:
    """Whether the compiled kernel takes ``logits``: built, not switched
    off (``MMSEG_GF_NATIVE=0``), float32 on the CPU, eager mode, no
    autocast (the dispatcher's ``resized_loss`` refusal of ``c++``)."""
    return dispatch.refusal('resized_loss', 'c++', logits) is None


def operator_usable(logits: Tensor) -> bool:
    """Whether :func:`traced_resized_cross_entropy` (a kernel as an
    operator, also under ``torch.compile``) takes ``logits``: the
    dispatcher's ``resized_loss_traced`` takes a kernel, not PyTorch."""
    return dispatch.choose('resized_loss_traced',
                           logits).implementation.name != 'torch'


def triton_usable(logits: Tensor) -> bool:
    """Whether the Triton kernel takes ``logits`` (float32 / float16 /
    bfloat16 CUDA tensors in eager mode, at most ``MAX_CLASSES`` classes,
    the Triton path switched on: the dispatcher's ``resized_loss`` refusal
    of ``triton``)."""
    return dispatch.refusal('resized_loss', 'triton', logits) is None


def _check(logits: Tensor, label: Tensor, weight: Optional[Tensor]) -> None:
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
            run) or the PyTorch path (False); default: the dispatcher's
            choice for ``resized_loss`` (the Triton kernel, the compiled
            kernel, else the PyTorch path).

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
    """The path that runs: the dispatcher's choice (``use_kernel=None``),
    the compiled kernel (True; refused with the dispatcher's reason) or
    the PyTorch path (False)."""
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


def triton_loss(logits: Tensor, label: Tensor, ignore_index: int,
                align_corners: bool, weight: Optional[Tensor],
                want_grad: bool, want_pixels: bool,
                sigmoid: bool) -> ResizedCrossEntropy:
    """The Triton path: per image, ``F.interpolate``'s upsampled logits
    (the PyTorch path's, bit for bit), one kernel for every per-pixel
    quantity (``triton_loss_kernels``) and autograd's own upsampling
    backward written into the image's slice of the gradient: 3 launches
    per image, one for the batch's totals (:class:`BatchTotals`), where
    the PyTorch path takes ~20 per image. One image's upsampled logits
    and their gradient exist at a time, as on the PyTorch path. Labels
    out of range: on the CPU (the interpreter) :func:`check_labels`
    raises at once; on a GPU (and under
    :func:`~.device_path.as_on_cuda`) the kernels count them and one
    device-side assertion reads the count (no pass over the labels of
    its own, where check_labels takes five)."""
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
    """Per-image loss and hits, the :class:`BatchTotals` and the count of
    labels out of range (int32 0-d) from the partial sums, in one
    launch (``triton_loss_kernels.batch_totals``)."""
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
