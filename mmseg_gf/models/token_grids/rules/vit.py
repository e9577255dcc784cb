"""Grid rule of ``VisionTransformer`` (mmseg/models/backbones/vit.py; DeiT,
also under Segmenter, SETR, DPT): the patch embedding returns the grid,
the layers see ``[cls] + H*W`` tokens (``with_cls_token``)."""
from mmseg.models.backbones.vit import \
    TransformerEncoderLayer as ViTEncoderLayer
from mmseg.models.backbones.vit import VisionTransformer
from torch import nn

from ..registry import register_grid_rule
from .shared import embedded_token_layers


@register_grid_rule(VisionTransformer, checkpointed=(ViTEncoderLayer, ))
def vision_transformer(bindings, path: str, vit: nn.Module) -> None:
    """``VisionTransformer``: the patch embedding returns ``hw_shape``; the
    layers see ``[cls] + H*W`` tokens (``with_cls_token``)."""
    embedded_token_layers(bindings, path, vit,
                          1 if vit.with_cls_token else 0)
