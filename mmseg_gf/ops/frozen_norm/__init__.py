"""The frozen batch norm's backward and its implementations, fastest first.

``frozen_norm``: a frozen norm's input ``x``: the Triton backward
(:mod:`.gpu`, which keeps nothing of ``x``), else PyTorch's (which keeps
``x``).
``frozen_layer_norm``: a frozen layer norm's kept input and its normalised
dimensions: the Triton backward, else ATen's.
"""
from ..backend import dispatch
from . import gpu

dispatch.register('frozen_norm', [
    dispatch.Implementation('triton', gpu.refusal),
    dispatch.Implementation('torch', lambda x: None),
])

dispatch.register('frozen_layer_norm', [
    dispatch.Implementation('triton', gpu.layer_norm_refusal),
    dispatch.Implementation('torch', lambda x, dims: None),
])
