"""GFConv2d and GFLinear, registered as ``type='GFConv2d'`` /
``type='GFLinear'`` where mm* is installed, and the registry of layer kinds
gradient filtering can train (:mod:`.layer_kinds`).

``gf_conv``, ``gf_linear`` and ``gf_attention`` themselves are pure
PyTorch. When mmseg is present the layers are registered in mmseg's
``MODELS`` (configs with ``default_scope='mmseg'``) and in mmengine's root
``MODELS`` (mmcv's ``build_conv_layer`` outside any scope), so
``conv_cfg=dict(type='GFConv2d', radius=4)`` builds it either way; and
``token_grids`` (the grid rules of mmseg's transformer blocks, one file per
family) is importable.
"""
from importlib.util import find_spec

from .filtered_layer import FilteredLayer
from .gf_attention import GFMultiheadAttention, is_filterable_attention
from .gf_conv import GFConv2d, is_filterable_conv
from .gf_linear import GFLinear, TokenGridSource, is_filterable_linear
from .layer_kinds import LayerKind, kind_of, layer_kinds, register_layer_kind

__all__ = [
    'FilteredLayer', 'GFConv2d', 'GFLinear', 'GFMultiheadAttention',
    'TokenGridSource',
    'is_filterable_attention', 'is_filterable_conv', 'is_filterable_linear',
    'LayerKind', 'kind_of', 'layer_kinds', 'register_layer_kind'
]

if find_spec('mmseg') is not None:
    from mmengine.registry import MODELS as MMENGINE_MODELS
    from mmseg.registry import MODELS as MMSEG_MODELS

    for _registry in (MMSEG_MODELS, MMENGINE_MODELS):
        _registry.register_module(module=GFConv2d)
        _registry.register_module(module=GFLinear)

    # the Linear / attention kinds: their grid rules need mmseg's blocks
    from . import linear_kinds  # noqa: F401,E402
