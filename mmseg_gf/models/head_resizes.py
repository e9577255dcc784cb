"""An eager lean head's bilinear resizes take the strided-gradient rule
(:func:`~mmseg_gf.ops.resize.bilinear.strided_gradient_resize`) through
``F.interpolate`` alone.

A torch function mode would see every torch call of the head's loss (the
convs, norms and activations of its blocks too: hundreds a step, each a
trip into Python). Instead, while any thread is inside
:func:`routed_resizes`, ``torch.nn.functional.interpolate`` is a function
that applies the rule for the threads inside the block and calls the
original for every other call: mmseg's ``resize``, ``nn.Upsample`` and
direct calls all reach it, since they look ``F.interpolate`` up when
called. The entry is set through :mod:`mmseg_gf.patching` and put back
when the last thread leaves (docs/patching.md).
"""
import contextlib
import threading
from typing import Iterator, List

import torch.nn.functional as F

from ..ops.resize.bilinear import strided_gradient_resize
from ..patching import Entry, set_entry

__all__ = ['routed_resizes', 'routing']

_this_thread = threading.local()
_lock = threading.Lock()
_entry: List[Entry] = []  # the undo while any thread is inside
_inside = 0  # threads inside the block, nested entries counted


def routing() -> bool:
    """Whether this thread is inside :func:`routed_resizes`."""
    return getattr(_this_thread, 'depth', 0) > 0


def _interpolate(*args, **kwargs):
    if getattr(_this_thread, 'depth', 0):
        out = strided_gradient_resize(*args, **kwargs)
        if out is not None:
            return out
    return _entry[0].previous(*args, **kwargs)


def _enter() -> None:
    global _inside
    with _lock:
        if _inside == 0:
            _entry.append(set_entry(vars(F), 'interpolate', _interpolate))
        _inside += 1
    _this_thread.depth = getattr(_this_thread, 'depth', 0) + 1


def _leave() -> None:
    global _inside
    _this_thread.depth -= 1
    with _lock:
        _inside -= 1
        if _inside == 0:
            _entry.pop()()


@contextlib.contextmanager
def routed_resizes() -> Iterator[None]:
    """In the block, this thread's bilinear resizes that need a gradient run
    as :class:`~mmseg_gf.ops.resize.bilinear.BilinearResizeFunction` (same
    outputs and gradients); nothing changes for other threads."""
    _enter()
    try:
        yield
    finally:
        _leave()
