"""The cost model of a convolution's backward, for the accounting.

The formulas are the conv kind's (:mod:`mmseg_gf.ops.conv_cost`, where the
layer-kind registry of :mod:`mmseg_gf.models.layer_kinds` reaches them too);
this module keeps their accounting-side name.
"""
from ..ops.conv_cost import (ConvBackwardCost, ConvGeometry,
                             conv_backward_cost, map_output_stride,
                             output_stride)

__all__ = ['ConvBackwardCost', 'conv_backward_cost', 'ConvGeometry',
           'output_stride', 'map_output_stride']
