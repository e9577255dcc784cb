"""The compiled extension's pool of large CPU outputs.

Outputs of 128 KiB or more (``g_x``, patch grids, and the lean region's
backward outputs through :func:`empty_for_writing`) are recycled: when such
a tensor dies its memory goes back to a small pool and the next output of
the same byte size reuses it, so a training step does not pay the page
faults of fresh memory again (see ``csrc/output_recycler.cpp``).
The pool holds at most ``MMSEG_GF_RECYCLE_MB`` MiB (default 256, ``0``
turns it off; a ``process_mib`` budget on CPU turns it off, as no
prediction counts its blocks); :func:`release_recycled` empties it.
"""
import contextlib

import torch
from torch import Tensor

from . import extension, shape_caches, switches

__all__ = ['recycle_limit', 'current_recycle_limit', 'recycled_bytes',
           'release_recycled',
           'recycling_off', 'empty_for_writing', 'applier']

_kernels = extension.module('patch_ops')


def recycle_limit(limit_bytes: int) -> int:
    """Set how many bytes of freed large outputs are kept for reuse (``0``:
    none, freeing what is kept); returns the previous limit."""
    return _kernels.recycle_limit(int(limit_bytes))


def current_recycle_limit() -> int:
    """The pool's limit in bytes, read by raising it for a moment (a larger
    limit frees nothing; putting the old one back frees nothing either, as
    the pool already holds no more than it)."""
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
    """Every large output in the block is fresh memory, as torch allocates
    it, and nothing is kept; the previous limit is restored afterwards.
    Memory profilers that count allocations need this: a recycled block was
    allocated once, in an earlier step. A no-op without the kernels."""
    if _kernels is None:
        yield
        return
    previous = recycle_limit(0)
    try:
        yield
    finally:
        recycle_limit(previous)


def empty_for_writing(shape, like: Tensor) -> Tensor:
    """An uninitialised contiguous tensor of ``shape`` in ``like``'s dtype
    and device, for an output written in full: on CPU with the kernels
    built, a recycled block when one of its byte size is kept (no page
    faults of fresh memory; the lean region's backward outputs use it as
    the filtered convs' do), else ``torch.empty``."""
    if (_kernels is None or like.device.type != 'cpu'
            or torch.compiler.is_compiling()
            or not extension.switched_on()):
        return like.new_empty(shape)
    return _kernels.empty_for_writing([int(v) for v in shape], like.dtype)


def applier(setter, to_kernel=lambda value: value):
    """:func:`switches.override`'s way to a toggle kept in the compiled
    kernels: ``setter`` (which returns the previous state) takes the value,
    and the previous state, as the kernels hold it, is put back. Without
    the kernels nothing reads the toggle, so there is nothing to set."""

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
