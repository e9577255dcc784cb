"""GFConv2d, registered as ``type='GFConv2d'`` where mm* is installed, and
the registry of layer kinds gradient filtering can train
(:mod:`.layer_kinds`).

``gf_conv`` itself is pure PyTorch. When mmseg is present the class is
registered in mmseg's ``MODELS`` (configs with ``default_scope='mmseg'``)
and in mmengine's root ``MODELS`` (mmcv's ``build_conv_layer`` outside any
scope), so ``conv_cfg=dict(type='GFConv2d', radius=4)`` builds it either way.
"""
from importlib.util import find_spec

from .gf_conv import GFConv2d, is_filterable_conv
from .layer_kinds import LayerKind, kind_of, layer_kinds, register_layer_kind

__all__ = ['GFConv2d', 'is_filterable_conv', 'LayerKind', 'kind_of',
           'layer_kinds', 'register_layer_kind']

if find_spec('mmseg') is not None:
    from mmengine.registry import MODELS as MMENGINE_MODELS
    from mmseg.registry import MODELS as MMSEG_MODELS

    for _registry in (MMSEG_MODELS, MMENGINE_MODELS):
        _registry.register_module(module=GFConv2d)
