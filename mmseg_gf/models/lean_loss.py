"""mmseg's cross-entropy decode loss, one image at a time.

``BaseDecodeHead.loss_by_feat`` upsamples the whole batch's logits to the
label size and takes the loss of that: at 512x512, batch 8 and 21 classes,
176 MB of upsampled logits plus as much again of log-softmax, alive in the
forward and, recomputed, in the backward. For the common case (every
``loss_decode`` is mmseg's ``CrossEntropyLoss`` without sigmoid, mask or
class weights, reduction ``'mean'`` or ``'sum'``, and no pixel sampler) the
loss is a sum of per-pixel terms over a normaliser that depends on the labels
only, so :class:`ChunkedCrossEntropyFunction` computes it image by image,
forward and backward, keeping the low-resolution logits alone: one image's
upsampled logits are alive at a time.

The numbers are mmseg's: the same per-pixel cross-entropy, the same
normaliser (``avg_non_ignore``, ``loss_weight``, ``+ eps``) and the same
accuracy; only the sum over pixels is taken per image and then added, which
rounds differently from one sum (relative differences ~1e-7). Other losses
take :func:`mmseg_gf.ops.lean.recomputed_losses` (the whole batch,
recomputed in the backward).
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function

__all__ = ['chunkable_losses', 'chunked_cross_entropy_losses',
           'ChunkedCrossEntropyFunction']

_EPS = torch.finfo(torch.float32).eps

# (loss name, loss weight, reduction, average over non-ignored pixels only)
LossSpec = Tuple[str, float, str, bool]


def chunkable_losses(head: nn.Module) -> Optional[List[LossSpec]]:
    """The head's losses as :data:`LossSpec` if the chunked path computes
    them exactly as mmseg does, else None."""
    from mmseg.models.losses import CrossEntropyLoss
    if getattr(head, 'sampler', None) is not None:
        return None
    losses = head.loss_decode
    losses = list(losses) if isinstance(losses, nn.ModuleList) else [losses]
    specs = []
    for loss in losses:
        if (type(loss) is not CrossEntropyLoss or loss.use_sigmoid
                or loss.use_mask or loss.class_weight is not None
                or loss.reduction not in ('mean', 'sum')):
            return None
        specs.append((loss.loss_name, float(loss.loss_weight),
                      loss.reduction, bool(loss.avg_non_ignore)))
    return specs


def _upsample(logits: Tensor, size, align_corners: bool) -> Tensor:
    return F.interpolate(logits, size=size, mode='bilinear',
                         align_corners=align_corners)


def _autocast_dtype(device_type: str):
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


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
        ctx.ignore_index, ctx.specs = ignore_index, list(specs)
        ctx.autocast = _autocast_dtype(logits.device.type)
        size = label.shape[-2:]
        total = correct = None
        for i in range(logits.shape[0]):
            up = _upsample(logits[i:i + 1], size, align_corners)
            target = label[i:i + 1]
            part = F.cross_entropy(up, target, reduction='none',
                                   ignore_index=ignore_index).sum()
            hit = up.topk(1, dim=1)[1].squeeze(1).eq(target)
            hit = hit[target != ignore_index].float().sum()
            total = part if total is None else total + part
            correct = hit if correct is None else correct + hit
            del up
        valid = int((label != ignore_index).sum())
        ctx.coefficients = []
        values: Dict[str, Tensor] = {}
        for name, weight, reduction, non_ignore in specs:
            if reduction == 'mean':
                factor = (valid if non_ignore else label.numel()) + _EPS
                value = weight * (total / factor)
                ctx.coefficients.append(weight / factor)
            else:
                value = weight * total
                ctx.coefficients.append(weight)
            values[name] = values[name] + value if name in values else value
        accuracy = (correct.reshape(1) + _EPS).mul_(100.0 / (valid + _EPS))
        ctx.mark_non_differentiable(accuracy)
        ctx.names = list(values)
        return tuple(values.values()) + (accuracy, )

    @staticmethod
    def backward(ctx, *grads):
        logits, = ctx.saved_tensors
        by_name = dict(zip(ctx.names, grads[:-1]))
        scale = sum(
            by_name[name] * coefficient
            for (name, *_), coefficient in zip(ctx.specs, ctx.coefficients)
            if by_name[name] is not None)
        grad = torch.empty_like(logits)
        size = ctx.label.shape[-2:]
        device = logits.device.type
        for i in range(logits.shape[0]):
            leaf = logits[i:i + 1].detach().requires_grad_(True)
            with torch.enable_grad(), torch.autocast(
                    device, dtype=ctx.autocast,
                    enabled=ctx.autocast is not None):
                up = _upsample(leaf, size, ctx.align_corners)
                part = F.cross_entropy(up, ctx.label[i:i + 1],
                                       reduction='none',
                                       ignore_index=ctx.ignore_index).sum()
                grad[i:i + 1], = torch.autograd.grad(part * scale, leaf)
        return grad, None, None, None, None


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
