"""Mixed precision on CPU: ``tools/train.py --amp`` without a GPU.

mmengine's ``AmpOptimWrapper`` refuses to run without CUDA (or NPU/MLU),
while PyTorch autocasts CPU convolutions and matmuls to bfloat16.
:class:`CPUAmpOptimWrapper` is an ``OptimWrapper`` whose forward runs under
``torch.autocast('cpu', dtype=torch.bfloat16)``; bfloat16 has float32's
exponent range, so no loss scaling is needed. :func:`enable_amp` picks it
for ``--amp`` on a machine without CUDA, mmengine's wrapper otherwise.
"""
import logging
from contextlib import contextmanager

import torch
from mmengine.logging import print_log
from mmengine.optim import OptimWrapper
from mmseg.registry import OPTIM_WRAPPERS
from torch import nn

__all__ = ['CPUAmpOptimWrapper', 'enable_amp']

_DTYPES = ('bfloat16', 'float16')


@OPTIM_WRAPPERS.register_module()
class CPUAmpOptimWrapper(OptimWrapper):
    """``OptimWrapper`` with CPU autocast around the forward.

    Args:
        dtype: ``'bfloat16'`` (default) or ``'float16'``.
        **kwargs: those of ``OptimWrapper``.
    """

    def __init__(self, dtype: str = 'bfloat16', **kwargs) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f'CPUAmpOptimWrapper dtype must be one of '
                             f'{_DTYPES}, got {dtype!r}')
        super().__init__(**kwargs)
        self.cast_dtype = getattr(torch, dtype)

    @contextmanager
    def optim_context(self, model: nn.Module):
        with super().optim_context(model), torch.autocast(
                'cpu', dtype=self.cast_dtype):
            yield


def enable_amp(cfg) -> None:
    """Switch a config's ``OptimWrapper`` to mixed precision (``--amp``):
    mmengine's ``AmpOptimWrapper`` with dynamic loss scaling where CUDA is
    available, :class:`CPUAmpOptimWrapper` (bfloat16) otherwise.

    Raises:
        ValueError: the config's wrapper is neither ``OptimWrapper`` nor
            already a mixed-precision one.
    """
    wrapper = cfg.optim_wrapper
    if wrapper.get('type') in ('AmpOptimWrapper', 'CPUAmpOptimWrapper'):
        print_log('AMP training is already enabled in your config.',
                  logger='current', level=logging.WARNING)
        return
    if wrapper.get('type', 'OptimWrapper') != 'OptimWrapper':
        raise ValueError('--amp is only supported when the optimizer wrapper '
                         f'type is OptimWrapper, got {wrapper.get("type")!r}')
    if torch.cuda.is_available():
        wrapper.type = 'AmpOptimWrapper'
        wrapper.loss_scale = 'dynamic'
    else:
        wrapper.type = 'CPUAmpOptimWrapper'
