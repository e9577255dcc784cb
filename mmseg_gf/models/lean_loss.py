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
import functools
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
from mmengine.logging import print_log
from torch import Tensor, nn
from torch.autograd import Function

from ..ops.fused_loss import (ConvSpec, FusedClassifierLossFunction,
                              LogitGradients, forward_graph,
                              PrecomputedGradientLossFunction,
                              loss_gradients)

__all__ = ['chunkable_losses', 'chunked_cross_entropy_losses',
           'chunked_cross_entropy_gradients', 'ChunkedCrossEntropyFunction',
           'base_decode_head', 'ClassifierCapture', 'fusion_blocker',
           'fused_classifier_losses', 'lean_head_losses',
           'log_fallback_once', 'loss_gradient_copies',
           'classifier_fused_now']

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


def _image_cross_entropy(logits: Tensor, target: Tensor, align_corners: bool,
                         ignore_index: int) -> Tuple[Tensor, Tensor]:
    """Summed per-pixel cross-entropy of one image's logits upsampled to
    its label (``target``, 1 x H x W), and the upsampled logits."""
    up = _upsample(logits, target.shape[-2:], align_corners)
    part = F.cross_entropy(up, target, reduction='none',
                           ignore_index=ignore_index).sum()
    return part, up


def _image_hits(up: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """Correctly classified labelled pixels of one image: mmseg's
    ``accuracy`` (top-1, no threshold) before its division."""
    hit = up.topk(1, dim=1)[1].squeeze(1).eq(target)
    return hit[target != ignore_index].float().sum()


def _spec_values(total: Tensor, correct: Tensor, label: Tensor,
                 ignore_index: int, specs: Sequence[LossSpec]
                 ) -> Tuple[Dict[str, Tensor], List[float]]:
    """Each loss name's value from the summed cross-entropy ``total`` (mmseg's
    normalisers), ``acc_seg`` from the summed hits, and the factor of
    ``total`` in each spec's loss."""
    valid = int((label != ignore_index).sum())
    coefficients = []
    values: Dict[str, Tensor] = {}
    for name, weight, reduction, non_ignore in specs:
        if reduction == 'mean':
            factor = (valid if non_ignore else label.numel()) + _EPS
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
                                            align_corners, ignore_index)
            hit = _image_hits(up, target, ignore_index)
            total = part if total is None else total + part
            correct = hit if correct is None else correct + hit
            del up
        values, coefficients = _spec_values(total, correct, label,
                                            ignore_index, specs)
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
                                               ctx.ignore_index)
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
                                            ignore_index)
            basis[i:i + 1], = torch.autograd.grad(part, leaf)
        hit = _image_hits(up.detach(), target, ignore_index)
        part = part.detach()
        total = part if total is None else total + part
        correct = hit if correct is None else correct + hit
        del up
    values, coefficients = _spec_values(total, correct, label, ignore_index,
                                        specs)
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


def base_decode_head():
    """mmseg's ``BaseDecodeHead`` class (None without mmseg)."""
    try:
        from mmseg.models.decode_heads.decode_head import BaseDecodeHead
    except ImportError:
        return None
    return BaseDecodeHead


def _plain_class(head: nn.Module) -> type:
    return getattr(type(head), '_plain_class', type(head))


def _has_base_loss(head: nn.Module) -> bool:
    base = base_decode_head()
    return base is not None and \
        _plain_class(head).loss_by_feat is base.loss_by_feat


def _plain_loss_by_feat(head: nn.Module) -> Callable:
    return functools.partial(_plain_class(head).loss_by_feat, head)


_LOGGED: Set[Tuple[str, str]] = set()


def log_fallback_once(head: nn.Module, reason: str) -> None:
    """Log, once per head class and reason, why its classifier is not
    fused with its loss (mmengine's current logger)."""
    key = (_plain_class(head).__name__, reason)
    if key not in _LOGGED:
        _LOGGED.add(key)
        print_log(f'lean loss: {key[0]} keeps its classifier\'s input '
                  f'(classifier not fused with the loss): {reason}',
                  logger='current')


def fusion_blocker(head: nn.Module) -> Optional[str]:
    """Why ``head``'s classifier cannot be fused with its loss (logged
    once), or None when it can: the head must classify with mmseg's
    ``cls_seg`` (dropout, then ``conv_seg``), compute mmseg's
    ``loss_by_feat`` (its loss is then the only consumer of the logits) and
    have a plain ``nn.Conv2d`` as ``conv_seg``."""
    reason = getattr(head, '_fused_classifier_off', None)
    base = base_decode_head()
    plain = _plain_class(head)
    if reason is not None:
        return reason
    if plain.cls_seg is not base.cls_seg:
        reason = 'its class overrides cls_seg'
    elif not _has_base_loss(head):
        reason = ('its class has its own loss_by_feat (its loss\'s gradient '
                  'is taken in the forward instead)')
    elif type(getattr(head, 'conv_seg', None)) is not nn.Conv2d or \
            head.conv_seg.padding_mode != 'zeros':
        reason = 'conv_seg is not a zero-padded torch.nn.Conv2d'
    if reason is not None:
        log_fallback_once(head, reason)
    return reason


class ClassifierCapture:
    """The classifier calls of one head's ``loss``, with what autograd saved
    for them held here, so that they can be dropped once the loss is fused.

    If the forward's output is not the one classifier call's output (the
    head transforms it), nothing is dropped: the calls keep their inputs
    as autograd would, and the backward is autograd's.
    """

    def __init__(self) -> None:
        self.calls: List[Tuple[Tensor, Tensor]] = []
        self._held: List[list] = []

    @staticmethod
    def _packer(held: List[list]) -> Callable[[Tensor], list]:
        # Not a bound method: the classifier's autograd node keeps its pack
        # hook, and a hook holding the capture (hence the node's own
        # output) would make a cycle the garbage collector cannot see.
        def pack(tensor: Tensor) -> list:
            holder = [tensor]
            held.append(holder)
            return holder

        return pack

    @staticmethod
    def _unpack(holder: list) -> Tensor:
        if holder[0] is None:
            raise RuntimeError(
                'lean loss: the classifier\'s output was used besides the '
                'decode head\'s loss, whose gradient was fused with the '
                'classifier; set gradient_filter lean=False')
        return holder[0]

    def classify(self, head: nn.Module, feat: Tensor) -> Tensor:
        """mmseg's ``cls_seg`` (dropout, then ``conv_seg``), recorded."""
        if head.dropout is not None:
            feat = head.dropout(feat)
        with torch.autograd.graph.saved_tensors_hooks(
                self._packer(self._held), self._unpack):
            logits = head.conv_seg(feat)
        self.calls.append((feat, logits))
        return logits

    def mismatch(self, seg_logits) -> Optional[str]:
        """Why ``seg_logits`` cannot be fused (None: it is the one
        classifier call's output)."""
        if len(self.calls) != 1:
            return f'cls_seg ran {len(self.calls)} times in the forward'
        if seg_logits is not self.calls[0][1]:
            return 'its forward does not return the classifier\'s output'
        return None

    def release(self) -> Tuple[Tensor, Tensor]:
        """Drop what the classifier call saved; its input and output."""
        for holder in self._held:
            holder[0] = None
        return self.calls[0]


def _trainable(head: nn.Module) -> List[Tensor]:
    return [p for p in head.parameters() if p.requires_grad]


def _single_logit_gradients(compute: Callable[[Tensor], Dict[str, Tensor]],
                            logits: Tensor,
                            params: Sequence[Tensor]) -> LogitGradients:
    values, grads = loss_gradients(compute, [logits], params)
    result = LogitGradients(values)
    for key, (grad, ) in grads.items():
        if grad is not None:
            result.mix[key] = [(len(result.bases), 1.0)]
            result.bases.append(grad)
    return result


def fused_classifier_losses(head: nn.Module, capture: ClassifierCapture,
                            batch_data_samples) -> Dict[str, Tensor]:
    """``head.loss_by_feat`` of its classifier's output, through
    :class:`~mmseg_gf.ops.fused_loss.FusedClassifierLossFunction`: mmseg's
    cross-entropy image by image when :func:`chunkable_losses` allows,
    the head's ``loss_by_feat`` on the whole batch otherwise.

    Raises:
        ValueError: the loss cannot be differentiated in the forward (see
            :func:`~mmseg_gf.ops.fused_loss.loss_gradients`); the capture
            then still holds what the classifier saved.
    """
    feat, logits = capture.calls[0]
    specs = chunkable_losses(head)
    if specs is not None:
        label = head._stack_batch_gt(batch_data_samples).squeeze(1)

        def gradients(z: Tensor) -> LogitGradients:
            return chunked_cross_entropy_gradients(
                z, label, head.align_corners, head.ignore_index, specs)
    else:
        plain = _plain_loss_by_feat(head)

        def gradients(z: Tensor) -> LogitGradients:
            return _single_logit_gradients(
                lambda leaf: plain(leaf, batch_data_samples), z,
                _trainable(head))
    conv = head.conv_seg
    keys: List[str] = []
    values = FusedClassifierLossFunction.apply(
        feat, conv.weight, conv.bias, logits.detach(), ConvSpec.of(conv),
        gradients, keys)
    capture.release()
    return dict(zip(keys, values))


def lean_head_losses(head: nn.Module, seg_logits,
                     batch_data_samples) -> Dict[str, Tensor]:
    """``head.loss_by_feat`` without fusing the classifier: mmseg's
    cross-entropy image by image (keeps the logits) where
    :func:`chunkable_losses` allows, otherwise the head's own
    ``loss_by_feat`` once, with its gradient w.r.t. every logits tensor
    taken in the forward and kept.

    Raises:
        ValueError: the loss cannot be differentiated in the forward (see
            :func:`~mmseg_gf.ops.fused_loss.loss_gradients`).
    """
    specs = chunkable_losses(head) if _has_base_loss(head) else None
    if specs is not None:
        return chunked_cross_entropy_losses(head, seg_logits,
                                            batch_data_samples, specs)
    plain = _plain_loss_by_feat(head)
    tensors = tuple(seg_logits) if isinstance(seg_logits, (tuple, list)) \
        else (seg_logits, )

    def compute(*leaves):
        feats = type(seg_logits)(leaves) if isinstance(
            seg_logits, (tuple, list)) else leaves[0]
        return plain(feats, batch_data_samples)

    keys: List[str] = []
    values = PrecomputedGradientLossFunction.apply(compute, keys,
                                                   _trainable(head),
                                                   *tensors)
    return dict(zip(keys, values))


def loss_gradient_copies(head: nn.Module) -> Optional[int]:
    """How many logits-sized tensors ``head``'s lean loss keeps per
    classifier output: 1 for the chunked cross-entropy, one gradient per
    loss name for mmseg's ``loss_by_feat`` otherwise; None when the head
    has its own ``loss_by_feat`` (it depends on that code)."""
    if not _has_base_loss(head):
        return None
    if chunkable_losses(head) is not None:
        return 1
    losses = head.loss_decode
    losses = list(losses) if isinstance(losses, nn.ModuleList) else [losses]
    return len({loss.loss_name for loss in losses})


def classifier_fused_now(head: nn.Module) -> bool:
    """Whether ``head`` is in a ``loss`` call that fuses its classifier
    with the loss (what a step tracer asks at the classifier's call)."""
    return getattr(head, '_classifier_capture', None) is not None
