"""Grid rule of ``VisionTransformer`` (mmseg/models/backbones/vit.py; DeiT,
also under Segmenter, SETR, DPT): the patch embedding returns the grid,
the layers see ``[cls] + H*W`` tokens (``with_cls_token``)."""
import functools

from mmseg.models.backbones.vit import \
    TransformerEncoderLayer as ViTEncoderLayer
from mmseg.models.backbones.vit import VisionTransformer
from torch import nn

from ....ops.gradient_filter_linear import TokenGrid
from ...gf_linear import TokenGridSource
from ..registry import register_grid_rule
from ..sites import join


def _embedded_grid(extra: int, module, args, output) -> tuple:
    _, hw = output
    return (TokenGrid(int(hw[0]), int(hw[1]), extra_tokens=extra), )


def _no_grid(module, args, kwargs) -> tuple:
    return (None, )


@register_grid_rule(VisionTransformer, checkpointed=(ViTEncoderLayer, ))
def vision_transformer(bindings, path: str, vit: nn.Module) -> None:
    """``VisionTransformer``: the patch embedding returns ``hw_shape``; the
    layers see ``[cls] + H*W`` tokens (``with_cls_token``)."""
    rule = type(vit).__name__
    tokens = TokenGridSource(name=f'{path}.patch_embed')

    extra = 1 if vit.with_cls_token else 0
    bindings.set_after(vit.patch_embed,
                       functools.partial(_embedded_grid, extra), (tokens, ))
    bindings.set_around(vit, _no_grid, (tokens, ))
    bindings.bind_all(vit.layers, join(path, 'layers'), tokens, rule)
