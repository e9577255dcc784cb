"""Losses whose gradient is computed in the forward, in two modules: the
loss's own gradients (:mod:`.loss_gradients`) and a head's classifier fused
with its loss (:mod:`.fused_classifier`). Their public names are importable
from here too.
"""
from .fused_classifier import (ConvSpec, FusedClassifierLossFunction,
                               channel_scaled_classifier, input_gradient,
                               is_pointwise, weight_and_bias_gradients)
from .loss_gradients import (KeptGradientLossFunction, LogitGradients,
                             PrecomputedGradientLossFunction, forward_graph,
                             loss_gradients)

__all__ = ['LogitGradients', 'forward_graph', 'loss_gradients', 'ConvSpec',
           'PrecomputedGradientLossFunction', 'KeptGradientLossFunction',
           'FusedClassifierLossFunction', 'channel_scaled_classifier',
           'is_pointwise',
           'weight_and_bias_gradients', 'input_gradient']
