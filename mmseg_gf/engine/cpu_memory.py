"""Freed CPU memory kept for reuse: a training step without page faults.

glibc's ``malloc`` ``mmap``s every block of 32 MiB or more and returns it on
free, so the next such tensor (a step's feature maps and gradients at
512x512) faults all its pages in again. :func:`keep_freed_cpu_memory` sets
``M_MMAP_MAX`` 0 and ``M_TRIM_THRESHOLD`` to its maximum, so the heap keeps
freed memory, as PyTorch's CUDA caching allocator does. The price is
resident memory (the heap keeps its peak and fragments); figures in
docs/benchmarks/README.md, "Freed CPU memory kept for reuse". Opt-in, as
memory is what an edge device lacks first:
``gradient_filter=dict(..., reuse_cpu_memory=True)``. Process-wide.
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
    """glibc's ``mallopt``, or None where the C library has none (macOS,
    musl, Windows)."""
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
    """Keep freed CPU memory in ``malloc``'s heap for reuse (``keep``), or
    return to glibc's default of giving large blocks back at once.

    Returns:
        bool: whether the C library took the setting (False without glibc's
        ``mallopt``; nothing changes then).
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
    """Have ``malloc`` give every block of 128 KiB or more back to the
    system when it is freed (glibc's static default threshold, its dynamic
    raise switched off): the process's resident memory then follows its
    live tensors instead of keeping what earlier, larger steps (a budget's
    profile) freed, which a ``process_mib`` budget needs. Process-wide.

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
    """Switch the compiled kernels' output pool off (``MMSEG_GF_RECYCLE_MB``
    0, freeing what it keeps). The pool keeps the large outputs one
    backward freed (``g_x``, the lean region's gradients) for the next
    step's, up to 256 MiB: torch allocations that are no step's live
    tensors, so no prediction of the step counts them (Swin-T UPerNet,
    256x256, batch 2, 21 layers: 142 MiB kept between steps). Returns
    whether there was a pool (False without the compiled kernels)."""
    if not extension.built():
        return False
    output_pool.recycle_limit(0)
    return True


def bound_process_memory() -> bool:
    """What a ``process_mib`` budget needs on CPU: large freed blocks go back
    to the system (:func:`return_freed_cpu_memory`) and the compiled kernels
    keep no freed outputs (:func:`_keep_no_kernel_outputs`). Process-wide.

    Returns:
        bool: whether the C library took the ``malloc`` setting.
    """
    _keep_no_kernel_outputs()
    return return_freed_cpu_memory()
