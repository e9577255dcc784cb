"""Grid rules of Twins' ``PCPVT`` and ``SVT``
(mmseg/models/backbones/twins.py): both layers are called with their
``hw_shape``; the global sub-sampled attention (``GSAEncoderLayer``) reads
keys on the grid of its ``sr`` conv, the locally grouped one
(``LSAEncoderLayer``) computes ``qkv`` on fixed ``ws x ws`` windows."""
from mmseg.models.backbones.twins import GSAEncoderLayer, LSAEncoderLayer
from torch import nn

from ....ops.linear.token_grid import TokenGrid
from ...gf_linear import TokenGridSource
from ..registry import register_grid_rule
from .shared import hw_grid, spatial_reduction_layer

register_grid_rule(GSAEncoderLayer)(spatial_reduction_layer)


@register_grid_rule(LSAEncoderLayer)
def locally_grouped_layer(bindings, path: str, layer: nn.Module) -> None:
    """``LSAEncoderLayer(x, hw_shape)``: ``LocallyGroupedSelfAttention``'s
    ``qkv`` on ``(B, h, w, ws, ws, C)`` windows (token axis 3), the rest on
    ``hw_shape``."""
    rule = type(layer).__name__
    tokens = TokenGridSource(name=path)
    bindings.set_around(layer, hw_grid, (tokens, ))
    ws = layer.attn.window_size
    window = TokenGridSource(TokenGrid(ws, ws, layout='hwc'),
                             name=f'{path}.attn.window_size')
    bindings.bind_layer(f'{path}.attn.qkv', window, None, 3, rule)
    bindings.bind_all(layer, path, tokens, rule)
