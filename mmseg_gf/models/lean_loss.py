"""mmseg's cross-entropy decode loss (softmax or sigmoid) with its gradient
taken in the forward, without the batch's upsampled logits.

mmseg's ``loss_by_feat`` keeps the whole batch's upsampled logits and their
log-softmax alive; for mmseg's ``CrossEntropyLoss`` (and the thresholded
``OHEMPixelSampler``) the loss is a sum of per-pixel terms over a
label-only normaliser, so only its gradient w.r.t. the low-resolution
logits is kept. Which losses qualify and how mmseg's numbers are
reproduced: docs/lean_region.md, "The loss, fused with the classifier"."""
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..ops.loss.gradients import KeptGradientLossFunction, LogitGradients
from ..ops.backend import dispatch
from ..ops.resized_loss.loss import (BatchTotals, accuracy, check_labels,
                                     resized_cross_entropy)

__all__ = ['chunkable_losses', 'chunk_blocker', 'ohem_sampler_spec',
           'chunked_cross_entropy_losses', 'chunked_cross_entropy_gradients',
           'LossSpec', 'SamplerSpec']

_EPS = torch.finfo(torch.float32).eps

# (loss name, loss weight, reduction, average over non-ignored pixels only,
# sigmoid, class weights or None)
LossSpec = Tuple[str, float, str, bool, bool, Optional[Tuple[float, ...]]]
# mmseg's OHEMPixelSampler: (thresh, min_kept per image)
SamplerSpec = Tuple[float, int]


def selection_weights(label: Tensor, keep: Tensor,
                      class_weight: Optional[Tensor], dtype) -> Tensor:
    """``keep * class_weight[label]`` (``keep`` where no class weights)."""
    weight = keep.to(dtype)
    if class_weight is not None:
        weight = weight * class_weight[torch.where(keep, label, 0)]
    return weight


def probability_selection(prob: Tensor, valid: Tensor, kept: int,
                          thresh: float) -> Tensor:
    """mmseg's hard-pixel rule (``OhemCrossEntropy``, ``OHEMPixelSampler``):
    the ``valid`` pixels whose probability is strictly below the larger of the
    ``min(kept, count - 1)``-th smallest one and ``thresh``."""
    pred = prob[valid]
    k = min(kept, pred.numel() - 1)
    min_value = torch.kthvalue(pred, k + 1).values
    return valid & (prob < max(min_value, thresh))


def ohem_sampler_spec(head: nn.Module) -> Optional[SamplerSpec]:
    """``head``'s thresholded ``OHEMPixelSampler`` as :data:`SamplerSpec`, else
    None (without a threshold its order of losses is not mirrored)."""
    from mmseg.structures.sampler import OHEMPixelSampler
    sampler = getattr(head, 'sampler', None)
    if type(sampler) is not OHEMPixelSampler or sampler.thresh is None:
        return None
    return float(sampler.thresh), int(sampler.min_kept)


def _loss_spec(loss: nn.Module, head: nn.Module
               ) -> Tuple[Optional[LossSpec], Optional[str]]:
    """One ``loss_decode`` as :data:`LossSpec`, or why it is not one."""
    from mmseg.models.losses import CrossEntropyLoss
    if type(loss) is not CrossEntropyLoss:
        return None, f'{type(loss).__name__} is not mmseg\'s CrossEntropyLoss'
    weights = loss.class_weight
    if loss.use_mask:
        return None, 'CrossEntropyLoss with use_mask'
    if loss.reduction not in ('mean', 'sum'):
        return None, f'CrossEntropyLoss with reduction {loss.reduction!r}'
    if loss.use_sigmoid and head.out_channels == 1:
        return None, 'a sigmoid CrossEntropyLoss of one channel'
    if loss.use_sigmoid and weights is not None:
        return None, 'a sigmoid CrossEntropyLoss with class weights'
    return (loss.loss_name, float(loss.loss_weight), loss.reduction,
            bool(loss.avg_non_ignore), bool(loss.use_sigmoid),
            None if weights is None else tuple(map(float, weights))), None


def chunk_blocker(head: nn.Module) -> Optional[str]:
    """Why :func:`chunkable_losses` refuses ``head`` (None: it does not)."""
    sampler = getattr(head, 'sampler', None)
    if sampler is not None and ohem_sampler_spec(head) is None:
        return f'its pixel sampler {type(sampler).__name__} is not ' \
            'OHEMPixelSampler with a threshold'
    losses = head.loss_decode
    losses = list(losses) if isinstance(losses, nn.ModuleList) else [losses]
    specs = []
    for loss in losses:
        spec, reason = _loss_spec(loss, head)
        if reason is not None:
            return reason
        specs.append(spec)
    if len({spec[4] for spec in specs}) != 1:
        return 'softmax and sigmoid losses mixed'
    if sampler is not None and specs[0][4]:
        return 'a pixel sampler with sigmoid losses'
    return None


def chunkable_losses(head: nn.Module) -> Optional[List[LossSpec]]:
    """The head's losses as :data:`LossSpec` if the chunked path computes them
    exactly as mmseg does, else None (:func:`chunk_blocker` says why)."""
    if chunk_blocker(head) is not None:
        return None
    losses = head.loss_decode
    losses = list(losses) if isinstance(losses, nn.ModuleList) else [losses]
    return [_loss_spec(loss, head)[0] for loss in losses]


def _class_weight_map(logits: Tensor, label: Tensor, ignore_index: int,
                      weights: Tuple[float, ...]) -> Tensor:
    """``class_weight[label]`` per pixel, 0 where ignored."""
    table = logits.new_tensor(weights, dtype=torch.float32)
    if table.numel() != logits.shape[1]:
        raise ValueError(f'class_weight has {table.numel()} entries for '
                         f'{logits.shape[1]} classes')
    check_labels(label, logits.shape[1], ignore_index)  # before indexing
    return selection_weights(label, label != ignore_index, table,
                             torch.float32)


def _totals(logits: Tensor, label: Tensor, align_corners: bool,
            ignore_index: int, sigmoid: bool,
            weights: Optional[Tuple[float, ...]],
            sampled: Optional[Tensor], traced: bool = False
            ) -> Tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor],
                       Optional[BatchTotals]]:
    """The summed weighted cross-entropy, its gradient, the hits, the
    labelled pixels' summed class weight (None without class weights) and the
    batch's totals where computed; ``traced``: differentiable, no gradient."""
    classes = None if weights is None else _class_weight_map(
        logits, label, ignore_index, weights)
    weight = classes if sampled is None else (
        sampled if classes is None else sampled * classes)
    mass = None if classes is None else classes.sum()
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if traced:
        form = dispatch.choose('resized_loss_traced',
                               logits).implementation.run
        loss, hits = form(logits, label, ignore_index=ignore_index,
                          align_corners=align_corners, weight=weight,
                          sigmoid=sigmoid)
        return loss.sum().to(dtype), None, hits.sum().float(), mass, None
    out = resized_cross_entropy(logits, label, ignore_index=ignore_index,
                                align_corners=align_corners, weight=weight,
                                sigmoid=sigmoid)
    if out.totals is not None:
        return out.totals.loss, out.grad, out.totals.hits, mass, out.totals
    return (out.loss.sum().to(dtype), out.grad, out.hits.sum().float(), mass,
            None)


def _sampled_pixels(logits: Tensor, label: Tensor, align_corners: bool,
                    ignore_index: int, sampler: SamplerSpec) -> Tensor:
    """mmseg's ``OHEMPixelSampler.sample``: weight 1 on the batch's hard
    pixels, 0 elsewhere."""
    thresh, min_kept = sampler
    valid = label != ignore_index
    weight = torch.zeros(label.shape, dtype=torch.float32,
                         device=label.device)
    if not bool(valid.any()):
        return weight
    prob = resized_cross_entropy(logits, label, ignore_index=ignore_index,
                                 align_corners=align_corners,
                                 want_grad=False,
                                 want_pixels=True).target_prob
    kept = min_kept * label.shape[0]
    return weight.masked_fill_(
        probability_selection(prob, valid, kept, thresh), 1.0)


def _spec_value(total: Tensor, pixels: Union[int, Tensor], spec: LossSpec,
                classes: int) -> Tuple[Tensor, Union[float, Tensor]]:
    """One spec's loss from the summed cross-entropy ``total`` and its factor.
    Counts stay 0-d device tensors: a host read would sync every step."""
    _, weight, reduction, _, sigmoid, _ = spec
    if reduction == 'sum':
        return weight * total, weight
    factor = pixels * (classes if sigmoid else 1) + _EPS
    return weight * (total / factor), weight / factor


def _mean_normaliser(spec: LossSpec, valid: Tensor, pixels: int,
                     mass: Optional[Tensor]) -> Union[int, Tensor]:
    """mmseg's ``avg_factor`` of a mean loss (ignored pixels weigh 0)."""
    if mass is not None:
        return mass
    return valid if spec[3] else pixels


def chunked_cross_entropy_gradients(logits: Tensor, label: Tensor,
                                    align_corners: bool, ignore_index: int,
                                    specs: Sequence[LossSpec],
                                    sampler: Optional[SamplerSpec] = None,
                                    traced: bool = False
                                    ) -> LogitGradients:
    """The chunked losses and accuracy of ``logits`` (detached) with their
    gradient w.r.t. ``logits``, one basis per class weighting (each loss
    name's gradient is a multiple of it). ``sampler``: the head's
    :data:`SamplerSpec`, if any. ``traced`` (``torch.compile``, no sampler):
    the values are differentiable w.r.t. ``logits``; no bases returned."""
    logits = logits if traced else logits.detach()
    sampled = None if sampler is None else _sampled_pixels(
        logits, label, align_corners, ignore_index, sampler)
    groups: Dict[Optional[Tuple[float, ...]], int] = {}
    totals: List[Tuple[Tensor, Optional[float]]] = []
    result = LogitGradients({})
    correct = valid = first = None
    for spec in specs:
        name, key = spec[0], spec[5]
        if key not in groups:
            total, grad, hits, mass, batch = _totals(
                logits, label, align_corners, ignore_index, spec[4], key,
                sampled, traced)
            groups[key] = len(totals)
            totals.append((total, mass))
            result.bases.append(grad)
            if correct is None:
                correct, first = hits, batch
                valid = _labelled(label, ignore_index, batch)
        total, mass = totals[groups[key]]
        value, factor = _spec_value(
            total, _mean_normaliser(spec, valid, label.numel(), mass), spec,
            logits.shape[1])
        result.values[name] = result.values[name] + value \
            if name in result.values else value
        result.mix.setdefault(name, []).append((groups[key], factor))
    result.values['acc_seg'] = accuracy(correct, valid) if first is None \
        else first.accuracy
    return result


def _labelled(label: Tensor, ignore_index: int,
              totals: Optional[BatchTotals]) -> Tensor:
    """The pixels not labelled ``ignore_index`` (0-d, on the device: no
    sync), from the loss's totals where it counted them."""
    if totals is not None:
        return totals.labelled
    return (label != ignore_index).sum()


def chunked_cross_entropy_losses(head: nn.Module, seg_logits: Tensor,
                                 batch_data_samples,
                                 specs: Sequence[LossSpec]
                                 ) -> Dict[str, Tensor]:
    """``head.loss_by_feat(seg_logits, batch_data_samples)``, same keys and
    values, with only the gradient kept for the backward."""
    label = head._stack_batch_gt(batch_data_samples).squeeze(1)
    if torch.compiler.is_compiling():
        # the traced form: the kernel's operator, differentiated by
        # autograd (what lean_head.traced_head_losses allows)
        return dict(chunked_cross_entropy_gradients(
            seg_logits, label, head.align_corners, head.ignore_index, specs,
            traced=True).values)

    def gradients(z: Tensor) -> LogitGradients:
        return chunked_cross_entropy_gradients(
            z, label, head.align_corners, head.ignore_index, specs,
            ohem_sampler_spec(head))

    keys: List[str] = []
    values = KeptGradientLossFunction.apply(gradients, keys, seg_logits)
    return dict(zip(keys, values))
