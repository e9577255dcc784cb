"""The step's peak memory, predicted from one profile.

A budget's ``peak_mib`` limit needs the peak of live tensor bytes of every
"last N, radii" setting without running each; :func:`step_peak` adds what
the setting keeps, the backward's gradients and the filtered convs'
scratch to the profile's forward (docs/budget.md, "How the costs are
predicted")."""
import copy
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..models.layer_kinds import kind_of
from .measured import live_bytes_by_interval

__all__ = ['Lifetime', 'step_peak', 'scratch_key', 'backward_scratch']


@dataclass
class Lifetime:
    """A module output that needs a gradient, in the batch-1 trace: the call
    that made it, the last candidate conv behind it, its bytes, and the call
    during which it was freed (None: it outlived the trace)."""

    made: int
    upstream: int
    nbytes: int
    freed: Optional[int] = None
    #: the last call during which an operation or a module call read it
    #: (or a view of it); None: not seen
    last_use: Optional[int] = None

    def end(self, n: int) -> int:
        """The first call at which its gradient is no longer alive in the
        mirrored backward (``n``: it outlived the trace)."""
        end = n if self.freed is None else self.freed
        if self.last_use is not None:
            end = min(end, max(self.made, self.last_use) + 1)
        return end


def step_peak(live: Sequence[Tuple[int, int]], kept: List[int],
              grads: List[int], scratch: List[int],
              tensors: Sequence[Lifetime], first: int, start: int,
              batch: int,
              forward_kept: Optional[List[int]] = None) -> int:
    """The step's peak of live tensor bytes, predicted.

    The forward's live bytes (linear in the batch) plus what calls so far
    keep; the backward mirrors the forward, holding the gradients of tensors
    still used, what earlier calls kept, the trained layers' parameter
    gradients and, during a filtered conv's backward, its ``scratch``.

    Args:
        live: ``(batch 1, batch 2)`` live bytes per call, plus what
            follows the last call.
        kept, grads, scratch: per call, at ``batch``.
        tensors: lifetimes from the profile's batch-1 trace.
        first: index of the first trained candidate conv.
        start: the call of that conv (the backward ends there).
        batch: images per step.
        forward_kept: ``kept`` as the forward adds it to the traced live
            bytes (default ``kept``)."""
    n = len(live)
    if forward_kept is None:
        forward_kept = kept
    mirrored = [0] * (n + 1)
    for t in tensors:
        if t.upstream >= first:
            mirrored[t.made] += t.nbytes * batch
            mirrored[t.end(n)] -= t.nbytes * batch
    after = sum(grads)
    peak = after
    held = gradients = extra = 0
    for k, (one, two) in enumerate(live):
        held += kept[k]
        extra += forward_kept[k]
        after -= grads[k]
        gradients += mirrored[k]
        forward = one + (batch - 1) * (two - one)
        peak = max(peak, forward + extra)
        if k >= start:
            # during call k's backward its own parameter gradient is made
            # while its output's gradient is still alive
            peak = max(peak, held + gradients + after + grads[k] + scratch[k])
    return peak


def scratch_key(layer: nn.Module, in_shape: Sequence[int], radius: int,
                need_input_grad: bool) -> tuple:
    """What a filtered layer's backward scratch depends on: input shape,
    class and ``extra_repr``, radius and ``g_x``."""
    return (tuple(in_shape), type(layer), layer.extra_repr(), radius,
            need_input_grad)


def backward_scratch(conv: nn.Module, in_shape: Sequence[int], radius: int,
                     need_input_grad: bool, batch: int) -> int:
    """Peak bytes of one filtered layer's backward beyond ``g_y``, ``g_x`` and
    ``g_W`` all alive at once, on random data of its shapes; negative where
    they are not (docs/budget.md, "How the costs are predicted")."""
    module = kind_of(conv).from_plain(copy.deepcopy(conv), radius, True)
    for p in module.parameters():
        p.requires_grad_(True)
    x = torch.randn((batch, ) + tuple(in_shape),
                    requires_grad=need_input_grad)
    y = module(x)
    w = torch.randn_like(y)
    results = sum(p.numel() * p.element_size()
                  for p in module.parameters()) + y.numel() * y.element_size()
    if need_input_grad:
        results += x.numel() * x.element_size()
    peak = max(live_bytes_by_interval(
        lambda: torch.autograd.backward((y * w).sum()), marker=None,
        collect=False))
    return peak - results
