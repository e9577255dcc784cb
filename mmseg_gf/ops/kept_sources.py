"""What a tensor kept by a custom autograd Function was computed from.

The lean losses take their gradients in the forward and keep them with
``ctx.save_for_backward``. autograd packs those tensors after the
Function's forward has returned, outside any operation, so a saved-tensor
hook cannot tell which logits a kept gradient belongs to. The accounting
(:mod:`mmseg_gf.accounting.trace`) needs that to count each gradient in the
settings that keep it: a gradient w.r.t. an auxiliary branch's logits is
kept only when that branch is trained. :func:`note_sources` records it
(weakly: neither tensor is kept alive by the record), :func:`sources_of`
reads it back.
"""
import weakref
from typing import List, Sequence

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

_SOURCES = WeakIdKeyDictionary()


def note_sources(kept: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    """Record that ``kept[i]`` was computed from ``sources[i]`` (pairs)."""
    if len(kept) != len(sources):
        raise ValueError(f'note_sources: {len(kept)} kept tensors, '
                         f'{len(sources)} sources')
    for tensor, source in zip(kept, sources):
        _SOURCES[tensor] = weakref.ref(source)


def sources_of(tensor: Tensor) -> List[Tensor]:
    """The source recorded for ``tensor`` while both live (else ``[]``)."""
    ref = _SOURCES.get(tensor)
    source = None if ref is None else ref()
    return [] if source is None else [source]
