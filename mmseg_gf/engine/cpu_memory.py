"""Freed CPU memory kept for reuse: training steps without page faults.

glibc's ``malloc`` serves every block of 32 MiB or more (a segmentor's
feature maps and their gradients at 512x512) with its own ``mmap`` and
gives it back to the system when the tensor is freed, so the next tensor of
that size faults all its pages in again: on the 2-core benchmark VM a fresh
64 MiB tensor costs ~25 ms before a byte is computed, an elementwise product
into it 5 ms. A training step makes many such tensors (the backward's
gradients), more than inference does. :func:`keep_freed_cpu_memory` makes
``malloc`` serve them from its heap and keep what is freed there (glibc's
``M_MMAP_MAX`` 0, ``M_TRIM_THRESHOLD`` at its maximum), as PyTorch's CUDA
caching allocator keeps freed device memory, so later tensors reuse pages
already touched.

The setting ``reuse_cpu_memory`` (:data:`REUSE_MODES`) says for how long:

* ``'step'`` (the default): within each training step
  (:class:`StepMemoryReuse`; GradFilterHook begins it before the step and
  ends it after). The backward's gradients reuse the pages the forward's
  activations were freed from; at the step's end ``malloc_trim`` gives
  every free page back, so between steps the process holds what it held
  without reuse.
* ``'run'``: for the whole process, never given back: later steps also
  skip the faults of the first tensors, but the heap keeps its peak and
  fragments (a freed block split by a small allocation no longer fits the
  next large one). MobileNetV3-LRASPP, GF last 10 at 512x512, batch 2, one
  thread, AMD EPYC Zen 4 VM: 1617 MiB resident after 12 steps instead of
  1102 (docs/benchmarks/README.md, "Freed CPU memory kept for reuse").
* ``'off'``: glibc's default.

``True`` and ``False`` are read as ``'run'`` and ``'off'``. Only where the
model trains on CPU and the C library is glibc (:func:`supported`).
"""
import ctypes
import ctypes.util
import functools
from typing import Any, Callable, Optional

__all__ = ['REUSE_MODES', 'reuse_mode', 'keep_freed_cpu_memory',
           'cpu_memory_kept', 'give_back_free_memory', 'StepMemoryReuse',
           'supported']

#: What ``reuse_cpu_memory`` may be (see the module docstring).
REUSE_MODES = ('step', 'run', 'off')

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_KEEP = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: 2**31 - 1}
# glibc's defaults (its dynamic mmap threshold, switched off by setting
# either, stays off)
_RELEASE = {_M_MMAP_MAX: 65536, _M_TRIM_THRESHOLD: 128 * 1024}

_kept = False


def reuse_mode(value: Any) -> str:
    """``reuse_cpu_memory`` as one of :data:`REUSE_MODES` (``True`` ->
    ``'run'``, ``False`` -> ``'off'``).

    Raises:
        ValueError: anything else (the message lists the allowed values).
    """
    if value is True or value is False:
        return 'run' if value else 'off'
    if isinstance(value, str) and value in REUSE_MODES:
        return value
    raise ValueError(f'gradient_filter reuse_cpu_memory must be one of '
                     f'{list(REUSE_MODES)} (or True / False, read as '
                     f"'run' / 'off'), got {value!r}")


@functools.lru_cache(maxsize=None)
def _libc_function(name: str, argtypes: tuple) -> Optional[Callable]:
    """A function of glibc's ``malloc``, or None where the C library has
    none (macOS, musl, Windows). Looked up once (``find_library`` runs
    ``ldconfig``)."""
    library = ctypes.util.find_library('c')
    if library is None:
        return None
    try:
        function = getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


def _mallopt() -> Optional[Callable[[int, int], int]]:
    return _libc_function('mallopt', (ctypes.c_int, ctypes.c_int))


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


def give_back_free_memory() -> bool:
    """Give every free page of ``malloc``'s heaps back to the system
    (glibc's ``malloc_trim(0)``); whether the C library has it."""
    trim = _libc_function('malloc_trim', (ctypes.c_size_t, ))
    if trim is None:
        return False
    trim(0)
    return True


class StepMemoryReuse:
    """Freed CPU memory kept for reuse from :meth:`begin` to :meth:`end`
    (one training step), then given back (``reuse_cpu_memory='step'``).

    Where memory is already kept for the whole process (``'run'``), or the
    C library is not glibc, both do nothing. Also a context manager.
    """

    def __init__(self) -> None:
        self._active = False

    def begin(self) -> None:
        if not self._active and not cpu_memory_kept():
            self._active = keep_freed_cpu_memory(True)

    def end(self) -> None:
        if self._active:
            keep_freed_cpu_memory(False)
            give_back_free_memory()
            self._active = False

    def __enter__(self) -> 'StepMemoryReuse':
        self.begin()
        return self

    def __exit__(self, *exc) -> None:
        self.end()
