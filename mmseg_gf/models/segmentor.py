"""What the plugin reads of an mmseg segmentor, in one place.

Its classifiers (which every strategy trains and no layer count includes),
its norm layers (frozen ones stay in eval mode), and the segmentor inside an
mmengine model wrapper. Selection, surgery, the cost accounting and the
hooks all ask these questions; answering them once keeps "the classifier"
and "a frozen norm" one definition each.
"""
from typing import List

from mmengine.model import is_model_wrapper
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

__all__ = [
    'CLASSIFIER_NAMES', 'CLASS_SCORE_NAMES', 'CLASS_SCORE_PATHS',
    'NORM_TYPES', 'unwrap_model',
    'is_classifier', 'is_class_score_layer',
    'is_head_classifier', 'classifier_paths', 'set_frozen_norms_eval'
]

#: Names of a head's final classifier: ``conv_seg`` of mmseg's
#: ``BaseDecodeHead``, ``fc_seg`` of PointRend's ``PointHead`` (which
#: deletes its ``conv_seg``).
CLASSIFIER_NAMES = ('conv_seg', 'fc_seg')
#: Segmenter's mask transformer head has no ``conv_seg``: its class scores
#: are the product of ``patch_proj`` (patches) and ``classes_proj`` (class
#: embeddings); both are its classifier.
CLASS_SCORE_NAMES = ('patch_proj', 'classes_proj')
#: Class-score layers deeper inside a decode head, by their path in it.
#: SAN's ``SideAdapterCLIPHead`` scores its mask proposals as the product of
#: ``rec_with_attnbias.proj`` (the CLIP recognition branch's last
#: projection of the mask tokens) and the text encoder's class embeddings
#: (computed outside the head, frozen): that projection is its classifier.
CLASS_SCORE_PATHS = ('rec_with_attnbias.proj', )
#: Norm layers: frozen ones are kept in eval mode during training.
NORM_TYPES = (_BatchNorm, _InstanceNorm, nn.GroupNorm, nn.LayerNorm)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside an mmengine model wrapper (DDP, FSDP, ...), or
    ``model`` itself when it is not wrapped."""
    return model.module if is_model_wrapper(model) else model


def _in_head(path: str, head: str) -> bool:
    return path.startswith(head + '.') and \
        path.split('.')[-1] in CLASSIFIER_NAMES


def _is_decode_head(path: str) -> bool:
    """``decode_head`` or one head of a cascade, ``decode_head.<i>``."""
    head, _, index = path.partition('.')
    return head == 'decode_head' and (not index or index.isdigit())


def is_class_score_layer(path: str) -> bool:
    """One of the Linear layers whose product gives a decode head's class
    scores (Segmenter's ``patch_proj`` / ``classes_proj``, directly under
    ``decode_head[.i]``; SAN's ``rec_with_attnbias.proj``)."""
    head, _, name = path.rpartition('.')
    if name in CLASS_SCORE_NAMES and _is_decode_head(head):
        return True
    return any(
        path.endswith('.' + rel) and _is_decode_head(path[:-len(rel) - 1])
        for rel in CLASS_SCORE_PATHS)


def is_classifier(path: str) -> bool:
    """A decode head's classifier (``decode_head[.i].conv_seg``,
    PointHead's ``fc_seg``, or the class-score Linears of Segmenter and
    SAN): trained by every strategy, counted by no ``num_layers``."""
    return _in_head(path, 'decode_head') or is_class_score_layer(path)


def is_head_classifier(path: str) -> bool:
    """The classifier of any head, decode or auxiliary: the layer whose
    output a head's loss reads (the lean loss then keeps those logits)."""
    return _in_head(path, 'decode_head') or _in_head(path, 'auxiliary_head')


def classifier_paths(model: nn.Module) -> List[str]:
    """Paths of the decode head classifier(s) of ``model``."""
    return [n for n, _ in unwrap_model(model).named_modules()
            if is_classifier(n)]


def set_frozen_norms_eval(model: nn.Module) -> int:
    """Put norm layers with no trainable parameter in eval mode.

    Frozen BN must keep its (calibrated) running statistics: in train mode it
    would both normalise with batch statistics and overwrite them. mmengine's
    train loops call ``model.train()`` every iteration, so call this again
    before each iteration (GradFilterHook does).

    Returns:
        int: how many norm layers were put in eval mode.
    """
    count = 0
    for m in unwrap_model(model).modules():
        if isinstance(m, NORM_TYPES) and not any(
                p.requires_grad for p in m.parameters()):
            m.eval()
            count += 1
    return count
