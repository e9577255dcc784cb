"""Grid rule of Segformer's ``MixVisionTransformer``
(mmseg/models/backbones/mit.py): each ``TransformerEncoderLayer`` is
called with its ``hw_shape``; its efficient attention reads keys on the
grid of its ``sr`` conv."""
from mmseg.models.backbones.mit import \
    TransformerEncoderLayer as MiTEncoderLayer

from ..registry import register_grid_rule
from .shared import spatial_reduction_layer

register_grid_rule(MiTEncoderLayer, checkpointed=(MiTEncoderLayer, ))(
    spatial_reduction_layer)
