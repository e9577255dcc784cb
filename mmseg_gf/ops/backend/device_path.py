"""The host checks that only CPU tensors get, and a switch to skip them.

A few ops read a tensor's value on the host when it lives on the CPU (a
free read there) and skip that read on other devices, where it would wait
for the device's queue every step: the resized loss's recount of the hits
of non-finite logits, and the label-range check (image by image on the CPU,
one device-side assertion elsewhere). Those branches ask
:func:`host_checks`.

Inside :func:`as_on_cuda` they take the decisions CUDA tensors take, so that
a step on CPU tensors runs the operators a CUDA step launches (what
:mod:`mmseg_gf.accounting.launches` counts). Outside it nothing changes.
"""
import contextlib
from typing import Iterator

from torch import Tensor

__all__ = ['host_checks', 'as_on_cuda', 'acting_as_cuda']

_as_cuda = False


def host_checks(t: Tensor) -> bool:
    """Whether checks that read ``t``'s values on the host run: on CPU
    tensors, except inside :func:`as_on_cuda`."""
    return t.device.type == 'cpu' and not _as_cuda


def acting_as_cuda() -> bool:
    """True inside :func:`as_on_cuda`."""
    return _as_cuda


@contextlib.contextmanager
def as_on_cuda() -> Iterator[None]:
    """CPU tensors take CUDA's side of :func:`host_checks` in the block
    (process-wide; the previous setting is restored)."""
    global _as_cuda
    previous, _as_cuda = _as_cuda, True
    try:
        yield
    finally:
        _as_cuda = previous
