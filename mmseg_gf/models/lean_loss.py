"""mmseg's cross-entropy decode loss (softmax or sigmoid), one image at a
time.

``BaseDecodeHead.loss_by_feat`` upsamples the whole batch's logits to the
label size and takes the loss of that: at 512x512, batch 8 and 21 classes,
176 MB of upsampled logits plus as much again of log-softmax, alive in the
forward and, recomputed, in the backward. For the common case (every
``loss_decode`` is mmseg's ``CrossEntropyLoss`` without mask or class
weights, reduction ``'mean'`` or ``'sum'``, all with softmax or all with
sigmoid (a binary cross-entropy on one-hot labels, over more than one
channel), and no pixel sampler) the loss is a sum of per-pixel terms over a
normaliser that depends on the labels only, so :class:`ChunkedCrossEntropyFunction` computes it image by image,
forward and backward, keeping the low-resolution logits alone: one image's
upsampled logits are alive at a time.

The numbers are mmseg's: the same per-pixel cross-entropy (mmseg's own
``binary_cross_entropy`` for sigmoid, summed), the same normaliser (``avg_non_ignore``, ``loss_weight``, ``+ eps``) and the same
accuracy; only the sum over pixels is taken per image and then added, which
rounds differently from one sum (relative differences ~1e-7).
:func:`chunked_cross_entropy_gradients` computes the same loss with its
gradient w.r.t. the logits, for the classifier fused with its loss
(:mod:`.lean_head`); other losses are wired there too.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function

from ..ops.fused_loss import LogitGradients, forward_graph

__all__ = ['chunkable_losses', 'chunked_cross_entropy_losses',
           'chunked_cross_entropy_gradients', 'ChunkedCrossEntropyFunction']

_EPS = torch.finfo(torch.float32).eps

# (loss name, loss weight, reduction, average over non-ignored pixels only,
# sigmoid)
LossSpec = Tuple[str, float, str, bool, bool]


def chunkable_losses(head: nn.Module) -> Optional[List[LossSpec]]:
    """The head's losses as :data:`LossSpec` if the chunked path computes
    them exactly as mmseg does, else None: all with softmax or all with
    sigmoid (one summed loss), sigmoid not on a single channel (mmseg's
    binary case refuses an image without labels, which a batch may
    hold)."""
    from mmseg.models.losses import CrossEntropyLoss
    if getattr(head, 'sampler', None) is not None:
        return None
    losses = head.loss_decode
    losses = list(losses) if isinstance(losses, nn.ModuleList) else [losses]
    specs = []
    for loss in losses:
        if (type(loss) is not CrossEntropyLoss or loss.use_mask
                or loss.class_weight is not None
                or loss.reduction not in ('mean', 'sum')
                or (loss.use_sigmoid and head.out_channels == 1)):
            return None
        specs.append((loss.loss_name, float(loss.loss_weight),
                      loss.reduction, bool(loss.avg_non_ignore),
                      bool(loss.use_sigmoid)))
    if len({spec[4] for spec in specs}) != 1:
        return None
    return specs


def _upsample(logits: Tensor, size, align_corners: bool) -> Tensor:
    return F.interpolate(logits, size=size, mode='bilinear',
                         align_corners=align_corners)


def _autocast_dtype(device_type: str):
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _image_cross_entropy(logits: Tensor, target: Tensor, align_corners: bool,
                         ignore_index: int,
                         sigmoid: bool) -> Tuple[Tensor, Tensor]:
    """Summed per-pixel cross-entropy of one image's logits upsampled to
    its label (``target``, 1 x H x W), and the upsampled logits; with
    ``sigmoid``, mmseg's binary cross-entropy on one-hot labels (ignored
    pixels weighted 0), summed."""
    up = _upsample(logits, target.shape[-2:], align_corners)
    if sigmoid:
        from mmseg.models.losses.cross_entropy_loss import \
            binary_cross_entropy
        part = binary_cross_entropy(up, target, reduction='sum',
                                    ignore_index=ignore_index)
    else:
        part = F.cross_entropy(up, target, reduction='none',
                               ignore_index=ignore_index).sum()
    return part, up


def _image_hits(up: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """Correctly classified labelled pixels of one image: mmseg's
    ``accuracy`` (top-1, no threshold) before its division."""
    hit = up.topk(1, dim=1)[1].squeeze(1).eq(target)
    return hit[target != ignore_index].float().sum()


def _spec_values(total: Tensor, correct: Tensor, label: Tensor,
                 ignore_index: int, specs: Sequence[LossSpec], classes: int
                 ) -> Tuple[Dict[str, Tensor], List[float]]:
    """Each loss name's value from the summed cross-entropy ``total`` (mmseg's
    normalisers: a sigmoid loss has ``classes`` terms per pixel),
    ``acc_seg`` from the summed hits, and the factor of ``total`` in each
    spec's loss."""
    valid = int((label != ignore_index).sum())
    coefficients = []
    values: Dict[str, Tensor] = {}
    for name, weight, reduction, non_ignore, sigmoid in specs:
        if reduction == 'mean':
            pixels = valid if non_ignore else label.numel()
            factor = pixels * (classes if sigmoid else 1) + _EPS
            value = weight * (total / factor)
            coefficients.append(weight / factor)
        else:
            value = weight * total
            coefficients.append(weight)
        values[name] = values[name] + value if name in values else value
    values['acc_seg'] = (correct.reshape(1) + _EPS).mul_(100.0 /
                                                         (valid + _EPS))
    return values, coefficients


def _by_name(specs: Sequence[LossSpec],
             coefficients: Sequence[float]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for (name, *_), c in zip(specs, coefficients):
        out[name] = out.get(name, 0.0) + c
    return out


class ChunkedCrossEntropyFunction(Function):
    """Per-image cross-entropy losses and accuracy of upsampled logits.

    Inputs: low-resolution ``logits`` (N x K x h x w), ``label`` (N x H x
    W), then the upsampling and loss settings. Outputs: one loss per distinct
    loss name (in :data:`LossSpec` order) and the accuracy (percent,
    non-differentiable). Keeps ``logits`` for backward; ``label`` is held by
    reference (it is part of the batch).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, label: Tensor, align_corners: bool,
                ignore_index: int, specs: Sequence[LossSpec]):
        ctx.save_for_backward(logits)
        ctx.label, ctx.align_corners = label, align_corners
        ctx.ignore_index = ignore_index
        ctx.autocast = _autocast_dtype(logits.device.type)
        total = correct = None
        for i in range(logits.shape[0]):
            target = label[i:i + 1]
            part, up = _image_cross_entropy(logits[i:i + 1], target,
                                            align_corners, ignore_index,
                                            specs[0][4])
            hit = _image_hits(up, target, ignore_index)
            total = part if total is None else total + part
            correct = hit if correct is None else correct + hit
            del up
        values, coefficients = _spec_values(total, correct, label,
                                            ignore_index, specs,
                                            logits.shape[1])
        ctx.sigmoid = specs[0][4]
        ctx.coefficients = _by_name(specs, coefficients)
        ctx.mark_non_differentiable(values['acc_seg'])
        ctx.names = list(values)[:-1]
        return tuple(values.values())

    @staticmethod
    def backward(ctx, *grads):
        logits, = ctx.saved_tensors
        scale = sum(grad * ctx.coefficients[name]
                    for name, grad in zip(ctx.names, grads[:-1])
                    if grad is not None)
        grad = torch.empty_like(logits)
        device = logits.device.type
        for i in range(logits.shape[0]):
            leaf = logits[i:i + 1].detach().requires_grad_(True)
            with torch.enable_grad(), torch.autocast(
                    device, dtype=ctx.autocast,
                    enabled=ctx.autocast is not None):
                part, _ = _image_cross_entropy(leaf, ctx.label[i:i + 1],
                                               ctx.align_corners,
                                               ctx.ignore_index, ctx.sigmoid)
                grad[i:i + 1], = torch.autograd.grad(part * scale, leaf)
        return grad, None, None, None, None


def chunked_cross_entropy_gradients(logits: Tensor, label: Tensor,
                                    align_corners: bool, ignore_index: int,
                                    specs: Sequence[LossSpec]
                                    ) -> LogitGradients:
    """The chunked losses and accuracy of ``logits`` (detached) with their
    gradient w.r.t. ``logits``, image by image: what
    :class:`~mmseg_gf.ops.fused_loss.FusedClassifierLossFunction` keeps.
    Every loss name's gradient is a multiple of the summed cross-entropy's,
    so one basis serves them all. Runs under the caller's autocast."""
    basis = torch.empty_like(logits)
    total = correct = None
    for i in range(logits.shape[0]):
        target = label[i:i + 1]
        leaf = logits[i:i + 1].detach().requires_grad_(True)
        with forward_graph():
            part, up = _image_cross_entropy(leaf, target, align_corners,
                                            ignore_index, specs[0][4])
            basis[i:i + 1], = torch.autograd.grad(part, leaf)
        hit = _image_hits(up.detach(), target, ignore_index)
        part = part.detach()
        total = part if total is None else total + part
        correct = hit if correct is None else correct + hit
        del up
    values, coefficients = _spec_values(total, correct, label, ignore_index,
                                        specs, logits.shape[1])
    mix = {name: [(0, c)] for name, c in _by_name(specs,
                                                  coefficients).items()}
    return LogitGradients(values, [basis], mix)


def chunked_cross_entropy_losses(head: nn.Module, seg_logits: Tensor,
                                 batch_data_samples,
                                 specs: Sequence[LossSpec]
                                 ) -> Dict[str, Tensor]:
    """``head.loss_by_feat(seg_logits, batch_data_samples)`` computed image
    by image (see the module docstring); the same keys and values."""
    label = head._stack_batch_gt(batch_data_samples).squeeze(1)
    names = list(dict.fromkeys(name for name, *_ in specs))
    values = ChunkedCrossEntropyFunction.apply(
        seg_logits, label, head.align_corners, head.ignore_index, specs)
    out = dict(zip(names, values[:-1]))
    out['acc_seg'] = values[-1]
    return out

