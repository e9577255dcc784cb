"""Checking a checkpoint against the model it is loaded into.

mmengine loads ``load_from`` with ``strict=False``: a checkpoint of another
model only logs a warning. :func:`check_checkpoint_matches` makes it an
error (used by GradFilterHook before training and by tools/test.py).
"""
import logging
import os.path as osp
import re
from typing import Any, Dict, List, Optional, Sequence

from mmengine.logging import print_log
from torch import nn

from .safe_load import load_checkpoint_file

__all__ = ['check_checkpoint_matches', 'load_from_report', 'CLASSIFIER_KEYS']

#: State-dict keys allowed to differ between a ``load_from`` checkpoint and
#: the model being finetuned: the classifiers, whose shape follows the
#: number of classes of a dataset (e.g. Cityscapes 19 -> VOC 21).
CLASSIFIER_KEYS = r'^(decode_head(\.\d+)?\.conv_seg\.|auxiliary_head\.)'


def _listing(items: Sequence[str], limit: int = 8) -> str:
    shown = ', '.join(items[:limit])
    more = f', ... ({len(items) - limit} more)' if len(items) > limit else ''
    return f'[{shown}{more}]'


def _by_module(keys: Sequence[str]) -> str:
    """Every key, grouped by module: ``a.conv.{weight, bias}``."""
    groups: Dict[str, List[str]] = {}
    for key in keys:
        module, _, leaf = key.rpartition('.')
        groups.setdefault(module, []).append(leaf)
    return ', '.join(
        f'{m}.{leaves[0]}' if len(leaves) == 1 else
        f'{m}.{{{", ".join(leaves)}}}' for m, leaves in groups.items())


def _shape_mismatches(state: dict, own: dict) -> List[str]:
    return [
        k for k in own if k in state and hasattr(state[k], 'shape')
        and tuple(state[k].shape) != tuple(own[k].shape)
    ]


def _shape_text(keys: Sequence[str], state: dict, own: dict) -> List[str]:
    return [f'{k}: checkpoint {tuple(state[k].shape)} vs model '
            f'{tuple(own[k].shape)}' for k in keys]


def load_from_report(setting: str, filename: str, shapes: Sequence[str],
                     missing: Sequence[str],
                     dropped: Sequence[str]) -> str:
    """The warning for a checkpoint that differs in the allowed keys only.

    Shape mismatches first, then missing keys, then dropped keys, every key
    named, grouped by module.
    """
    parts = []
    if shapes:
        parts.append('re-initialised, shapes differ: ' + '; '.join(shapes))
    if missing:
        parts.append('re-initialised, not in the checkpoint: '
                     + _by_module(missing))
    if dropped:
        parts.append('dropped, not in the model: ' + _by_module(dropped))
    return (f'{setting}: {filename!r} differs from the model in the '
            f'classifiers only (the model keeps its initialisation where '
            f'the checkpoint does not fit). ' + '. '.join(parts))


def check_checkpoint_matches(model: nn.Module,
                             filename: str,
                             setting: str = 'load_from',
                             allowed: Optional[str] = CLASSIFIER_KEYS,
                             logger: Any = 'current') -> None:
    """Fail early if a checkpoint does not fit ``model``.

    mmengine loads ``load_from`` with ``strict=False``, so a wrong checkpoint
    only warns and training starts from random weights. Here any mismatch is
    an error, except for keys matching ``allowed`` (the classifiers, logged).
    Remote checkpoints are not checked.

    Args:
        model: the (unwrapped) model.
        filename: the checkpoint path.
        setting: the config setting that named it, for the messages.
        allowed: regex of keys allowed to differ; None: none.
        logger: where to log the allowed differences.

    Raises:
        FileNotFoundError: ``filename`` is a local path that does not exist.
        RefusedCheckpointError: the file holds what a checkpoint may not.
        ValueError: the keys / shapes do not match, listing the mismatches.
    """
    if '://' in str(filename):
        return
    state = _load_state_dict(filename, setting)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = _shape_mismatches(state, own)
    missing, ok_missing = _split(missing, allowed)
    unexpected, ok_unexpected = _split(unexpected, allowed)
    shapes, ok_shapes = _split(shapes, allowed)
    if missing or unexpected or shapes:
        differences = _mismatches(missing, unexpected,
                                  _shape_text(shapes, state, own))
        raise ValueError(
            f'{setting}: checkpoint {filename!r} does not match the '
            f'{type(model).__name__} being trained (a checkpoint of a '
            f'different model?): {differences}.'
            f'{_ALLOWED_NOTE if allowed == CLASSIFIER_KEYS else ""} '
            'Expected: a checkpoint of this model config (or set '
            'GradFilterHook(check_load_from=False) to load it anyway)')
    if ok_missing or ok_unexpected or ok_shapes:
        print_log(
            load_from_report(setting, filename,
                             _shape_text(ok_shapes, state, own), ok_missing,
                             ok_unexpected),
            logger=logger, level=logging.WARNING)


_ALLOWED_NOTE = (' Only the classifiers (decode_head.conv_seg, '
                 'auxiliary_head) may differ.')


def _load_state_dict(filename: str, setting: str) -> dict:
    """The checkpoint's state dict, ``module.`` prefixes (DDP) removed."""
    if not osp.isfile(filename):
        raise FileNotFoundError(
            f'{setting}: checkpoint file {filename!r} does not exist '
            '(allowed: an existing checkpoint file, a URL, or None)')
    checkpoint = load_checkpoint_file(filename, map_location='cpu')
    state = checkpoint.get('state_dict', checkpoint) if isinstance(
        checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ValueError(f'{setting}: {filename!r} holds no state dict '
                         f'(got {type(checkpoint).__name__})')
    return {re.sub(r'^module\.', '', k): v for k, v in state.items()}


def _split(keys: List[str], allowed: Optional[str]):
    """``(not allowed to differ, allowed to differ)``."""
    if allowed is None:
        return keys, []
    return ([k for k in keys if not re.match(allowed, k)],
            [k for k in keys if re.match(allowed, k)])


def _mismatches(missing: List[str], unexpected: List[str],
                shapes: List[str]) -> str:
    """Every shape mismatch, then the first missing and unexpected keys."""
    parts = []
    if shapes:
        parts.append(f'{len(shapes)} shape mismatches [{", ".join(shapes)}]')
    if missing:
        parts.append(f'{len(missing)} model keys missing from it '
                     f'{_listing(missing)}')
    if unexpected:
        parts.append(f'{len(unexpected)} keys the model does not have '
                     f'{_listing(unexpected)}')
    return '; '.join(parts)
