"""Mixed precision on CPU: ``tools/train.py --amp`` without a GPU.

mmengine's ``AmpOptimWrapper`` refuses to run without CUDA (or NPU/MLU),
while PyTorch autocasts CPU convolutions and matmuls to bfloat16.
:class:`CPUAmpOptimWrapper` is an ``OptimWrapper`` whose forward runs under
``torch.autocast('cpu', dtype=torch.bfloat16)``; bfloat16 has float32's
exponent range, so no loss scaling is needed. :func:`enable_amp` picks it
for ``--amp`` on a machine without CUDA, mmengine's wrapper otherwise.

A CPU without native instructions for the autocast dtype (x86's
``avx512_bf16`` / ``amx_bf16`` for bfloat16, ``avx512_fp16`` / ``amx_fp16``
for float16; Arm's ``bf16``) converts every operand and runs the float32
kernels, or falls back to scalar reference code: on such machines the step
was measured 5-10x slower than float32, with no accuracy to gain. The
wrapper says so when it is built (:func:`native_cpu_dtype`), so that the
slowdown is not discovered from the iteration times.
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
    """The CPU's feature flags (lower case), or None where they cannot be
    read (no ``/proc/cpuinfo``: not Linux)."""
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
    """Whether this CPU computes in ``dtype`` natively (a flag of
    :data:`NATIVE_FLAGS`); None when unknown (no flags to read)."""
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
