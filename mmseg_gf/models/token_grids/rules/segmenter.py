"""Grid rule of ``SegmenterMaskTransformerHead``
(mmseg/models/decode_heads/segmenter_mask_head.py): the head's Linears on
the grid of its input features, its transformer layers on that grid plus
``num_classes`` trailing class embeddings."""
import functools
from typing import Tuple

from mmseg.models.decode_heads.segmenter_mask_head import \
    SegmenterMaskTransformerHead
from torch import nn

from ....ops.linear.token_grid import TokenGrid
from ...gf_linear import TokenGridSource
from ..registry import register_grid_rule
from ..sites import CLASS_SCORES, inside_token_layer, join, token_kind_of


@register_grid_rule(SegmenterMaskTransformerHead)
def segmenter_head(bindings, path: str, head: nn.Module) -> None:
    """``SegmenterMaskTransformerHead``: ``dec_proj`` and ``patch_proj`` on
    the feature map's grid, the layers on it plus ``num_classes`` trailing
    class embeddings, ``classes_proj`` on the class embeddings alone (no
    grid). ``patch_proj`` and ``classes_proj`` give the class scores.

    mmseg calls a decode head's ``forward`` directly (``loss`` /
    ``predict``), which runs no hooks of the head; so the grid is set from
    the features the segmentor's backbone (or neck) returns, the head's
    input, when they are computed.
    """
    rule = type(head).__name__
    patches = TokenGridSource(name=path)
    layers = TokenGridSource(name=f'{path} (+ class embeddings)')
    producer = getattr(bindings.model, 'neck', None)
    if producer is None:
        producer = getattr(bindings.model, 'backbone', None)
    if producer is None:
        why = ('its grid comes from the segmentor\'s features: bind the '
               'segmentor, not the head alone')
        for name, module in head.named_modules(prefix=path):
            if token_kind_of(module) is not None and not inside_token_layer(
                    head, path, name):
                bindings.bind_layer(name, None, rule=rule, no_grid=why)
        return

    bindings.set_after(
        producer,
        functools.partial(_segmenter_grids, head.input_transform,
                          head.in_index, head.num_classes),
        (patches, layers))
    bindings.bind_layer(join(path, 'dec_proj'), patches, None, 1, rule)
    bindings.bind_layer(join(path, 'patch_proj'), patches, None, 1, rule,
                        role=CLASS_SCORES)
    bindings.bind_layer(join(path, 'classes_proj'), None, None, 1, rule,
                        no_grid='class embeddings: tokens on no spatial grid',
                        role=CLASS_SCORES)
    bindings.bind_all(head.layers, join(path, 'layers'), layers, rule)


def _segmenter_grids(input_transform, in_index, num_classes, module, args,
                     output) -> tuple:
    h, w = _head_input_hw(input_transform, in_index, output)
    return TokenGrid(h, w), TokenGrid(h, w, trailing_tokens=num_classes)


def _head_input_hw(input_transform, in_index, inputs) -> Tuple[int, int]:
    """``(H, W)`` of the map a head's ``_transform_inputs(inputs)``
    returns, from the shapes alone (no resize run)."""
    if input_transform == 'resize_concat':
        shape = inputs[in_index[0]].shape
    elif input_transform == 'multiple_select':
        raise ValueError('SegmenterMaskTransformerHead with '
                         "input_transform='multiple_select' has no one grid")
    else:
        shape = inputs[in_index].shape
    return int(shape[-2]), int(shape[-1])
