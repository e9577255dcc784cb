"""Freed CPU memory kept for reuse: a training step without page faults.

glibc ``mmap``s blocks of 32 MiB or more and returns them on free, so each
large tensor faults its pages in again; keeping them trades resident
memory for step time (docs/benchmarks/README.md, "Freed CPU memory kept
for reuse"). Opt-in (``reuse_cpu_memory=True``); process-wide.
"""
import ctypes
import ctypes.util
from typing import Callable, Optional

from ..ops.backend import extension, output_pool

__all__ = ['keep_freed_cpu_memory', 'cpu_memory_kept', 'supported',
           'return_freed_cpu_memory', 'bound_process_memory']

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_KEEP = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: 2**31 - 1}
# glibc's defaults (its dynamic mmap threshold, switched off by setting
# either, stays off)
_RELEASE = {_M_MMAP_MAX: 65536, _M_TRIM_THRESHOLD: 128 * 1024}

_kept = False


def _mallopt() -> Optional[Callable[[int, int], int]]:
    """glibc's ``mallopt``, or None where the C library has none."""
    name = ctypes.util.find_library('c')
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def supported() -> bool:
    """Whether the C library has glibc's ``mallopt``."""
    return _mallopt() is not None


def keep_freed_cpu_memory(keep: bool = True) -> bool:
    """Keep freed CPU memory in ``malloc``'s heap (``keep``), or restore
    glibc's default.

    Returns:
        bool: whether the C library took the setting.
    """
    global _kept
    mallopt = _mallopt()
    if mallopt is None:
        return False
    values = _KEEP if keep else _RELEASE
    if not all(mallopt(option, value) == 1
               for option, value in values.items()):
        return False
    _kept = bool(keep)
    return True


def cpu_memory_kept() -> bool:
    """Whether :func:`keep_freed_cpu_memory` is in effect."""
    return _kept


def return_freed_cpu_memory() -> bool:
    """Have ``malloc`` give blocks of 128 KiB or more back when freed.

    Resident memory then follows live tensors, which a ``process_mib``
    budget needs. Process-wide.

    Returns:
        bool: whether the C library took the setting.
    """
    global _kept
    mallopt = _mallopt()
    if mallopt is None:
        return False
    values = {**_RELEASE, _M_MMAP_THRESHOLD: 128 * 1024}
    if not all(mallopt(option, value) == 1
               for option, value in values.items()):
        return False
    _kept = False
    return True


def _keep_no_kernel_outputs() -> bool:
    """Switch the compiled kernels' output pool off; returns whether there was
    one.

    Its blocks are no step's live tensors, so no prediction counts them
    (docs/benchmarks/design_measurements.md).
    """
    if not extension.built():
        return False
    output_pool.recycle_limit(0)
    return True


def bound_process_memory() -> bool:
    """What a ``process_mib`` budget needs on CPU: freed blocks returned, no
    output pool.

    Returns:
        bool: whether the C library took the ``malloc`` setting.
    """
    _keep_no_kernel_outputs()
    return return_freed_cpu_memory()
