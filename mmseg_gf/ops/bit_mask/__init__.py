"""The bit masks' pack and apply and their implementations, fastest first.

``bit_mask``: the mask's tensor in its memory order: the Triton kernels
(:mod:`.gpu`), the compiled C++ kernels (``mmseg_gf._bit_mask``,
:func:`~.masks.kernel_refusal`), or PyTorch (:mod:`.masks`).
"""
from ..backend import dispatch
from . import gpu, masks

dispatch.register('bit_mask', [
    dispatch.Implementation('triton', gpu.refusal, gpu),
    dispatch.Implementation('c++', masks.kernel_refusal),
    dispatch.Implementation('torch', lambda t: None),
])
