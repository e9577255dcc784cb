"""Analysis: the single cost model and gradient-quality measures."""
from .cost import ConvBackwardCost, conv_backward_cost

__all__ = ['ConvBackwardCost', 'conv_backward_cost']
