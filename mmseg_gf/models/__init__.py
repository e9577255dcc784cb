"""Modules registered in mmseg's ``MODELS`` registry."""
from .gf_conv import GFConv2d, is_filterable_conv

__all__ = ['GFConv2d', 'is_filterable_conv']
