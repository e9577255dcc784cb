"""Frozen auxiliary heads are not run in training: none steers the trained
parameters.

A frozen head either reads features needing no gradient (a constant loss)
or would train the backbone towards a head that never trains; so it is cut
off. The segmentor's class is swapped for a subclass deciding head by head
at every call; cases, log lines and switches: docs/lean_region.md
("Frozen auxiliary heads").
"""
import contextlib
import logging
from typing import List, Optional, Tuple

import torch
from mmengine.logging import print_log
from mmseg.models.decode_heads.decode_head import BaseDecodeHead
from mmseg.models.segmentors import EncoderDecoder
from mmseg.utils import add_prefix
from torch import nn

from ..models.segmentor import unwrap_model
from ..patching import is_swapped, plain_class, swap_class, unswap_class
from .layer_trace import nested_tensors
from .state import GradientFilterState, get_state

__all__ = ['aux_heads', 'features_read', 'frozen_head_reason',
           'skip_frozen_aux_heads', 'run_frozen_aux_heads',
           'skips_frozen_aux_heads', 'unlogged_aux_heads']


def aux_heads(segmentor: nn.Module) -> List[Tuple[str, str, nn.Module]]:
    """``(loss prefix, module path, head)`` of each auxiliary head, named as
    mmseg does."""
    heads = getattr(segmentor, 'auxiliary_head', None)
    if heads is None:
        return []
    if isinstance(heads, nn.ModuleList):
        return [(f'aux_{i}', f'auxiliary_head.{i}', h)
                for i, h in enumerate(heads)]
    return [('aux', 'auxiliary_head', heads)]


def features_read(head: nn.Module, inputs) -> List[torch.Tensor]:
    """The tensors of ``inputs`` that ``head`` reads (its ``in_index``
    selection)."""
    index = getattr(head, 'in_index', None)
    transform = getattr(type(head), '_transform_inputs', None)
    if (index is not None and isinstance(inputs, (list, tuple))
            and transform is BaseDecodeHead._transform_inputs):
        indices = index if isinstance(index, (list, tuple)) else [index]
        try:
            return nested_tensors([inputs[i] for i in indices])
        except (IndexError, TypeError):
            pass  # mmseg itself will fail on this selection
    return nested_tensors(inputs)


def frozen_head_reason(head: nn.Module, inputs) -> Optional[str]:
    """Why ``head`` is not run in training, or None when it runs."""
    if any(p.requires_grad for p in head.parameters()):
        return None
    index = getattr(head, 'in_index', None)
    read = 'its input' if index is None else f'its input (in_index {index})'
    if any(t.requires_grad for t in features_read(head, inputs)):
        return (f'all its parameters (its classifier too) are frozen and '
                f'{read} comes from trained layers: it is cut off from the '
                'backbone, as a loss through a head that is never trained '
                '(after a class-count change, a random classifier) would '
                'steer them')
    return (f'all its parameters are frozen and {read} needs no gradient, '
            'so its loss is constant in the trained parameters')


def _log_skipped_once(state: GradientFilterState, path: str,
                      head: nn.Module, reason: str) -> None:
    if path in state.logged_frozen_aux_heads:
        return
    state.logged_frozen_aux_heads.add(path)
    losses = ('its loss is computed without autograd for the log'
              if state.log_frozen_aux_losses else
              'its loss is not logged (log_frozen_aux_losses=True logs it)')
    name = plain_class(head).__name__
    print_log(
        f'gradient_filter: {path} ({name}) is not run in '
        f'training: {reason}; {losses}; keep_frozen_aux_heads=True runs '
        'it as mmseg does', logger='current', level=logging.INFO)


@contextlib.contextmanager
def unlogged_aux_heads(segmentor: nn.Module):
    """Within the block, left-out heads are not logged (traced steps before
    training)."""
    state = get_state(segmentor)
    if state is None:
        yield
        return
    logged = set(state.logged_frozen_aux_heads)
    state.logged_frozen_aux_heads.update(
        path for _, path, _ in aux_heads(unwrap_model(segmentor)))
    try:
        yield
    finally:
        state.logged_frozen_aux_heads = logged


def _constant_losses(head: nn.Module, inputs, data_samples,
                     train_cfg) -> dict:
    """A skipped head's losses for the log: no graph, detached values."""
    with torch.no_grad():
        losses = head.loss(inputs, data_samples, train_cfg)
    return {k: v.detach() if isinstance(v, torch.Tensor) else v
            for k, v in losses.items()}


class _SkipsFrozenAuxHeads:
    """``_auxiliary_head_forward_train`` leaving out frozen heads."""

    def _auxiliary_head_forward_train(self, inputs, data_samples) -> dict:
        state = get_state(self)
        if state is None or state.keep_frozen_aux_heads:
            return super()._auxiliary_head_forward_train(inputs, data_samples)
        losses = dict()
        for prefix, path, head in aux_heads(self):
            reason = frozen_head_reason(head, inputs)
            if reason is None:
                loss = head.loss(inputs, data_samples, self.train_cfg)
            else:
                _log_skipped_once(state, path, head, reason)
                if not state.log_frozen_aux_losses:
                    continue
                loss = _constant_losses(head, inputs, data_samples,
                                        self.train_cfg)
            losses.update(add_prefix(loss, prefix))
        return losses


#: The owner of this module's class swaps (:mod:`mmseg_gf.patching`).
SWAP_OWNER = 'frozen_aux_heads'


def skips_frozen_aux_heads(segmentor: nn.Module) -> bool:
    """Whether :func:`skip_frozen_aux_heads` swapped ``segmentor``."""
    return is_swapped(unwrap_model(segmentor), SWAP_OWNER)


def skip_frozen_aux_heads(segmentor: nn.Module) -> bool:
    """Let ``segmentor`` leave out frozen auxiliary heads in training;
    idempotent.

    Returns:
        Whether the segmentor skips such heads now (False: no auxiliary head,
        or not mmseg's ``_auxiliary_head_forward_train``).
    """
    model = unwrap_model(segmentor)
    if skips_frozen_aux_heads(model):
        return True
    own = getattr(type(model), '_auxiliary_head_forward_train', None)
    if not aux_heads(model) or \
            own is not EncoderDecoder._auxiliary_head_forward_train:
        return False
    swap_class(model, _SkipsFrozenAuxHeads, SWAP_OWNER)
    return True


def run_frozen_aux_heads(segmentor: nn.Module) -> bool:
    """Undo :func:`skip_frozen_aux_heads`; returns whether it was done."""
    return unswap_class(unwrap_model(segmentor), SWAP_OWNER)

