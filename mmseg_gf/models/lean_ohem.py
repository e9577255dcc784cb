"""PIDHead's and DDRHead's losses with their gradients taken in the forward,
image by image, from the low-resolution logits (docs/lean_region.md, "The
cross-entropy of upsampled logits", has the rules), where mmseg upsamples
every logits tensor and runs its losses under autograd."""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function

from ..ops.loss.scaling import (flatten_gradients, function_outputs,
                                recombine_gradients)
from ..ops.loss.gradients import LogitGradients, forward_graph
from ..ops.lean.kept_sources import note_sources
from ..ops.resized_loss.loss import check_labels, resized_cross_entropy
from .lean_loss import probability_selection, selection_weights

__all__ = ['HeadGradients', 'selection_weights', 'probability_selection', 'ohem_selection', 'ohem_cross_entropy',
           'cross_entropy_loss', 'own_loss_producer', 'logit_gradients_at',
           'HeadGradientsLossFunction']

_EPS = torch.finfo(torch.float32).eps

#: One loss output's gradient w.r.t. one logits tensor: ``factor * grad``.
Term = Tuple[Tensor, float]


@dataclass
class HeadGradients:
    """A head's loss outputs and their gradients w.r.t. its logits tensors.

    Attributes:
        values: every output (detached), in mmseg's key order.
        grads: output key -> {logits index: (gradient, factor)}; outputs
            without an entry are not differentiable."""

    values: Dict[str, Tensor]
    grads: Dict[str, Dict[int, Term]] = field(default_factory=dict)


def _loss_list(head: nn.Module) -> Optional[List[nn.Module]]:
    losses = head.loss_decode
    return list(losses) if isinstance(losses, nn.ModuleList) else None


def _class_weights(loss: nn.Module, like: Tensor) -> Optional[Tensor]:
    if loss.class_weight is None:
        return None
    return like.new_tensor(loss.class_weight)


def _value(number: float, like: Tensor) -> Tensor:
    """A loss value in the logits' dtype, at least float32 (mmseg's
    cross-entropy of bfloat16 logits under autocast is float32)."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    return torch.tensor(number, dtype=dtype, device=like.device)


def label_probabilities(logits: Tensor, label: Tensor, ignore_index: int,
                        align_corners: bool):
    """First pass: each pixel's softmax probability of its label (0 where
    ignored) and the top-1 hits, without the gradient."""
    return resized_cross_entropy(logits, label, ignore_index=ignore_index,
                    align_corners=align_corners, want_grad=False,
                    want_pixels=True)


def ohem_selection(prob: Tensor, label: Tensor,
                   loss: nn.Module) -> Optional[Tensor]:
    """The pixels mmseg's ``OhemCrossEntropy`` averages over, or None when no
    pixel is labelled (mmseg's loss is then a constant 0)."""
    mask = label != loss.ignore_label
    if not bool(mask.any()):
        return None
    return probability_selection(prob, mask, loss.min_kept, loss.thresh)


def ohem_cross_entropy(logits: Tensor, label: Tensor, prob: Tensor,
                       loss: nn.Module, align_corners: bool,
                       want_grad: bool) -> Tuple[Tensor, Optional[Term]]:
    """mmseg's ``OhemCrossEntropy`` of ``logits`` upsampled to ``label``, and
    with ``want_grad`` its gradient w.r.t. the low-resolution logits (None:
    not differentiable)."""
    selected = ohem_selection(prob, label, loss)
    if selected is None:
        return logits.new_tensor(0.0), None
    count = int(selected.sum())
    if count == 0:  # mmseg: the mean of nothing, its gradient zero
        grad = torch.zeros_like(logits) if want_grad else None
        return _value(float('nan'), logits), \
            None if grad is None else (grad, 0.0)
    weight = selection_weights(label, selected, _class_weights(loss, logits),
                         logits.dtype)
    second = resized_cross_entropy(
        logits, label, ignore_index=loss.ignore_label,
        align_corners=align_corners, weight=weight, want_grad=want_grad)
    factor = float(loss.loss_weight) / count
    value = _value(float(second.loss.sum()) * factor, logits)
    return value, (second.grad, factor) if want_grad else None


def cross_entropy_loss(logits: Tensor, label: Tensor, loss: nn.Module,
                       ignore_index: int, align_corners: bool,
                       want_grad: bool) -> Tuple[Tensor, Optional[Term]]:
    """mmseg's softmax ``CrossEntropyLoss`` of ``logits`` upsampled to
    ``label``, with mmseg's normaliser (ignored pixels weigh 0), and its
    gradient."""
    check_labels(label, logits.shape[1], ignore_index)
    class_weight = _class_weights(loss, logits)
    valid = label != ignore_index
    weight = selection_weights(label, valid, class_weight, logits.dtype)
    factor = float(loss.loss_weight)
    if loss.reduction == 'mean':
        if class_weight is not None:
            pixels = float(weight.sum())
        else:
            pixels = int(valid.sum()) if loss.avg_non_ignore \
                else label.numel()
        factor /= pixels + _EPS
    out = resized_cross_entropy(
        logits, label, ignore_index=ignore_index, align_corners=align_corners,
        weight=weight, want_grad=want_grad)
    value = _value(float(out.loss.sum()) * factor, logits)
    return value, (out.grad, factor) if want_grad else None


def _accuracy(hits: Tensor, label: Tensor, ignore_index: int) -> Tensor:
    """mmseg's ``accuracy`` (top-1, percent, shape ``(1,)``) from the hits."""
    valid = int((label != ignore_index).sum())
    correct = hits.sum().float().reshape(1).to(label.device)
    return (correct + _EPS).mul_(100.0 / (valid + _EPS))


def _resize(logits: Tensor, size, align_corners: bool) -> Tensor:
    return F.interpolate(logits, size=size, mode='bilinear',
                         align_corners=align_corners)


def _boundary_loss(d_logit: Tensor, bd_label: Tensor, loss: nn.Module,
                   align_corners: bool, want_grad: bool
                   ) -> Tuple[Tensor, Optional[Term], Tensor]:
    """PIDNet's boundary loss by autograd on the upsampled one-channel map,
    its gradient, and the upsampled logits that gate ``loss_sem_bd``."""
    leaf = d_logit.detach().requires_grad_(want_grad)
    with forward_graph():
        up = _resize(leaf, bd_label.shape[-2:], align_corners)
        value = loss(up, bd_label)
        grad = torch.autograd.grad(value, leaf)[0] if want_grad else None
    return value.detach(), None if grad is None else (grad, 1.0), \
        up.detach()


def _pid_gradients(head: nn.Module, logits: Sequence[Tensor],
                   needs: Sequence[bool], batch_data_samples
                   ) -> HeadGradients:
    """PIDHead's ``loss_by_feat`` of ``(p, i, d)`` logits."""
    p_logit, i_logit, d_logit = logits
    sem_label, bd_label = head._stack_batch_gt(batch_data_samples)
    sem_label, bd_label = sem_label.squeeze(1), bd_label.squeeze(1)
    ac, ignore = head.align_corners, head.ignore_index
    loss_p, loss_i, loss_bd, loss_sem_bd = head.loss_decode
    result = HeadGradients({})

    def put(key: str, value: Tensor, term: Optional[Term], at: int) -> None:
        result.values[key] = value
        if term is not None:
            result.grads[key] = {at: term}

    put('loss_sem_p', *cross_entropy_loss(p_logit, sem_label, loss_p, ignore,
                                          ac, needs[0]), 0)
    first = label_probabilities(i_logit, sem_label, ignore, ac)
    put('loss_sem_i', *ohem_cross_entropy(i_logit, sem_label,
                                          first.target_prob, loss_i, ac,
                                          needs[1]), 1)
    value, term, d_up = _boundary_loss(d_logit, bd_label, loss_bd, ac,
                                       needs[2])
    put('loss_bd', value, term, 2)
    gate = torch.sigmoid(d_up[:, 0, :, :]) > 0.8
    del d_up
    bd_sem = torch.where(gate, sem_label,
                         torch.ones_like(sem_label) * ignore)
    put('loss_sem_bd', *ohem_cross_entropy(
        i_logit, bd_sem, torch.where(gate, first.target_prob, 0.0),
        loss_sem_bd, ac, needs[1]), 1)
    result.values['acc_seg'] = _accuracy(first.hits, sem_label, ignore)
    return result


def _ddr_gradients(head: nn.Module, logits: Sequence[Tensor],
                   needs: Sequence[bool], batch_data_samples
                   ) -> HeadGradients:
    """DDRHead's ``loss_by_feat`` of ``(context, spatial)`` logits."""
    label = head._stack_batch_gt(batch_data_samples).squeeze(1)
    ac, ignore = head.align_corners, head.ignore_index
    result = HeadGradients({})
    hits = None
    for at, (key, loss) in enumerate(zip(('loss_context', 'loss_spatial'),
                                         head.loss_decode)):
        first = label_probabilities(logits[at], label, ignore, ac)
        hits = first.hits if at == 0 else hits
        value, term = ohem_cross_entropy(logits[at], label,
                                         first.target_prob, loss, ac,
                                         needs[at])
        del first
        result.values[key] = value
        if term is not None:
            result.grads[key] = {at: term}
    result.values['acc_seg'] = _accuracy(hits, label, ignore)
    return result


def _is_softmax_cross_entropy(loss: nn.Module) -> bool:
    from mmseg.models.losses import CrossEntropyLoss
    return (type(loss) is CrossEntropyLoss and not loss.use_sigmoid
            and not loss.use_mask and loss.reduction in ('mean', 'sum'))


def _is_ohem(loss: nn.Module, ignore_index: int) -> bool:
    from mmseg.models.losses import OhemCrossEntropy
    return type(loss) is OhemCrossEntropy and \
        loss.ignore_label == ignore_index


#: A head's loss outputs and gradients from its logits tensors (forward
#: order) and which of them need a gradient.
Producer = Callable[[Sequence[Tensor], Sequence[bool]], HeadGradients]


def own_loss_producer(head: nn.Module, plain_class: type, seg_logits,
                      batch_data_samples) -> Optional[Producer]:
    """The lean ``loss_by_feat`` of a head with its own, or None where none
    mirrors every ``loss_decode`` exactly (PIDHead, DDRHead)."""
    try:
        from mmseg.models.decode_heads import DDRHead, PIDHead
        from mmseg.models.losses import BoundaryLoss
    except ImportError:
        return None
    if plain_class not in (PIDHead, DDRHead):
        return None
    losses = _loss_list(head)
    ignore = head.ignore_index
    count = len(seg_logits) if isinstance(seg_logits, (tuple, list)) else 0
    if losses is None:
        return None
    if plain_class is PIDHead and len(losses) == 4 and count == 3 \
            and _is_softmax_cross_entropy(losses[0]) \
            and _is_ohem(losses[1], ignore) \
            and type(losses[2]) is BoundaryLoss \
            and _is_ohem(losses[3], ignore):
        produce = _pid_gradients
    elif plain_class is DDRHead and len(losses) == 2 and count == 2 \
            and all(_is_ohem(loss, ignore) for loss in losses):
        produce = _ddr_gradients
    else:
        return None

    def producer(logits: Sequence[Tensor],
                 needs: Sequence[bool]) -> HeadGradients:
        return produce(head, logits, needs, batch_data_samples)

    return producer


def _scaled(term: Optional[Term]) -> Optional[Tensor]:
    if term is None:
        return None
    grad, factor = term
    return grad if factor == 1.0 else grad.mul_(factor)


def logit_gradients_at(producer: Producer, position: int, z: Tensor,
                       rest: Sequence[Tensor]) -> LogitGradients:
    """The producer's result as ``LogitGradients`` of the classifier output
    ``z`` at ``position`` among the head's logits."""
    logits = list(rest)
    logits.insert(position, z)
    needs = [True if i == position else t.requires_grad
             for i, t in enumerate(logits)]
    result = producer(logits, needs)
    out = LogitGradients(result.values)
    for key, per in result.grads.items():
        if position in per:
            grad, factor = per[position]
            out.mix[key] = [(len(out.bases), factor)]
            out.bases.append(grad)
        if rest:
            out.others[key] = tuple(_scaled(per.get(i))
                                    for i in range(len(logits))
                                    if i != position)
    return out


class HeadGradientsLossFunction(Function):
    """A :data:`Producer`'s loss outputs with only their gradients kept: the
    lean loss of a head whose classifier is not fused with it. Inputs: the
    producer, ``keys`` (receives the output keys), then the logits tensors."""

    @staticmethod
    def forward(ctx, producer: Producer, keys: List[str], *logits: Tensor):
        result = producer(logits, ctx.needs_input_grad[2:])
        keys.extend(result.values)
        ctx.keys = list(result.values)
        grads = {key: tuple(_scaled(per.get(i)) for i in range(len(logits)))
                 for key, per in result.grads.items()}
        ctx.layout, kept = flatten_gradients(grads, ctx.keys)
        note_sources(kept, [logits[j] for _, j in ctx.layout])
        ctx.save_for_backward(*kept)
        ctx.num_logits = len(logits)
        return function_outputs(ctx, result.values, grads)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, None) + recombine_gradients(
            ctx.layout, ctx.saved_tensors, grad_outputs, ctx.num_logits)
