"""A decode head's loss kept lean, its classifier fused with it where possible
(docs/lean_region.md, "The loss, fused with the classifier").

Fused, the loss's, ``g_W``'s and ``g_b``'s gradients are taken in the
forward without keeping the classifier's input; otherwise only the loss's
gradient w.r.t. the logits is kept. Why a head is not fused is logged once."""
import functools
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from mmengine.logging import print_log
from torch import Tensor, nn

from ..patching import overridden, plain_class
from ..ops.loss.fused_classifier import (ConvSpec, FusedClassifierLossFunction,
                                         channel_scaled_classifier,
                                         is_pointwise)
from ..ops.loss.gradients import (LogitGradients,
                                  PrecomputedGradientLossFunction,
                                  loss_gradients)
from .layer_kinds import CONV2D
from .lean_loss import (chunk_blocker, chunkable_losses,
                        chunked_cross_entropy_gradients,
                        chunked_cross_entropy_losses, ohem_sampler_spec)
from .lean_ohem import (HeadGradientsLossFunction, logit_gradients_at,
                        own_loss_producer)

__all__ = ['base_decode_head', 'ClassifierCapture', 'fusion_blocker',
           'folds_into_classifier', 'feature_noise',
           'fused_classifier_losses', 'lean_head_losses',
           'log_fallback_once', 'loss_gradient_copies',
           'disable_classifier_fusion', 'classifier_fused_now',
           'folded_dropout_noise', 'traced_head_losses']


def base_decode_head():
    """mmseg's ``BaseDecodeHead`` class (None without mmseg)."""
    try:
        from mmseg.models.decode_heads.decode_head import BaseDecodeHead
    except ImportError:
        return None
    return BaseDecodeHead


def _has_base_loss(head: nn.Module) -> bool:
    base = base_decode_head()
    return base is not None and \
        plain_class(head).loss_by_feat is base.loss_by_feat


def _plain_loss_by_feat(head: nn.Module) -> Callable:
    return functools.partial(plain_class(head).loss_by_feat, head)


_LOGGED: Set[Tuple[str, str]] = set()


def _log_once(head: nn.Module, what: str, reason: str) -> None:
    key = (plain_class(head).__name__, what + reason)
    if key not in _LOGGED:
        _LOGGED.add(key)
        print_log(f'lean loss: {key[0]} {what}: {reason}', logger='current')


def log_fallback_once(head: nn.Module, reason: str) -> None:
    """Log, once per head class and reason, why its classifier is not
    fused with its loss (mmengine's current logger)."""
    _log_once(head, 'keeps its classifier\'s input (classifier not fused '
              'with the loss)', reason)


def _chunked_specs(head: nn.Module):
    """The head's :func:`chunkable_losses` if it uses mmseg's ``loss_by_feat``;
    when that loss is not mirrored, why is logged once."""
    if not _has_base_loss(head):
        return None
    reason = chunk_blocker(head)
    if reason is not None:
        _log_once(head, 'runs mmseg\'s loss_by_feat on the whole batch '
                  '(upsampled logits of every image alive at once)', reason)
        return None
    return chunkable_losses(head)


def fusion_blocker(head: nn.Module) -> Optional[str]:
    """Why ``head``'s classifier cannot be fused with its loss (logged once),
    or None: it must classify with mmseg's ``cls_seg`` through a plain or
    lean 2-D conv, not the filtered one whose backward fusion would bypass."""
    reason = getattr(head, '_gf_fused_classifier_off', None)
    base = base_decode_head()
    plain = plain_class(head)
    if reason is not None:
        return reason
    if plain.cls_seg is not base.cls_seg:
        reason = 'its class overrides cls_seg'
    elif plain_class(getattr(head, 'conv_seg', None)) not in \
            CONV2D.plain_types or head.conv_seg.padding_mode != 'zeros':
        reason = 'conv_seg is not a zero-padded torch.nn.Conv2d'
    if reason is not None:
        log_fallback_once(head, reason)
    return reason


def folds_into_classifier(dropout: Optional[nn.Module], feat: Tensor,
                          conv: nn.Module) -> bool:
    """Whether ``dropout`` before a head's 1x1 classifier is a training
    ``Dropout2d`` that :class:`ClassifierCapture` folds into the classifier."""
    return (dropout is not None and plain_class(dropout) is nn.Dropout2d
            and dropout.training and 0 < dropout.p < 1
            and not dropout.inplace and feat.dim() == 4
            and is_pointwise(conv.weight, ConvSpec.of(conv))
            and not {'forward'} & (set(vars(dropout)) | set(vars(conv))))


def feature_noise(feat: Tensor, p: float) -> Tensor:
    """The ``N x C x 1 x 1`` noise a training ``Dropout2d(p)`` multiplies
    ``feat`` by, drawn as torch draws it, so a folded dropout drops the
    channels the module would."""
    noise = feat.new_empty(feat.shape[:2] + (1, 1))
    return noise.bernoulli_(1 - p).div_(1 - p)


class ClassifierCapture:
    """The classifier calls of one head's ``loss``, with what autograd saved for
    them, dropped once the loss is fused. A training ``Dropout2d`` before a 1x1
    classifier is folded into its weight, so the dropped-out input is never
    made.

    Attributes:
        calls: ``(classifier input, logits, channel scale or None)`` per call.
    """

    def __init__(self) -> None:
        self.calls: List[Tuple[Tensor, Tensor, Optional[Tensor]]] = []
        #: the channel scale of the classifier call running now (None
        #: outside one, or without a folded dropout)
        self.scale: Optional[Tensor] = None
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
        conv, noise = head.conv_seg, []
        if folds_into_classifier(head.dropout, feat, conv):
            def draw(x: Tensor) -> Tensor:
                noise.append(feature_noise(x, head.dropout.p))
                return x

            # through the module, not around it: its hooks still run, so
            # a step tracer sees the call as it sees any other
            with overridden(head.dropout, 'forward', draw):
                feat = head.dropout(feat)
        elif head.dropout is not None:
            feat = head.dropout(feat)
        scale = self.scale = noise[0] if noise else None
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                    self._packer(self._held), self._unpack):
                if scale is None:
                    logits = conv(feat)
                else:
                    with overridden(conv, 'forward',
                                    lambda x: channel_scaled_classifier(
                                        x, conv.weight, conv.bias, scale)):
                        logits = conv(feat)
        finally:
            self.scale = None
        self.calls.append((feat, logits, scale))
        return logits

    def mismatch(self, seg_logits) -> Optional[str]:
        """Why ``seg_logits`` cannot be fused (None: it is the one
        classifier call's output, or a tuple holding it once)."""
        if len(self.calls) != 1:
            return f'cls_seg ran {len(self.calls)} times in the forward'
        items = seg_logits if isinstance(seg_logits, (tuple, list)) \
            else [seg_logits]
        if sum(t is self.calls[0][1] for t in items) != 1:
            return 'its forward does not return the classifier\'s output'
        return None

    def release(self) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """Drop what the classifier call saved; its input, output and
        channel scale."""
        for holder in self._held:
            holder[0] = None
        return self.calls[0]


def _trainable(head: nn.Module) -> List[Tensor]:
    return [p for p in head.parameters() if p.requires_grad]


def _logit_gradients(compute: Callable[..., Dict[str, Tensor]],
                     logits: Tensor, others: Sequence[Tensor],
                     params: Sequence[Tensor]) -> LogitGradients:
    """``compute(logits, *others)`` differentiated in the forward."""
    values, grads = loss_gradients(
        compute, [logits, *others], params,
        [True] + [t.requires_grad for t in others])
    result = LogitGradients(values)
    for key, (grad, *rest) in grads.items():
        if grad is not None:
            result.mix[key] = [(len(result.bases), 1.0)]
            result.bases.append(grad)
        if others:
            result.others[key] = tuple(rest)
    return result


def _with_logits_at(seg_logits, position: Optional[int]) -> Callable:
    """Rebuild the head's output from ``(classifier logits, *others)``."""
    def rebuild(logits: Tensor, *others: Tensor):
        if position is None:
            return logits
        items = list(others)
        items.insert(position, logits)
        return type(seg_logits)(items)

    return rebuild


def fused_classifier_losses(head: nn.Module, capture: ClassifierCapture,
                            seg_logits, batch_data_samples
                            ) -> Dict[str, Tensor]:
    """``head.loss_by_feat(seg_logits)`` with the classifier fused into it
    (image by image where the loss allows, else on the whole batch).

    Raises:
        ValueError: the loss cannot be differentiated in the forward; the
            capture still holds what the classifier saved."""
    feat, logits, scale = capture.calls[0]
    position, others = None, []
    if isinstance(seg_logits, (tuple, list)):
        position = [t is logits for t in seg_logits].index(True)
        others = [t for i, t in enumerate(seg_logits) if i != position]
    specs = _chunked_specs(head) if position is None else None
    own = None if _has_base_loss(head) else own_loss_producer(
        head, plain_class(head), seg_logits, batch_data_samples)
    if specs is not None:
        label = head._stack_batch_gt(batch_data_samples).squeeze(1)

        def gradients(z: Tensor) -> LogitGradients:
            return chunked_cross_entropy_gradients(
                z, label, head.align_corners, head.ignore_index, specs,
                ohem_sampler_spec(head))
    elif own is not None:
        def gradients(z: Tensor, *rest: Tensor) -> LogitGradients:
            return logit_gradients_at(own, position, z, rest)
    else:
        plain, rebuild = _plain_loss_by_feat(head), _with_logits_at(
            seg_logits, position)

        def gradients(z: Tensor, *rest: Tensor) -> LogitGradients:
            return _logit_gradients(
                lambda *leaves: plain(rebuild(*leaves), batch_data_samples),
                z, rest, _trainable(head))
    conv = head.conv_seg
    keys: List[str] = []
    values = FusedClassifierLossFunction.apply(
        feat, conv.weight, conv.bias, logits.detach(), scale,
        ConvSpec.of(conv), gradients, keys, *others)
    capture.release()
    return dict(zip(keys, values))


def lean_head_losses(head: nn.Module, seg_logits,
                     batch_data_samples) -> Dict[str, Tensor]:
    """``head.loss_by_feat`` without fusion, keeping each loss's gradient
    w.r.t. the logits.

    Raises:
        ValueError: the loss cannot be differentiated in the forward."""
    specs = _chunked_specs(head)
    if specs is not None:
        return chunked_cross_entropy_losses(head, seg_logits,
                                            batch_data_samples, specs)
    tensors = tuple(seg_logits) if isinstance(seg_logits, (tuple, list)) \
        else (seg_logits, )
    own = None if _has_base_loss(head) else own_loss_producer(
        head, plain_class(head), seg_logits, batch_data_samples)
    keys: List[str] = []
    if own is not None:
        values = HeadGradientsLossFunction.apply(own, keys, *tensors)
        return dict(zip(keys, values))
    plain = _plain_loss_by_feat(head)

    def compute(*leaves):
        feats = type(seg_logits)(leaves) if isinstance(
            seg_logits, (tuple, list)) else leaves[0]
        return plain(feats, batch_data_samples)

    values = PrecomputedGradientLossFunction.apply(compute, keys,
                                                   _trainable(head),
                                                   *tensors)
    return dict(zip(keys, values))


def traced_head_losses(head: nn.Module, seg_logits,
                       batch_data_samples) -> Dict[str, Tensor]:
    """``head.loss_by_feat`` as ``torch.compile`` traces it (no fusion: its
    hooks do not trace), without data-dependent shapes."""
    specs = chunkable_losses(head) if _has_base_loss(head) else None
    if (specs is None or ohem_sampler_spec(head) is not None
            or not isinstance(seg_logits, Tensor)):
        return _plain_loss_by_feat(head)(seg_logits, batch_data_samples)
    return chunked_cross_entropy_losses(head, seg_logits, batch_data_samples,
                                        specs)


def loss_gradient_copies(head: nn.Module) -> Optional[int]:
    """How many logits-sized tensors ``head``'s lean loss keeps per classifier
    output; None when the head has its own ``loss_by_feat`` (the step tracer
    measures it)."""
    if not _has_base_loss(head):
        return None
    specs = chunkable_losses(head)
    if specs is not None:
        return len({spec[5] for spec in specs})
    losses = head.loss_decode
    losses = list(losses) if isinstance(losses, nn.ModuleList) else [losses]
    return len({loss.loss_name for loss in losses})


def disable_classifier_fusion(head: nn.Module, reason: str) -> None:
    """Keep ``head``'s classifier out of its loss from now on: for comparing
    the two, or for a head whose forward reads its classifier's output in a
    way the fusion does not see. ``reason`` is logged once."""
    head._gf_fused_classifier_off = reason
    log_fallback_once(head, reason)


def folded_dropout_noise(head: nn.Module) -> Optional[Tensor]:
    """The noise of the ``Dropout2d`` folded into ``head``'s running
    classifier call, or None."""
    capture = getattr(head, '_gf_classifier_capture', None)
    return None if capture is None else capture.scale


def classifier_fused_now(head: nn.Module) -> bool:
    """Whether ``head`` is in a ``loss`` call that fuses its classifier
    with the loss (what a step tracer asks at the classifier's call)."""
    return getattr(head, '_gf_classifier_capture', None) is not None
