"""What a tensor kept by a custom autograd Function was computed from.

The lean losses take their gradients in the forward and keep them with
``ctx.save_for_backward``. autograd packs those tensors after the
Function's forward has returned, outside any operation, so a saved-tensor
hook cannot tell which logits a kept gradient belongs to. The accounting
(:mod:`mmseg_gf.accounting.trace`) needs that to count each gradient in the
settings that keep it: a gradient w.r.t. an auxiliary branch's logits is
kept only when that branch is trained. :func:`note_sources` records it
(weakly: neither tensor is kept alive by the record) while the tracer's
:func:`recording` block runs, and does nothing otherwise (a training step
pays nothing); :func:`sources_of` reads it back.
"""
import contextlib
import weakref
from typing import Iterator, List, Sequence

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

_SOURCES = WeakIdKeyDictionary()
_recording = 0


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Record the sources :func:`note_sources` is given while the block
    runs (nestable)."""
    global _recording
    _recording += 1
    try:
        yield
    finally:
        _recording -= 1


def note_sources(kept: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    """Record that ``kept[i]`` was computed from ``sources[i]`` (pairs),
    inside a :func:`recording` block."""
    if len(kept) != len(sources):
        raise ValueError(f'note_sources: {len(kept)} kept tensors, '
                         f'{len(sources)} sources')
    if not _recording:
        return
    for tensor, source in zip(kept, sources):
        _SOURCES[tensor] = weakref.ref(source)


def sources_of(tensor: Tensor) -> List[Tensor]:
    """The source recorded for ``tensor`` while both live (else ``[]``)."""
    ref = _SOURCES.get(tensor)
    source = None if ref is None else ref()
    return [] if source is None else [source]
