"""Mixed precision on CPU: ``tools/train.py --amp`` without a GPU.

bfloat16 autocast around the forward, no loss scaling; a warning on CPUs
without native instructions for the dtype (docs/reliability.md).
"""
import logging
import platform
from contextlib import contextmanager
from typing import FrozenSet, Optional

import torch
from mmengine.logging import print_log
from mmengine.optim import OptimWrapper
from mmseg.registry import OPTIM_WRAPPERS
from torch import nn

__all__ = ['CPUAmpOptimWrapper', 'enable_amp', 'cpu_flags',
           'native_cpu_dtype']

_DTYPES = ('bfloat16', 'float16')

#: CPU flags (``/proc/cpuinfo``'s ``flags`` on x86, ``Features`` on Arm)
#: any of which gives native arithmetic in the autocast dtype.
NATIVE_FLAGS = {
    'bfloat16': ('avx512_bf16', 'amx_bf16', 'bf16'),
    'float16': ('avx512_fp16', 'amx_fp16', 'fphp', 'asimdhp'),
}


def cpu_flags(path: str = '/proc/cpuinfo') -> Optional[FrozenSet[str]]:
    """The CPU's feature flags (lower case), or None where unreadable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(':')
        if key.strip().lower() in ('flags', 'features'):
            flags.update(value.lower().split())
    return frozenset(flags)


def native_cpu_dtype(dtype: str) -> Optional[bool]:
    """Whether this CPU computes in ``dtype`` natively; None when unknown."""
    flags = cpu_flags()
    if flags is None:
        return None
    return any(flag in flags for flag in NATIVE_FLAGS[dtype])


def _warn_if_emulated(dtype: str) -> None:
    """Log a warning naming the slowdown when the CPU lacks ``dtype``."""
    native = native_cpu_dtype(dtype)
    if native is not False:
        return
    capability = torch.backends.cpu.get_cpu_capability()
    print_log(
        f'CPUAmpOptimWrapper: this CPU ({platform.machine()}, PyTorch '
        f'kernels {capability}) has no native {dtype} arithmetic (none of '
        f'the flags {", ".join(NATIVE_FLAGS[dtype])}): {dtype} autocast '
        'converts every operand and runs emulated kernels, measured 5-10x '
        'slower per step than float32 on such CPUs. Train without --amp '
        '(OptimWrapper) here.', logger='current', level=logging.WARNING)


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
        _warn_if_emulated(dtype)

    @contextmanager
    def optim_context(self, model: nn.Module):
        with super().optim_context(model), torch.autocast(
                'cpu', dtype=self.cast_dtype):
            yield


def enable_amp(cfg) -> None:
    """Switch a config's ``OptimWrapper`` to mixed precision (``--amp``).

    mmengine's ``AmpOptimWrapper`` where CUDA is available,
    :class:`CPUAmpOptimWrapper` (bfloat16) otherwise.

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
