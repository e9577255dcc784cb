"""A filtered conv, a frozen norm and a bit-masked activation as one node,
and its implementations, fastest first.

``conv_block``: the conv's input, weight and bias: the fused Triton node
(:mod:`.gpu`, while ``MMSEG_GF_CONV_BLOCKS`` is on), else the three
modules, each with its own path.
"""
import torch

from ..backend import dispatch, switches
from ..backend.dispatch import tensor_signature
from . import gpu


def _refusal(x, weight, bias):
    if not switches.value('MMSEG_GF_CONV_BLOCKS'):
        return 'MMSEG_GF_CONV_BLOCKS off'
    if torch.compiler.is_compiling():
        return 'compiling'
    return gpu.refusal(x, weight, bias)


dispatch.register('conv_block', [
    dispatch.Implementation('triton', _refusal),
    dispatch.Implementation('torch', lambda *call: None),
], signature=lambda x, weight, bias: (tensor_signature(x),
                                      tensor_signature(weight),
                                      tensor_signature(bias)))
