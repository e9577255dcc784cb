"""The compiled extension's pool of large CPU outputs.

Outputs of 128 KiB or more are recycled by byte size, so a training step
does not pay the page faults of fresh memory again
(``csrc/output_recycler.cpp``). At most ``MMSEG_GF_RECYCLE_MB`` MiB
(default 256, ``0``: off; a ``process_mib`` budget on CPU turns it off, as
no prediction counts its blocks).
"""
import contextlib

import torch
from torch import Tensor

from . import availability, extension, shape_caches, switches

__all__ = ['recycle_limit', 'current_recycle_limit', 'recycled_bytes',
           'release_recycled',
           'recycling_off', 'empty_for_writing', 'applier']

_kernels = extension.module('patch_ops')


def recycle_limit(limit_bytes: int) -> int:
    """Set the pool's limit in bytes (``0``: off, freeing it); returns the
    previous.
    """
    return _kernels.recycle_limit(int(limit_bytes))


def current_recycle_limit() -> int:
    """The pool's limit in bytes, read by raising it for a moment (which frees
    nothing).
    """
    previous = _kernels.recycle_limit(1 << 62)
    _kernels.recycle_limit(previous)
    return previous


def recycled_bytes() -> int:
    """Bytes of freed large outputs kept for reuse right now."""
    return _kernels.recycled_bytes()


def release_recycled() -> None:
    """Free every kept output block (as ``torch.cuda.empty_cache`` does)."""
    _kernels.release_recycled()


@contextlib.contextmanager
def recycling_off():
    """Inside the block every large output is fresh memory and nothing is
    kept, for memory profilers that count allocations; a no-op without the
    kernels.
    """
    if _kernels is None:
        yield
        return
    previous = recycle_limit(0)
    try:
        yield
    finally:
        recycle_limit(previous)


def empty_for_writing(shape, like: Tensor) -> Tensor:
    """An uninitialised contiguous tensor for an output written in full: a
    recycled block on CPU where one of its size is kept, else ``torch.empty``.
    """
    if (_kernels is None or like.device.type != 'cpu'
            or torch.compiler.is_compiling()
            or not availability.native_switched_on()):
        return like.new_empty(shape)
    return _kernels.empty_for_writing([int(v) for v in shape], like.dtype)


def applier(setter, to_kernel=lambda value: value):
    """How :func:`switches.override` sets a toggle held in compiled kernels:
    ``setter`` takes the value and returns the previous state, put back
    afterwards; nothing to set without the kernels.
    """

    def apply(value):
        if _kernels is None:
            return lambda: None
        previous = setter(to_kernel(value))
        return lambda: setter(previous)

    return apply


switches.bind_applier('MMSEG_GF_RECYCLE_MB',
                      applier(recycle_limit, lambda mib: mib << 20))
# blocks kept per byte size (a new shape, a new size), at most the
# switch's MiB; least recently returned ones are freed first
shape_caches.register(
    'native.recycled_outputs',
    lambda: 0 if _kernels is None else current_recycle_limit(),
    lambda: 0 if _kernels is None else recycled_bytes(), unit='bytes',
    clear=lambda: None if _kernels is None else release_recycled())
