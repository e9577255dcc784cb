"""Freed CPU memory kept for reuse: a training step without page faults.

glibc's ``malloc`` serves every block of 32 MiB or more (a segmentor's
feature maps and their gradients at 512x512) with its own ``mmap`` and
gives it back to the system when the tensor is freed, so the next tensor of
that size faults all its pages in again: on the 2-core benchmark VM a fresh
64 MiB tensor costs ~25 ms before a byte is computed, an elementwise product
into it 5 ms. A training step makes many such tensors (the backward's
gradients), more than inference does. :func:`keep_freed_cpu_memory` makes
``malloc`` serve them from its heap and keep what is freed there (glibc's
``M_MMAP_MAX`` 0, ``M_TRIM_THRESHOLD`` at its maximum), as PyTorch's CUDA
caching allocator keeps freed device memory: steps reuse the pages they
touched before.

The price is resident memory: the heap keeps its peak and fragments (a
freed block split by a small allocation no longer fits the next large
one). MobileNetV3-LRASPP, GF last 10 at 512x512, batch 2, one thread, AMD
EPYC Zen 4 VM: 1.05 s per step instead of 1.23 s, 1547 MiB resident after
12 steps instead of 1069 (docs/benchmarks/README.md, "Freed CPU memory kept
for reuse"). Memory is what an edge
device lacks first, so this is opt-in: ``gradient_filter=dict(...,
reuse_cpu_memory=True)`` (GradFilterHook applies it when the model trains
on CPU). Process-wide.
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
    """What a ``process_mib`` budget needs on CPU: the process holds its
    live tensors and the libraries, not freed memory kept for reuse.
    ``malloc`` gives large freed blocks back
    (:func:`return_freed_cpu_memory`) and the compiled kernels keep no
    freed outputs (their pool off, :func:`_keep_no_kernel_outputs`).
    Process-wide.

    Returns:
        bool: whether the C library took the ``malloc`` setting.
    """
    _keep_no_kernel_outputs()
    return return_freed_cpu_memory()
